"""The per-rank report the actor ships to the driver (plain dict; names are a contract).

Memory figures: ``accounted_peak_bytes`` is the peak of the storages the replay held, by
trace sizes; ``measured_peak_bytes`` what the device's allocator really handed out (None
where the device cannot measure: meta); ``peak_memory_bytes`` is the measured one where it
exists, else the accounted one, and ``peak_memory_source`` says which.
"""
from __future__ import annotations

import socket
import statistics
from collections import Counter
from dataclasses import dataclass, field, fields

from actors.trace.categories import breakdown
from actors.replay.timed_iterations import interval_fields
from actors.trace.liveness import peak_without
from actors.errors import describe
from actors.replay.failure import status_of

MAX_ERROR_CHARS = 300


@dataclass
class RankReport:
    """Measurements of one rank; `to_dict()` is what the driver aggregates."""

    rank: int
    device: str
    mode: str
    allocation_mode: str
    status: str = "ok"
    error: str | None = None
    last_op: str | None = None
    oom: dict | None = None
    iteration_times_s: list = field(default_factory=list)
    compute_times_s: list = field(default_factory=list)
    comm_times_s: list = field(default_factory=list)
    figures: RankFigures | None = None  # set by finish()
    #: (extension name, its report() part, its headline() figures), in extension order
    parts: list = field(default_factory=list)

    @classmethod
    def start(cls, engine) -> "RankReport":
        return cls(rank=engine.rank, device=str(engine.device), mode=str(engine.cfg.mode),
                   allocation_mode=str(engine.cfg.allocation.mode))

    def add_iteration(self, elapsed_s: float, compute_s: float, comm_s: float) -> None:
        self.iteration_times_s.append(elapsed_s)
        self.compute_times_s.append(compute_s)
        self.comm_times_s.append(comm_s)

    def set_oom(self, op, held_bytes: int, requested_bytes: int, message: str | None = None,
                in_hook: bool = False):
        node = f"node {op.node_id} {op.name}" if op is not None else None
        if in_hook:  # e.g. a ZeRO-3 all-gather at a module boundary
            where = f"at an extension's hook (a ZeRO-3 fetch, ...) next to {node}"
        else:  # no op yet: what an extension holds for the whole replay (ZeRO-3 shards)
            where = f"at {node}" if node else "before the first op"
        self.status = "oom"
        self.oom = {"node_id": op.node_id if op else None, "op": op.name if op else None,
                    "held_bytes": held_bytes, "requested_bytes": requested_bytes}
        detail = message or f"{held_bytes} B held, {requested_bytes} B requested"
        self.error = f"rank {self.rank}: out of memory {where}: {detail}"

    def set_failed(self, op, error: BaseException) -> None:
        """A failure inside the replay (a collective's peer gone or timed out, a strict
        mismatch): the iterations that finished before it are kept."""
        text = describe(error, "iteration", op)
        self.status = str(status_of(error))  # a timeout by type (actors/replay/failure.py)
        self.error = f"rank {self.rank}: {text[:MAX_ERROR_CHARS]}"

    def finish(self, engine) -> "RankReport":
        replayed, in_scope, reasons = coverage(engine)
        op = engine.last_op
        self.last_op = f"node {op.node_id} {op.name}" if op is not None else None
        med = statistics.median
        memory = engine.memory
        meta = engine.trace.meta
        dropped = meta.get("num_dropped_ops", 0)
        self.figures = RankFigures(
            num_ops=len(engine.steps), num_in_scope=in_scope, num_replayed=replayed,
            num_skipped=in_scope - replayed, skipped_reasons=dict(reasons),
            num_dropped_ops=dropped, num_orphan_ops=meta.get("num_orphan_ops", 0),
            coverage=replayed / (in_scope + dropped),
            not_run_ops=not_run_ops(engine.steps, meta.get("dropped_ops") or {}),
            translated_ops=_op_name_counts(engine.steps, "translated_from"),
            standin_ops=_op_name_counts(engine.steps, "standin"),
            num_shape_mismatches=engine.calls.num_shape_mismatches,
            num_iterations_completed=engine.num_iterations_run,
            iteration_time_s=med(self.iteration_times_s) if self.iteration_times_s else None,
            intervals=interval_fields(self.iteration_times_s),
            timing_stop_reason=engine.stop_rule.reason if engine.stop_rule else None,
            compute_time_s=med(self.compute_times_s) if self.compute_times_s else None,
            comm_time_s=med(self.comm_times_s) if self.comm_times_s else None,
            accounted_peak_bytes=memory.peak_bytes,
            peak_breakdown=breakdown(memory.peak_category_bytes),
            peak_op=peak_op(engine, memory.peak_step),
            peak_memory_bytes=memory.peak_bytes,
            persistent_bytes=engine.policy.persistent_bytes(engine.liveness.storage_bytes),
            liveness_lower_bound_bytes=lower_bound_bytes(engine),
            device_memory_capacity_bytes=memory.capacity_bytes,
            device_memory_threshold=engine.cfg.allocation.device_memory_threshold,
            num_flushes=engine.room.num_flushes, flushed_bytes=engine.room.flushed_bytes,
            flush_ticks=list(memory.flush_ticks), num_materialized=engine.store.num_materialized,
            memory_timeline=[list(p) for p in memory.timeline],
            top_ops=top_ops(engine.steps, len(self.iteration_times_s)))
        # each extension's part under its name, and its headline figures at the top level
        self.parts = [(ext.name, ext.report(), ext.headline()) for ext in engine.extensions]
        return self

    def to_dict(self) -> dict:
        d = {"rank": self.rank, "node_ip": _node_ip(), "device": self.device, "mode": self.mode,
             "allocation_mode": self.allocation_mode, "status": self.status, "error": self.error,
             "last_op": self.last_op, "oom": self.oom, "iteration_times_s": self.iteration_times_s}
        if self.figures is not None:
            d.update(self.figures.to_dict())
        for name, part, headline in self.parts:  # a key above keeps its place when set again
            d[name] = part
            d.update(headline)
        return d


