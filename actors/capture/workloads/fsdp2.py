"""FSDP2 training step: ``fully_shard`` on every decoder block, then on the root, as torchtitan
shards a decoder.

Parameters become DTensor shards over a 1-D DeviceMesh of all ranks; each block's are
all-gathered before its forward and backward and freed after (``reshard_after_forward``),
except the last block's after forward: backward needs them at once (torchtitan's default
policy; ``workload.reshard_after_forward`` always / never are its other two); the root keeps
its own gathered through backward. Gradients are reduce-scattered. ``bf16_mixed`` shards float32 parameters with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: gathered parameters and
compute in bf16, float32 shards (master weights), gradient reduction and AdamW state. With
several micro-batches the gradient reduction runs after the last one only
(``set_requires_gradient_sync(False)`` before the others).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from actors.capture.workloads.activation_offload import offloading
from actors.capture.workloads.data_parallel import micro_batch_loss
from actors.capture.workloads.moe import MoE
from actors.capture.workloads.optimizer_in_backward import OptimizersInBackward
from actors.capture.workloads.optimizers import make_optimizer


def reshards_after_forward(cfg, index: int, num_blocks: int, pipelined: bool = False) -> bool:
    """Whether block ``index`` of ``num_blocks`` frees its gathered parameters after forward,
    under workload.reshard_after_forward (torchtitan's policies; absent: default)."""
    policy = str(getattr(cfg, "reshard_after_forward", "default"))
    if policy != "default":
        return policy == "always"
    return not pipelined and index < num_blocks - 1


def offload_kwargs(cfg, device: torch.device) -> dict:
    """``fully_shard``'s ``offload_policy`` for workload.cpu_offload (pinned host memory only
    beside a GPU), else nothing."""
    if not getattr(cfg, "cpu_offload", False):
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}


def fsdp2_step(model: nn.Module, cfg, blocks: nn.ModuleList, device: torch.device,
               world_size: int, mesh=None, experts_mesh=None):
    """Shard ``model`` in place; ``step(batch)``: micro-batches' forward and backward, AdamW.
    ``experts_mesh``: expert parallel's (actors/capture/workloads/parallelize/expert_parallel.py):
    each MoE block's experts are an FSDP unit of their own over it, inside the block's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(device.type, (world_size,))
    kwargs = {"mesh": mesh, **offload_kwargs(cfg, device)}
    if cfg.precision == "bf16_mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        reshard = reshards_after_forward(cfg, i, len(blocks))
        if experts_mesh is not None and isinstance(block.feed_forward, MoE):
            fully_shard(block.feed_forward.experts, reshard_after_forward=reshard,
                        **{**kwargs, "mesh": experts_mesh})
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, **kwargs)
    if getattr(cfg, "optimizer_in_backward", False):
        opt = OptimizersInBackward(model.parameters(), partial(make_optimizer, cfg))
    else:
        opt = make_optimizer(cfg, model.parameters())

    def step(batch):
        opt.zero_grad(set_to_none=True)
        for i, micro_batch in enumerate(batch):
            if len(batch) > 1:
                model.set_requires_gradient_sync(i == len(batch) - 1)
            with offloading(cfg):
                loss = micro_batch_loss(model, micro_batch, len(batch))
            loss.backward()
        opt.step()

    step.optimizer = opt  # for PyTorch's FSDPMemTracker (scripts/bench_predict.py)
    return step
