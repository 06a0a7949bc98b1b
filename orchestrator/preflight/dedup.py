"""Ranks with identical traces replay once (``replay.mode=compute`` only).

Pre-flight groups the ranks by trace content (``PreflightResult.same_as``). In compute mode
no collective is replayed, so the ranks are independent and a rank's report depends on its
trace and the config only: one actor per distinct trace replays (it takes the rank it stands
for: ``WorkerGroup.name_ranks``), and every rank's row is its group representative's report,
marked ``replayed_as_rank``. A 1,024-rank dry run of a meta capture (one trace written for
every rank) is one replay.

ZeRO-3 emulation (``zero3.world_size``) uses ``rank % world`` for shard *offsets*, but every
rank's shard *sizes* are the same (DeepSpeed pads each parameter to a multiple of the world:
actors/zero3/partition.py), so the memory and time a rank reports do not depend on its rank:
still dedupable. ``full``/``comms`` replay collectives, which need every rank: never deduped.
"""
from __future__ import annotations

from orchestrator.preflight.validate import PreflightResult


def replayed_actors(pre: PreflightResult, mode: str, enabled: bool) -> list[int]:
    """The ranks (actor indices) that replay: the lowest rank of each group of identical
    traces in compute mode when ``enabled``, else all of them (fewer than the world size
    means the reports are to be expanded: `expand_reports`)."""
    if enabled and str(mode) == "compute" and pre.same_as:
        return sorted(set(pre.same_as))
    return list(range(pre.world_size))


def expand_reports(reports: list[dict], replayed: list[int], same_as: list[int]) -> list[dict]:
    """One report per rank: rank i gets the report of the actor that replayed ``same_as[i]``,
    with ``rank`` set to i and ``replayed_as_rank`` to the rank replayed (shallow copies: the
    measured values are shared, not duplicated, at 1,024 ranks)."""
    by_rank = dict(zip(replayed, reports))
    return [{**by_rank[rep], "rank": rank, "replayed_as_rank": rep}
            for rank, rep in enumerate(same_as)]
