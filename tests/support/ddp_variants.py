"""A user's step (``build(ctx)``) that trains four small models, each under its own
``DistributedDataParallel`` with other options, so one capture covers what DDP's reducer does
differently (tests/capture/test_fake_ddp.py compares a real capture with a fake one):

* ``first_bucket``: defaults; five 256-wide Linears (1.3 MiB of gradients: after the rebuild
  the 1 MiB first bucket, then the rest), two micro-batches, the first under ``no_sync``;
* ``views``: ``gradient_as_bucket_view=True, bucket_cap_mb=0.1``: several buckets, gradients
  that are views of them;
* ``unused``: ``find_unused_parameters=True`` with a Linear the forward skips and a
  BatchNorm1d (buffers broadcast every forward; buckets never rebuilt);
* ``static``: ``static_graph=True`` (the first iteration reduced in one go).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

BATCH = 8


class _Net(nn.Module):
    def __init__(self, dim: int, num_layers: int, unused: bool = False):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(num_layers)])
        self.norm = nn.BatchNorm1d(dim) if unused else nn.Identity()
        self.skipped = nn.Linear(dim, dim) if unused else None
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.layers(x))))


VARIANTS = {
    "first_bucket": (256, 5, {}),
    "views": (128, 4, dict(gradient_as_bucket_view=True, bucket_cap_mb=0.1)),
    "unused": (64, 2, dict(find_unused_parameters=True)),
    "static": (64, 2, dict(static_graph=True)),
}


def build(ctx):
    """(a module holding the four DDP models, make_batch, step) on ctx.device."""
    torch.manual_seed(0)
    models = nn.ModuleDict()
    for name, (dim, num_layers, options) in VARIANTS.items():
        net = _Net(dim, num_layers, unused=name == "unused").to(ctx.device)
        models[name] = DistributedDataParallel(net, **options)
    opt = torch.optim.SGD(models.parameters(), lr=0.1)

    def make_batch():
        return {name: (torch.randn(BATCH, dim, device=ctx.device),
                       torch.randint(0, 4, (BATCH,), device=ctx.device))
                for name, (dim, _, _) in VARIANTS.items()}

    def step(batch):
        for name, (x, y) in batch.items():
            ddp = models[name]
            if name == "first_bucket":  # gradient accumulation: no all-reduce for the first
                with ddp.no_sync():
                    (F.cross_entropy(ddp(x[:BATCH // 2]), y[:BATCH // 2]) / 2).backward()
                (F.cross_entropy(ddp(x[BATCH // 2:]), y[BATCH // 2:]) / 2).backward()
            else:
                F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return models, make_batch, step
