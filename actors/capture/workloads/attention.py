"""Causal attention as training on a GPU records it: one fused kernel, nothing seq x seq kept.

``fused`` is, per device:

* cuda: ``scaled_dot_product_attention`` (it picks the kernel);
* meta and fake tensors (FakeTensorMode), which stand for a GPU run: the kernel CUDA's SDPA
  picks, called directly with its backward: ``_scaled_dot_product_flash_attention`` for
  bf16/fp16, ``_scaled_dot_product_efficient_attention`` for fp32 (flash takes half precision
  only), each with its logsumexp and philox seed/offset (actors/capture/fake/cuda_attention.py;
  a user's own ``F.scaled_dot_product_attention`` goes there too on a GPU target: see
  actors/capture/fake/cuda_dispatch.py). On meta, SDPA itself would fall back to the unfused math
  path (``bmm``, softmax, a seq x seq score matrix kept for backward). The
  trace then replays natively on CUDA; elsewhere the replay translates it to the CPU kernel
  (actors/replay/ops/translate_attention.py);
* cpu: CPU's flash kernel ``_scaled_dot_product_flash_attention_for_cpu``, directly.

Values narrower than queries and keys (DeepSeek's MLA) take the memory-efficient kernel on
meta and fake, as CUDA's SDPA does (its flash kernel wants equal head sizes).

``math`` is Meta's reference ``softmax(q k^T / sqrt(d) + mask) v``, which keeps the scores.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from actors.capture.fake.cuda_attention import EfficientAttention, FlashAttention
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
    if q.shape[-1] != v.shape[-1]:  # MLA's values are narrower than its queries and keys
        return _unequal_head_sizes(q, k, v)
    if q.device.type == "cuda" and (torch.compiler.is_compiling() or not is_fake(q)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if torch.compiler.is_compiling():  # inductor lowers the cpu kernel for the fake cpu tensors
        return _CpuFlashAttention.apply(q, k, v)  # (actors/capture/fake/compiled_on_fake.py)
    if q.device.type == "meta" or is_fake(q):  # the kernel CUDA's SDPA picks for the dtype
        if q.dtype in (torch.bfloat16, torch.float16):
            return FlashAttention.apply(q, k, v, 0.0, True, None)
        return EfficientAttention.apply(q, k, v, None, 0.0, True, None)
    return _CpuFlashAttention.apply(q, k, v)


def _unequal_head_sizes(q, k, v):
    """Causal attention whose values have another head size than q and k (DeepSeek's MLA:
    192 and 128). CUDA's flash kernel takes equal sizes only, so SDPA runs the memory-efficient
    one, whatever the dtype; CPU's flash kernel too: it runs on values zero-padded to q's size,
    the padding's output sliced off."""
    if q.device.type == "cuda" and not is_fake(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.device.type == "meta" or is_fake(q):
        return EfficientAttention.apply(q, k, v, None, 0.0, True, None)
    padded = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
    return _CpuFlashAttention.apply(q, k, padded)[..., :v.shape[-1]]
