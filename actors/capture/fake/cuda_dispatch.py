"""A capture for a GPU target runs the GPU's kernels where the CPU's would allocate otherwise.

Fake tensors report ``cpu``, so without this an op whose CPU and CUDA paths differ dispatches
as on a CPU. Within :func:`cuda_kernels`, two functions of ``torch.nn.functional`` (which
``nn.Dropout``, ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``, transformers and
torchtitan call) run as on the target, and torch.optim picks its kernels as there:

* ``scaled_dot_product_attention`` picks its kernel by torch's CUDA rules for the target's
  architecture (actors/capture/fake/sdpa_choice.py) and runs it on fake
  (actors/capture/fake/cuda_attention.py). On a CPU, dropout (or a head dim its flash kernel
  refuses) sends it to the math path, which keeps seq x seq score matrices no fused GPU kernel
  holds.
* ``dropout`` in training runs CUDA's fused ``native_dropout`` (``at::dropout`` takes it for
  CUDA tensors): it keeps a one-byte mask per element for backward, where the CPU's path
  multiplies by a noise tensor of the input's dtype and keeps that.
* ``torch.autocast`` regions cast as CUDA's autocast does, a region for ``cuda`` included
  (torch disables it where CUDA is absent): actors/capture/fake/cuda_autocast.py.
* torch.optim's optimizers left to their default (neither ``foreach`` nor ``fused`` given)
  pick their implementation as for CUDA tensors: the multi-tensor foreach kernels, whose lists
  of temporaries the CPU's for-loop never holds at once
  (actors/capture/fake/optimizer_default.py).
* the fused attention kernels' backward (SDPA's, the built-in models') holds what CUDA's
  kernel allocates beside its gradients: actors/capture/fake/attention_backward.py.
* ``torch.autograd.graph.save_on_cpu`` keeps its copies in host memory:
  actors/capture/fake/host_copies.py.
* ``torch.compile(flex_attention)`` is lowered as inductor lowers it for a GPU (its backward
  has no CPU kernel): actors/capture/fake/cuda_flex_attention.py; logged once per compiled
  graph, as inductor lowers it.

Every call is logged: the kernel, what the CPU would have run, the bytes each keeps; the
prediction shows them (docs/capture.md, "CPU and CUDA paths"). A module that bound either
function under another name at import (``from torch.nn.functional import dropout``) is not
reached. Inside a torch.compile region SDPA and dropout run as torch's own: inductor lowers
them for the device the fake tensors report (actors/capture/fake/compiled_on_fake.py), and they
are not logged.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from actors.capture.fake.attention_backward import attention_backward_as_on_cuda
from actors.capture.fake.cuda_attention import sdpa_as_cuda
from actors.capture.fake.cuda_autocast import autocast_as_on_cuda, lower_precision_inputs
from actors.capture.fake.cuda_flex_attention import CPU_KERNEL as FLEX_CPU_KERNEL
from actors.capture.fake.cuda_flex_attention import KERNEL as FLEX_KERNEL
from actors.capture.fake.cuda_flex_attention import flex_attention_as_on_cuda
from actors.capture.fake.host_copies import save_on_cpu_as_on_gpu
from actors.capture.fake.optimizer_default import optimizers_as_on_cuda
from actors.capture.fake.sdpa_choice import CPU_MATH, MATH, SdpaCall, cpu_backend
from actors.gpu_arch import GpuArch
from actors.trace.dtypes import dtype_name

SDPA, DROPOUT = "aten::scaled_dot_product_attention", "aten::dropout"
OPTIMIZER, AUTOCAST = "torch.optim step", "torch.autocast region"
FLEX = "flex_attention (compiled)"
SAVE_ON_CPU = "torch.autograd.graph.save_on_cpu"


def _sdpa_kept_bytes(call: SdpaCall, backend: str) -> int:
    """Bytes a fused kernel keeps for backward besides q, k, v and the output: the float32
    logsumexp (B x H x L; the memory-efficient kernel pads L to a multiple of 32) and the philox
    seed and offset (two int64); none without grad."""
    if not call.requires_grad or backend == MATH or not call.dense_4d:
        return 0
    b, h, length = call.q_shape[0], call.q_shape[1], call.q_shape[2]
    rows = length if backend != "efficient" else -(-length // 32) * 32
    return 4 * b * h * rows + 16


def _score_bytes(call: SdpaCall) -> int:
    """Bytes of one float32 L x S score matrix per batch and head; the math path keeps several
    (scores, softmax, dropout's mask and output)."""
    if not call.dense_4d:
        return 0
    return 4 * call.q_shape[0] * call.q_shape[1] * call.q_shape[2] * call.k_shape[2]


@dataclass
class DispatchLog:
    """The calls run as the target's kernels, grouped by op, kernel and what decided it."""

    arch: GpuArch
    calls: Counter = field(default_factory=Counter)
    kept: Counter = field(default_factory=Counter)
    cpu_kept: Counter = field(default_factory=Counter)
    lowered: Counter = field(default_factory=Counter)
    lowered_kept: Counter = field(default_factory=Counter)

    def add(self, op: str, kernel: str, cpu_kernel: str, detail: str, kept_bytes: int,
            cpu_bytes: int) -> None:
        """One call: ``kept_bytes`` the target's kernel keeps, ``cpu_bytes`` what the CPU's
        path would have made in its place (0 where the two agree)."""
        key = (op, kernel, cpu_kernel, detail)
        self.calls[key] += 1
        self.kept[key] += kept_bytes
        self.cpu_kept[key] += cpu_bytes

    def add_lowered(self, op: str, kernel: str, cpu_kernel: str, detail: str,
                    kept_bytes: int) -> None:
        """One call site inductor lowered for the target (at compile time, in warm-up): kept
        across :meth:`clear`, counted once per compiled graph however often it runs."""
        key = (op, kernel, cpu_kernel, f"{detail}, per compiled graph")
        self.lowered[key] += 1
        self.lowered_kept[key] += kept_bytes

    def clear(self) -> None:
        for counter in (self.calls, self.kept, self.cpu_kept):
            counter.clear()

    def summary(self) -> list[dict]:
        """One record per (op, kernel, CPU's kernel, detail): meta.json's ``kernel_dispatch``."""
        fields = ("op", "kernel", "cpu_kernel", "detail")

        def records(calls: Counter, kept: Counter, cpu_kept: Counter) -> list[dict]:
            return [{**dict(zip(fields, key)), "arch": str(self.arch), "num_calls": calls[key],
                     "kept_bytes": kept[key], "cpu_bytes": cpu_kept[key]}
                    for key in sorted(calls)]
        return records(self.calls, self.kept, self.cpu_kept) + \
            records(self.lowered, self.lowered_kept, Counter())


def _sdpa(log: DispatchLog, cpu_sdpa):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        # torch's own error from its own check; inside torch.compile, inductor lowers the op
        # for the device the fake tensors report (actors/capture/fake/compiled_on_fake.py)
        if is_causal and attn_mask is not None or torch.compiler.is_compiling():
            return cpu_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                            enable_gqa=enable_gqa)
        # SDPA is on autocast's lower-precision list (the cpu's and CUDA's): the kernels
        # run here come after the dispatcher's autocast kernel
        with lower_precision_inputs(query, key, value, attn_mask) as \
                (query, key, value, attn_mask):
            out, call, backend = sdpa_as_cuda(log.arch, query, key, value, attn_mask, dropout_p,
                                              is_causal, scale, enable_gqa)
        cpu = cpu_backend(call)
        detail = f"{dtype_name(str(call.dtype))}, dropout {call.dropout_p:g}" + \
            (", attn_mask" if call.has_mask else "")
        log.add(SDPA, backend, cpu, detail, _sdpa_kept_bytes(call, backend),
                _score_bytes(call) if cpu == CPU_MATH and backend != MATH else 0)
        return out
    return sdpa