@dataclass
class RankFigures:
    """What every replay measures and accounts, whichever extensions ran (the rank report's
    top level, in this order; extensions add their parts after it, and their headline
    figures, e.g. the memory meter's ``measured_peak_bytes``, replace these in place)."""

    num_ops: int
    num_in_scope: int
    num_replayed: int
    num_skipped: int
    skipped_reasons: dict
    # ops the loader left out count too: what was recorded and did not run
    num_dropped_ops: int
    num_orphan_ops: int
    coverage: float
    not_run_ops: list
    translated_ops: dict
    standin_ops: dict
    num_shape_mismatches: int
    num_iterations_completed: int
    iteration_time_s: float | None
    intervals: dict  # interval_fields of the iteration times (actors/replay/timed_iterations.py)
    timing_stop_reason: str | None
    compute_time_s: float | None
    comm_time_s: float | None
    accounted_peak_bytes: int
    peak_breakdown: dict
    peak_op: dict | None
    peak_memory_bytes: int
    persistent_bytes: int
    liveness_lower_bound_bytes: int
    device_memory_capacity_bytes: int | None
    device_memory_threshold: float
    num_flushes: int
    flushed_bytes: int
    flush_ticks: list
    num_materialized: int
    memory_timeline: list
    top_ops: list
    # these four are the memory meter's when it measured (its headline replaces them)
    measured_peak_bytes: int | None = None
    peak_memory_source: str = "accounted"
    memory_measure_method: str | None = None
    memory_measure: dict | None = None

    @classmethod
    def of(cls, report: dict) -> "RankFigures":
        """The figures of a rank report's dict (``to_dict()``'s, read back on the driver:
        a report of a rank that finished, not a failure report)."""
        names = {f.name for f in fields(cls)} - {"intervals"}
        return cls(**{name: report[name] for name in names if name in report},
                   intervals={k: report[k] for k in interval_fields([]) if k in report})

    def to_dict(self) -> dict:
        """The figures as the rank report's keys, in the report's order."""
        return {
            "num_ops": self.num_ops, "num_in_scope": self.num_in_scope,
            "num_replayed": self.num_replayed, "num_skipped": self.num_skipped,
            "skipped_reasons": self.skipped_reasons, "num_dropped_ops": self.num_dropped_ops,
            "num_orphan_ops": self.num_orphan_ops, "coverage": self.coverage,
            "not_run_ops": self.not_run_ops, "translated_ops": self.translated_ops,
            "standin_ops": self.standin_ops, "num_shape_mismatches": self.num_shape_mismatches,
            "num_iterations_completed": self.num_iterations_completed,
            "iteration_time_s": self.iteration_time_s, **self.intervals,
            "timing_stop_reason": self.timing_stop_reason,
            "compute_time_s": self.compute_time_s, "comm_time_s": self.comm_time_s,
            "measured_peak_bytes": self.measured_peak_bytes,
            "accounted_peak_bytes": self.accounted_peak_bytes,
            "peak_breakdown": self.peak_breakdown, "peak_op": self.peak_op,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_source": self.peak_memory_source,
            "memory_measure_method": self.memory_measure_method,
            "memory_measure": self.memory_measure, "persistent_bytes": self.persistent_bytes,
            "liveness_lower_bound_bytes": self.liveness_lower_bound_bytes,
            "device_memory_capacity_bytes": self.device_memory_capacity_bytes,
            "device_memory_threshold": self.device_memory_threshold,
            "num_flushes": self.num_flushes, "flushed_bytes": self.flushed_bytes,
            "flush_ticks": self.flush_ticks, "num_materialized": self.num_materialized,
            "memory_timeline": self.memory_timeline, "top_ops": self.top_ops,
            "collectives": {},  # the collectives extension's, if any
        }


