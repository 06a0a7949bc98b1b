"""FlexAttention in training as a GPU runs it, on fake tensors.

``torch.compile(flex_attention)`` with a block mask (document masking of packed sequences,
sliding windows, chunked attention: torchtitan's ``use_flex_attn``) is lowered by inductor to
one fused Triton kernel per direction on a GPU. On a CPU torch refuses its backward
(``_validate_device``: "FlexAttention does not support backward on CPU"), and inductor's CPU
lowering has a forward template only. Fake tensors report ``cpu``, so a GPU target's capture of
such a step failed.

Within :func:`flex_attention_as_on_cuda`, the fake tensors stand for CUDA ones: torch's
device check lets their backward through, and inductor's lowerings of the two higher-order
ops make the buffers the Triton lowering makes (torch/_inductor/kernel/flex/flex_attention.py),
which the capture's fake allocator records (actors/capture/fake/compiled_on_fake.py); each
template is one stand-in op called with what it reads and writes (actors/trace/kernel_ops.py),
so every tensor lives in the trace as long as around the GPU's kernel:

* forward: the output (B x Hq x L x Ev, the query's dtype, strides in the query's order), a
  float32 logsumexp and a float32 row max (B x Hq x L each); the logsumexp is what autograd
  saves with q, k, v and the output, the max is let go after the kernel unless asked for;
* backward: ``delta``, the float32 row sums of output x its gradient (a fused reduction,
  lowered by inductor as torch does), then the gradients of q, k and v in their inputs'
  layouts, summed over the batch where k and v were broadcast over it; a captured buffer
  (a learned bias in ``score_mod``) gets a gradient of its own shape.

Nothing of size L x S exists in either direction: the block mask's index tensors (a few KB)
are made by ``create_block_mask`` outside the kernel and recorded as any tensor. What is not
modelled: the decoding template (a short query with ``BACKEND="AUTO"``: inference, not a
training step) keeps per-split partial outputs; a ``BACKEND="FLASH"`` (CuteDSL) kernel keeps no
row max. Eager ``flex_attention`` (no torch.compile around it: torch warns it is for debugging)
materializes the scores on a GPU too, and on fake tensors runs the higher-order op's shape
rule, which makes only the outputs: it is refused on a GPU target, naming the fix.
"""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from typing import Callable
from unittest import mock

import torch
import torch.nn.attention.flex_attention as flex_api

from actors.trace.kernel_ops import kernel_op

_hop = torch.ops.higher_order
_aten, _prims = torch.ops.aten, torch.ops.prims
KERNEL, CPU_KERNEL = "triton_flex", "no CPU backward"  # kernel_dispatch's names


class EagerFlexOnFake(NotImplementedError):
    """``flex_attention`` called outside torch.compile on a GPU target's fake tensors."""


def _dense_strides(size, stride_like):
    from torch._inductor.kernel.flex.common import infer_dense_strides

    return infer_dense_strides(size, stride_like)


def _empty(size, stride, dtype, device):
    from torch._inductor.lowering import empty_strided

    return empty_strided(size, stride, dtype=dtype, device=device)


def _run_kernel(name: str, *args) -> None:
    """The GPU's kernel as its stand-in op (actors/trace/kernel_ops.py): inductor calls it in
    the generated wrapper with the buffers it reads and writes."""
    from torch._inductor.ir import FallbackKernel

    FallbackKernel.create(kernel_op(name), *args)


def _forward(on_lowered: Callable[[str, int], None]):
    def lower(query, key, value, subgraph, block_mask, scale, kernel_options,
              score_mod_other_buffers, mask_mod_other_buffers):
        from torch._inductor.kernel.flex.common import maybe_realize

        query, key, value = maybe_realize([query, key, value])
        batch, num_q_heads, len_q, _ = query.get_size()
        v_head_dim = value.get_size()[-1]
        out_size = [batch, num_q_heads, len_q, v_head_dim]
        device = query.get_device()
        out = _empty(out_size, _dense_strides(out_size, query.get_stride()), query.get_dtype(),
                     device)
        row_size = [batch, num_q_heads, len_q]
        logsumexp = _empty(row_size, None, torch.float32, device)
        max_scores = _empty(row_size, None, torch.float32, device)
        _run_kernel("flex_attention", query, key, value, out, logsumexp, max_scores)
        on_lowered("forward", _numel(row_size) * 4)
        return out, logsumexp, max_scores
    return lower


