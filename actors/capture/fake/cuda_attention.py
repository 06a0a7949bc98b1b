"""``scaled_dot_product_attention`` as CUDA runs it, on meta or fake tensors.

The fused kernels' own aten ops (flash, memory-efficient) have meta kernels, so on shapes-only
tensors they allocate exactly what the GPU kernels allocate: the output, a float32 logsumexp
of batch x heads x seq (the memory-efficient kernel pads its rows to a multiple of 32), the
philox RNG state for dropout, and in backward the three gradients; nothing of size
seq x seq. For a GPU target each backward also holds what CUDA's kernel allocates beside
them (actors/capture/fake/attention_backward.py). Around the kernels, what torch's composite
``scaled_dot_product_attention`` (aten/src/ATen/native/transformers/attention.cpp) does on
CUDA is done too: head dims padded
to a multiple of 8 for flash (and the output cut back), a boolean mask turned into an additive
one and padded for the memory-efficient kernel. The math fallback is torch's own
``_scaled_dot_product_attention_math``, as on CUDA.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from actors.capture.fake import attention_backward
from actors.capture.fake.sdpa_choice import EFFICIENT, FLASH, SdpaCall, choose_cuda_backend
from actors.gpu_arch import GpuArch

_aten = torch.ops.aten
_MASK_ALIGN = 8  # preprocess_mask's mem_eff_alignment


def _scale_kw(scale):
    return {} if scale is None else {"scale": scale}


class FlashAttention(torch.autograd.Function):
    """``_scaled_dot_product_flash_attention`` and its backward, (B, H, L, E) tensors."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, is_causal, scale):
        out, lse, _, _, max_q, max_k, rng_state, unused, _ = \
            _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal,
                                                      **_scale_kw(scale))
        ctx.args = (max_q, max_k, dropout_p, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, rng_state, unused)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, rng_state, unused = ctx.saved_tensors
        max_q, max_k, dropout_p, is_causal, scale = ctx.args
        grad_out = attention_backward.kernel_grad_out(grad_out)
        held = attention_backward.flash_workspace(q, k)  # for the kernel's duration
        grads = _aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, max_q, max_k, dropout_p,
            is_causal, rng_state, unused, **_scale_kw(scale))
        del held
        return (*grads, None, None, None)


class EfficientAttention(torch.autograd.Function):
    """``_scaled_dot_product_efficient_attention`` and its backward, an additive bias
    optional."""

    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p, is_causal, scale):
        out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, **_scale_kw(scale))
        ctx.args = (dropout_p, is_causal, scale, bias is not None and bias.requires_grad)
        ctx.save_for_backward(q, k, v, bias, out, lse, seed, offset)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
        dropout_p, is_causal, scale, bias_grad = ctx.args
        grad_out = attention_backward.kernel_grad_out(grad_out)
        held = attention_backward.efficient_delta(q, grad_out, out)  # for the kernel
        gq, gk, gv, gb = _aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p,
            [True, True, True, bias_grad], is_causal, **_scale_kw(scale))
        del held
        return gq, gk, gv, gb if bias_grad else None, None, None, None


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[-1] % multiple
    return F.pad(t, (0, extra)) if extra else t


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """convert_boolean_attn_mask: True takes part (0), False is -inf; a float mask as is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def _efficient_bias(mask: torch.Tensor, q, k) -> torch.Tensor:
    """preprocess_mask: a bias whose strides are not aligned is padded (then cut back to its
    length, so the kernel reads aligned rows), then expanded to (B, H, L, S)."""
    if any(s % _MASK_ALIGN for s in mask.stride()[:-1]):
        mask = _pad_last(mask, _MASK_ALIGN)[..., :k.shape[2]]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def flash(q, k, v, dropout_p=0.0, is_causal=False, scale=None, grad=True):
    """The flash branch: head dims padded to a multiple of 8, the scale of the unpadded head
    dim, the output cut back; ``grad``: autograd records it (SdpaCall.requires_grad)."""
    head_dim = q.shape[-1]
    og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    padded = [_pad_last(t, 8) for t in (q, k, v)]
    if grad:
        out = FlashAttention.apply(*padded, dropout_p, is_causal, og_scale)
    else:
        out = _aten._scaled_dot_product_flash_attention(*padded, dropout_p, is_causal,
                                                        scale=og_scale)[0]
    return out[..., :head_dim] if out.shape[-1] != head_dim else out


def efficient(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, grad=True):
    """The memory-efficient branch, with the mask made additive and aligned (``grad`` as for
    :func:`flash`). Grouped-query
    key and value heads are repeated to the query's (as the math path does): the kernel's
    backward makes key and value gradients of the query's head count (its meta kernel says so),
    so the repeated copies are what the GPU holds too."""
    if k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bias = additive_mask(attn_mask, q.dtype)
    if bias is not None:
        bias = _efficient_bias(bias, q, k)
    if grad:
        return EfficientAttention.apply(q, k, v, bias, dropout_p, is_causal, scale)
    return _aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, dropout_p,
                                                         is_causal, **_scale_kw(scale))[0]


def sdpa_as_cuda(arch: GpuArch, query, key, value, attn_mask=None, dropout_p=0.0,
                 is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as it runs on ``arch``; ``(output, SdpaCall,
    backend)``."""
    call = SdpaCall.of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    backend = choose_cuda_backend(call, arch).backend
    if backend == FLASH:
        out = flash(query, key, value, dropout_p, is_causal, scale, call.requires_grad)
    elif backend == EFFICIENT:
        out = efficient(query, key, value, attn_mask, dropout_p, is_causal, scale,
                        call.requires_grad)
    else:
        out = _aten._scaled_dot_product_attention_math(
            query, key, value, additive_mask(attn_mask, query.dtype), dropout_p, is_causal,
            None, scale=scale, enable_gqa=enable_gqa)[0]
    return out, call, backend
