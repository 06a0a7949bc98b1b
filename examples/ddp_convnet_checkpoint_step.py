"""A user's DDP step: a small conv net whose blocks are activation-checkpointed, SGD.

    tracefleet-capture workload=custom \\
        workload.entrypoint=examples/ddp_convnet_checkpoint_step.py:build world_size=2
    tracefleet-capture workload=custom \\
        workload.entrypoint=examples/ddp_convnet_checkpoint_step.py:build \\
        workload.device=fake world_size=64

Each block (3x3 conv, BatchNorm, ReLU, twice) runs under ``torch.utils.checkpoint``
(non-reentrant, as torch recommends): its activations are recomputed in backward. The model is
wrapped in ``DistributedDataParallel`` with its defaults (BatchNorm's buffers are broadcast
from rank 0 before every forward). Sizes from the environment (tiny by default):
EXAMPLE_CHANNELS, EXAMPLE_BLOCKS, EXAMPLE_IMAGE (side, pixels), EXAMPLE_BATCH.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

NUM_CLASSES = 10


def _size(name: str, default: int) -> int:
    return int(os.environ.get(f"EXAMPLE_{name}", default))


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ConvNet(nn.Module):
    def __init__(self, channels: int, num_blocks: int):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(Block(channels) for _ in range(num_blocks))
        self.head = nn.Linear(channels, NUM_CLASSES)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x.mean(dim=(2, 3)))


def build(ctx):
    """(DDP-wrapped model, make_batch, step) on ctx.device."""
    channels, image, batch = _size("CHANNELS", 16), _size("IMAGE", 16), _size("BATCH", 4)
    torch.manual_seed(0)
    model = ConvNet(channels, _size("BLOCKS", 2)).to(ctx.device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def make_batch():
        x = torch.randn(batch, 3, image, image, device=ctx.device)
        return x, torch.randint(0, NUM_CLASSES, (batch,), device=ctx.device)

    def step(batch):
        x, y = batch
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return ddp, make_batch, step
