"""Storages first seen as an input that an op nested inside another op made in the iteration.

Only top-level ops are replayed, so a tensor a composite op creates inside itself and does
not return is invisible until a later top-level op reads it: ``cross_entropy_loss`` keeps
the ``log_softmax`` it computes for ``nll_loss_backward``, ``layer_norm`` its mean and
rstd for the backward, a copy helper's ``clone`` is chunked by the next op. Judged by its
first top-level use alone, such a storage looks alive before the iteration began (an input
"made outside the trace", like a parameter) and the ``faithful`` allocation mode would keep
it across iterations, which the original never did.

The observer records the nested nodes too. A storage is *made inside* when, before its
first top-level use and inside the same step window, a nested op node returned a tensor on
its storage id that none of that node's own inputs lives on (a new allocation, not a view
or an in-place write), and no top-level op used that storage id in between (the allocator
hands storage ids out again, so an earlier use would belong to an earlier tensor). Pure data.
"""
from __future__ import annotations

import bisect

from actors.trace.model import Op


def tensor_storage_ids(values, out: set, extent: dict | None = None,
                       with_elements: bool = False) -> None:
    """Add the storage ids of every tensor tuple ``[tensor_id, storage_id, offset, numel,
    itemsize, device]`` in a node side's (possibly nested) values to ``out``; ``extent``:
    storage id -> the most bytes a tuple reaches; ``with_elements``: only tensors with elements
    (actors/trace/subclass_wrappers.py). Iterative: a malformed trace may nest lists as deep as
    the JSON parser allows, deeper than Python's recursion limit."""
    todo = [values] if isinstance(values, list) else []
    while todo:
        for v in todo.pop():
            if isinstance(v, list):
                if len(v) == 6 and isinstance(v[5], str) and type(v[1]) is int:
                    if v[1] and (not with_elements or type(v[3]) is int and v[3] > 0):
                        out.add(v[1])
                        if extent is not None and all(type(x) is int and x >= 0 for x in v[2:5]):
                            nbytes = (v[2] + v[3]) * v[4]
                            if nbytes > extent.get(v[1], 0):
                                extent[v[1]] = nbytes
                else:
                    todo.append(v)


class NestedAllocations:
    """Collects, while the loader walks nodes in id order, the node ids at which nested op
    nodes returned new storages, per storage id."""

    def __init__(self):
        self.by_storage: dict[int, list[int]] = {}
        self.top_of_alloc: dict[int, int] = {}  # allocating node id -> its top-level op's id
        self.last_use_top: dict[int, int] = {}  # storage id -> top-level op of its last nested use
        self.extent: dict[int, int] = {}  # storage id -> most bytes a nested node reached on it

    def add(self, node_id: int, inputs, outputs, top: int | None = None) -> None:
        """A nested op node's input and output values (``values`` lists); ``top``: the node id
        of the top-level op it runs inside (None: unknown)."""
        made: set[int] = set()
        tensor_storage_ids(outputs, made, self.extent)
        used: set[int] = set()
        tensor_storage_ids(inputs, used, self.extent)
        if top is not None:
            for sid in used:
                self.last_use_top[sid] = top
        if not made:
            return
        for sid in made - used:
            self.by_storage.setdefault(sid, []).append(node_id)
            if top is not None:
                self.top_of_alloc[node_id] = top


def storages_made_inside(ops: list[Op], nested: NestedAllocations,
                         step_first_ids: list[int]) -> dict[int, int]:
    """Suids first used as an input that a nested op created earlier in the same step window
    (module doc), each with the node id of that nested allocation. ``step_first_ids``: the
    node id that opens each step (``Op.step`` indexes it); ops outside any step look back to
    the start of the trace."""
    made = nested.by_storage
    last_use: dict[int, int] = {}  # storage id -> node id of the last top-level op using it
    seen: set[int] = set()
    out: dict[int, int] = {}
    for op in ops:
        inputs = op.input_tensors()
        for t in inputs:
            if t.suid < 0 or t.suid in seen:
                continue
            ids = made.get(t.storage_id)
            if ids:
                low = last_use.get(t.storage_id, -1)
                if op.step >= 0:
                    low = max(low, step_first_ids[op.step])
                k = bisect.bisect_right(ids, low)
                if k < len(ids) and ids[k] < op.node_id:
                    out[t.suid] = ids[k]
        for t in (*inputs, *op.output_tensors()):
            if t.suid >= 0:
                seen.add(t.suid)
                last_use[t.storage_id] = op.node_id
    return out
