"""Module backward markers of a captured trace, as positions between the trace's ops.

Capture writes zero-length ``## module_bwd_begin/end:<qualname> ##`` nodes (see
actors/trace/conventions.py). They are not operators, so the trace model does not keep them;
this reads them from the raw trace once. A marker's position is the boundary before the first
op recorded after it (node ids are handed out in time order, across threads).
"""
from __future__ import annotations

import bisect

from actors.trace.conventions import BWD_BEGIN, BWD_END, MODULE_BWD_BEGIN_PREFIX, MODULE_BWD_END_PREFIX, \
    parse_module_range
from actors.gc_pause import gc_paused
from actors.trace.loader import read_json
from actors.trace.model import Trace

_PREFIXES = (MODULE_BWD_BEGIN_PREFIX, MODULE_BWD_END_PREFIX)


def read_backward_marks(trace: Trace, data: bytes | None = None) -> list[tuple[int, str, str]]:
    """``(boundary, qualname, kind)`` per backward marker inside the trace's op span, in
    execution order; kind is ``bwd_begin`` or ``bwd_end``. ``data``: the file's bytes when
    they arrived another way than its path."""
    if not trace.ops:
        return []
    # The raw trace again: millions of containers, no cycles (actors/gc_pause.py); they are
    # freed before the collector resumes, which would otherwise scan them all once more.
    with gc_paused():
        return _read_marks(trace, data)


def _read_marks(trace: Trace, data: bytes | None) -> list[tuple[int, str, str]]:
    """``read_backward_marks``'s body (the raw document is freed when it returns)."""
    doc = read_json(trace.path, data)
    ids = [op.node_id for op in trace.ops]
    first, last = ids[0], ids[-1]
    marks = []
    for node in doc["nodes"]:
        name = node.get("name") if isinstance(node, dict) else None
        if not isinstance(name, str) or not name.startswith(_PREFIXES):
            continue
        nid = node.get("id")
        parsed = parse_module_range(name)
        if not isinstance(nid, int) or parsed is None or not first < nid < last:
            continue
        marks.append((nid, bisect.bisect_left(ids, nid), *parsed))
    marks.sort()
    return [(boundary, qualname, kind) for _, boundary, qualname, kind in marks]


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
