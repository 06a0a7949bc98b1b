"""Host time the trace does not show: reproduce the CPU time the original spent between ops.

An Execution Trace records operators, not the Python and framework work between them
(DeepSpeed's hooks, optimizer bookkeeping), so a replay of a framework-heavy run is faster
than the original. Capture records the same iteration's profiler trace; its op events link to
the ET nodes by record-function id (actors/trace/kineto.py), which gives, per op, the CPU
time between the end of the previous top-level op and its start, and the op's own duration.
With ``replay.host_gaps`` this extension busy-waits before ops so that the replay's host
time follows the original's.

Busy-wait, not sleep: most gaps are microseconds to a few milliseconds, below the
scheduler's sleep granularity (a sleep overshoots by 50-100 us and hands the core away),
and the original spent them computing on the CPU, holding the GIL, which a spinning thread
reproduces.

Every wait costs the loop a hook call (~1-2 us), so consecutive small gaps are merged into one
wait of their sum, spent before the op where the sum reaches ``MERGE_S``, and always before a
collective (whose timing against the host work is what matters across ranks); a gap never
moves by more than the ops that span ``MERGE_S`` of host time.

**Paced** (the profiler trace gives op durations, as capture's does): the replay has host
time of its own between ops (argument binding, allocation, accounting), which the original
did not, so spinning every recorded gap on top of it counts host time twice. Each wait
instead spins only until the replay's host time since the iteration began (wall time less the
time blocked in collectives) reaches the original's up to that op (its ops' recorded
durations plus the gaps between them, collectives excluded on both sides). A replay whose own
overhead already covers a gap spins nothing there. Pacing is cumulative over the iteration,
not per window: per window, two lock-stepped ranks each spin the positive part of every window
and their spins add up across ranks.

**Calibrated** (a ``meta.json`` beside the trace holds the rank's ``profiler_op_cost_s``):
the profiler's per-op bookkeeping inflates the recorded host time. Capture measures its cost
per recorded event with a fixed micro-benchmark in the rank (actors/capture/profiler_cost.py);
the profiled step's events (on the host thread, outside collectives) times that cost is taken
off the original's host time by a uniform scale. The original's iteration time is no input:
a replay's time can then be judged against it. Without the figure (older captures) the waits
are paced to the recorded host time as it is, and the report says it is not calibrated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from actors.errors import ReplayError, TraceError
from actors.replay.extension_contract import ReplayContext, ReplayExtension
from actors.trace.kineto import HostTimes, host_times, kineto_path_for
from actors.trace.meta_file import meta_path_of, rank_seconds, read_meta

# Consecutive gaps are merged until they reach this, then spent in one wait.
MERGE_S = 50e-6


def _spin(gap_ns: int, total: list) -> None:
    """Busy-wait ``gap_ns`` nanoseconds; adds the time really spent to ``total[0]``."""
    clock = time.perf_counter_ns
    start = clock()
    deadline = start + gap_ns
    now = start
    while now < deadline:
        now = clock()
    total[0] += now - start


@dataclass(frozen=True)
class Calibration:
    """How much of the recorded host time the waits reproduce (module doc)."""

    scale: float = 1.0  # the share of the recorded host time that was the original's own
    how: str = "none"
    calibrated: bool = False  # from the profiler's cost measured at capture
    num_profiled_events: int = 0
    profiler_op_cost_s: float | None = None


def profiler_calibration(host: HostTimes, collectives: set[int], trace_path,
                         rank: int) -> Calibration:
    """The profiled step's events times the profiler's cost per event, measured at capture
    (``profiler_op_cost_s`` of the rank in the ``meta.json`` beside the trace), taken off the
    recorded host time; not calibrated (scale 1.0) when meta.json has no such figure."""
    meta_path = meta_path_of(Path(trace_path).parent)
    meta = read_meta(meta_path)  # bounded; a malformed file names its field (TraceError)
    cost_s = rank_seconds(meta_path, meta, rank, "profiler_op_cost_s") if meta else None
    if cost_s is None:
        return Calibration(how="not calibrated: no profiler_op_cost_s for this rank in a "
                               "meta.json beside the trace (captured before capture measured "
                               "the profiler's cost); paced to the recorded host time, the "
                               "profiler's bookkeeping included")
    recorded_s = sum(host.gaps_s) + sum(d for i, d in enumerate(host.op_s) if i not in collectives)
    excess_s = host.num_events * cost_s
    scale = max(0.0, 1.0 - excess_s / recorded_s) if recorded_s > 0 else 1.0
    how = (f"{host.num_events} profiled events x {cost_s * 1e6:.3f} us = {excess_s * 1e3:.2f} ms "
           f"taken off {recorded_s * 1e3:.1f} ms of host time")
    return Calibration(scale, how, True, host.num_events, cost_s)


class HostGaps(ReplayExtension):
    """Busy-waits the original's host time before ops (``replay.host_gaps=true``): each merged
    gap as it is, or, given the ops' recorded durations ``op_s``, paced (module doc)."""

    name = "host_gaps"

    def __init__(self, gaps_s: list[float], source: str, op_s: list[float] | None = None,
                 calibration: Calibration | None = None):
        self.gaps_s = gaps_s
        self.source = source
        self.op_s = op_s
        self.calibration = calibration or Calibration()
        self.scale = self.calibration.scale
        self._collectives: set[int] = set()
        self._comm = None
        self._spent_ns = [0]
        self._per_iteration_s: list[float] = []
        # (clock ns, comm blocked s) at the iteration's start; the original's host ns so far
        self._mark = (0, 0.0, 0)

    @classmethod
    def for_trace(cls, trace) -> "HostGaps":
        """Paced, calibrated host gaps of ``trace`` from the profiler trace captured beside it."""
        path = kineto_path_for(trace.path)
        if path is None:
            raise ReplayError(f"replay.host_gaps=true needs the profiler trace recorded beside "
                              f"{trace.path} (e.g. {Path(trace.path).name.split('.')[0]}"
                              f".kineto.json.gz, written by tracefleet-capture); none found")
        collectives = {op.index for op in trace.ops if op.collective is not None}
        try:
            host = host_times(trace, path)
            calibration = profiler_calibration(host, collectives, trace.path, trace.rank)
        except TraceError as e:
            raise ReplayError(f"replay.host_gaps=true: {e}") from None
        return cls(host.gaps_s, str(path), host.op_s, calibration)

    def attach(self, ctx: ReplayContext) -> None:
        self._collectives = {op.index for op in ctx.trace.ops if op.collective is not None}
        self._comm = ctx.comm

    def waits_s(self) -> dict[int, float]:
        """Op index -> seconds of recorded gaps to spend right before it (merged; module doc)."""
        waits, debt = {}, 0.0
        for i, gap in enumerate(self.gaps_s):
            debt += gap
            if debt > 0 and (debt >= MERGE_S or i in self._collectives):
                waits[i], debt = debt, 0.0
        if debt > 0 and self.gaps_s:  # what is left is spent before the last op
            last = len(self.gaps_s) - 1
            waits[last] = waits.get(last, 0.0) + debt
        return waits

    def windows_s(self) -> dict[int, float]:
        """Op index -> the original's host time (scaled) from the previous wait to this one:
        the gaps merged into the wait plus the recorded durations of the ops in between."""
        waits, windows, start = self.waits_s(), {}, 0
        for w in sorted(waits):
            ops_s = sum(self.op_s[j] for j in range(start, w) if j not in self._collectives)
            windows[w], start = self.scale * (waits[w] + ops_s), w
        return windows

    def hooks(self):
        if self.op_s is None:
            before = {i: [partial(_spin, int(wait * 1e9), self._spent_ns)]
                      for i, wait in self.waits_s().items()}
        else:
            before = {i: [partial(self._pace, int(target * 1e9))]
                      for i, target in self.windows_s().items()}
        return before, {}

    def _blocked_s(self) -> float:
        return self._comm.blocked_s if self._comm is not None else 0.0

    def _pace(self, target_ns: int) -> None:
        """Spin until the replay's host time since the iteration began reaches the original's
        up to here (``target_ns`` more than at the previous wait)."""
        start_ns, blocked_s, due_ns = self._mark
        due_ns += target_ns
        own_ns = time.perf_counter_ns() - start_ns - int((self._blocked_s() - blocked_s) * 1e9)
        if own_ns < due_ns:
            _spin(due_ns - own_ns, self._spent_ns)
        self._mark = (start_ns, blocked_s, due_ns)

    def on_iteration_start(self) -> None:
        self._spent_ns[0] = 0
        self._mark = (time.perf_counter_ns(), self._blocked_s(), 0)

    def on_iteration_end(self, measured: bool) -> None:
        if measured:
            self._per_iteration_s.append(self._spent_ns[0] / 1e9)

    def report(self) -> dict:
        added = self._per_iteration_s
        paced = self.op_s is not None
        return {"source": self.source, "num_gaps": sum(g > 0 for g in self.gaps_s),
                "num_waits": len(self.waits_s()), "paced": paced,
                "recorded_s_per_iteration": sum(self.gaps_s),
                "target_host_s_per_iteration": sum(self.windows_s().values()) if paced else None,
                "calibrated": self.calibration.calibrated, "scale": self.scale,
                "calibration": self.calibration.how,
                "num_profiled_events": self.calibration.num_profiled_events,
                "profiler_op_cost_s": self.calibration.profiler_op_cost_s,
                "added_s_per_iteration": sum(added) / len(added) if added else None}
