"""Liveness of tensors and storages over one pass of a trace's ops, and the memory lower bound.

The lower bound is the peak of live storage bytes if each storage generation lived exactly
from its first to its last use: no allocator can do better on the same op order.
``peak_without`` is the same peak over the storages an extension does not manage (ZeRO-3's
partitioned parameters and model states, held as shards): the replay's bound adds back what
the extension holds (actors/replay/report.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.trace.model import Op


@dataclass
class Liveness:
    storage_bytes: list[int]  # per suid: bytes its views reach
    storage_first: list[int]  # per suid: first op index using it (-1 if unused)
    storage_last: list[int]  # per suid: last op index using it
    storage_external: list[bool]  # per suid: first seen as an input (made outside the trace)
    free_after: list[list[int]]  # per op index: suids whose last use is this op
    live_bytes: list[int]  # per op index: bytes live while the op runs (the bound's curve)
    lower_bound_bytes: int
    uids_by_suid: list[list[int]]  # per suid: the tensor uids viewing it

    def external_bytes(self) -> int:
        return sum(b for b, ext in zip(self.storage_bytes, self.storage_external) if ext)

    def hold_until(self, suid: int, end: int) -> bool:
        """Free storage ``suid`` after op ``end`` instead of after its last use, when that is
        later (a rule of actors/trace/*_lifetimes.py: the original held it longer than its
        last use); whether it moved. ``live_bytes`` (the lower bound) is not recomputed."""
        last = self.storage_last[suid]
        if end <= last or suid not in self.free_after[last]:
            return False
        self.free_after[last].remove(suid)
        self.free_after[end].append(suid)
        self.storage_last[suid] = end
        return True


def compute_liveness(ops: list[Op], num_storages: int) -> Liveness:
    """One sweep over ``ops`` (every op's inputs and outputs count as uses)."""
    size = [0] * num_storages
    first = [-1] * num_storages
    last = [-1] * num_storages
    external = [False] * num_storages
    uids: list[set] = [set() for _ in range(num_storages)]
    for op in ops:
        i = op.index
        for is_input, tensors in ((True, op.input_tensors()), (False, op.output_tensors())):
            for t in tensors:
                s = t.suid
                if s < 0:
                    continue
                nbytes = t.extent_elems * t.itemsize
                if nbytes > size[s]:
                    size[s] = nbytes
                uids[s].add(t.uid)
                if first[s] < 0:
                    first[s] = i
                    external[s] = is_input
                last[s] = i
    free_after: list[list[int]] = [[] for _ in range(len(ops) and ops[-1].index + 1)]
    delta = [0] * (len(free_after) + 1)
    for s in range(num_storages):
        if first[s] >= 0:
            free_after[last[s]].append(s)
            delta[first[s]] += size[s]
            delta[last[s] + 1] -= size[s]
    live = _running_sum(delta, len(free_after))
    return Liveness(size, first, last, external, free_after, live, max(live, default=0),
                    [sorted(u) for u in uids])


def peak_without(live: Liveness, excluded: set[int] | frozenset[int]) -> int:
    """The peak of live bytes over the storages not in ``excluded`` (suids)."""
    if not excluded:
        return live.lower_bound_bytes
    num_ops = len(live.live_bytes)
    delta = [0] * (num_ops + 1)
    for s, (first, last, nbytes) in enumerate(zip(live.storage_first, live.storage_last,
                                                   live.storage_bytes)):
        if first >= 0 and s not in excluded:
            delta[first] += nbytes
            delta[last + 1] -= nbytes
    return max(_running_sum(delta, num_ops), default=0)


def _running_sum(delta: list[int], n: int) -> list[int]:
    """Bytes live at each of ``n`` ops from the per-op changes ``delta``."""
    live, running = [], 0
    for i in range(n):
        running += delta[i]
        live.append(running)
    return live
