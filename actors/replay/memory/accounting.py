"""Accounted memory: the bytes of the storages the replay holds, by trace sizes, with capacity,
threshold flushing decisions and a bounded timeline.

"Accounted" means computed from the trace: a storage counts with the bytes its recorded views
reach. What the device really allocated (op temporaries, workspaces, allocator rounding) is
measured separately (actors/replay/memory/meters.py). Accounting drives the OOM and flush decisions
because it can tell *before* an op runs what the op will need.
"""
from __future__ import annotations

import torch

from actors.replay.out_of_memory import OutOfMemory
from actors.trace.categories import CATEGORIES, TEMPORARIES


def device_capacity(device: torch.device, configured: int | None) -> int | None:
    """The configured capacity, else the GPU's memory (cuda) or physical RAM (cpu); None on meta."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        import psutil
        return psutil.virtual_memory().total
    return None


class MemoryTracker:
    """Accounted bytes held per storage generation (a list indexed by suid), bytes charged by
    extensions, the peak with its breakdown by category (actors/trace/categories.py) and the
    op it happened at, the flush ticks and a bounded timeline."""

    def __init__(self, num_storages: int, capacity_bytes: int | None, max_points: int = 2000):
        self.capacity_bytes = capacity_bytes
        self.held: list[int] = [0] * num_storages  # suid -> accounted bytes held (0: not held)
        self.held_bytes = 0
        self.peak_bytes = 0
        # The most and fewest bytes held since the last timeline sample, so a downsampled
        # timeline keeps its extremes.
        self.high_bytes = 0
        self.low_bytes = 0
        self.max_points = max(16, max_points)
        # The timeline and the flush ticks describe the first iteration (every iteration
        # replays the same ops under the same policy); later ones run without sampling.
        self.recording = True
        self.flush_ticks: list[int] = []  # op index of each flush
        # (op index, bytes held after it, most and fewest held since the previous sample):
        # a downsampled timeline keeps its extremes, the peak among them.
        self.timeline: list[tuple[int, int, int, int]] = []
        self.categories: list[int] = [TEMPORARIES] * num_storages  # suid -> category index
        self.category_bytes = [0] * len(CATEGORIES)  # bytes held now, per category
        self.peak_category_bytes = list(self.category_bytes)  # ... when the peak was reached
        self.peak_step = None  # the replay step (its op) running when the peak was reached
        self.step = None  # the step running now, for charges between ops (engine sets it)
        self.observer = None  # sees every allocation and free (observe)

    def observe(self, observer) -> None:
        """Tell ``observer`` (an allocator model: actors/replay/memory/reserved_model.py) of every
        storage held and released, ``held(suid, nbytes)`` / ``released(suid)``, and of every
        extension charge, ``charged(nbytes, category, host)`` / ``discharged(nbytes, category,
        host)``. The op loop's ``add_new`` becomes ``add``, which tells it."""
        self.observer = observer
        self.add_new = self.add  # an instance attribute: shadows the fast variant

    def check(self, requested_bytes: int) -> None:
        """Raise OutOfMemory when ``requested_bytes`` more would cross the capacity."""
        cap = self.capacity_bytes
        if cap is not None and self.held_bytes + requested_bytes > cap:
            raise OutOfMemory(self.held_bytes, requested_bytes, cap)

    # Every write of ``held`` goes through add, add_new or release (the one bookkeeping path).
    def add(self, suid: int, nbytes: int) -> None:
        """Account storage ``suid`` as held (once)."""
        if self.held[suid]:
            return
        self.held[suid] = nbytes
        if nbytes and self.observer is not None:
            self.observer.held(suid, nbytes)
        self._grow(nbytes, self.categories[suid])

    def add_new(self, suid: int, nbytes: int) -> None:
        """``add`` for an op's fresh output (step_plan.set_fast_path) with no observer attached:
        the op loop's variant, equal to ``add`` (tests/replay/test_memory_accounting.py);
        ``observe`` replaces it with ``add``."""
        if self.held[suid]:  # a storage the trace shows fresh may already be held: once
            return
        self.held[suid] = nbytes
        held = self.held_bytes = self.held_bytes + nbytes
        self.category_bytes[self.categories[suid]] += nbytes
        if held > self.high_bytes:  # the peak is never below the bucket's high
            self.high_bytes = held
            if held > self.peak_bytes:
                self.new_peak(self.step)

    def release(self, suid: int) -> int:
        """Stop accounting storage ``suid``; returns the bytes it held (0: it was not held)."""
        nbytes = self.held[suid]
        self.held[suid] = 0
        if nbytes and self.observer is not None:
            self.observer.released(suid)
        held = self.held_bytes = self.held_bytes - nbytes
        self.category_bytes[self.categories[suid]] -= nbytes
        if held < self.low_bytes:  # the timeline bucket's low
            self.low_bytes = held
        return nbytes

    def charge(self, nbytes: int, category: int = TEMPORARIES, host: bool = False) -> None:
        """Account bytes an extension allocated itself (checked against the capacity), as a
        category of actors/trace/categories.py. ``host``: the job keeps them in host memory
        (DeepSpeed's offload): in the accounted total, not checked against the device's
        capacity, and apart in an allocator model (its host peak)."""
        if not host:
            self.check(nbytes)
        if self.observer is not None:
            self.observer.charged(nbytes, category, host)
        self._grow(nbytes, category)

    def discharge(self, nbytes: int, category: int = TEMPORARIES, host: bool = False) -> None:
        """Stop accounting bytes an extension released (charged as ``category``, ``host``)."""
        if self.observer is not None:
            self.observer.discharged(nbytes, category, host)
        self.held_bytes -= nbytes
        self.category_bytes[category] -= nbytes

    def _grow(self, nbytes: int, category: int) -> None:
        """``nbytes`` more held as ``category``: the bucket's high and the peak follow."""
        self.held_bytes += nbytes
        self.category_bytes[category] += nbytes
        if self.held_bytes > self.high_bytes:
            self.high_bytes = self.held_bytes
        if self.held_bytes > self.peak_bytes:
            self.new_peak(self.step)

    def new_peak(self, step) -> None:
        """The bytes held now are the peak: remember their breakdown and the step."""
        self.peak_bytes = self.held_bytes
        self.peak_category_bytes = self.category_bytes[:]
        self.peak_step = step
        if self.held_bytes < self.low_bytes:
            self.low_bytes = self.held_bytes

    def note_flush(self, op_index: int) -> None:
        if self.recording:
            self.flush_ticks.append(op_index)

    def sample(self, op_index: int) -> None:
        """Record the bytes held after op ``op_index`` and the extremes since the previous
        sample; the next bucket starts from what is held now."""
        held = self.held_bytes
        self.timeline.append((op_index, held, max(self.high_bytes, held),
                              min(self.low_bytes, held)))
        self.high_bytes = self.low_bytes = held


def sample_points(num_ops: int, max_points: int) -> list[int]:
    """Op indices after which the first iteration's timeline samples (about ``max_points``),
    the last op always among them: every op falls in some point's bucket."""
    stride = max(1, -(-num_ops // max_points))
    points = list(range(stride - 1, num_ops, stride))
    if num_ops and points[-1:] != [num_ops - 1]:
        points.append(num_ops - 1)
    return points
