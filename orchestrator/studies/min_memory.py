"""``experiment.search=min_memory``: the smallest ``replay.device_memory_capacity`` at which the
replay completes, per allocation mode (and per flush threshold), by bisection.

For each (mode, threshold):

1. A reference replay without a capacity limit (threshold 1.0): it must complete; its
   accounted peak ``P`` is a capacity that fits (with a threshold: probed, and raised by
   doubling if it does not fit), and its liveness lower bound ``B`` is a capacity below which no replay
   without flushing can run (a flush drops live storages and re-materializes them later, so
   with a threshold below 1 a replay can go under ``B``).
2. Without flushing (threshold 1), what a replay holds does not depend on the capacity,
   which only decides whether a check fails: the replay fits iff its peak does. So ``P`` is
   the answer when it is ``B``, or when a replay at ``P`` minus the tolerance fails (two
   replays in all instead of a bisection's ten or so; pre_allocate, which frees nothing
   before the iteration ends, is the common case). When that replay completes anyway, ``P``
   was not the peak: a replay at ``B`` and bisection follow.
3. Bisection between the largest failing and the smallest completing capacity until they
   are within ``max(tolerance x answer, tolerance_bytes)``; a capacity of 0 counts as failing.

The answer is the smallest capacity seen to complete (``min_capacity_bytes``) with the largest
seen to fail (``max_failing_capacity_bytes``) beside it. Every replay is a ``probe`` row and each
answer a ``min_memory`` row of the run dir's results table. The replays share one
``ReplaySession``: one Ray cluster, one set of rank actors, traces loaded once.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from actors.replay.config import AllocationMode
from orchestrator.results import CAPACITY, MAX_FAILING_CAPACITY, MIN_CAPACITY, MODE, REASON, \
    STATUS, THRESHOLD, ResultsStore, RowKind, make_row, point_key, summary_columns
from orchestrator.outputs import CONFIG_YAML
from orchestrator.status import RunStatus
from orchestrator.run.launch import quiet_replays
from orchestrator.reports.html_report import write_report

log = logging.getLogger("tracefleet")

MAX_DOUBLINGS = 8  # raising a reference peak that does not fit under a threshold


@dataclass
class Bisection:
    """The outcome of ``bisect``: the answer (None when nothing completed) and the trail."""

    min_ok: int | None
    max_fail: int
    steps: list[tuple[int, bool]]  # (capacity, completed) in probe order


def bisect(fits: Callable[[int], bool], lo: int, hi: int, tolerance: float, tolerance_bytes: int,
           max_steps: int) -> Bisection:
    """Smallest ``c`` in (lo, hi] with ``fits(c)``, assuming ``fits`` is monotone, ``lo`` fails
    and ``hi`` fits (neither is probed); stops within ``max(tolerance*hi, tolerance_bytes)``."""
    steps = []
    while hi - lo > max(tolerance * hi, tolerance_bytes) and len(steps) < max_steps:
        mid = (lo + hi) // 2
        ok = fits(mid)
        steps.append((mid, ok))
        if ok:
            hi = mid
        else:
            lo = mid
    return Bisection(hi, lo, steps)


def combos(cfg) -> list[tuple[str, float]]:
    """The (allocation mode, threshold) pairs the search covers."""
    mm = cfg.experiment.min_memory
    modes = [str(m) for m in mm.allocation_modes] or [str(cfg.replay.allocation.mode)]
    thresholds = list(mm.thresholds) or [cfg.replay.allocation.device_memory_threshold]
    pairs = []
    for mode in modes:
        for t in ([1.0] if mode == AllocationMode.pre_allocate else thresholds):
            if (mode, float(t)) not in pairs:
                pairs.append((mode, float(t)))
    return pairs


class _Search:
    """One (mode, threshold) search: probes through ``replay(cfg, out_dir) -> summary``."""

    def __init__(self, cfg, mode: str, threshold: float, out_dir: Path, store: ResultsStore,
                 replay: Callable):
        self.cfg, self.mode, self.threshold = cfg, mode, threshold
        self.out_dir, self.store, self.replay = out_dir, store, replay
        self.num_steps = 0
        self.summaries: dict[int, dict] = {}  # capacity -> summary of its probe

    def axes(self) -> list[str]:
        return [f"{MODE}={self.mode}", f"{THRESHOLD}={self.threshold}"]

    def probe(self, capacity: int | None, threshold: float | None = None) -> dict:
        threshold = self.threshold if threshold is None else threshold
        cfg = copy.deepcopy(self.cfg)
        cfg.replay.allocation.mode = AllocationMode(self.mode)
        cfg.replay.allocation.device_memory_threshold = threshold
        cfg.replay.device_memory_capacity = None if capacity is None else str(capacity)
        name = f"{self.mode}-t{threshold:g}-{'unlimited' if capacity is None else capacity}"
        run_dir = self.out_dir / "probes" / name
        summary = self.replay(cfg, run_dir)
        self.num_steps += 1
        overrides = [f"{MODE}={self.mode}", f"{THRESHOLD}={threshold}",
                     f"{CAPACITY}={'null' if capacity is None else capacity}"]
        self.store.put(make_row(RowKind.probe, f"{RowKind.probe} " + point_key(overrides),
                                overrides, summary[STATUS], summary.get("error"),
                                str(run_dir.relative_to(self.out_dir)), summary_columns(summary),
                                search_step=self.num_steps))
        log.info("min_memory %s threshold %g: capacity %s -> %s", self.mode, threshold,
                 "unlimited" if capacity is None else capacity, summary[STATUS])
        if capacity is not None:
            self.summaries[capacity] = summary
        return summary

    def run(self) -> dict:
        """Search; returns the answer row (also recorded)."""
        t0 = time.perf_counter()
        mm = self.cfg.experiment.min_memory
        ref = self.probe(None, threshold=1.0)
        if ref[STATUS] != RunStatus.ok:
            return self._answer(None, 0, t0, f"the replay does not complete without a capacity "
                                             f"limit ({ref[STATUS]}: {ref.get('error')})")
        hi = ref.get("accounted_peak_bytes") or ref.get("peak_memory_bytes") or 0
        bound = ref.get("liveness_lower_bound_bytes") or 0
        if hi <= 0:
            return self._answer(None, 0, t0, "the reference replay holds no memory: nothing to search")
        if self.threshold >= 1:  # the reference ran as a replay at its peak would
            self.summaries[hi] = ref
        else:
            for _ in range(MAX_DOUBLINGS):  # the reference peak normally fits with a threshold
                if self.probe(hi)[STATUS] == RunStatus.ok:  # too
                    break
                hi *= 2
            else:
                return self._answer(None, hi, t0, f"no capacity up to {hi} B completes")
        lo = 0
        if self.threshold >= 1:  # flushing re-materializes storages, so only without it is
            # the bound a floor, and only without it is the peak the answer: the capacity then
            # changes nothing the replay holds, it only decides whether a check fails
            if 0 < bound == hi:
                return self._answer(bound, bound - 1, t0, None)
            below = hi - max(int(mm.tolerance * hi), mm.tolerance_bytes)
            if below <= 0 or self.probe(below)[STATUS] != RunStatus.ok:
                return self._answer(hi, max(below, 0), t0, None)
            hi = below  # (a peak the accounting did not see: search on)
            if 0 < bound <= hi:
                if bound == hi or self.probe(bound)[STATUS] == RunStatus.ok:
                    return self._answer(bound, bound - 1, t0, None)
                lo = bound
        result = bisect(lambda c: self.probe(c)[STATUS] == RunStatus.ok, lo, hi, mm.tolerance,
                        mm.tolerance_bytes, mm.max_steps - self.num_steps)
        reason = None if result.min_ok - result.max_fail <= max(
            mm.tolerance * result.min_ok, mm.tolerance_bytes) else \
            f"stopped after experiment.min_memory.max_steps={mm.max_steps} replays"
        return self._answer(result.min_ok, result.max_fail, t0, reason)

    def _answer(self, min_ok: int | None, max_fail: int, t0: float, reason: str | None) -> dict:
        mm = self.cfg.experiment.min_memory
        at = self.summaries.get(min_ok) or {}
        row = make_row(
            RowKind.min_memory, f"{RowKind.min_memory} " + point_key(self.axes()), self.axes(),
            RunStatus.ok if min_ok is not None and reason is None else RunStatus.failed, reason,
            None, summary_columns(at), **{MIN_CAPACITY: min_ok, MAX_FAILING_CAPACITY: max_fail},
            tolerance_bytes=None if min_ok is None else int(max(mm.tolerance * min_ok,
                                                                mm.tolerance_bytes)),
            num_steps=self.num_steps, search_s=time.perf_counter() - t0)
        self.store.put(row)
        return row


def search(cfg, out_dir: Path, replay: Callable) -> dict:
    """Run every (mode, threshold) search of ``cfg`` (a RunConfig) with ``replay(cfg, out_dir)``
    for each probe; rows go to ``out_dir``'s results table. Returns a summary:
    ``status`` ok when every search found its answer, ``error`` naming those that did not,
    ``searches`` the answer rows."""
    cfg.experiment.min_memory.validate()
    store = ResultsStore(out_dir)
    answers = [_Search(cfg, mode, t, Path(out_dir), store, replay).run()
               for mode, t in combos(cfg)]
    failed = [a for a in answers if a[STATUS] != RunStatus.ok]
    error = "; ".join(f"{a[MODE]} threshold {a[THRESHOLD]}: {a[REASON]}" for a in failed) or None
    return {"status": RunStatus.failed if failed else RunStatus.ok, "error": error,
            "searches": answers}


def run_min_memory(cfg, out_dir: Path, config_yaml: str | None, session=None) -> dict:
    """``tracefleet experiment=min_memory``: the search on one ``ReplaySession`` (the given one,
    or one started and stopped here), its rows and ``report.html`` in ``out_dir``; returns the
    search summary and prints one line per answer."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config_yaml is not None:
        (out_dir / CONFIG_YAML).write_text(config_yaml)
    with quiet_replays(session) as replay:
        summary = search(cfg, out_dir, replay)
    for a in summary["searches"]:
        found = "-" if a[MIN_CAPACITY] is None else \
            f"{a[MIN_CAPACITY]} B (> {a[MAX_FAILING_CAPACITY]} B fails)"
        print(f"min_memory {a[MODE]} threshold {a[THRESHOLD]:g}: {found}, {a['num_steps']} "
              f"replays, {a['search_s']:.1f} s" + (f"; {a[REASON]}" if a[REASON] else ""))
    if cfg.experiment.report:
        print(f"report: {write_report(out_dir)}")
    return summary
