"""Activation checkpointing of decoder blocks, the reference Llama trainer's (torchtitan's) modes.

* ``full``: every block's forward is recomputed in its backward; only the block's input is
  kept.
* ``selective_layer``: every ``ac_every``-th block (the 2nd, 4th, ... for 2) is checkpointed
  as in ``full``, the others keep all their activations.
* ``selective_op``: inside every block, the outputs of the matmuls and of attention are kept
  and everything else recomputed, except every second matmul, whose output is recomputed too
  (torchtitan's op-level selective AC: its save list is ``aten.mm`` plus the fused attention
  kernels; this decoder's biased Linears (GPT) run ``aten.addmm``, which counts as a matmul
  here).

Non-reentrant ``torch.utils.checkpoint`` without RNG state stashing and without early stop, as
torchtitan applies it (its ``early_stop`` defaults to off). A user's own step may keep torch's
default early stop: it ends the recompute by raising inside a submodule's forward, and the
recorder's module ranges close on that too (actors/capture/recorder.py).
The block's own ``forward`` is wrapped rather than the module (``checkpoint_wrapper`` would add
``_checkpoint_wrapped_module`` to every qualified name in the trace's module ranges); hooks of
the block itself therefore run once, those of its submodules again during recomputation, as
they do under torchtitan's wrapper.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from actors.choices import Choice

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
# Outputs kept by selective_op besides the matmuls: the fused attention kernels (each device's).
_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


class ActivationCheckpointing(Choice):
    """What a block keeps for backward (see the module docstring)."""

    none = "none"
    full = "full"
    selective_layer = "selective_layer"
    selective_op = "selective_op"


def _every_second_matmul_recomputed():
    """SAC contexts for one block call: matmul outputs kept but every second one, attention kept.

    Counts restart with every block call, and separately for the forward and the recompute, so
    both see the same matmuls in the same order (the recompute asks the same question again).
    """
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        if func in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, context_fn, *args):
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False,
                      early_stop=False, **kwargs)


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: ActivationCheckpointing,
                                   every: int) -> None:
    """Checkpoint ``blocks`` per ``mode`` (``every``: selective_layer's period)."""
    if mode == ActivationCheckpointing.none:
        return
    chosen = [i for i in range(len(blocks))
              if mode != ActivationCheckpointing.selective_layer or (i + 1) % every == 0]
    context_fn = (_every_second_matmul_recomputed
                  if mode == ActivationCheckpointing.selective_op else None)
    for i in chosen:
        block = blocks[i]
        # An instance attribute: nn.Module.__call__ runs it in place of the class's forward.
        block.forward = partial(_checkpointed, block.forward, context_fn)
