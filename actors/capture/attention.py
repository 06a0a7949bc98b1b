"""Causal attention as training on a GPU records it: one fused kernel, nothing seq x seq kept.

``fused`` calls ``scaled_dot_product_attention`` on CUDA (flash / memory-efficient kernels).
Elsewhere it calls the CPU flash-attention kernel and its backward directly: on ``meta``,
``scaled_dot_product_attention`` falls back to the unfused math path (``bmm``, ``softmax``,
a seq x seq score matrix kept for backward), so a meta trace would hold what no GPU run
holds. The CPU kernel has meta kernels, so cpu, meta and fake tensors (FakeTensorMode over
cpu) record the same ``aten::_scaled_dot_product_flash_attention_for_cpu`` op with its
logsumexp, like the GPU's ``_scaled_dot_product_flash_attention``; the replay translates
one into the other (actors/replay/translate_attention.py).
``math`` is Meta's reference ``softmax(q k^T / sqrt(d) + mask) v``, which keeps the scores.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from actors.choices import Choice


class Attention(Choice):
    """How a decoder block computes attention (see the module docstring)."""

    fused = "fused"
    math = "math"


class _CpuFlashAttention(torch.autograd.Function):
    """Causal attention through CPU's flash kernel and its backward (meta kernels exist)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, logsumexp = ctx.saved_tensors
        return tuple(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, k, v, out, logsumexp, 0.0, True))


def causal_attention(q, k, v, attention: Attention):
    """Causal attention of (b, heads, t, head_dim) tensors, heads already repeated."""
    if attention == Attention.math:
        t = q.shape[2]
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
        mask = torch.full((t, t), float("-inf"), device=q.device).triu(1)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(q)
        return torch.matmul(scores, v)
    if q.device.type == "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _CpuFlashAttention.apply(q, k, v)
