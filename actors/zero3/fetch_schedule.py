"""The fetch/release plan: from the windows where parameters are needed to events between ops.

A *home* is where this rank keeps shards: one parameter (DeepSpeed's layout) or a leaf unit's
flat buffer of one dtype (actors/zero3/partition.py). A *window* needs some homes gathered
from boundary ``start`` (before op ``start``) to boundary ``end`` (after op ``end - 1``).
Windows nest and overlap (a module inside a module, a bucket); homes are reference-counted:
gathered when the first window needing them opens, released when the last one closes.

``simulate`` walks the boundaries once and writes, per boundary: the releases of windows that
end there, then for each window that starts there one all-gather per group of homes it still
lacks (the strategy splits them into groups) followed by its wait. ``add_prefetch`` then moves
upcoming all-gathers forward to right after the previous wait, within the look-ahead and
live-element budgets, leaving their waits in place. Update-phase uses (the optimizer step)
bind the parameter's shard instead (``scratch``/``unscratch``): ZeRO-3 steps the shard.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from actors.zero3.params import Param
from actors.zero3.partition import aligned_numel, flat_offsets


@dataclass(eq=False)
class Home:
    """The shards of one parameter, or of a leaf unit's parameters of one dtype (flat)."""

    id: int
    params: list[Param]
    flat: bool = False
    persistent: bool = False  # at most param_persistence_threshold elements: always gathered

    @property
    def dtype(self) -> str:
        return self.params[0].dtype

    @property
    def itemsize(self) -> int:
        return self.params[0].itemsize

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def gathered_numel(self, world: int) -> int:
        """Elements of this home once gathered (padding included)."""
        if self.flat:
            return flat_offsets([p.numel for p in self.params], world)[1]
        return aligned_numel(self.params[0].numel, world)


@dataclass(eq=False)
class Window:
    """Homes needed gathered between two boundaries (``start == end``: an empty stretch)."""

    start: int
    end: int
    homes: list[Home]
    unit: str  # who needs them: a module name, "param #k", "bucket k"
    scratch: bool = False  # update phase: the shard is bound, no all-gather
    backward: bool = False  # opens in the backward phase (hpZ gathers within the node there)


@dataclass(eq=False)
class Gather:
    """One all-gather: ``single`` (one parameter), ``rank_major`` (several parameters of one
    dtype, each rank's shards side by side, copied out per parameter) or ``flat`` (one flat
    home, a leaf unit's parameters as views: the leaf_coalesced strategy's)."""

    id: int
    homes: list[Home]
    kind: str
    unit: str
    numel: int  # gathered elements
    backward: bool = False  # issued for a backward window


@dataclass
class Plan:
    """Events per boundary (0..num_ops) and the all-gathers they issue, per iteration."""

    events: dict[int, list[tuple[str, object]]]
    gathers: list[Gather]
    homes: list[Home]
    windows: list[Window]
    num_ops: int = 0
    leaves: list[str] = field(default_factory=list)


def split_by_layout(homes: list[Home]) -> list[tuple[str, list[Home]]]:
    """Groups one fetch issues: each flat home alone, the rest one rank-major gather per dtype
    (a single one for one parameter)."""
    groups = [("flat", [h]) for h in homes if h.flat]
    by_dtype: dict[str, list[Home]] = defaultdict(list)
    for h in homes:
        if not h.flat:
            by_dtype[h.dtype].append(h)
    groups += [("single" if len(hs) == 1 else "rank_major", hs) for hs in by_dtype.values()]
    return groups


def simulate(windows: list[Window], num_ops: int, world: int, split) -> Plan:
    """Events for ``windows`` (see the module docstring); ``split(homes)`` groups a fetch."""
    starts: dict[int, list[Window]] = defaultdict(list)
    ends: dict[int, list[Window]] = defaultdict(list)
    for w in windows:
        starts[w.start].append(w)
        if w.end > w.start:
            ends[w.end].append(w)
    events: dict[int, list] = defaultdict(list)
    gathers: list[Gather] = []
    count: dict[Home, int] = defaultdict(int)
    scratch: set[Home] = set()

    def close(w: Window, out: list) -> None:
        for h in w.homes:
            count[h] -= 1
            if count[h] == 0:
                out.append(("unscratch" if h in scratch else "release", h))
                scratch.discard(h)

    for b in sorted(set(starts) | set(ends)):
        out = events[b]
        for w in ends.get(b, ()):
            close(w, out)
        for w in starts.get(b, ()):
            lacking = [h for h in w.homes if count[h] == 0]
            if w.scratch:
                out += [("scratch", h) for h in lacking]
                scratch.update(lacking)
            else:
                for kind, hs in split(lacking):
                    g = Gather(len(gathers), hs, kind, w.unit,
                               sum(h.gathered_numel(world) for h in hs), w.backward)
                    gathers.append(g)
                    out += [("gather", g), ("wait", g)]
            for h in w.homes:
                count[h] += 1
            if w.end == w.start:
                close(w, out)
    return Plan({b: e for b, e in events.items() if e}, gathers, [], windows, num_ops)


def add_prefetch(plan: Plan, world: int, lookahead_numel: int, max_live_numel: int) -> None:
    """After each wait, issue the next all-gathers early, in order, while their elements stay
    within ``lookahead_numel`` and all gathered elements within ``max_live_numel`` (as
    DeepSpeed's prefetch: ``min(max_live - available, prefetch_bucket_size)``). A gather
    whose homes are still gathered at that point (released in between) stops the look-ahead."""
    order = [(b, ev) for b in sorted(plan.events) for ev in plan.events[b]]
    next_gathers = [k for k, (_, ev) in enumerate(order) if ev[0] == "gather"]
    live: set[Home] = set()
    hoisted: set[int] = set()
    events: dict[int, list] = defaultdict(list)
    for k, (b, (kind, obj)) in enumerate(order):
        if kind == "gather":
            if obj.id in hoisted:
                continue
            live.update(obj.homes)
        elif kind == "scratch":
            live.add(obj)
        elif kind in ("release", "unscratch"):
            live.discard(obj)
        events[b].append((kind, obj))
        if kind != "wait":
            continue
        budget = min(lookahead_numel, max_live_numel - sum(h.gathered_numel(world) for h in live))
        taken = 0
        for j in next_gathers[bisect.bisect_right(next_gathers, k):]:
            g = order[j][1][1]
            if g.id in hoisted:
                continue
            if taken >= budget or any(h in live for h in g.homes):
                break
            events[b].append(("gather", g))
            hoisted.add(g.id)
            live.update(g.homes)
            taken += g.numel
    plan.events = dict(events)


def uncovered_uses(plan: Plan, params: list[Param]) -> list[tuple]:
    """(op index, param) pairs where an op uses a parameter that is not gathered, bound as
    scratch or persistent at that moment; empty for a sound plan."""
    use_at: dict[int, list[Param]] = defaultdict(list)
    for p in params:
        for i in p.uses:
            use_at[i].append(p)
    bound: set[int] = {p.suid for h in plan.homes if h.persistent for p in h.params}
    bad = []
    for i in range(plan.num_ops):
        for kind, obj in plan.events.get(i, ()):
            homes = obj.homes if kind == "wait" else [obj] if kind in (
                "scratch", "release", "unscratch") else []
            suids = {p.suid for h in homes for p in h.params}
            if kind in ("wait", "scratch"):
                bound |= suids
            else:
                bound -= suids
        bad += [(i, p) for p in use_at.get(i, ()) if p.suid not in bound]
    return bad
