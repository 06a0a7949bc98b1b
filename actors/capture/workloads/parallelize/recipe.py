"""The mesh recipe of the built-in Llama, in torchtitan's order (``parallelize_llama``):
tensor parallel on ``tp``, ring attention on ``cp``, expert parallel on ``ep`` (the MoE
blocks' experts split, :mod:`.expert_parallel`), activation checkpointing (applied by the
caller, actors/capture/workloads/build.py), then FSDP2 on ``dp_shard_cp`` — HSDP, a 2-D
``(dp_replicate, dp_shard_cp)`` mesh, when there are replicas: parameters sharded within a
replica, gradients reduce-scattered there and all-reduced across replicas; the experts in
units of their own over ``efsdp``.

The step is FSDP2's (actors/capture/workloads/fsdp2.py): every block then the root
``fully_shard``-ed, AdamW, micro-batches; with pp, the pipeline schedule's over this rank's stages
(:mod:`.pipeline`). With no rank left for ``dp_replicate x dp_shard x cp`` (tp and pp only),
torchtitan applies no FSDP and neither does the recipe: the plain local step, or the schedule
over unsharded stages. Around it: each micro-batch cut to the rank's share of the sequence
(cp), and the whole step under ``loss_parallel`` (tp), whose cross-entropy on sharded logits
runs in forward and backward; under pp too, where the last stage's output stays a
vocabulary-sharded DTensor the schedule's loss takes (as torchtitan), so neither the loss nor
the schedule, which keeps every micro-batch's output until the step ends, holds the whole
vocabulary's logits.

On fake, the parallelize and ``fully_shard`` calls run under ``unset_fake_temporarily``: they
slice the mesh, which reads its (real) rank tensors with ops that have no fake kernel
(``aten.nonzero`` in ``DeviceMesh._concatenate``); the parameters stay fake.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

from actors.capture.workloads.mesh import sub_mesh
from actors.capture.workloads.parallelize.context_parallel import (apply_context_parallel,
                                                                   shard_batch)
from actors.capture.workloads.parallelize.expert_parallel import (apply_expert_parallel,
                                                                  expert_fsdp_mesh)
from actors.capture.workloads.parallelize.tensor_parallel import (apply_tensor_parallel,
                                                                  loss_parallel_context)
from actors.capture.workloads.data_parallel import data_parallel_step
from actors.capture.workloads.fsdp2 import fsdp2_step
from actors.capture.workloads.parallelize.pipeline import PipelineStages, pipeline_step, split_model


def mesh_step(model: nn.Module, cfg, blocks: nn.ModuleList, device: torch.device,
              world_size: int, mesh):
    """Split ``model`` over ``mesh`` (actors/capture/workloads/mesh.py's N-D mesh) in place; the
    training ``step(batch)``, whose ``model`` is what this rank trains (the model, or its
    pipeline stages)."""
    par = cfg.parallelism
    degrees = par.degrees(world_size)
    tp_mesh = sub_mesh(mesh, par, world_size, "tp")
    cp_mesh = sub_mesh(mesh, par, world_size, "cp")
    pp_mesh = sub_mesh(mesh, par, world_size, "pp")
    fsdp_mesh = sub_mesh(mesh, par, world_size, "dp_replicate", "dp_shard_cp")
    # under pp too: the last stage's logits stay vocabulary-sharded (the module docstring)
    loss_parallel = tp_mesh is not None
    fake = detect_fake_mode() is not None
    with unset_fake_temporarily():  # a no-op outside a fake mode
        parts = [model] if pp_mesh is None else split_model(
            model, pp_mesh.get_local_rank(), degrees["pp"], par.pp_stages_per_rank)
        for part in parts:
            if tp_mesh is not None:
                apply_tensor_parallel(part, tp_mesh, loss_parallel)
            if cp_mesh is not None:
                apply_context_parallel(part, cp_mesh)
            if par.ep > 1:
                apply_expert_parallel(part, mesh.expert_mesh["ep"])
        if pp_mesh is None and fsdp_mesh is None:  # tp only: no FSDP (validate_parallelism)
            inner = data_parallel_step(model, cfg, device, 0)
        elif pp_mesh is None:
            experts_mesh = expert_fsdp_mesh(mesh.expert_mesh) if par.ep > 1 else None
            inner = fsdp2_step(model, cfg, blocks, device, world_size, fsdp_mesh, experts_mesh)
        else:
            seq = cfg.seq_len // degrees["cp"]
            inner = pipeline_step(parts, cfg, device, pp_mesh, fsdp_mesh, _activation_dtype(cfg),
                                  seq, seq // degrees["tp"], fake)

    def on_mesh(run):
        def step(batch):
            if cp_mesh is not None:
                batch = shard_batch(batch, cp_mesh)
            with loss_parallel_context(loss_parallel):
                run(batch)
        return step

    step = on_mesh(inner)
    if getattr(inner, "warm_step", None) is not None:
        step.warm_step = on_mesh(inner.warm_step)
    step.optimizer = inner.optimizer
    step.model = model if pp_mesh is None else PipelineStages(parts)
    return step


def _activation_dtype(cfg) -> torch.dtype:
    """The dtype of the hidden states between blocks (FSDP2 casts to param_dtype)."""
    return {"fp32": torch.float32, "fp16": torch.float16}.get(str(cfg.precision), torch.bfloat16)
