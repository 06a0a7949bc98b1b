"""Host time the trace does not show: reproduce the CPU time the original spent between ops.

An Execution Trace records operators, not the Python and framework work between them
(DeepSpeed's hooks, optimizer bookkeeping), so a replay of a framework-heavy run is faster
than the original. Capture records the same iteration's profiler trace; its op events link to
the ET nodes by record-function id (actors/trace/kineto.py), which gives, per op, the CPU
time between the end of the previous top-level op and its start. With ``replay.host_gaps``
this extension busy-waits that long before each op.

Busy-wait, not sleep: most gaps are microseconds to a few milliseconds, below the
scheduler's sleep granularity (a sleep overshoots by 50-100 us and hands the core away),
and the original spent them computing on the CPU, holding the GIL, which a spinning thread
reproduces.

Every wait costs the loop a hook call (~1-2 us), so consecutive small gaps are merged into one
wait of their sum, spent before the op where the sum reaches ``MERGE_S``, and always before a
collective (whose timing against the host work is what matters across ranks); a gap never
moves by more than the ops that span ``MERGE_S`` of host time.
"""
from __future__ import annotations

import time
from pathlib import Path

from actors.errors import ReplayError, TraceError
from actors.replay.extension import ReplayExtension
from actors.trace.kineto import host_gaps_s, kineto_path_for

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


class HostGaps(ReplayExtension):
    """Busy-waits the original's host time before each op (``replay.host_gaps=true``)."""

    name = "host_gaps"

    def __init__(self, gaps_s: list[float], source: str):
        self.gaps_s = gaps_s
        self.source = source
        self._collectives: set[int] = set()
        self._spent_ns = [0]
        self._per_iteration_s: list[float] = []

    @classmethod
    def for_trace(cls, trace) -> "HostGaps":
        """The gaps of ``trace`` from the profiler trace captured beside it."""
        path = kineto_path_for(trace.path)
        if path is None:
            raise ReplayError(f"replay.host_gaps=true needs the profiler trace recorded beside "
                              f"{trace.path} (e.g. {Path(trace.path).name.split('.')[0]}"
                              f".kineto.json.gz, written by tracefleet-capture); none found")
        try:
            return cls(host_gaps_s(trace, path), str(path))
        except TraceError as e:
            raise ReplayError(f"replay.host_gaps=true: {e}") from None

    def attach(self, engine) -> None:
        self._collectives = {op.index for op in engine.trace.ops if op.collective is not None}

    def waits_s(self) -> dict[int, float]:
        """Op index -> seconds to spend right before it (merged gaps; see the module doc)."""
        waits, debt = {}, 0.0
        for i, gap in enumerate(self.gaps_s):
            debt += gap
            if debt > 0 and (debt >= MERGE_S or i in self._collectives):
                waits[i], debt = debt, 0.0
        if debt > 0 and self.gaps_s:  # what is left is spent before the last op
            last = len(self.gaps_s) - 1
            waits[last] = waits.get(last, 0.0) + debt
        return waits

    def hooks(self):
        before = {i: [lambda ns=int(wait * 1e9): _spin(ns, self._spent_ns)]
                  for i, wait in self.waits_s().items()}
        return before, {}

    def on_iteration_start(self) -> None:
        self._spent_ns[0] = 0

    def on_iteration_end(self, measured: bool) -> None:
        if measured:
            self._per_iteration_s.append(self._spent_ns[0] / 1e9)

    def report(self) -> dict:
        added = self._per_iteration_s
        return {"source": self.source, "num_gaps": sum(g > 0 for g in self.gaps_s),
                "num_waits": len(self.waits_s()),
                "recorded_s_per_iteration": sum(self.gaps_s),
                "added_s_per_iteration": sum(added) / len(added) if added else None}
