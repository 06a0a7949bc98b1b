"""Measured memory: what the device's allocator really handed out, op temporaries included.

One meter per device kind, joined to the replay as an extension (``MemoryMeter``, the first
of the list): it opens in ``attach``, before anything of the replay is allocated (before
other extensions such as ZeRO-3 allocate their shards), ``start``/``stop`` wrap every timed
iteration, and it is closed by ``engine.close()`` (or when the engine is collected):

* cpu: a counter of the CPU allocator's live bytes (actors/cpu_counter.py), installed as
  torch's CPU allocator from ``open`` to ``close``. It sees allocations and frees in every
  thread (gloo's worker thread frees collective temporaries, which the torch profiler's
  allocator events miss), counts only blocks allocated after ``open``, and its peak is reset
  to the bytes alive at the start of every timed iteration. Cost: three atomic updates per
  allocation, so every timed iteration is measured, with no iteration of its own. One count
  per process: if another meter opens before this one's last iteration, this one reports
  nothing (``superseded``) rather than another replay's bytes.
* cuda: the caching allocator's own peak statistics, reset before every timed iteration;
  free to read, so every timed iteration is measured. ``max_memory_reserved`` (what the
  allocator took from the driver) is reported beside ``max_memory_allocated``.
* meta: nothing is allocated, nothing can be measured; the accounted figure stands alone.
"""
from __future__ import annotations

import torch

from actors import cpu_counter
from actors.replay.extension_contract import ReplayContext, ReplayExtension

CPU_METHOD = "cpu_allocator_counter"
CUDA_METHOD = "cuda_allocator_stats"


class NoMeter:
    """A device that cannot measure (meta), or measuring turned off."""

    method = None

    def open(self) -> None:
        """Before the replay allocates anything: what is counted from here on."""

    def start(self) -> None:
        """Begin a measured window (a timed iteration)."""

    def stop(self) -> None:
        """End the window begun by ``start``."""

    def close(self) -> None:
        """The replay is over (safe to call more than once, and without ``open``)."""

    @property
    def peak_bytes(self) -> int | None:
        return None

    def details(self) -> dict | None:
        return None


class CpuCounterMeter(NoMeter):
    """Peak live bytes of the CPU allocator per timed iteration, from the allocation counter
    installed between ``open`` and ``close``."""

    method = CPU_METHOD

    def __init__(self):
        self._open = False
        self._count: int | None = None  # the counter's count this meter started
        self._superseded = False
        self._start_bytes: list[int] = []
        self._peaks: list[int] = []

    def open(self) -> None:
        cpu_counter.install()
        self._open = True
        self._count = cpu_counter.count_id()

    def start(self) -> None:
        self._start_bytes.append(cpu_counter.reset_peak())

    def stop(self) -> None:
        # another meter opened in this process meanwhile: the count is no longer this replay's
        self._superseded |= cpu_counter.count_id() != self._count
        self._peaks.append(cpu_counter.peak_bytes())

    def close(self) -> None:
        if self._open:
            self._open = False
            cpu_counter.uninstall()

    @property
    def peak_bytes(self) -> int | None:
        return max(self._peaks) if self._peaks and not self._superseded else None

    def details(self) -> dict:
        return {"peak_bytes_per_iteration": list(self._peaks),
                "start_bytes_per_iteration": list(self._start_bytes),
                "superseded": self._superseded}


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


def make_meter(device: torch.device, enabled: bool) -> NoMeter:
    """The meter for ``device`` (NoMeter on meta or when measuring is off)."""
    if not enabled or device.type == "meta":
        return NoMeter()
    if device.type == "cuda":
        return CudaAllocatorMeter(device)
    if device.type == "cpu":
        return CpuCounterMeter()
    return NoMeter()


class MemoryMeter(ReplayExtension):
    """The device's meter as a replay extension: its window is every timed iteration; the
    report's ``memory_measure`` section and its top-level measured figures are its own."""

    name = "memory_measure"

    def __init__(self, meter: NoMeter):
        self.meter = meter

    def attach(self, ctx: ReplayContext) -> None:
        self.meter.open()

    def start_measuring(self) -> None:
        self.meter.start()

    def stop_measuring(self) -> None:
        self.meter.stop()

    def report(self) -> dict | None:
        return self.meter.details()

    def headline(self) -> dict:
        measured = self.meter.peak_bytes
        out = {"measured_peak_bytes": measured, "memory_measure_method": self.meter.method}
        if measured is not None:  # else the accounted peak stands alone
            out.update(peak_memory_bytes=measured, peak_memory_source="measured")
        return out

    def close(self) -> None:
        self.meter.close()
