"""The original's memory at capture (actors/capture/memory.py): a known allocation pattern
measured on CPU by the allocation counter, and the CUDA allocator path."""
from __future__ import annotations

import pytest
import torch

from actors import cpu_counter
from actors.capture.memory import CPU_METHOD, CUDA_METHOD, META_METHOD, MemoryMeter

MiB = 2**20


def test_cpu_meter_sees_what_lives_before_and_inside_the_iteration():
    """1 MiB alive when the iteration starts, 2 MiB and 3 MiB made inside it, the 2 MiB freed
    first: alive at the start 1 MiB, peak 4 MiB (1 + 3), to the byte: the counter was
    installed by ``start`` and nothing else allocates here."""
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
    assert result["iteration_start_bytes"] == 1 * MiB
    assert result["peak_memory_bytes"] == 4 * MiB
    assert not cpu_counter.installed()  # stop restored torch's allocator
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
