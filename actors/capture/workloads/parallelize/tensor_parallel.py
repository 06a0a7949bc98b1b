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
* The output projection is split by vocabulary columns and its logits stay sharded
  (``Shard(-1)``): the cross-entropy runs under ``loss_parallel`` (no rank holds the whole
  vocabulary's logits).
"""
from __future__ import annotations

import contextlib

import torch.nn as nn


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a Llama (a list) or of a pipeline stage (a dict by layer)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_tensor_parallel(model: nn.Module, tp_mesh, loss_parallel: bool = True) -> None:
    """Split ``model`` (actors/capture/workloads/models/llama/model.py's Llama, or a pipeline stage
    of it) over the 1-D ``tp_mesh`` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

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
        if hasattr(block.attention, "q_norm"):  # Qwen3: each rank norms its own heads
            parallelize_module(block, tp_mesh, {
                "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin): the rotary tables stay plain, whole-sequence tensors
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def loss_parallel_context(enabled: bool):
    """torch's ``loss_parallel()`` (cross-entropy on vocabulary-sharded logits, forward and
    backward) when ``enabled``, else nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
