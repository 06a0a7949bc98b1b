"""Accounting of the bytes the replayer holds (storages, not views), capacity and timeline.

Works the same on cpu, meta and cuda: it counts the storages the replay keeps alive. On CUDA
the allocator's own figures (allocated/reserved/peak) are reported beside it.
"""
from __future__ import annotations

import torch


class OutOfMemory(Exception):
    """Raised inside the replay loop when a request would cross the device capacity."""

    def __init__(self, held_bytes: int, requested_bytes: int, capacity_bytes: int):
        super().__init__(f"need {requested_bytes} B more with {held_bytes} B held; "
                         f"capacity {capacity_bytes} B")
        self.held_bytes = held_bytes
        self.requested_bytes = requested_bytes
        self.capacity_bytes = capacity_bytes

    def __reduce__(self):  # the custom __init__ needs its own arguments to unpickle
        return type(self), (self.held_bytes, self.requested_bytes, self.capacity_bytes)


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
    """Held bytes per storage generation, the peak, and a bounded timeline."""

    def __init__(self, capacity_bytes: int | None, max_points: int = 2000):
        self.capacity_bytes = capacity_bytes
        self.held: dict[int, int] = {}  # suid -> bytes
        self.held_bytes = 0
        self.peak_bytes = 0
        self._max_points = max(16, max_points)
        self._stride = 1
        self.tick = 0  # ops run so far (the timeline's x axis)
        self.next_sample = 1
        self.timeline: list[tuple[int, int]] = []

    def check(self, requested_bytes: int) -> None:
        """Raise OutOfMemory when ``requested_bytes`` more would cross the capacity."""
        cap = self.capacity_bytes
        if cap is not None and self.held_bytes + requested_bytes > cap:
            raise OutOfMemory(self.held_bytes, requested_bytes, cap)

    def add(self, suid: int, nbytes: int) -> None:
        if suid in self.held:
            return
        self.held[suid] = nbytes
        self.held_bytes += nbytes
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes = self.held_bytes

    def release(self, suid: int) -> int:
        nbytes = self.held.pop(suid, 0)
        self.held_bytes -= nbytes
        return nbytes

    def sample(self, tick: int) -> int:
        """Record held bytes at op ``tick``; returns the next tick to sample.

        The op loop calls this only every ``stride`` ops; the stride doubles (and the kept
        points halve) whenever the buffer fills, so the timeline stays bounded.
        """
        self.timeline.append((tick, self.held_bytes))
        if len(self.timeline) >= self._max_points:
            self.timeline = self.timeline[::2]
            self._stride *= 2
        return tick + self._stride

    def utilization(self) -> float:
        return self.held_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


def cuda_memory_stats(device: torch.device) -> dict | None:
    """Peak allocated/reserved bytes from the CUDA caching allocator (None off CUDA)."""
    if device.type != "cuda":
        return None
    return {"allocated_peak": torch.cuda.max_memory_allocated(device),
            "reserved_peak": torch.cuda.max_memory_reserved(device),
            "allocated": torch.cuda.memory_allocated(device)}