def peak_op(engine, step) -> dict | None:
    """The op running when the accounted peak was reached (``hook``: in an extension's hook
    next to it, e.g. a ZeRO-3 fetch), None before the first op."""
    if step is None:
        return None
    op = step.op if step.op is not None else engine.trace.ops[step.at]
    return {"node_id": op.node_id, "op": op.name, "index": op.index, "hook": step.op is None}


def lower_bound_bytes(engine) -> int:
    """The liveness lower bound on what this replay holds (computed, not measured): the
    trace's storages each live from first to last use, except those extensions manage
    (ZeRO-3's parameters and model states), for which what the extension holds for the whole
    replay (their shards) counts instead."""
    return peak_without(engine.liveness, engine.store.owned) + \
        sum(ext.resident_bytes() for ext in engine.extensions)


def coverage(engine) -> tuple[int, int, Counter]:
    """(ops that ran, ops in scope, skip reasons) over the mode's scope.

    An op ran if it completed in some iteration: all runnable ops once an iteration
    completed, else those before the op the replay stopped at.
    """
    reasons = Counter()
    in_scope = replayed = 0
    stop = None if engine.num_iterations_run else (engine.stop_index or 0)
    for step in engine.steps:
        if step.reason == "out of scope":
            continue
        in_scope += 1
        if step.kind in ("skip", "failed"):
            reasons[step.reason] += 1
        elif stop is None or step.op.index < stop:
            replayed += 1
    return replayed, in_scope, reasons


DROPPED_WHY = "outside every ProfilerStep window (set-up, not the recorded iteration)"


def not_run_ops(steps, dropped: dict) -> list[dict]:
    """Every op that did not run as recorded, grouped: ``{op, kind, why, num_ops, bytes}``
    (kind ``skipped`` or ``failed``: its outputs are missing from memory; ``stand-in``: outputs
    made from the trace's shapes, not computed; ``dropped``: left out by the loader, given as
    ``dropped`` = {name: [count, output bytes]}), largest bytes first."""
    groups: dict[tuple, list[int]] = {}
    for step in steps:
        if step.kind in ("skip", "failed") and step.reason != "out of scope":
            key = (step.op.name, "failed" if step.kind == "failed" else "skipped", step.reason)
        elif step.standin:
            key = (step.op.name, "stand-in", step.standin)
        else:
            continue
        group = groups.setdefault(key, [0, 0])
        group[0] += 1
        group[1] += sum(t.numel * t.itemsize for t in step.op.output_tensors())
    for name, (count, nbytes) in dropped.items():
        groups[(name, "dropped", DROPPED_WHY)] = [count, nbytes]
    rows = [{"op": name, "kind": kind, "why": why[:MAX_ERROR_CHARS], "num_ops": n, "bytes": b}
            for (name, kind, why), (n, b) in groups.items()]
    return sorted(rows, key=lambda r: (-r["bytes"], -r["num_ops"], r["op"]))


def top_ops(steps, iters: int, n: int = 15) -> list[dict]:
    """Ops by total time over the measured iterations (empty unless replay.per_op_timing)."""
    total, calls = Counter(), Counter()
    for step in steps:
        if step.time_ns:
            total[step.op.name] += step.time_ns
            calls[step.op.name] += 1
    iters = max(1, iters)
    return [{"name": name, "num_calls": calls[name] * iters, "total_s": ns / 1e9,
             "mean_us": ns / 1e3 / (calls[name] * iters)} for name, ns in total.most_common(n)]


def _op_name_counts(steps, attribute: str) -> dict[str, int]:
    """Per recorded op name, how many ops have ``attribute`` set (translated_from, standin)."""
    return dict(Counter(s.op.name for s in steps if getattr(s, attribute)))


def _node_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
