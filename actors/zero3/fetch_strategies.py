"""One class per ``zero3.strategy``: which homes hold the shards and which windows need them.

Every strategy answers the same three questions (``homes``, ``windows``, ``split``); the plan
(fetch_schedule.py) and the runtime do the rest. Parameter uses no strategy window covers
(a weight tied across modules, a trace without module ranges) get a window of their own per
phase: an all-gather at first use in forward and in backward, the shard bound in the update
phase (``orphan_windows``).
"""
from __future__ import annotations

from collections import defaultdict

from actors.zero3.config import Zero3Config, Zero3Strategy
from actors.zero3.leaves import select_leaves
from actors.zero3.modules import BWD, FWD, UPDATE, Module, ModuleTree, ancestors
from actors.zero3.params import Param
from actors.zero3.fetch_schedule import Home, Window, split_by_layout


class Context:
    """What strategies plan from: parameters, module tree, phases and step windows."""

    def __init__(self, params: list[Param], tree: ModuleTree, phase: list[str],
                 steps: list[tuple[int, int]], cfg: Zero3Config, has_markers: bool):
        self.params, self.tree, self.phase, self.cfg = params, tree, phase, cfg
        self.steps = steps  # (first op, end) of every step window
        self.has_markers = has_markers
        # per step window: the boundary right after its last backward op
        self._backward_end = [max((i + 1 for i in range(a, e) if phase[i] == BWD), default=a)
                              for a, e in steps]

    def use_windows(self, params: list[Param], phases=(FWD, BWD)) -> list[tuple[int, int, str]]:
        """(start, end, phase): per step window and phase, first to last use of ``params``."""
        spans: dict[tuple[int, str], list[int]] = {}
        for p in params:
            for i in p.uses:
                ph = self.phase[i]
                if ph in phases:
                    span = spans.setdefault((self._step_of(i), ph), [i, i])
                    span[0], span[1] = min(span[0], i), max(span[1], i)
        return [(a, b + 1, ph) for (_, ph), (a, b) in sorted(spans.items(), key=lambda kv: kv[1])]

    def _step_of(self, i: int) -> int:
        return next((k for k, (a, e) in enumerate(self.steps) if a <= i < e), -1)

    def module_windows(self, m: Module, params: list[Param]) -> list[tuple[int, int]]:
        """Boundaries where module ``m`` runs: its forward runs and backward stretches; from
        its parameters' uses where the trace does not delimit it."""
        forward = [(a, b + 1) for a, b in m.forward]
        if not forward:
            forward = [(a, e) for a, e, ph in self.use_windows(params, (FWD,))]
        backward = [self._close_backward(a, e) for a, e in m.backward] \
            or self._descendant_backward(m)
        if not backward and not self.has_markers:
            backward = [(a, e) for a, e, ph in self.use_windows(params, (BWD,))]
        return forward + backward

    def _close_backward(self, a: int, e: int) -> tuple[int, int]:
        """Both markers at once: none of the module's inputs needed a gradient, so its
        backward end never fires and it runs until the step's backward ends (DeepSpeed
        releases such modules when the backward pass is over)."""
        if a < e:
            return a, e
        end = self._backward_end[self._step_of(a)] if self._step_of(a) >= 0 else a
        return a, max(a, end)

    def _descendant_backward(self, m: Module) -> list[tuple[int, int]]:
        """A container's backward: per step window, from its first descendant's backward
        begin to its last one's end."""
        spans: dict[int, list[int]] = {}
        for sub in self.tree.subtree(m.name):
            for a, e in map(lambda w: self._close_backward(*w), sub.backward):
                span = spans.setdefault(self._step_of(a), [a, e])
                span[0], span[1] = min(span[0], a), max(span[1], e)
        return [tuple(v) for _, v in sorted(spans.items())]


class PerModule:
    """One all-gather of a module's own parameters before it runs, forward and backward;
    the parameters are copied out of the gathered buffer and released one by one."""

    name = Zero3Strategy.per_module

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.leaves: list[str] = []

    def homes(self) -> dict[int, Home]:
        """suid -> home; persistent parameters get a home that is never fetched."""
        threshold = self.ctx.cfg.param_persistence_threshold
        return {p.suid: Home(k, [p], persistent=p.numel <= threshold)
                for k, p in enumerate(self.ctx.params)}

    def windows(self, home_of: dict[int, Home]) -> list[Window]:
        out = []
        for m in self.ctx.tree.modules.values():
            homes = _fetched(m.own, home_of)
            if homes:
                out += [Window(a, e, homes, m.label) for a, e in self.ctx.module_windows(m, m.own)]
        return out

    def split(self, homes: list[Home]) -> list[tuple[str, list[Home]]]:
        return split_by_layout(homes)


