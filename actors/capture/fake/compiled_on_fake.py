"""torch.compile on ``workload.device=fake``: inductor's own plan of buffers, run on fake tensors.

A compiled step's memory is not its eager step's: AOTAutograd's partitioner decides which
activations are saved for backward (the rest is recomputed), and inductor's scheduler fuses
pointwise ops so their intermediates never exist, frees each buffer after its last use and
reuses freed ones in place. All of that is decided before any kernel runs and is written into
the Python wrapper inductor generates for each graph: ``bufN = empty_strided_cpu(size, stride,
dtype)`` for every buffer it realizes, ``del bufN`` where it lets go, ``bufM = bufN; del bufN #
reuse`` where it recycles one, extern kernels (``extern_kernels.mm(..., out=buf)``, attention)
called as aten ops, fused kernels called on the buffers.

On fake the real compiler runs unchanged (Dynamo, AOTAutograd with inductor's partitioner and
decompositions, lowering, scheduling, wrapper code generation); only what needs real memory
is swapped while :func:`inductor_on_fake` is on:

* the wrapper's allocators (``torch._C._dynamo.guards._empty_strided_*``,
  ``_reinterpret_tensor``) go through the dispatcher (``torch.empty_strided``,
  ``torch.as_strided``), so the capture's fake mode makes each buffer and the observer
  records it; its ``del`` is recorded by the run's own frees (actors/capture/fake/free_markers.py);
* generated kernels (C++, Triton, Halide) are not compiled: each is a no-op, as a fake
  tensor holds no values to compute;
* a compiled graph's tensor inputs are each read by one ``aten::detach`` as the graph is
  called: its generated kernels leave no op in the trace, so a tensor only they read (the
  state of torchao's compiled low-bit optimizer step, a norm's weight) would be unknown to the
  trace, its bytes missing from the prediction; a floating input the graph writes in place
  (inductor's ``mutated_input_idxs``: the weights a compiled optimizer step updates) is
  written by one ``aten::mul_(1)`` instead, so the trace sees the update that tells its
  parameters from what they are not (actors/trace/stats.py);
* inductor's and AOTAutograd's on-disk caches are off (a cached graph may carry kernels
  compiled for real tensors) and Dynamo's cache is reset on entry and exit, so compiled code
  of a real run and of a capture never meet.

What is exact: the saved-for-backward set, the buffers realized and their sizes, order, frees
and reuse, as inductor plans them for the device the fake tensors report (``cpu``). What is an
approximation: a GPU run's inductor generates Triton kernels, whose fusion groups can differ
from the C++ backend's in a few places (reductions split across blocks get a workspace
buffer; a template matmul epilogue fuses there and not on cpu); extern kernels are the same.
The fused kernels themselves leave no op in the trace (their time is not replayed).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor

_GUARDS = torch._C._dynamo.guards
# the wrapper's allocators, by the device each one makes memory on
_ALLOCATORS = {"_empty_strided_cpu": "cpu", "_empty_strided_cpu_pinned": "cpu",
               "_empty_strided_cuda": "cuda", "_empty_strided_xpu": "xpu",
               "_empty_strided_mtia": "mtia"}
# AsyncCompile's entry points that would compile a generated kernel
_KERNEL_COMPILERS = ("cpp", "cpp_pybinding", "triton", "halide", "pallas", "cutedsl")


def _kernel(*args, **kwargs) -> None:
    """A generated kernel on fake tensors: nothing to compute."""


def _no_compile(self, *args, **kwargs):
    return _kernel


def _allocator(device: str):
    def empty_strided(size, stride, dtype, *_device_index):
        # the wrapper's buffers are plain tensors of the device the graph was lowered for;
        # the fake mode turns this one into a fake (and recorded) one
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    return empty_strided


def _reinterpret_tensor(base, size, stride, offset_increment=0):
    """inductor's view of a buffer (its C++ original builds the view below the dispatcher)."""
    return torch.as_strided(base, size, stride, base.storage_offset() + offset_increment)


def _reading_inputs(call):
    def call_reading_inputs(self, inputs):
        written = getattr(self, "mutated_input_idxs", ())
        with torch.no_grad():
            for at, value in enumerate(inputs):
                # (a real tensor among them, the RNG state full AC's recompute restores, is
                # none of the run's device memory)
                if not isinstance(value, FakeTensor):
                    continue
                if at in written and value.is_floating_point():
                    value.mul_(1)  # recorded: the graph updates it in place
                else:
                    value.detach()  # recorded: the trace learns the input's storage
        return call(self, inputs)
    return call_reading_inputs


@contextmanager
def inductor_on_fake():
    """Within the block, torch.compile's default backend runs on fake tensors (module doc)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.output_code import CompiledFxGraph

    with ExitStack() as stack:
        for name, device in _ALLOCATORS.items():
            if hasattr(_GUARDS, name):
                stack.enter_context(mock.patch.object(_GUARDS, name, _allocator(device)))
        stack.enter_context(mock.patch.object(_GUARDS, "_reinterpret_tensor",
                                              _reinterpret_tensor))
        stack.enter_context(mock.patch.object(CompiledFxGraph, "__call__",
                                              _reading_inputs(CompiledFxGraph.__call__)))
        for name in _KERNEL_COMPILERS:
            if hasattr(AsyncCompile, name):
                stack.enter_context(mock.patch.object(AsyncCompile, name, _no_compile))
        stack.enter_context(inductor_config.patch(fx_graph_cache=False,
                                                  fx_graph_remote_cache=False,
                                                  compile_threads=1))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        torch._dynamo.reset()
        stack.callback(torch._dynamo.reset)
        yield


def num_compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
