"""Module backward markers of a captured trace, as positions between the trace's ops.

Capture writes zero-length ``## module_bwd_begin/end:<qualname> ##`` nodes (see
actors/trace/conventions.py). They are not operators; the loader keeps them apart
(``Trace.backward_marks``). A marker's position is the boundary before the first op recorded
after it (node ids are handed out in time order, across threads).
"""
from __future__ import annotations

import bisect

from actors.trace.conventions import BWD_BEGIN, BWD_END
from actors.trace.model import Trace


def read_backward_marks(trace: Trace) -> list[tuple[int, str, str]]:
    """``(boundary, qualname, kind)`` per backward marker inside the trace's op span, in
    execution order; kind is ``bwd_begin`` or ``bwd_end``."""
    ids = [op.node_id for op in trace.ops]
    return [(bisect.bisect_left(ids, nid), qualname, kind)
            for nid, qualname, kind in trace.backward_marks]


def backward_windows(marks: list[tuple[int, str, str]]) -> dict[str, list[tuple[int, int]]]:
    """Per module, its backward stretches ``(begin, end)`` as boundaries: ops begin..end-1.

    A begin is closed by the next end of the same module; a begin never closed is an empty
    stretch at its own position (its module's backward ran no op the trace recorded).
    """
    open_: dict[str, list[int]] = {}
    out: dict[str, list[tuple[int, int]]] = {}
    for boundary, qualname, kind in marks:
        if kind == BWD_BEGIN:
            open_.setdefault(qualname, []).append(boundary)
        elif kind == BWD_END and open_.get(qualname):
            out.setdefault(qualname, []).append((open_[qualname].pop(), boundary))
    for qualname, begins in open_.items():
        out.setdefault(qualname, []).extend((b, b) for b in begins)
    for windows in out.values():
        windows.sort()
    return out