class PerParam(PerModule):
    """As per_module, but one all-gather, wait and release per parameter."""

    name = Zero3Strategy.per_param

    def split(self, homes):
        return [("flat" if h.flat else "single", [h]) for h in homes]


class LeafCoalesced(PerModule):
    """Leaf modules fetch their whole subtree: one flat buffer per dtype, one all-gather, one
    wait, parameters as views, one bulk release. Other modules as per_module."""

    name = Zero3Strategy.leaf_coalesced

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.leaves = select_leaves(ctx.tree, ctx.cfg.leaf_modules,
                                    ctx.cfg.module_granularity_threshold)

    def homes(self):
        home_of = super().homes()
        for leaf in self.leaves:
            by_dtype: dict[str, list[Param]] = defaultdict(list)
            for p in self.ctx.tree.subtree_params(leaf):
                if not home_of[p.suid].persistent:
                    by_dtype[p.dtype].append(p)
            for ps in by_dtype.values():
                home = Home(len(home_of) + len(self.ctx.params), ps, flat=True)
                home_of.update({p.suid: home for p in ps})
        return home_of

    def windows(self, home_of):
        out, leaves = [], set(self.leaves)
        for m in self.ctx.tree.modules.values():
            if any(a in leaves for a in ancestors(m.name)[1:]):
                continue  # fetched with its leaf
            params = self.ctx.tree.subtree_params(m.name) if m.name in self.leaves else m.own
            homes = _fetched(params, home_of)
            if homes:
                out += [Window(a, e, homes, m.label)
                        for a, e in self.ctx.module_windows(m, params)]
        return out


class Bucketed(PerModule):
    """Parameters in the order per_module needs them, packed into buckets of at most
    ``prefetch_bucket_size`` elements: one all-gather per bucket at its first need, released
    when the last need it covers ends."""

    name = Zero3Strategy.bucketed

    def windows(self, home_of):
        entries = sorted(((w.start, w.end, h) for w in super().windows(home_of) for h in w.homes),
                         key=lambda e: (e[0], e[2].id))
        out: list[Window] = []
        size = self.ctx.cfg.prefetch_bucket_size
        filled = 0
        for start, end, h in entries:
            if out and h in out[-1].homes:
                out[-1].end = max(out[-1].end, end)
                continue
            if not out or filled + h.numel > size:  # a bucket holds at least one home
                out.append(Window(start, end, [], f"bucket {len(out)}"))
                filled = 0
            w = out[-1]
            w.end = max(w.end, end)
            w.homes.append(h)
            filled += h.numel
        return out


STRATEGIES = {cls.name: cls for cls in (PerParam, PerModule, LeafCoalesced, Bucketed)}


def orphan_windows(ctx: Context, home_of: dict[int, Home], windows: list[Window]) -> list[Window]:
    """Windows for the uses of partitioned parameters that ``windows`` do not cover. A scratch
    window binds its one parameter (a home of its own), whatever home holds its shard."""
    covered: dict[Home, list[tuple[int, int]]] = defaultdict(list)
    for w in windows:
        for h in w.homes:
            covered[h].append((w.start, w.end))
    out = []
    next_id = 1 + max((h.id for h in home_of.values()), default=0)
    for p in ctx.params:
        h = home_of[p.suid]
        if h.persistent:
            continue
        spans = covered.get(h, ())
        orphans = [i for i in p.uses if not any(a <= i < e for a, e in spans)]
        if not orphans:
            continue
        loose = Param(p.suid, p.index, p.numel, p.dtype, p.itemsize, p.tensor_ids, p.views, orphans)
        own = None
        for a, e, ph in ctx.use_windows([loose], (FWD, BWD, UPDATE)):
            if ph == UPDATE and own is None:
                own = Home(next_id, [p])
                next_id += 1
            out.append(Window(a, e, [own if ph == UPDATE else h], f"param #{p.index}",
                              scratch=ph == UPDATE))
    return out


def _fetched(params: list[Param], home_of: dict[int, Home]) -> list[Home]:
    """The distinct non-persistent homes of ``params``, in order."""
    out: list[Home] = []
    for p in params:
        h = home_of[p.suid]
        if not h.persistent and h not in out:
            out.append(h)
    return out
