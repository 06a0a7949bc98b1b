"""What CUDA's fused attention backward kernels hold besides their gradients, for a GPU target
on fake.

The backward aten ops have meta kernels that make the gradients and nothing else. The CUDA
kernels behind them (aten/src/ATen/native/transformers/cuda/attention_backward.cu) allocate
more through the caching allocator, for the kernel's duration. Both first make the output's
gradient contiguous in their (batch, seq, heads, head_dim) layout: a copy only where that view
of it is not contiguous already (a gradient coming back through
``out.transpose(1, 2).reshape(...)`` is). Flash makes the output contiguous the same way, which
never copies on a GPU (its forward wrote it in that layout; the meta kernel's output is
heads-first, so it is left as it is). Then:

* flash (``mha_bwd`` in .../cuda/flash_attn/flash_api.cpp): ``softmax_d``, float32, batch x
  heads x seq_q rounded up to 128; ``dq_accum``, float32, batch x seq_q rounded up to 128 x
  heads x head_dim rounded up to 32 (64 above 128): the query gradient accumulated in float32,
  twice a bf16 gradient's bytes; under grouped-query attention (fewer key/value heads),
  ``dk_expanded`` and ``dv_expanded`` at the query's head count, summed into the key and value
  gradients after the kernel;
* memory-efficient (``_efficient_attention_backward``): ``delta``, float32 batch x heads x
  seq_q, which the kernel computes itself for fp16/bf16; for float32 it is computed before the
  kernel as ``(grad_out * out).sum(-1)``, transposed and made contiguous, so the product (the
  output's size in float32) exists for a moment too.

Within :func:`attention_backward_as_on_cuda` the capture allocates these around the backward
op, so the trace holds them while it runs. Without it (a CPU target, whose replay runs the
CPU's kernel) the backward stays as it was. Not modelled: flash's deterministic variant
(``torch.use_deterministic_algorithms(True)``: one ``dq_accum`` per split, the split count from
the GPU's SM count); the memory-efficient kernel's accumulation workspace (fp16/bf16: its size
comes from the CUTLASS kernel chosen and the key splits its heuristic picks from the SM count).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

_state = {"on": False}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@contextmanager
def attention_backward_as_on_cuda():
    """Within the block, :func:`kernel_grad_out`, :func:`flash_workspace` and
    :func:`efficient_delta` act as CUDA's kernels."""
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


def flash_workspace(query: torch.Tensor, key: torch.Tensor) -> list[torch.Tensor]:
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


def efficient_delta(query: torch.Tensor, grad_out: torch.Tensor,
                    out: torch.Tensor) -> list[torch.Tensor]:
    """The memory-efficient backward's ``delta`` for (B, H, L, E) views (``grad_out`` as
    :func:`kernel_grad_out` gave it), to be held while the kernel runs; none off a GPU
    target."""
    if not _state["on"]:
        return []
    batch, heads, len_q = query.shape[:3]
    if query.dtype in (torch.float16, torch.bfloat16):  # the kernel computes it
        return [torch.empty(batch, heads, len_q, dtype=torch.float32, device=query.device)]
    rows = (grad_out.transpose(1, 2).float() * out.transpose(1, 2).float()).sum(-1)
    return [rows.transpose(-2, -1).contiguous()]
