"""The fake reducer's buckets (actors/capture/fake/fake_reducer.py): DDP's flat gradient tensors and
the per-parameter views into them, laid out as the C++ reducer lays them out."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._prims_common import is_non_overlapping_and_dense_or_false

from actors.errors import ConfigError


def is_alias(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share a storage (the reducer's ``is_alias_of``)."""
    return torch._C._is_alias_of(a, b)


def bucket_view(flat: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """The param's window of a bucket, in the param's layout where it is dense (the layout
    AccumulateGrad gives its gradient), row-major otherwise."""
    if is_non_overlapping_and_dense_or_false(param):
        return flat.as_strided(param.size(), param.stride(), offset)
    return flat.narrow(0, offset, param.numel()).view(param.size())


class Bucket:
    """One bucket: the parameters ``indices`` (of ``params``), their offsets, the flat
    ``gradients`` tensor (allocated here, as the reducer allocates it), the views the
    gradients are copied into (``views_in``) and out of (``views_out``)."""

    def __init__(self, params: list, indices: list[int]):
        first = params[indices[0]]
        if any(params[i].dtype != first.dtype or params[i].device != first.device
               for i in indices):
            raise ConfigError("DDP bucket mixes dtypes or devices (the reducer refuses it too)")
        self.indices = indices
        self.offsets, offset = [], 0
        for i in indices:
            self.offsets.append(offset)
            offset += params[i].numel()
        self.gradients = torch.empty(offset, dtype=first.dtype, device=first.device)
        self.views_in = self.views_of(self.gradients, params)
        self.views_out = self.views_in
        self.pending = len(indices)
        self.work = None

    def views_of(self, flat: torch.Tensor, params: list) -> list[torch.Tensor]:
        """Every parameter's view of ``flat`` (the bucket or its all-reduce's result)."""
        return [bucket_view(flat, params[i], o) for i, o in zip(self.indices, self.offsets)]


def broadcast_assignment(indices: list[list[int]], device: torch.device, group) -> None:
    """Rank 0's rebuilt assignment to every rank, as the reducer sends it: the flat indices
    (+ the bucket count), then the bucket sizes, each an int32 host tensor copied to the
    device, broadcast and copied back."""
    for numel in (sum(len(b) for b in indices) + 1, len(indices)):
        host = torch.empty(numel, dtype=torch.int32)
        on_device = torch.empty(numel, dtype=torch.int32, device=device)
        on_device.copy_(host, non_blocking=True)
        dist.broadcast(on_device, group=group, group_src=0)
        host.copy_(on_device)
