"""Record one training iteration of one rank with torch's ExecutionTraceObserver.

The trace follows the conventions in :mod:`actors.capture`: the iteration runs inside a
``ProfilerStep#<n>`` range, every module call inside a ``## module:<qualname> ##`` range,
and each module's backward between ``## module_bwd_begin/end:<qualname> ##`` markers (from
hooks on the autograd graph, :mod:`actors.capture.backward_markers`), so a replayer can tell
which parameters each stretch of operators uses. Integral input tensors carry their value range
(``tensor_range`` attr) so index ops replay with valid indices. Optionally a profiler (Kineto)
trace is written beside it: the host time between ops that the ET does not show.
"""
from __future__ import annotations

import gzip
import os
import shutil
import time
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import _disable_current_modes

from actors.errors import writing
from actors.trace.conventions import BWD_BEGIN, BWD_END, STEP_PREFIX, module_range_name
from actors.capture.host_profile import write_relabeled
from actors.capture.backward_markers import register_backward_markers
from actors.capture.trace_file import rewrite_file

# Read by the observer when it registers: any value turns tensor ranges on.
TENSOR_RANGE_ENV = "ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_RANGE"


def _mark(name: str) -> None:
    """A zero-length record_function node: a position in execution order."""
    with _disable_current_modes(), record_function(name):
        pass


def _outside_dispatch_modes(call, *args):
    """Run a record_function enter or exit with no Python dispatch mode active.

    Under a mode (selective activation checkpointing's, FakeTensorMode) the range's enter op is
    dispatched through the mode, whose ``PythonDispatchMode`` frame becomes the range's parent
    while the ops that follow land under that frame instead of inside the range: the trace
    would lose every module range opened under the mode.
    """
    with _disable_current_modes():
        return call(*args)


def _eager_modules(module: nn.Module, prefix: str = "", seen: set | None = None):
    """``(qualname, module)`` of ``module`` and its descendants that run eagerly: a module
    compiled in place (``module.compile()``) or wrapped by ``torch.compile`` runs its
    submodules (and its own hooks, in place) inside the compiled graph, where a range's hook
    is traced, not run; the wrapper itself runs outside and keeps its range."""
    seen = set() if seen is None else seen
    if id(module) in seen or getattr(module, "_compiled_call_impl", None) is not None:
        return
    seen.add(id(module))
    yield prefix, module
    if isinstance(module, OptimizedModule):
        return
    for name, child in module.named_children():
        yield from _eager_modules(child, f"{prefix}.{name}" if prefix else name, seen)


class ModuleRanges:
    """Context manager: name every module call of ``model`` in the trace.

    Forward pre hooks are prepended so the range also covers whatever other pre hooks do
    (e.g. ZeRO-3 parameter fetch); post hooks are appended (covering the release). The
    root module gets no backward markers: they would bracket nothing.
    """

    def __init__(self, model: nn.Module, backward: bool = True):
        self.model = model
        self.backward = backward
        self._handles = []
        self._open: dict[int, list] = {}  # id(module) -> open forward ranges

    def _enter(self, key: int, name: str) -> None:
        self._open.setdefault(key, []).append(
            _outside_dispatch_modes(record_function(name).__enter__))

    def _exit(self, key: int) -> None:
        ranges = self._open.get(key)
        if ranges:  # a global pre hook that raised before ours ran opened none
            _outside_dispatch_modes(ranges.pop().__exit__, None, None, None)

    def __enter__(self):
        for qualname, module in _eager_modules(self.model):
            key, name = id(module), module_range_name(qualname)
            self._handles += [
                module.register_forward_pre_hook(
                    lambda m, a, k=key, n=name: self._enter(k, n), prepend=True),
                # always_call: the range also closes when the forward raises (checkpoint's
                # early stop ends every recompute that way; a user's try/except around a
                # module too); left open, every later op would hang under a node never written
                module.register_forward_hook(lambda m, a, o, k=key: self._exit(k),
                                             always_call=True),
            ]
            if self.backward and module is not self.model:
                begin, end = (module_range_name(qualname, kind) for kind in (BWD_BEGIN, BWD_END))
                self._handles += register_backward_markers(
                    module, lambda n=begin: _mark(n), lambda n=end: _mark(n))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # Ranges left open (an exception mid-forward) are closed innermost first.
        for ranges in self._open.values():
            while ranges:
                ranges.pop().__exit__(None, None, None)
        return False