def _numel(size) -> int:
    return math.prod(int(s) for s in size)


def _captured_grads(joint_graph, buffers) -> tuple:
    """A gradient for each captured buffer the joint graph differentiates (its outputs after
    the score's and the four indices' b, h, m, n), None for the rest."""
    output = next(n for n in joint_graph.graph_module.graph.nodes if n.op == "output")
    grads = list(output.args[0])[1 + 4:]
    return tuple(None if i >= len(grads) or grads[i] is None
                 else _empty(buffer.get_size(), None, buffer.get_dtype(), buffer.get_device())
                 for i, buffer in enumerate(buffers))


def _backward(on_lowered: Callable[[str, int], None]):
    def lower(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
              joint_graph, block_mask, scale, kernel_options, score_mod_other_buffers,
              mask_mod_other_buffers):
        from torch._inductor.ir import ExternKernel
        from torch._inductor.kernel.flex.common import maybe_realize
        from torch._inductor.lowering import lowerings

        query, key, value, logsumexp, grad_out = maybe_realize(
            [query, key, value, logsumexp, grad_out])
        device = query.get_device()
        batch_q, num_q_heads, len_q, qk_head_dim = query.get_size()
        batch_kv, num_kv_heads, len_kv, v_head_dim = value.get_size()
        # delta as the Triton lowering computes it: a fused reduction inductor plans itself
        delta = lowerings[_aten.sum](lowerings[_aten.mul](out, grad_out), axis=-1)
        delta = lowerings[_prims.convert_element_type](delta, torch.float32)
        if grad_logsumexp is not None:
            delta = lowerings[_aten.sub](
                delta, lowerings[_aten.mul](grad_logsumexp, 1 / math.log(2)))
        (delta,) = maybe_realize([ExternKernel.require_contiguous(delta)])
        q_size = [batch_q, num_q_heads, len_q, qk_head_dim]
        k_size = [batch_q, num_kv_heads, len_kv, qk_head_dim]
        v_size = [batch_q, num_kv_heads, len_kv, v_head_dim]
        grad_query = _empty(q_size, _dense_strides(q_size, query.get_stride()),
                            query.get_dtype(), device)
        grad_key = _empty(k_size, _dense_strides(k_size, key.get_stride()), key.get_dtype(),
                          device)
        grad_value = _empty(v_size, _dense_strides(v_size, value.get_stride()),
                            value.get_dtype(), device)
        _run_kernel("flex_attention_backward", query, key, value, logsumexp, delta, grad_out,
                    grad_query, grad_key, grad_value)
        if int(batch_kv) != int(batch_q):  # k and v broadcast over the batch
            grad_key = lowerings[_aten.sum](grad_key, axis=0, keepdims=True)
            grad_value = lowerings[_aten.sum](grad_value, axis=0, keepdims=True)
        on_lowered("backward", _numel(q_size[:3]) * 4)
        return (grad_query, grad_key, grad_value,
                _captured_grads(joint_graph, score_mod_other_buffers))
    return lower


def _device_check(cpu_check: Callable) -> Callable:
    def validate_device(query, key, value):
        if query.device.type == "cpu" and not torch.compiler.is_compiling():
            raise EagerFlexOnFake(
                "flex_attention was called outside torch.compile: on a GPU its eager path "
                "materializes every score matrix (torch warns it is for debugging), which a "
                "fake capture cannot follow; compile it as a training step does "
                "(torch.compile(flex_attention))")
        if query.device.type != "cpu":
            cpu_check(query, key, value)
    return validate_device


@contextmanager
def flex_attention_as_on_cuda(on_lowered: Callable[[str, int], None]):
    """Within the block, compiled FlexAttention on fake tensors is lowered as for a GPU (module
    doc); ``on_lowered(direction, kept_bytes)`` is called as inductor lowers each call
    (``kept_bytes``: the float32 logsumexp, or backward's delta)."""
    from torch._inductor.lowering import lowerings, register_lowering

    ours: dict = {}
    register_lowering(_hop.flex_attention, type_promotion_kind=None,
                      lowering_dict=ours)(_forward(on_lowered))
    register_lowering(_hop.flex_attention_backward, type_promotion_kind=None,
                      lowering_dict=ours)(_backward(on_lowered))
    with ExitStack() as stack:
        stack.enter_context(mock.patch.dict(lowerings, ours))
        stack.enter_context(mock.patch.object(flex_api, "_validate_device",
                                              _device_check(flex_api._validate_device)))
        yield
