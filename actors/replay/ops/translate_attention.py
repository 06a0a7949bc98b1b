"""Fused attention kernels of CUDA traces (flash, memory-efficient, cudnn; forward and
backward) as the CPU flash-attention kernel.

Why not the math path: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward are
one op each, have CPU and meta kernels, and work in blocks like the GPU kernels, so the replay
neither materializes the L x S score matrix the original never held nor needs autograd for the
backward. It takes (B, H, L, E) like SDPA, an additive or boolean mask, and grouped-query
heads, but one head size for q, k and v: a narrower side is padded with zero columns (exact).
It refuses dropout > 0, so dropout runs as p=0: the same matmuls without drawing a mask (on
synthetic data the values are moot). Outputs only the GPU kernel makes (philox seed and
offset, rng state, debug mask) are zero stand-ins of the recorded shape; the memory-efficient
kernel's logsumexp, padded to a multiple of 32 rows, is padded the same way.
"""
from __future__ import annotations

import torch

from actors.replay.ops.recorded import Outputs, fit, input_arg, recorded_value
from actors.trace.model import Op, TensorArg
from actors.trace.op_schema import OpSchema

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
TARGET_FWD = "aten::_scaled_dot_product_flash_attention_for_cpu"
TARGET_BWD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _attend(query, key, value, is_causal, mask=None, scale=None):
    """(output, logsumexp) in (B, H, L, E). The CPU kernel wants one head size for q, k and v:
    zero columns appended to the narrower side change neither the scores nor the output's
    leading columns (the scale stays that of the query's own head size)."""
    e, ev = query.shape[-1], value.shape[-1]
    if e == ev:
        return _FWD(query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale)
    width = max(e, ev)
    out, lse = _FWD(_pad(query, width), _pad(key, width), _pad(value, width), 0.0, is_causal,
                    attn_mask=mask, scale=e ** -0.5 if scale is None else scale)
    return out[..., :ev], lse


def _attend_backward(grad_out, query, key, value, out, lse, is_causal, mask=None, scale=None):
    """(grad_query, grad_key, grad_value) in (B, H, L, E), padded like `_attend`."""
    e, ev = query.shape[-1], value.shape[-1]
    if e == ev:
        return _BWD(grad_out, query, key, value, out, lse, 0.0, is_causal, attn_mask=mask,
                    scale=scale)
    width = max(e, ev)
    gq, gk, gv = _BWD(*(_pad(t, width) for t in (grad_out, query, key, value, out)), lse, 0.0,
                      is_causal, attn_mask=mask, scale=e ** -0.5 if scale is None else scale)
    return gq[..., :e], gk[..., :e], gv[..., :ev]


def _lse_arg(op: Op, position: int) -> TensorArg | None:
    out = op.outputs[position] if position < len(op.outputs) else None
    return out if type(out) is TensorArg else None


def _declined(op: Op, schema: OpSchema, seq_dim: int, packed: str | None = None,
              mask_type: str | None = None, causal: str | None = None,
              bias_grad: str | None = None) -> str | None:
    """Why this call has no CPU equivalent here, or None. The CPU kernel's causal mask is
    aligned to the top left; with L != S the flash kernel aligns it to the bottom right, and
    the efficient one does when ``custom_mask_type`` is 2."""
    if packed and type(input_arg(op, schema, packed)) is TensorArg:
        return f"packed variable-length input ({packed})"
    q, k = input_arg(op, schema, "query"), input_arg(op, schema, "key")
    square = type(q) is not TensorArg or type(k) is not TensorArg or \
        q.shape[seq_dim] == k.shape[seq_dim]
    bottom_right = mask_type and recorded_value(input_arg(op, schema, mask_type)) == 2 or \
        causal and recorded_value(input_arg(op, schema, causal))
    if bottom_right and not square:
        return "a causal mask aligned to the bottom right with L != S"
    if bias_grad and recorded_value(input_arg(op, schema, bias_grad)):
        return "the gradient of the attention bias"
    return None


# --- SDPA entry points: (B, H, L, E) -------------------------------------------------------
def sdpa_flash(op: Op, schema: OpSchema, device):
    why = _declined(op, schema, 2, causal="is_causal")
    if why:
        return why
    outputs = Outputs(op, device)

    def run(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
            scale=None):
        out, lse = _attend(query, key, value, is_causal, scale=scale)
        return outputs({0: out, 1: lse})
    return run