def record_iteration(step: Callable[[tuple], None], batch: tuple, model: nn.Module,
                     step_index: int, out_path: str, module_backward: bool = True,
                     kineto_path: str | None = None, tensor_ranges: bool = True,
                     num_timing_iters: int = 3,
                     rewrite: Callable[[dict], object] | None = None,
                     around_step: Callable[[], ContextManager] | None = None) -> dict:
    """Run ``step(batch)`` once under the ET observer and write the gzipped trace to out_path.

    With ``kineto_path``, the profiler (Kineto) trace of the host time between ops is
    written there, gzipped: the ET's iteration runs under ``torch.profiler`` too (so their
    record-function ids agree), then the fastest of ``num_timing_iters`` bare iterations
    under the profiler alone gives the timing, which the observer and the module ranges'
    hooks would inflate (see actors/capture/host_profile.py).
    ``tensor_ranges`` records integral tensors' value ranges (impossible on meta tensors).
    The batch is made before the observer starts: data loading is not part of the step.
    ``rewrite`` edits the parsed trace in place before it is written (the fake capture's
    :func:`actors.capture.fake.fake_mode.strip_dispatch_mode_nodes`); None writes it as recorded.
    ``around_step`` makes a context entered around the recorded step, inside its range (the
    fake capture's :func:`actors.capture.fake.free_markers.recording`).
    Returns ``{"path", "kineto_path", "aligned_host_ops", "et_host_ops"}``.
    """
    if tensor_ranges:
        os.environ[TENSOR_RANGE_ENV] = "1"  # must precede register_callback()
    else:
        os.environ.pop(TENSOR_RANGE_ENV, None)
    raw_path = _partial_path(out_path)
    observer = ExecutionTraceObserver()
    observer.register_callback(raw_path)
    step_name = f"{STEP_PREFIX}{step_index}"
    profiles = []  # (exported Chrome trace, s): the ET's iteration, the timing one, the rest
    try:
        try:
            with ModuleRanges(model, backward=module_backward):
                if kineto_path is None:
                    observer.start()
                    with record_function(step_name), (around_step or nullcontext)():
                        step(batch)
                    observer.stop()
                else:  # the profiler starts, stops and finalizes the observer with itself
                    profiles.append(_profile_once(step, batch, step_name, kineto_path, 0, observer))
        finally:
            observer.unregister_callback()  # finalizes the JSON (a no-op once the profiler did)
        if kineto_path is not None:
            # Bare, like the eager iterations: without the module ranges' hooks, whose Python
            # would land in the gaps. The fastest of a few: a preempted one inflates its gaps.
            timing = [_profile_once(step, batch, step_name, kineto_path, 1 + i)
                      for i in range(num_timing_iters)]
            fastest = min(timing, key=lambda p: p[1])
            profiles += [fastest] + [p for p in timing if p is not fastest]
        if rewrite is None:
            _gzip_to(raw_path, out_path)
        else:
            rewrite_file(raw_path, out_path, rewrite)
        result = {"path": out_path, "kineto_path": kineto_path}
        if profiles:
            result.update(write_relabeled(profiles[0][0], profiles[1][0], kineto_path))
        return result
    except BaseException:  # a half-written trace would pass for a finished one on a rerun
        for path in (out_path, kineto_path):
            if path is not None and os.path.exists(path):
                os.remove(path)
        raise
    finally:  # the observer's uncompressed file (a failed step leaves it) and the profiles
        for path in (raw_path, *(p for p, _ in profiles)):
            if os.path.exists(path):
                os.remove(path)


def _profile_once(step, batch, step_name: str, kineto_path: str, index: int,
                  observer: ExecutionTraceObserver | None = None) -> tuple[str, float]:
    """Run the step once under the profiler; ``(exported Chrome trace path, seconds)``."""
    with profile(activities=profiler_activities(), execution_trace_observer=observer) as prof:
        start = time.perf_counter()
        with record_function(step_name):
            step(batch)
        elapsed = time.perf_counter() - start
    path = f"{_partial_path(kineto_path)}.{index}"
    prof.export_chrome_trace(path)
    return path, elapsed


def profiler_activities() -> list:
    """CPU ops always; the device's kernels too when the rank has a GPU."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def _partial_path(out_path: str) -> str:
    """Where the uncompressed file is written before it is gzipped to ``out_path``."""
    raw = out_path[:-len(".gz")] if out_path.endswith(".gz") else out_path + ".json"
    return raw + ".partial"


def _gzip_to(raw_path: str, out_path: str) -> None:
    with writing(out_path, "a rank trace"), open(raw_path, "rb") as src, \
            gzip.open(out_path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw_path)
