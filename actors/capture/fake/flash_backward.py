"""What CUDA's flash-attention backward holds besides its gradients, for a GPU target on fake.

The backward's aten op has a meta kernel that makes the three gradients and nothing else. The
CUDA kernel behind it (``_flash_attention_backward`` in
aten/src/ATen/native/transformers/cuda/attention_backward.cu, ``mha_bwd`` in
.../cuda/flash_attn/flash_api.cpp) allocates more through the caching allocator, for the
kernel's duration:

* the output's gradient made contiguous in the kernel's (batch, seq, heads, head_dim) layout:
  a copy only where that view of it is not contiguous already (a gradient coming back
  through ``out.transpose(1, 2).reshape(...)`` is). The output is made contiguous the same
  way, which never copies on a GPU: the forward kernel wrote it in that layout (the meta
  kernel's output is heads-first, so it is left as it is);
* ``softmax_d``: float32, batch x heads x seq_q rounded up to 128;
* ``dq_accum``: float32, batch x seq_q rounded up to 128 x heads x head_dim rounded up to 32
  (64 above 128): the query gradient accumulated in float32, twice a bf16 gradient's bytes;
* under grouped-query attention (fewer key/value heads), ``dk_expanded`` and ``dv_expanded``
  at the query's head count, summed into the key and value gradients after the kernel.

Within :func:`flash_backward_as_on_cuda` the capture allocates these around the backward op,
so the trace holds them while it runs. Without it (a CPU target, whose replay runs the CPU's
flash kernel) the backward stays as it was. Not modelled: the deterministic variant
(``torch.use_deterministic_algorithms(True)``: one ``dq_accum`` per split, the split count
from the GPU's SM count).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

_state = {"on": False}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@contextmanager
def flash_backward_as_on_cuda():
    """Within the block, :func:`kernel_grad_out` and :func:`workspace` act as CUDA's
    kernel."""
    before = _state["on"]
    _state["on"] = True
    try:
        yield
    finally:
        _state["on"] = before


def kernel_grad_out(grad_out: torch.Tensor) -> torch.Tensor:
    """The output's gradient, a (B, H, L, E) view, as the backward kernel reads it: CUDA's
    contiguous as (B, L, H, E) (a copy only where needed), else contiguous as it is."""
    if not _state["on"]:
        return grad_out.contiguous()
    return grad_out.transpose(1, 2).contiguous().transpose(1, 2)


def workspace(query: torch.Tensor, key: torch.Tensor) -> list[torch.Tensor]:
    """The tensors CUDA's flash backward allocates for (B, H, L, E) ``query`` and ``key``
    besides the gradients (module doc), to be held while the kernel runs; none off a GPU
    target."""
    if not _state["on"]:
        return []
    batch, heads, len_q, head_dim = query.shape
    kv_heads, len_k = key.shape[1], key.shape[2]
    rows = _round_up(len_q, 128)
    width = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    fp32 = {"dtype": torch.float32, "device": query.device}
    made = [torch.empty(batch, heads, rows, **fp32),  # softmax_d
            torch.empty(batch, rows, heads, width, **fp32)]  # dq_accum
    if kv_heads != heads:  # dk_expanded, dv_expanded
        made += [query.new_empty(batch, len_k, heads, head_dim) for _ in range(2)]
    return made

