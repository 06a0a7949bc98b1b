"""Partition math: which elements of a parameter each rank holds, and how gathers reassemble.

DeepSpeed's layout (partition_parameters.py, ``_partition_param``/``_padding_size``): a
parameter of n elements is padded to a multiple of the world size W and rank r holds elements
[r*s, (r+1)*s) of it, s = padded/W. A rank-major all-gather of several parameters puts each
rank's shards side by side, so the gathered buffer is rank-major and every parameter is
reassembled by copying its W pieces (what DeepSpeed's ``AllGatherCoalescedHandle.wait`` does).

The flat layout (the leaf_coalesced strategy's leaf units): the unit's parameters, each padded as
above, are concatenated into one flat tensor and rank r holds the r-th 1/W of it. The gathered
buffer is that flat tensor, so every parameter is a view into it: no copy, one buffer to free.
A rank holds exactly as many elements as with DeepSpeed's layout (the same padding).
"""
from __future__ import annotations

import torch


def aligned_numel(numel: int, world: int) -> int:
    """``numel`` padded up to a multiple of ``world`` (DeepSpeed's aligned size)."""
    remainder = numel % world
    return numel + (world - remainder if remainder else 0)


def shard_numel(numel: int, world: int) -> int:
    """Elements each rank holds of a parameter of ``numel`` elements."""
    return aligned_numel(numel, world) // world


def flat_offsets(numels: list[int], world: int) -> tuple[list[int], int]:
    """Offsets of each parameter in a flat unit buffer, and the buffer's elements."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += aligned_numel(n, world)
    return offsets, total


def param_shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` in DeepSpeed's layout (a new tensor, zero padding)."""
    flat = full.reshape(-1)
    s = shard_numel(flat.numel(), world)
    out = torch.zeros(s, dtype=flat.dtype, device=flat.device)
    piece = flat[rank * s:(rank + 1) * s]
    out[:piece.numel()].copy_(piece)
    return out


def flat_shard(fulls: list[torch.Tensor], world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the flat unit buffer of ``fulls`` (a new tensor)."""
    offsets, total = flat_offsets([f.numel() for f in fulls], world)
    flat = torch.zeros(total, dtype=fulls[0].dtype, device=fulls[0].device)
    for f, off in zip(fulls, offsets):
        flat[off:off + f.numel()].copy_(f.reshape(-1))
    s = total // world
    return flat[rank * s:(rank + 1) * s].clone()


def reassemble(gathered: torch.Tensor, numels: list[int], world: int,
               align: int | None = None) -> list[torch.Tensor]:
    """Each parameter of a rank-major gather over ``world`` ranks, copied out whole
    with its padding (DeepSpeed's layout; ``align``: the world size the padding was made for,
    when the gather ran over a subgroup, as hpZ's does). Parameter i is ``out[i][:numels[i]]``."""
    shards = [aligned_numel(n, align or world) // world for n in numels]
    chunk = sum(shards)
    out, off = [], 0
    for s in shards:
        out.append(torch.cat([gathered[r * chunk + off:r * chunk + off + s] for r in range(world)]))
        off += s
    return out
