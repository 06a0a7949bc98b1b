"""A user's DDP training step: a small MLP classifier, torch DistributedDataParallel, AdamW.

    tracefleet-capture workload=custom workload.entrypoint=examples/ddp_step.py:build world_size=2
    tracefleet-capture workload=custom workload.entrypoint=examples/ddp_step.py:build \\
        workload.device=fake world_size=64

Sizes come from the environment (tiny by default): EXAMPLE_DIM, EXAMPLE_LAYERS, EXAMPLE_BATCH.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

NUM_CLASSES = 10


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


def build(ctx):
    """(DDP-wrapped model, make_batch, step) on ctx.device."""
    dim, batch = _size("DIM", 64), _size("BATCH", 8)
    torch.manual_seed(0)  # DDP also broadcasts rank 0's weights at wrap time
    layers = []
    for _ in range(_size("LAYERS", 2)):
        layers += [nn.Linear(dim, dim), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(dim, NUM_CLASSES)).to(ctx.device)
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def make_batch():
        x = torch.randn(batch, dim, device=ctx.device)
        return x, torch.randint(0, NUM_CLASSES, (batch,), device=ctx.device)

    def step(batch):
        x, y = batch
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return ddp, make_batch, step
