"""The driver's phases of a run and their seconds (``summary.json``'s ``timings_s``).

``PhaseClock.timed(name)`` adds the seconds of a ``with`` block to its phase (a phase may run
in parts: the cluster starts once to join it before pre-flight, once for the actors);
``ordered()`` gives them in the run's order, ``PHASES``, whatever order they ran in.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

PHASES = ("preflight_s", "cluster_start_s", "actor_start_s", "trace_load_s", "rendezvous_s",
          "replay_s", "teardown_s", "aggregation_s", "total_s")


class PhaseClock:
    """Seconds per named phase since the clock started."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, phase: str):
        """Add the ``with`` block's seconds to ``phase`` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def ordered(self) -> dict[str, float]:
        """The phases of ``PHASES`` that ran, in that order, ``total_s`` included once set."""
        return {name: self.seconds[name] for name in PHASES if name in self.seconds}

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start
