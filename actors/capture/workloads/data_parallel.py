"""Data-parallel (ddp) and local training steps: micro-batches, autocast, bucketed all-reduce.

Gradients of all micro-batches accumulate locally and are all-reduced once, after the last
micro-batch's backward (DDP's ``no_sync`` on the others), packed in backward order into flat
buckets as DDP packs them (``dp_bucket_numel``), then AdamW steps. ``bf16_mixed`` keeps
float32 parameters, gradients and optimizer state and runs the forward under
``torch.autocast(bfloat16)``, as torch AMP runs with DDP; the backward runs outside it, as
torch recommends.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from actors.capture.workloads.activation_offload import offloading
from actors.capture.workloads.optimizers import make_optimizer


def compute_context(cfg, device: torch.device):
    """A context for the forward: autocast to bf16 for bf16_mixed, nothing otherwise."""
    if cfg.precision == "bf16_mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_batch_loss(model: nn.Module, micro_batch: tuple, num_micro_batches: int):
    """The loss of one micro-batch, scaled so the accumulated gradient is the batch mean's."""
    loss = model(*micro_batch)
    return loss / num_micro_batches if num_micro_batches > 1 else loss


def data_parallel_step(model: nn.Module, cfg, device: torch.device, world_size: int):
    """``step(batch)``: every micro-batch's forward and backward, the gradient all-reduce over
    ``world_size`` ranks (0: none), AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(cfg, params)
    buckets = _buckets(params[::-1], cfg.dp_bucket_numel) if world_size else []

    def step(batch):
        opt.zero_grad(set_to_none=True)
        for micro_batch in batch:
            with compute_context(cfg, device), offloading(cfg):
                loss = micro_batch_loss(model, micro_batch, len(batch))
            loss.backward()
        for bucket in buckets:  # DDP fills buckets in backward order
            grads = [p.grad for p in bucket]
            if len(grads) == 1:
                dist.all_reduce(grads[0])
                grads[0].div_(world_size)
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world_size)
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(chunk.view_as(g))
        opt.step()

    step.optimizer = opt
    return step


def _buckets(params: list, bucket_numel: int) -> list[list]:
    """Consecutive groups of params of at most bucket_numel elements (0: one param each)."""
    buckets, size = [], 0
    for p in params:
        if not buckets or bucket_numel <= 0 or size + p.numel() > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    return buckets
