"""Tensor parallel on the Llama decoder, torchtitan's plan (``apply_tp``, models/llama3).

* The token embedding is split by vocabulary rows (``RowwiseParallel``) and its output is
  reduce-scattered along the sequence: between blocks every activation is ``Shard(1)``, a
  ``1 / tp`` slice of the sequence (sequence parallel).
* The norms run on that slice (``SequenceParallel``); the attention and feed-forward inputs
  are all-gathered back to the whole sequence (``PrepareModuleInput``).
* ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` are split by output features (``ColwiseParallel``:
  each rank holds ``n_heads / tp`` heads and ``ffn / tp`` hidden units); ``wo`` and ``w2`` by
  input features (``RowwiseParallel``), their partial sums reduce-scattered to ``Shard(1)``.
* Qwen3's per-head q/k norms run on the rank's heads (``SequenceParallel`` over the heads
  dimension, torchtitan's qwen3 plan): their weights replicated.
* DeepSeek-V3's latent attention (models/deepseek_v3/model.py) takes the whole sequence as
  plain tensors: the low-rank projections into the query and key/value latents (``wq_a``,
  ``wkv_a``) and their norms run whole on every rank (torchtitan's ``NoParallel``), the
  projections out of the latents (``wq`` or ``wq_b``, ``wkv_b``) are split by head
  (``ColwiseParallel``: the latents' gradients all-reduced in backward) and ``wo`` by input
  features, reduce-scattered to ``Shard(1)``.
* A Mixture of Experts block (actors/capture/workloads/moe.py) takes the whole sequence as
  plain tensors, routes every token on every rank and runs its share of each expert's hidden
  units (expert tensor parallel: ``apply_expert_tensor_parallel``); its
  output, a partial sum (``Partial``), is reduce-scattered to ``Shard(1)``
  (``PrepareModuleInputOutput``, torchtitan's MoE plan at ``ep = 1``).
* The output projection is split by vocabulary columns and its logits stay sharded
  (``Shard(-1)``): the cross-entropy runs under ``loss_parallel`` (no rank holds the whole
  vocabulary's logits).
"""
from __future__ import annotations

import contextlib

import torch.nn as nn

from actors.capture.workloads.moe import MoE


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a Llama (a list) or of a pipeline stage (a dict by layer)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_tensor_parallel(model: nn.Module, tp_mesh, loss_parallel: bool = True) -> None:
    """Split ``model`` (actors/capture/workloads/models/llama/model.py's Llama, or a pipeline stage
    of it) over the 1-D ``tp_mesh`` in place."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleInputOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # a pipeline stage holds some of them
    parallelize_module(model, tp_mesh, {k: v for k, v in plan.items()
                                        if getattr(model, k, None) is not None})
    for block in blocks(model):
        latent = hasattr(block.attention, "wkv_b")  # DeepSeek-V3's MLA: its q_norm is a latent's
        if hasattr(block.attention, "q_norm") and not latent:  # Qwen3: each rank's own heads
            parallelize_module(block, tp_mesh, {
                "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
        heads = ({name: ColwiseParallel() for name in ("wq", "wq_b", "wkv_b")
                  if hasattr(block.attention, name)} if latent else
                 {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel()})
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin): the rotary tables stay plain, whole-sequence tensors; MLA's
            # latent projections and norms take x as a plain tensor
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None),
                                            use_local_output=latent),
            **{f"attention.{name}": style for name, style in heads.items()},
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        })
        if isinstance(block.feed_forward, MoE):
            apply_expert_tensor_parallel(block.feed_forward, tp_mesh)
            parallelize_module(block, tp_mesh, {"feed_forward": PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Partial(),),
                desired_output_layouts=(Shard(1),))})
            continue
        parallelize_module(block, tp_mesh, {
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def apply_expert_tensor_parallel(moe: MoE, tp_mesh) -> None:
    """Keep this rank's ``1 / tp`` of the hidden units of every expert of ``moe`` (the stacked
    ``w1``, ``w3`` rows and ``w2`` columns) and of its shared experts, as plain parameters (in
    place): torchtitan's expert tensor parallel at ``ep = 1``, whose experts' weights are
    ``Shard`` over ``tp`` on that dimension (the same bytes). The router runs whole on every
    rank; the block's output is then each rank's partial sum, which the tensor parallel plan
    reduce-scatters along the sequence."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()

    def keep(module: nn.Module, name: str, dim: int) -> None:
        whole = getattr(module, name).detach()
        size = whole.shape[dim] // tp
        setattr(module, name, nn.Parameter(whole.narrow(dim, rank * size, size).clone()))

    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        keep(moe.experts, name, dim)
    if moe.shared is not None:  # a SwiGLU: w1, w3 by output rows, w2 by input columns
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            keep(getattr(moe.shared, name), "weight", dim)


def loss_parallel_context(enabled: bool):
    """torch's ``loss_parallel()`` (cross-entropy on vocabulary-sharded logits, forward and
    backward) when ``enabled``, else nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
