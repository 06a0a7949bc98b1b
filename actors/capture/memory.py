"""The original's memory at capture: the peak of allocated bytes during one untraced iteration.

CPU: torch profiler allocator events (``profile_memory=True``). The profiler must start
before the model is built: CPU allocations made before it started are invisible to it, so
only then is the running sum of event bytes every byte alive (parameters, gradients,
optimizer state, framework buffers such as DeepSpeed's). It records every op too, so the
iterations it spans (the warm-up, whose last one is measured) are not timed.
CUDA: the caching allocator's ``memory_allocated`` / ``max_memory_allocated`` around the
iteration (the iteration is not slowed). meta: nothing to measure.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from actors.errors import TracefleetError

CPU_METHOD = "torch.profiler allocator events (profile_memory=True) from before the model was built"
CUDA_METHOD = "torch.cuda.memory_allocated / max_memory_allocated around the iteration"
META_METHOD = "not measured: the meta device allocates nothing"
WINDOW_NAME = "## tracefleet:memory_iteration ##"  # marks the measured iteration in the profile


class MemoryMeter:
    """Measure one iteration: ``start()`` before the model is built, the measured iteration
    inside ``with meter.iteration():``, then ``stop()``; ``result()`` gives the figures."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = {"cpu": CPU_METHOD, "cuda": CUDA_METHOD}.get(device.type, META_METHOD)
        self._prof = None
        self._measured = False
        self._peak: int | None = None
        self._start: int | None = None

    def start(self) -> None:
        """Begin recording allocations (CPU); call before anything of the model exists."""
        if self.device.type == "cpu":
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()

    @contextmanager
    def iteration(self):
        """Wrap the measured iteration."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self._peak = torch.cuda.max_memory_allocated(self.device)
            return
        with record_function(WINDOW_NAME):
            yield
        self._measured = True

    def stop(self) -> None:
        """End recording (safe to call after an error); CPU figures are computed here from
        the allocator events."""
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        events = self._prof.profiler.kineto_results.events()
        self._prof = None
        if not self._measured:  # stopped by an error before the measured iteration
            return
        window = [e for e in events if e.name() == WINDOW_NAME]
        if len(window) != 1:
            raise TracefleetError("capture memory: expected one measured iteration in the "
                                  f"profile, found {len(window)}")
        self._start, self._peak = peak_in_window(
            ((e.start_ns(), e.nbytes()) for e in events
             if e.name() == "[memory]" and e.device_type() == DeviceType.CPU),
            window[0].start_ns(), window[0].end_ns())

    def result(self) -> dict:
        """``{"method", "peak_memory_bytes", "iteration_start_bytes"}`` (None where not measured)."""
        return {"method": self.method, "peak_memory_bytes": self._peak,
                "iteration_start_bytes": self._start}


def peak_in_window(events, begin_ns: int, end_ns: int) -> tuple[int, int]:
    """``(bytes alive at begin_ns, peak bytes alive in [begin_ns, end_ns])`` from
    ``(timestamp ns, signed bytes)`` allocator events: the running sum from the first event."""
    running, at_start, peak = 0, None, None
    for ts, nbytes in sorted(events, key=lambda e: e[0]):  # stable: recorded order on ties
        if ts >= begin_ns and at_start is None:
            at_start = peak = running
        if ts > end_ns:
            break
        running += nbytes
        if at_start is not None and running > peak:
            peak = running
    if at_start is None:  # no event at or after the window's start
        at_start = peak = running
    return at_start, peak

