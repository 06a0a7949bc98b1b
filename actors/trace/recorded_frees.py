"""The run's own frees, as a fake capture recorded them (pure data).

A ``tracefleet::freed`` node (actors/trace/conventions.py: FREED_OP) lists storages the run
let go of since the op before it started, each with whether the step made it. The fake mode
writes it as an op's dispatch begins, after the observer opened that op's node: as its child,
or its sibling with the next id. Written so at a top-level op, it frees before that op (after
the one before it): ``(x + exp(y)) * z`` lets go of ``exp``'s output before ``mul`` runs,
where a replay that held it through ``mul`` charged a loss-parallel backward 8 MiB the run did
not hold. Written anywhere else, the storage dies after the last top-level op that began before
the node (the one it is nested in, or the one before it). The loader turns the nodes into
``Trace.recorded_frees`` ((storage generation, op index, made in the step) triples). A
faithful replay holds each storage until then where that is later than its last use (a tensor
the user's code kept: a ``ModelOutput``'s logits through backward), and lets go of one that
existed before the step there instead of keeping it all iteration (the previous step's
gradients, freed by a ``zero_grad`` at the start); one the step made that the trace first shows
as an input (its making op raised and was never written) is not alive before that use.
Storages freed without ever being seen by an op of the trace are not named in it.
"""
from __future__ import annotations

import bisect

from actors.trace.liveness import Liveness


def freed_storages(values) -> list[tuple[int, bool]]:
    """``(storage id, made in the step)`` of a FREED_OP node's inputs (a list of tensor values
    and a list of flags); what does not read as one is left out."""
    first = values[0] if isinstance(values, list) and values else None
    if not isinstance(first, list):
        return []
    flags = values[1] if len(values) > 1 and isinstance(values[1], list) else []
    return [(v[1], bool(flags[i]) if i < len(flags) else False) for i, v in enumerate(first)
            if isinstance(v, list) and len(v) == 6 and type(v[1]) is int and v[1] > 0]


def free_positions(marks: list[tuple[int, list, int | None]],
                   op_node_ids: list[int]) -> dict[int, list]:
    """Op index -> ``(storage id, made in the step)`` freed after that op, for FREED_OP nodes
    ``(node id, freed_storages, id of the node it was written at or None)``; ``op_node_ids``
    increase. A node before every op frees nothing the trace holds."""
    after: dict[int, list[int]] = {}
    for node_id, storage_ids, opener in marks:
        end = bisect.bisect_left(op_node_ids, node_id) - 1
        if end >= 0 and op_node_ids[end] == opener:
            end -= 1  # written as that op began: freed before it
        if end >= 0 and storage_ids:
            after.setdefault(end, []).extend(storage_ids)
    return after


def hold_recorded_frees(recorded: tuple, live: Liveness) -> int:
    """Extend, in ``live``, each storage to its recorded free where that is later than its last
    use; returns how many moved."""
    return sum(live.hold_until(suid, end) for suid, end, _ in recorded)


def released(recorded: tuple) -> frozenset[int]:
    """The storage generations the run let go of during the step: none outlives it."""
    return frozenset(suid for suid, _, _ in recorded)


def made_in_step(recorded: tuple) -> frozenset[int]:
    """The freed generations the step itself made (not alive before their first use)."""
    return frozenset(suid for suid, _, made in recorded if made)
