"""Ops that stand in a trace for a GPU's generated kernel the capture's device cannot run.

A GPU target's capture lowers some ops as the GPU's compiler does (FlexAttention's Triton
templates: actors/capture/fake/cuda_flex_attention.py). The buffers such a kernel writes are
made by the compiled graph and recorded as any; the kernel itself is one of these ops: it reads
its inputs and writes its outputs in place and computes nothing, so the trace has the step's
order and each tensor's use as the GPU's kernel has them, and a replay runs it in no time.
Their namespace is :data:`NAMESPACE`; a replay imports this module on its first miss
(actors/replay/ops/resolve.py).
"""
from __future__ import annotations

import torch

NAMESPACE = "tracefleet_kernel"
_SCHEMAS = {
    "flex_attention": "flex_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) out, "
                      "Tensor(b!) logsumexp, Tensor(c!) max_scores) -> ()",
    "flex_attention_backward": (
        "flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor logsumexp, "
        "Tensor delta, Tensor grad_out, Tensor(a!) grad_query, Tensor(b!) grad_key, "
        "Tensor(c!) grad_value) -> ()"),
}

_library = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in _SCHEMAS.items():
    _library.define(_schema)
    # one kernel for every device and for fake and meta tensors: nothing to compute
    _library.impl(_name, lambda *args: None, "CompositeExplicitAutograd")


def kernel_op(name: str):
    """The stand-in op ``name`` (a key of the module's schemas)."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default
