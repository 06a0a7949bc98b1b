"""Measured memory: what the device's allocator really handed out, op temporaries included.

One meter per device kind:

* cpu: the torch profiler's allocator events (``profile_memory=True``). Every allocation and
  free of the CPU allocator while the profiler runs is an event with its byte count; the
  running sum from the profiler's start is exact as long as nothing the replay holds was
  allocated before it, so the engine starts it before it allocates anything and runs two
  extra, untimed iterations under it: the peak is taken over the second (``mark``), after the
  first has paid for one-time allocations (gloo's buffers, lazily built kernels), as the
  original was measured after its warm-up. The timed iterations run without the profiler,
  whose per-op cost would distort them. Cost: two iterations at profiler speed (about 2-4x an
  iteration on tiny ops) plus the events' memory.
* cuda: the caching allocator's own peak statistics, reset before every timed iteration;
  free to read, so every timed iteration is measured. ``max_memory_reserved`` (what the
  allocator took from the driver) is reported beside ``max_memory_allocated``.
* meta: nothing is allocated, nothing can be measured; the accounted figure stands alone.
"""
from __future__ import annotations

import torch

CPU_METHOD = "cpu_profiler_allocator_events"
CUDA_METHOD = "cuda_allocator_stats"


class NoMeter:
    """A device that cannot measure (meta), or measuring turned off."""

    method = None
    needs_own_iteration = False

    def start(self) -> None:
        """Begin a measured window (an iteration, or the profiler's whole own iterations)."""

    def mark(self) -> None:
        """Where the window's peak starts to count (what came before still adds up)."""

    def stop(self) -> None:
        """End the window begun by ``start``."""

    @property
    def peak_bytes(self) -> int | None:
        return None

    def details(self) -> dict | None:
        return None


MARK = "tracefleet::measured_iteration"


class CpuProfilerMeter(NoMeter):
    """The peak of the running sum of CPU allocator events under the torch profiler, over the
    events after ``mark()``."""

    method = CPU_METHOD
    needs_own_iteration = True

    def __init__(self):
        self._profiler = None
        self._peak: int | None = None
        self.num_events = 0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                 record_shapes=False, with_stack=False)
        self._profiler.__enter__()

    def mark(self) -> None:
        from torch.profiler import record_function
        with record_function(MARK):  # a zero-length event: its start is the mark
            pass

    def stop(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        events, since = _cpu_memory_events(profiler)
        running = peak = 0
        for start_ns, nbytes in events:
            running += nbytes
            if running > peak and start_ns >= since:
                peak = running
        self.num_events = len(events)
        self._peak = max(peak, self._peak or 0)

    @property
    def peak_bytes(self) -> int | None:
        return self._peak

    def details(self) -> dict:
        return {"num_allocator_events": self.num_events}


def _cpu_memory_events(profiler) -> tuple[list[tuple[int, int]], int]:
    """(start ns, signed bytes) of every CPU allocator event in time order, and the start of
    the last ``mark()`` (0 without one), from one pass over the profiler's events."""
    from torch._C._autograd import DeviceType
    events, since = [], 0
    for e in profiler.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            if e.device_type() == DeviceType.CPU:
                events.append((e.start_ns(), e.nbytes()))
        elif name == MARK:
            since = max(since, e.start_ns())
    events.sort()
    return events, since


class CudaAllocatorMeter(NoMeter):
    """Peak allocated/reserved bytes of the CUDA caching allocator, reset per window."""

    method = CUDA_METHOD

    def __init__(self, device: torch.device):
        self.device = device
        self._allocated: list[int] = []
        self._reserved: list[int] = []

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> None:
        torch.cuda.synchronize(self.device)
        self._allocated.append(torch.cuda.max_memory_allocated(self.device))
        self._reserved.append(torch.cuda.max_memory_reserved(self.device))

    @property
    def peak_bytes(self) -> int | None:
        return max(self._allocated) if self._allocated else None

    def details(self) -> dict:
        return {"allocated_peak_bytes": self.peak_bytes,
                "reserved_peak_bytes": max(self._reserved) if self._reserved else None,
                "allocated_peak_bytes_per_iteration": list(self._allocated)}


def make_meter(device: torch.device, enabled: bool, profiling: bool = False) -> NoMeter:
    """The meter for ``device`` (NoMeter on meta or when measuring is off). While the user's
    own profiler runs (``replay.profile``) the CPU meter cannot: one profiler at a time."""
    if not enabled or device.type == "meta":
        return NoMeter()
    if device.type == "cuda":
        return CudaAllocatorMeter(device)
    if device.type == "cpu" and not profiling:
        return CpuProfilerMeter()
    return NoMeter()
