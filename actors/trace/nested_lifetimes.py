"""When memory that only nested ops touch is alive, in top-level op indices (pure data).

Only top-level ops are replayed, but composite ops allocate inside themselves tensors that
outlive them: autocast's bf16 copy of a weight made inside ``aten::linear`` and saved for the
backward's matmul, a loss's ``log_softmax`` read by its backward. The original held them from
that nested allocation on; the replay sees them at their first top-level use at the earliest
(``Trace.made_inside``), or never, when only nested ops of later top-level ops read them.

A lifetime is ``(suid, start, end, nbytes)``: allocated while top-level op ``start`` runs,
held until op ``end``. ``suid >= 0``: a made-inside storage, which the replay itself allocates
at ``end``, its first top-level use (the charge hands over there); ``suid == -1``: a storage
no top-level op uses, freed after op ``end``, the last op inside which a nested op read it.
Such hidden storages are only followed where the capture never reused an address (meta and
fake captures): elsewhere a storage id seen again may be another tensor's.
"""
from __future__ import annotations

from actors.trace.made_inside import NestedAllocations
from actors.trace.model import Op

Lifetime = tuple[int, int, int, int]


def nested_lifetimes(ops: list[Op], nested: NestedAllocations, made_inside: dict[int, int],
                     unique_storages: bool) -> tuple[Lifetime, ...]:
    """Lifetimes (module doc) of ``made_inside`` (suid -> allocating node id) storages whose
    allocation ran in an earlier top-level op than their first use, and, with
    ``unique_storages``, of storages only nested ops use across top-level ops."""
    index_of = {op.node_id: op.index for op in ops}
    first_use: dict[int, int] = {}
    storage_bytes: dict[int, int] = {}  # suid -> the bytes its top-level views reach
    top_level_sids: set[int] = set()
    for op in ops:
        for t in (*op.input_tensors(), *op.output_tensors()):
            if t.suid >= 0:
                first_use.setdefault(t.suid, op.index)
                if t.suid in made_inside:
                    nbytes = t.extent_elems * t.itemsize
                    if nbytes > storage_bytes.get(t.suid, 0):
                        storage_bytes[t.suid] = nbytes
            if t.storage_id:
                top_level_sids.add(t.storage_id)
    out: list[Lifetime] = []
    for suid, alloc in made_inside.items():
        start = index_of.get(nested.top_of_alloc.get(alloc))
        end = first_use.get(suid)
        if start is not None and end is not None and start < end and storage_bytes.get(suid):
            out.append((suid, start, end, storage_bytes[suid]))
    if unique_storages:
        for sid, allocs in nested.by_storage.items():
            if sid in top_level_sids:
                continue
            start = index_of.get(nested.top_of_alloc.get(allocs[0]))
            end = index_of.get(nested.last_use_top.get(sid))
            nbytes = nested.extent.get(sid, 0)
            if start is not None and end is not None and start < end and nbytes:
                out.append((-1, start, end, nbytes))
    return tuple(sorted(out, key=lambda lt: lt[1]))