def _dropout(log: DispatchLog, cpu_dropout):
    def dropout(input, p=0.5, training=True, inplace=False):
        # at::dropout's fused path: CUDA, training, 0 < p < 1, not in place
        if inplace or not training or not 0 < p < 1 or input.numel() == 0 \
                or torch.compiler.is_compiling():
            return cpu_dropout(input, p, training, inplace)
        out, mask = torch.native_dropout(input, p, True)
        grad = torch.is_grad_enabled() and input.requires_grad
        log.add(DROPOUT, "native_dropout", "mul by noise",
                dtype_name(str(input.dtype)), mask.numel() if grad else 0,
                input.numel() * input.element_size() if grad else 0)
        return out
    return dropout


def _optimizer_choice(log: DispatchLog):
    def on_choice(implementation: str, num_params: int) -> None:
        if implementation != "for-loop":  # the CPU's own choice: nothing to say
            log.add(OPTIMIZER, implementation, "for-loop", f"{num_params} tensors", 0, 0)
    return on_choice


def _autocast_region(log: DispatchLog):
    def on_region(device_type: str, dtype: torch.dtype) -> None:
        cpu = "disabled (no CUDA)" if device_type == "cuda" else "the cpu's autocast policy"
        log.add(AUTOCAST, "CUDA's autocast policy", cpu,
                f"device_type {device_type}, {dtype_name(str(dtype))}", 0, 0)
    return on_region


def _flex_lowered(log: DispatchLog):
    def on_lowered(direction: str, kept_bytes: int) -> None:
        log.add_lowered(FLEX, FLEX_KERNEL, FLEX_CPU_KERNEL, direction, kept_bytes)
    return on_lowered


def _host_copy(log: DispatchLog):
    def on_copy(nbytes: int) -> None:
        log.add(SAVE_ON_CPU, "host copy", "the device's own memory", "saved tensors", nbytes,
                0)
    return on_copy


@contextmanager
def cuda_kernels(arch: GpuArch | None):
    """Within the block, SDPA and dropout run as on ``arch``, autocast casts and torch.optim
    picks its kernels as there (None: unchanged, yields None); yields the
    :class:`DispatchLog`."""
    if arch is None:
        yield None
        return
    log = DispatchLog(GpuArch.coerce(arch, "workload.gpu_kernels"))
    cpu_sdpa, cpu_dropout = F.scaled_dot_product_attention, F.dropout
    F.scaled_dot_product_attention = _sdpa(log, cpu_sdpa)
    F.dropout = _dropout(log, cpu_dropout)
    try:
        with optimizers_as_on_cuda(_optimizer_choice(log)), \
                autocast_as_on_cuda(_autocast_region(log)), \
                flex_attention_as_on_cuda(_flex_lowered(log)), \
                attention_backward_as_on_cuda(), save_on_cpu_as_on_gpu(_host_copy(log)):
            yield log
    finally:
        F.scaled_dot_product_attention, F.dropout = cpu_sdpa, cpu_dropout
