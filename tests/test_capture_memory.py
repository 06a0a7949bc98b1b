"""The original's memory at capture (actors/capture/memory.py): the running sum of allocator
events, a known allocation pattern measured on CPU, and the CUDA allocator path."""
from __future__ import annotations

import pytest
import torch

from actors.capture.memory import CPU_METHOD, CUDA_METHOD, META_METHOD, MemoryMeter, peak_in_window

MiB = 2**20


def test_peak_in_window_is_the_running_sum_from_the_first_event():
    events = [(1, 100), (2, 50), (5, -50), (6, 30), (7, 200), (8, -230), (20, 999)]
    # Alive at 5: 150; then 100, 130, 330, 100; the event at 20 is after the window.
    assert peak_in_window(events, 5, 10) == (150, 330)
    assert peak_in_window(list(reversed(events)), 5, 10) == (150, 330)  # order by time
    assert peak_in_window(events, 30, 40) == (1099, 1099)  # nothing after: what is alive


def test_cpu_meter_sees_what_lives_before_and_inside_the_iteration():
    """1 MiB alive when the iteration starts, 2 MiB and 3 MiB made inside it, the 2 MiB freed
    first: alive at the start 1 MiB, peak 4 MiB (1 + 3), within the bookkeeping's bytes."""
    meter = MemoryMeter(torch.device("cpu"))
    meter.start()
    try:
        before = torch.empty(MiB, dtype=torch.uint8)
        with meter.iteration():
            a = torch.empty(2 * MiB, dtype=torch.uint8)
            del a
            b = torch.empty(3 * MiB, dtype=torch.uint8)
            del b
    finally:
        meter.stop()
    result = meter.result()
    assert result["method"] == CPU_METHOD
    assert 1 * MiB <= result["iteration_start_bytes"] <= 1.05 * MiB
    assert 4 * MiB <= result["peak_memory_bytes"] <= 4.1 * MiB
    del before


def test_cpu_meter_stopped_by_an_error_reports_nothing():
    meter = MemoryMeter(torch.device("cpu"))
    meter.start()
    meter.stop()  # e.g. the model failed to build: no measured iteration
    assert meter.result()["peak_memory_bytes"] is None


def test_meta_is_not_measured():
    meter = MemoryMeter(torch.device("meta"))
    meter.start()
    with meter.iteration():
        torch.empty(MiB, device="meta")
    meter.stop()
    assert meter.result() == {"method": META_METHOD, "peak_memory_bytes": None,
                              "iteration_start_bytes": None}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_meter_uses_the_allocator_peak():
    device = torch.device("cuda", 0)
    meter = MemoryMeter(device)
    meter.start()
    before = torch.empty(MiB, dtype=torch.uint8, device=device)
    with meter.iteration():
        a = torch.empty(8 * MiB, dtype=torch.uint8, device=device)
        del a
    meter.stop()
    result = meter.result()
    assert result["method"] == CUDA_METHOD
    assert result["iteration_start_bytes"] >= MiB
    assert result["peak_memory_bytes"] >= result["iteration_start_bytes"] + 8 * MiB
    del before
