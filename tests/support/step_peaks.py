"""A one-rank step's peak both ways: predicted (captured on fake, the trace's faithful dry run)
and measured (the CPU allocator's counter over a real iteration in this process)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from actors.capture.memory import MemoryMeter
from actors.capture.workloads.build import WorkloadConfig
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from orchestrator.run.capture import CaptureConfig, run_capture_job


def predicted_peak(spec: str, out_dir: Path, gpu_kernels: str | None = None) -> int:
    """The accounted peak of ``spec``'s step captured on fake at world 1 (for ``gpu_kernels``'
    GPU, or the cpu), dry-run with faithful allocation."""
    run_capture_job(CaptureConfig(
        workload=WorkloadConfig(model="custom", entrypoint=spec, device="fake",
                                gpu_kernels=gpu_kernels),
        world_size=1, out_dir=str(out_dir)))
    report = ReplayEngine(load_trace(out_dir / trace_file_name(0)), ReplayConfig(
        mode="compute", device="meta", iters=1, warmup_iters=1, measure_memory=False,
        allocation=AllocationConfig(mode="faithful"))).run().to_dict()
    assert report["status"] == "ok", report
    return report["accounted_peak_bytes"]


def measured_peak(make_step: Callable[[], Callable[[], None]]) -> int:
    """The CPU allocator's peak over the second call of the step ``make_step()`` returns (its
    model built inside the count; the first call warms up)."""
    meter = MemoryMeter(torch.device("cpu"))
    meter.start()
    try:
        step = make_step()
        step()
        with meter.iteration():
            step()
    finally:
        meter.stop()
    return meter.result()["peak_memory_bytes"]
