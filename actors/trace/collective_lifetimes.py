"""A functional collective's inputs live until the run waits for it (pure data).

Eager functional collectives (``_c10d_functional::*``: DTensor's redistributions, ring
attention's all-gathers and all-to-alls, expert parallel's token exchange) are asynchronous:
the call returns an AsyncCollectiveTensor at once, and the process group's work keeps the
input alive until ``wait_tensor`` runs (gloo's async work holds its tensors; NCCL stashes them
for the caching allocator until the work is waited). Eager code waits where the result is
first used: the wrapper waits when an op first touches it. A fake capture's process group
completes at once and its trace's wait follows the call, so there the input dies at the call.

The rule: each functional collective's input storages are held to the op before the first
use of its result (the collective's output, or its wait's output: on fake a wait returns a
fresh tensor) by an op other than a wait, i.e. to where the run waits. A result never used is
waited where the trace waits.
"""
from __future__ import annotations

from actors.trace.collectives import FUNCTIONAL_CALLS, FUNCTIONAL_WAITS
from actors.trace.liveness import Liveness
from actors.trace.model import Op


def hold_collective_inputs(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, each functional collective's inputs to the op before its result's
    first use (see the module docstring); returns how many storages moved."""
    results: dict[int, int] = {}  # result suid -> the collective's position in ops
    calls: list[tuple[int, list[int]]] = []  # (position, input suids)
    first_use: dict[int, int] = {}  # collective position -> op index of its result's first use
    for pos, op in enumerate(ops):
        if op.name in FUNCTIONAL_CALLS:
            calls.append((pos, [t.suid for t in op.input_tensors() if t.suid >= 0]))
            for t in op.output_tensors():
                if t.suid >= 0:
                    results[t.suid] = pos
            continue
        touched = [results[t.suid] for t in op.input_tensors() if t.suid in results]
        if op.name in FUNCTIONAL_WAITS:
            for call in touched:  # the wait's output stands for the result from here on
                for t in op.output_tensors():
                    if t.suid >= 0:
                        results[t.suid] = call
            continue
        for call in touched:
            first_use.setdefault(call, op.index)
    moved = 0
    for pos, inputs in calls:
        end = first_use.get(pos)
        if end is None:
            continue
        for s in inputs:
            moved += live.hold_until(s, end - 1)
    return moved
