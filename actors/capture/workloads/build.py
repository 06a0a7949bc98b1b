"""Capture workloads: a built-in decoder (a family of actors/capture/workloads/models/) trained as
the reference trainers (torchtitan, DeepSpeed) train large models, on cpu, cuda, meta or fake.

A recipe is ``model`` x ``parallel`` (ddp, fsdp2, zero3, local) x ``precision`` (fp32, bf16,
bf16_mixed) x ``activation_checkpointing`` x ``grad_accum_steps`` (docs/capture.md, "Recipes";
the config is actors/capture/workloads/config.py). ``build_workload`` returns a
:class:`Workload`: the model (whose submodules get the module ranges), a batch source and a
``step(batch)`` running one full training iteration (forward and backward of every
micro-batch, gradient communication, optimizer step).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from actors.capture.workloads.checkpointing import apply_activation_checkpointing
from actors.capture.workloads.context import CaptureContext, Workload
from actors.capture.workloads.custom import build_custom
from actors.capture.workloads.data_parallel import data_parallel_step
from actors.capture.workloads.fsdp2 import fsdp2_step
from actors.capture.workloads.models.registry import ffn_dim_of, model_spec
from actors.capture.workloads.mesh import batch_rows, dp_index, validate_parallelism
from actors.capture.workloads.parallelize.float8 import apply_float8
from actors.capture.workloads.parallelize.recipe import mesh_step
from actors.capture.workloads.config import (PARAM_DTYPES, ModelName, Parallel, WorkloadConfig,
                                             WorkloadDevice, moe_spec, validate)
from actors.capture.workloads.zero3 import zero3_step


def build_model(cfg: WorkloadConfig) -> tuple[nn.Module, type]:
    """``(model, block class)`` of ``cfg.model``'s family (actors/capture/workloads/models/) on the
    current default device (``with torch.device(...)``), in float32."""
    spec = model_spec(cfg.model)
    return spec.build(cfg, ffn_dim_of(cfg), moe_spec(cfg)), spec.block_class


def blocks_of(model: nn.Module, cfg: WorkloadConfig) -> nn.ModuleList:
    """The decoder blocks of a model build_model made from ``cfg``."""
    return model_spec(cfg.model).blocks(model)


def build_workload(cfg: WorkloadConfig, rank: int, world_size: int,
                   device: torch.device | None = None, mesh=None) -> Workload:
    """Build the model, optimizer and data source on ``device`` (default: cfg.device).

    torch.distributed must be initialized unless ``cfg.parallel`` is local. ``mesh``: fsdp2's
    1-D DeviceMesh over all ranks (None: made here with ``init_device_mesh``; pass one made
    outside a FakeTensorMode, where making it fails), or the N-D mesh of
    ``cfg.parallelism`` (actors/capture/workloads/mesh.py's ``build_mesh``; required then).
    """
    validate(cfg)
    validate_parallelism(cfg, world_size)
    device = device or torch.device("cpu" if cfg.device == WorkloadDevice.fake else str(cfg.device))
    if cfg.model == ModelName.custom:
        assert mesh is not None, "the caller creates the mesh (fake: before the fake mode)"
        return build_custom(cfg.entrypoint, CaptureContext(device, rank, world_size, mesh))
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    with torch.device(device):
        model, block_class = build_model(cfg)
    if cfg.parallel != Parallel.zero3:  # DeepSpeed casts the model itself in bf16 mode
        model = model.to(PARAM_DTYPES[cfg.precision])
    num_params = sum(p.numel() for p in model.parameters())
    if cfg.float8:  # a converter on the built model, before parallelizing it (torchtitan's)
        apply_float8(model, str(cfg.float8_recipe), cfg.float8_all_gather,
                     fsdp=cfg.parallel == Parallel.fsdp2)
    blocks = blocks_of(model, cfg)
    apply_activation_checkpointing(blocks, cfg.activation_checkpointing, cfg.ac_every)
    if cfg.compile:  # each block in place: module names stay, and so do FSDP2's units
        for block in blocks:
            block.compile()
    info = {}
    # ranks that split one model replica's work (tp, cp, pp peers) read the same data
    gen = torch.Generator().manual_seed(cfg.seed + 1 + dp_index(cfg.parallelism, world_size,
                                                                rank))

    rows = batch_rows(cfg.parallelism, world_size, cfg.batch_size)

    def micro_batch():
        if device.type == "meta":  # no values to draw
            idx = torch.empty(rows, cfg.seq_len, dtype=torch.long, device=device)
            return idx, torch.empty_like(idx)
        seq = torch.randint(0, cfg.vocab, (rows, cfg.seq_len + 1), generator=gen)
        return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)

    def next_batch():
        return tuple(micro_batch() for _ in range(cfg.grad_accum_steps))

    if cfg.parallel == Parallel.zero3:
        step, info = zero3_step(model, cfg, block_class)
    elif not cfg.parallelism.is_one_dim():
        assert mesh is not None, "the caller builds the N-D mesh (actors/capture/workloads/mesh.py)"
        step = mesh_step(model, cfg, blocks, device, world_size, mesh)
        model = step.model  # with pp: this rank's stages only
    elif cfg.parallel == Parallel.fsdp2:
        step = fsdp2_step(model, cfg, blocks, device, world_size, mesh)
    else:
        step = data_parallel_step(model, cfg, device,
                                  world_size if cfg.parallel == Parallel.ddp else 0)
    return Workload(model=model, step=step, next_batch=next_batch, num_params=num_params,
                    info=info, warm_step=getattr(step, "warm_step", None))