def sdpa_flash_backward(op: Op, schema: OpSchema, device):
    why = _declined(op, schema, 2, causal="is_causal")
    if why:
        return why

    def run(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
            dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        return _attend_backward(grad_out, query, key, value, out, logsumexp, is_causal,
                                scale=scale)
    return run


def sdpa_efficient(op: Op, schema: OpSchema, device):
    outputs, lse_arg = Outputs(op, device), _lse_arg(op, 1)

    def run(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
            *, scale=None):
        out, lse = _attend(query, key, value, is_causal, attn_bias, scale)
        return outputs({0: out, 1: fit(lse, lse_arg) if lse_arg else lse})
    return run


def sdpa_efficient_backward(op: Op, schema: OpSchema, device):
    mask = recorded_value(input_arg(op, schema, "grad_input_mask")) or ()
    if len(mask) > 3 and mask[3]:
        return "the gradient of the attention bias"
    outputs = Outputs(op, device)

    def run(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
            dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        lse = logsumexp[..., :query.shape[2]].contiguous()
        grads = _attend_backward(grad_out_, query, key, value, out, lse, is_causal, attn_bias,
                                 scale)
        return outputs(dict(enumerate(grads)))
    return run


def sdpa_cudnn(op: Op, schema: OpSchema, device):
    outputs, lse_arg = Outputs(op, device), _lse_arg(op, 1)

    def run(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
            return_debug_mask=False, *, scale=None):
        out, lse = _attend(query, key, value, is_causal, attn_bias, scale)
        return outputs({0: out, 1: fit(lse, lse_arg) if lse_arg else lse})
    return run


def sdpa_cudnn_backward(op: Op, schema: OpSchema, device):
    why = _declined(op, schema, 2, packed="cum_seq_q")
    if why:
        return why

    def run(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
            cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        lse = logsumexp.reshape(query.shape[:3])  # cudnn keeps a trailing 1
        return _attend_backward(grad_out, query, key, value, out, lse, is_causal, attn_bias, scale)
    return run


# --- kernels under SDPA: (B, L, H, E) ------------------------------------------------------
def _bhle(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def flash_forward(op: Op, schema: OpSchema, device):
    why = _declined(op, schema, 1, packed="cum_seq_q", causal="is_causal")
    if why:
        return why
    outputs = Outputs(op, device)

    def run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            return_debug_mask, *, scale=None):
        out, lse = _attend(*_bhle(query, key, value), is_causal, scale=scale)
        return outputs({0: out.transpose(1, 2), 1: lse})
    return run


def flash_backward(op: Op, schema: OpSchema, device):
    why = _declined(op, schema, 1, packed="cum_seq_q", causal="is_causal")
    if why:
        return why

    def run(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
            dropout_p, is_causal, rng_state, unused, *, scale=None):
        grads = _attend_backward(*_bhle(grad_out, query, key, value, out), logsumexp, is_causal,
                                 scale=scale)
        return tuple(_bhle(*grads))
    return run


def efficient_forward(op: Op, schema: OpSchema, device):
    why = _declined(op, schema, 1, packed="cu_seqlens_q", mask_type="custom_mask_type")
    if why:
        return why
    outputs, lse_arg = Outputs(op, device), _lse_arg(op, 1)

    def run(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p, custom_mask_type, compute_log_sumexp=False, *, scale=None):
        out, lse = _attend(*_bhle(query, key, value), custom_mask_type != 0, bias, scale)
        return outputs({0: out.transpose(1, 2), 1: fit(lse, lse_arg) if lse_arg else lse})
    return run


def efficient_backward(op: Op, schema: OpSchema, device):
    why = _declined(op, schema, 1, packed="cu_seqlens_q", mask_type="custom_mask_type",
                    bias_grad="bias_requires_grad")
    if why:
        return why
    outputs = Outputs(op, device)

    def run(grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type,
            bias_requires_grad, *, scale=None, num_splits_key=None, window_size=None,
            shared_storage_dqdkdv=False):
        lse = logsumexp[..., :query.shape[1]].contiguous()
        grads = _attend_backward(*_bhle(grad_out_, query, key, value, out), lse,
                                 custom_mask_type != 0, bias, scale)
        return outputs(dict(enumerate(_bhle(*grads))))
    return run
