"""A user's DDP step: torchvision's ResNet-18, SGD with momentum.

    tracefleet-capture workload=custom workload.entrypoint=examples/ddp_resnet_step.py:build \\
        world_size=2
    tracefleet-capture workload=custom workload.entrypoint=examples/ddp_resnet_step.py:build \\
        workload.device=fake world_size=64

``torchvision.models.resnet18`` (11.2 M parameters with 10 classes), wrapped in
``DistributedDataParallel`` with its defaults: gradients all-reduced in buckets (1 MiB first,
then 25 MiB), BatchNorm's buffers broadcast before every forward. Needs ``torchvision`` (its
models only; scripts/bootstrap.sh installs it). Sizes from the environment (tiny by default):
EXAMPLE_IMAGE (side, pixels), EXAMPLE_BATCH, EXAMPLE_CLASSES.
"""
import os

import torch
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


def build(ctx):
    """(DDP-wrapped model, make_batch, step) on ctx.device."""
    image, batch, classes = _size("IMAGE", 32), _size("BATCH", 2), _size("CLASSES", 10)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=classes).to(ctx.device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def make_batch():
        x = torch.randn(batch, 3, image, image, device=ctx.device)
        return x, torch.randint(0, classes, (batch,), device=ctx.device)

    def step(batch):
        x, y = batch
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return ddp, make_batch, step
