"""The original's memory at capture: the peak of allocated bytes during one untraced iteration.

CPU: the CPU allocator's live-byte counter (actors/cpu_counter.py), installed before the
model is built, so every byte alive is counted (parameters, gradients, optimizer state,
framework buffers such as DeepSpeed's), and frees are seen in every thread (gloo's worker
thread frees collective temporaries, which the torch profiler's allocator events miss). Its
cost is a few atomic updates per allocation: the iteration runs at full speed.
CUDA: the caching allocator's ``memory_allocated`` / ``max_memory_allocated`` around the
iteration (the iteration is not slowed). meta: nothing to measure.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from actors import cpu_counter

CPU_METHOD = "CPU allocator counter (every thread) installed before the model was built"
CUDA_METHOD = "torch.cuda.memory_allocated / max_memory_allocated around the iteration"
META_METHOD = "not measured: the meta device allocates nothing"


class MemoryMeter:
    """Measure one iteration: ``start()`` before the model is built, the measured iteration
    inside ``with meter.iteration():``, then ``stop()``; ``result()`` gives the figures."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = {"cpu": CPU_METHOD, "cuda": CUDA_METHOD}.get(device.type, META_METHOD)
        self._counting = False
        self._peak: int | None = None
        self._start: int | None = None

    def start(self) -> None:
        """Begin counting allocations (CPU); call before anything of the model exists."""
        if self.device.type == "cpu":
            cpu_counter.install()
            self._counting = True

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
        elif self._counting:
            start = cpu_counter.reset_peak()
            yield
            self._start, self._peak = start, cpu_counter.peak_bytes()
        else:
            yield

    def stop(self) -> None:
        """End counting (safe to call after an error, and more than once)."""
        if self._counting:
            self._counting = False
            cpu_counter.uninstall()

    def result(self) -> dict:
        """``{"method", "peak_memory_bytes", "iteration_start_bytes"}`` (None where not measured)."""
        return {"method": self.method, "peak_memory_bytes": self._peak,
                "iteration_start_bytes": self._start}
