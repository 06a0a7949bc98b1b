"""The run's own frees, as a fake capture recorded them (pure data).

A ``tracefleet::freed`` node (actors/trace/conventions.py: FREED_OP) lists storages the run
let go of since the op before it started: the storage dies after the last top-level op that
began before the node (the one it is nested in, or the one before it). The loader turns the
nodes into ``Trace.recorded_frees`` ((storage generation, op index) pairs); a faithful replay
holds each storage until then where that is later than its last use (a tensor the user's
code kept: a ``ModelOutput``'s logits through backward). Storages freed without ever being
seen by an op of the trace are not named in it, and none is ever freed earlier than its last
use.
"""
from __future__ import annotations

import bisect

from actors.trace.liveness import Liveness


def freed_storage_ids(values) -> list[int]:
    """The storage ids of a FREED_OP node's first input (a list of tensor values); what does
    not read as one is left out."""
    first = values[0] if isinstance(values, list) and values else None
    if not isinstance(first, list):
        return []
    return [v[1] for v in first if isinstance(v, list) and len(v) == 6 and type(v[1]) is int
            and v[1] > 0]


def free_positions(marks: list[tuple[int, list[int]]],
                   op_node_ids: list[int]) -> dict[int, list[int]]:
    """Op index -> storage ids freed after that op, for FREED_OP nodes ``(node id, storage
    ids)``; a node before every op frees nothing the trace holds."""
    after: dict[int, list[int]] = {}
    for node_id, storage_ids in marks:
        end = bisect.bisect_left(op_node_ids, node_id) - 1
        if end >= 0 and storage_ids:
            after.setdefault(end, []).extend(storage_ids)
    return after


def hold_recorded_frees(recorded: tuple, live: Liveness) -> int:
    """Extend, in ``live``, each storage to its recorded free where that is later than its last
    use; returns how many moved."""
    return sum(live.hold_until(suid, end) for suid, end in recorded)
