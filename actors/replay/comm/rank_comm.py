"""One rank's collectives for a replay: the trace's process groups created over the initialized
default group, and the replayer that issues the calls on them.

The rank actor, the benchmarks and gpu_validate start their collectives here: none of them
creates the groups or the replayer itself, so a change to either reaches every caller.
"""
from __future__ import annotations

from typing import Sequence

import torch

from actors.replay.comm.process_groups import ProcessGroups
from actors.replay.comm.replayer import CollectiveReplayer
from actors.trace.model import Op, ProcessGroupInfo


def backend_for(device: torch.device) -> str:
    """The ``torch.distributed`` backend a replay on ``device`` runs its collectives with."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_comm(pg_table: list[ProcessGroupInfo], rank: int, world_size: int,
              device: torch.device, *, timeout_s: float, group_map: dict[str, str] | None = None,
              ops: Sequence[Op] = (), cuda_sync_timing: bool = False) -> CollectiveReplayer:
    """The collective replayer of ``rank``: every group of ``pg_table`` (the merged table of all
    ranks) created with ``device``'s backend, each collective bounded by ``timeout_s``; the
    default group must be initialized (a collective call: every rank makes it)."""
    groups = ProcessGroups.create(pg_table, rank, world_size, backend_for(device), timeout_s,
                                  group_map)
    return CollectiveReplayer(groups, device, ops=ops, cuda_sync_timing=cuda_sync_timing)
