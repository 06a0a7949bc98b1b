"""Gradients and optimizer state of partitioned parameters: which storages they are, and when
ZeRO-3 shrinks them to shards (pure: no torch, no comm).

ZeRO-3 holds 1/world of every model state, not only of the parameters: backward produces a
gradient full-size, it waits in a bucket of ``zero3.reduce_bucket_size`` elements, the bucket
is reduce-scattered and the rank keeps its shard of each gradient (the full one is freed);
optimizer state (exp_avg, exp_avg_sq, momentum, fp32 masters) lives as shards and the step
runs on them, so its per-parameter temporaries are shard-sized too.

Which storages. The update phase's ops (after a step's last backward op) link the storages
they touch together element by element: storages of the same element count in one op, lists
paired by position (foreach and fused optimizers pass one list per state). A storage linked
to a partitioned parameter is one of its model states:

* a *gradient* when an op wrote it before the update phase (backward made it);
* *optimizer state* when it existed before the iteration (first seen as an input);
* an *update temporary* otherwise (the update phase made it).

One-element storages (step counters, learning rates) stay whole, as in DeepSpeed.

When. A gradient is *ready* after its last write that needs the whole gradient: a write in
backward, a collective on it, or a copy from another tensor (a data-parallel bucket's copy_).
Later in-place updates by scalars (the data-parallel division, clipping) run on the shard.
Ready gradients fill one bucket per dtype in ready order, as DeepSpeed's IPG buckets do: a
gradient that would overflow its bucket first sends the bucket's reduce-scatter, and a bucket
is sent at the latest right before an op touches one of its gradients again.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from actors.trace.liveness import Liveness
from actors.trace.model import TensorArg, Trace
from actors.zero3.modules import UPDATE
from actors.zero3.params import Param
from actors.zero3.partition import shard_numel

GRAD, STATE, TEMP = "gradient", "optimizer_state", "update_temporary"


@dataclass(eq=False)
class ModelState:
    """A gradient, optimizer state or update temporary of partitioned parameter ``param``."""

    suid: int
    kind: str  # GRAD, STATE or TEMP
    param: Param
    numel: int  # elements of the whole storage
    dtype: str
    itemsize: int
    first: int  # op index of its first use
    last: int  # op index of its last use
    external: bool  # existed before the iteration (first seen as an input)
    ready: int = -1  # gradients: the op after which the full gradient is final

    def shard_numel(self, world: int) -> int:
        return shard_numel(self.numel, world)

    def shard_bytes(self, world: int) -> int:
        return self.shard_numel(world) * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __repr__(self):
        return f"ModelState({self.kind} suid={self.suid} of {self.param})"


@dataclass(eq=False)
class Bucket:
    """Gradients reduce-scattered together at boundary ``at`` (before op ``at``)."""

    id: int
    grads: list[ModelState]
    at: int

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.grads)


@dataclass
class StatesPlan:
    """The model states found and, per boundary, what happens to them: ``early`` events run
    before the parameter plan's events (reduce-scatters, then releases: memory goes back
    first), ``late`` ones after them (charges for what the next op makes)."""

    states: list[ModelState] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    early: dict[int, list[tuple[str, object]]] = field(default_factory=dict)
    late: dict[int, list[tuple[str, object]]] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[ModelState]:
        return [s for s in self.states if s.kind == kind]


def find_model_states(trace: Trace, liveness: Liveness, partitioned: list[Param],
                      phase: list[str]) -> list[ModelState]:
    """The model states of the ``partitioned`` parameters (see the module docstring)."""
    numel = _storage_numels(trace, liveness)
    links = _Links()
    for op in trace.ops:
        if phase[op.index] != UPDATE or op.collective is not None:
            continue
        for group in _operand_groups(op):
            by_numel: dict[int, list[int]] = defaultdict(list)
            for s in group:
                if numel.get(s, (0,))[0] >= 2:
                    by_numel[numel[s][0]].append(s)
            for same in by_numel.values():
                for s in same[1:]:
                    links.union(same[0], s)
    owner: dict[int, Param] = {}  # component root -> its partitioned parameter
    for p in partitioned:
        owner.setdefault(links.find(p.suid), p)
    params = {p.suid for p in partitioned}
    written_before = _written_before_update(trace, phase)
    found = []
    for s in links.members():
        p = owner.get(links.find(s))
        if p is None or s in params:
            continue
        kind = GRAD if s in written_before else STATE if liveness.storage_external[s] else TEMP
        n, dtype, itemsize = numel[s]
        found.append(ModelState(s, kind, p, n, dtype, itemsize, liveness.storage_first[s],
                                liveness.storage_last[s], liveness.storage_external[s]))
    grads = {g.suid: g for g in found if g.kind == GRAD}
    for op in trace.ops:  # ready points
        for t in op.output_tensors():
            g = grads.get(t.suid)
            if g is not None and _needs_whole(op, g.suid, phase[op.index]):
                g.ready = op.index
    for g in grads.values():
        if g.ready < 0:  # never written whole: ready at its first use
            g.ready = g.first
    return sorted(found, key=lambda m: (m.first, m.suid))


def plan_states(trace: Trace, states: list[ModelState], bucket_numel: int,
                contiguous: bool = False) -> StatesPlan:
    """Buckets and per-boundary events for ``states`` (see the module docstring): full
    gradients charged when first made, reduce-scattered per bucket; temporaries charged when
    made; gradient shards and temporaries released after their last use (``release``
    events; a policy that holds intermediates to the end of the iteration drops them).
    ``contiguous``: a ready gradient moves into the reduce bucket's persistent buffer right
    away (``to_bucket``, DeepSpeed's contiguous_gradients)."""
    plan = StatesPlan(states=list(states))
    grads = plan.of_kind(GRAD)
    touch = _first_touch_after(trace, {g.suid: g.ready for g in grads})
    pending: dict[str, tuple[list[ModelState], int]] = {}  # dtype -> (grads, deadline)
    sent_at: dict[ModelState, int] = {}

    def send(dtype: str, at: int) -> None:
        members, _ = pending.pop(dtype)
        bucket = Bucket(len(plan.buckets), members, at)
        plan.buckets.append(bucket)
        plan.early.setdefault(at, []).append(("reduce_scatter", bucket))
        sent_at.update((g, at) for g in members)

    for g in sorted(grads, key=lambda g: (g.ready, g.suid)):
        b = g.ready + 1
        for dtype in [d for d, (_, deadline) in pending.items() if deadline <= b]:
            send(dtype, pending[dtype][1])
        members, deadline = pending.get(g.dtype, ([], _NEVER))
        if members and sum(m.numel for m in members) + g.numel > bucket_numel:
            send(g.dtype, b)
            members, deadline = [], _NEVER
        pending[g.dtype] = (members + [g], min(deadline, touch.get(g.suid, _NEVER)))
    for dtype in list(pending):
        members, deadline = pending[dtype]
        send(dtype, deadline if deadline < _NEVER else max(g.ready for g in members) + 1)
    if contiguous:
        for g in grads:
            plan.early.setdefault(g.ready + 1, []).append(("to_bucket", g))
    for m in states:
        if m.kind == STATE:
            continue
        plan.late.setdefault(m.first, []).append(("grad_full" if m.kind == GRAD else "temp", m))
        end = max(m.last + 1, sent_at.get(m, 0))  # after its bucket's reduce-scatter
        plan.early.setdefault(end, []).append(("release", m))
    for events in plan.early.values():  # reduce-scatters before releases at one boundary
        events.sort(key=lambda e: e[0] != "reduce_scatter")
    return plan


def views_of(trace: Trace, suids: set[int]) -> dict[int, list[TensorArg]]:
    """Per suid of ``suids``, one TensorArg per tensor uid on it (what binding rebinds)."""
    out: dict[int, dict[int, TensorArg]] = {s: {} for s in suids}
    for op in trace.ops:
        for t in op.input_tensors() + op.output_tensors():
            if t.suid in out:
                out[t.suid].setdefault(t.uid, t)
    return {s: list(views.values()) for s, views in out.items()}


_NEVER = 1 << 62


class _Links:
    """Union-find over suids."""

    def __init__(self):
        self.parent: dict[int, int] = {}

    def find(self, s: int) -> int:
        parent = self.parent
        parent.setdefault(s, s)
        while parent[s] != s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra

    def members(self) -> list[int]:
        return list(self.parent)


def _storage_numels(trace: Trace, liveness: Liveness) -> dict[int, tuple[int, str, int]]:
    """suid -> (elements of the whole storage, dtype, itemsize)."""
    out: dict[int, tuple[int, str, int]] = {}
    for op in trace.ops:
        for t in op.input_tensors() + op.output_tensors():
            if t.suid >= 0 and t.suid not in out and t.itemsize:
                out[t.suid] = (liveness.storage_bytes[t.suid] // t.itemsize, t.dtype, t.itemsize)
    return out


def _operand_groups(op) -> list[list[int]]:
    """The suids an op combines element by element: one group, or with tensor lists one per
    list position (the lists' j-th tensors plus every tensor passed alone)."""
    args = op.inputs + op.outputs
    alone = [a.suid for a in args if type(a) is TensorArg and a.suid >= 0]
    lists = [a.value for a in args if type(a) is not TensorArg and a.kind == "tensor_list"]
    if not lists:
        return [alone]
    return [[t.suid for lst in lists if j < len(lst) and (t := lst[j]) is not None
             and t.suid >= 0] + alone for j in range(max(map(len, lists)))]


def _written_before_update(trace: Trace, phase: list[str]) -> set[int]:
    return {t.suid for op in trace.ops if phase[op.index] != UPDATE for t in op.output_tensors()}


def _needs_whole(op, suid: int, op_phase: str) -> bool:
    """Whether an op writing ``suid`` needs the whole gradient: in backward, a collective, or
    a write from another tensor of more than one element."""
    if op_phase != UPDATE or op.collective is not None:
        return True
    return any(t.suid != suid and t.numel > 1 for t in op.input_tensors())


def _first_touch_after(trace: Trace, ready: dict[int, int]) -> dict[int, int]:
    """suid -> the first op after its ready op that touches it (absent: none does)."""
    out: dict[int, int] = {}
    for op in trace.ops:
        for t in op.input_tensors() + op.output_tensors():
            r = ready.get(t.suid)
            if r is not None and op.index > r and t.suid not in out:
                out[t.suid] = op.index
    return out
