"""Context parallel: the sequence split over the ``cp`` ranks, attention as torch's ring
attention (``torch.distributed.tensor.experimental._context_parallel``).

torchtitan enters ``context_parallel(cp_mesh, buffers=[inputs, labels, rope], ...)``: the
buffers are cut along the sequence with the head-tail load balancer (rank ``i`` of ``cp``
keeps chunks ``i`` and ``2 cp - 1 - i`` of ``2 cp``, so causal attention costs every rank the
same), and every SDPA call becomes a ring: each rank attends its queries to every rank's keys
and values, gathered once per layer (the default ``allgather`` rotation) in forward, and the
key/value gradients passed around the ring (all-to-all) in backward, the partial outputs
merged in float32.

torch's dispatcher does this for ``F.scaled_dot_product_attention`` on DTensors; the decoder
here calls the fused kernels directly (actors/capture/workloads/attention.py), so
:class:`RingAttention` calls torch's ring functions itself with the kernel of the device: the GPU
flash (bf16) or memory-efficient (fp32) kernel on meta and fake, CPU's flash kernel on a real cpu.
Values narrower than queries and keys (DeepSeek's MLA) take the memory-efficient kernel on meta
and fake, as CUDA's SDPA does, and zero-padded values on a real cpu, as outside the ring
(actors/capture/workloads/attention.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from actors.capture.workloads.parallelize.tensor_parallel import blocks

aten = torch.ops.aten


def head_tail(x: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """The load balancer's share of ``x`` along ``dim`` for ``cp_rank``: chunks ``cp_rank``
    and ``2 cp - 1 - cp_rank`` of ``2 cp`` equal ones, concatenated."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=dim).contiguous()


def _cpu_forward(query, key, value, is_causal, **kwargs):
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal)


def _cpu_backward(*, grad_out, query, key, value, out, logsumexp, is_causal, **kwargs):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), query, key, value, out, logsumexp, 0.0, is_causal)


class _Ring(torch.autograd.Function):
    """Causal ring attention of local (b, heads, t / cp, head_dim) q, k, v over ``mesh``."""

    @staticmethod
    def forward(ctx, q, k, v, mesh):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        ctx.mesh = mesh
        flash = q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == v.shape[-1]
        ctx.kind = ("cpu" if q.device.type == "cpu" and not is_fake(q)
                    else "flash" if flash else "efficient")
        if ctx.kind == "cpu":
            out, lse = cp._templated_ring_attention(mesh.get_group(), 2, _cpu_forward, q, k, v,
                                                    is_causal=True)
            rest = ()
        elif ctx.kind == "flash":
            out, lse, *rest = cp._scaled_dot_product_ring_flash_attention(
                mesh, q, k, v, is_causal=True)
            rest = rest[:6]  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, offset
        else:
            out, lse, *rest = cp._scaled_dot_product_ring_efficient_attention(
                mesh, q, k, v, is_causal=True)
        # the kernel's extra outputs (philox seed and offset, ...): tensors are saved
        ctx.tensor_at = [isinstance(t, torch.Tensor) for t in rest]
        ctx.rest = [None if is_tensor else t for t, is_tensor in zip(rest, ctx.tensor_at)]
        ctx.save_for_backward(q, k, v, out, lse, *(t for t in rest if isinstance(t, torch.Tensor)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        q, k, v, out, lse, *tensors = ctx.saved_tensors
        it = iter(tensors)
        rest = [next(it) if is_tensor else r for r, is_tensor in zip(ctx.rest, ctx.tensor_at)]
        grad_out = grad_out.contiguous()
        if ctx.kind == "cpu":
            grads = cp._templated_ring_attention_backward(
                ctx.mesh.get_group(), 2, _cpu_backward, grad_out, "grad_out", q, k, v, out, lse,
                True)
        elif ctx.kind == "flash":
            cum_q, cum_k, max_q, max_k, seed, offset = rest
            grads = cp._scaled_dot_product_ring_flash_attention_backward(
                ctx.mesh, grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True,
                seed, offset)
        else:
            seed, offset = rest[:2]
            grads = cp._scaled_dot_product_ring_efficient_attention_backward(
                ctx.mesh, grad_out, q, k, v, None, out, lse, seed, offset, 0.0,
                [True, True, True, False], True)
        return grads[0], grads[1], grads[2], None


class RingAttention:
    """The attention of every block of a context-parallel decoder (GQAttention calls it in
    place of ``causal_attention``)."""

    def __init__(self, cp_mesh):
        self.mesh = cp_mesh

    def __call__(self, q, k, v):
        width = v.shape[-1]
        if width == q.shape[-1] or q.device.type != "cpu" or is_fake(q):
            return _Ring.apply(q, k, v, self.mesh)
        # CPU's flash kernel takes one head size: the padding's output is zero, sliced off
        padded = nn.functional.pad(v, (0, q.shape[-1] - width))
        return _Ring.apply(q, k, padded, self.mesh)[..., :width]


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Ring attention in every block of ``model`` (Llama's, actors/capture/workloads/models/
    llama/model.py, or DeepSeek-V3's latent attention), and its rotary tables cut to this rank's
    positions, as context_parallel cuts the rope buffer."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    ring = RingAttention(cp_mesh)

    for block in blocks(model):
        block.attention.context_parallel = ring
    for name in ("rope_cos", "rope_sin"):
        setattr(model, name, head_tail(getattr(model, name), 0, rank, cp))


def shard_batch(batch: tuple, cp_mesh) -> tuple:
    """Every micro-batch's (idx, targets) cut along the sequence for this cp rank."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    return tuple(tuple(head_tail(t, 1, rank, cp) for t in micro) for micro in batch)
