"""The bound on a recording's resident memory and the peak it measures
(actors/memory_limit.py)."""
from __future__ import annotations

import mmap
import signal
import threading

import psutil
import pytest

from actors.memory_limit import MemoryLimitError, PeakRss, memory_limit

MIB = 2**20
PAGE = mmap.PAGESIZE


def _grow(num_mib: int) -> list:
    """Hold ``num_mib`` MiB of fresh anonymous mappings, every page written (resident, and
    none of it the heap's freed memory reused), computing all the while (the bound ticks on
    CPU time); closing a mapping gives its pages back at once."""
    held = []
    for _ in range(num_mib):
        held.append(mmap.mmap(-1, MIB))
        for offset in range(0, MIB, PAGE):
            held[-1][offset] = 1
    return held


def test_a_block_past_its_bound_is_stopped_naming_the_key_and_the_size():
    with PeakRss() as before:
        pass
    limit = before.bytes + 64 * MIB
    with pytest.raises(MemoryLimitError, match=r"roles\.memory_limit_gib=[\d.]+ GiB: the test "
                       r"block held [\d.]+ GiB resident \(stopped at .*test_memory_limit\.py"):
        with memory_limit(limit, "roles.memory_limit_gib", "the test block"):
            held = _grow(512)
            while True:  # past the bound the next tick stops it; never reached otherwise
                held[0][0] = 1
    # the timer and the handler are put back: nothing fires after the block
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGPROF) in (signal.SIG_DFL, None, signal.SIG_IGN)


def test_a_stop_that_makes_a_cleanup_fail_is_still_the_bounds_error():
    """The stop can land inside a library's cleanup, which then fails on the way out (torch's
    mode stack half popped, seen in CI: "trying to set the current FakeTensorMode, but one
    already exists"); the block's error is still the bound's, not that follow-on failure."""
    with pytest.raises(MemoryLimitError, match=r"roles\.memory_limit_gib=[\d.]+ GiB: the test "
                       r"block held [\d.]+ GiB resident \(stopped at .*test_memory_limit\.py"):
        with memory_limit(64 * MIB, "roles.memory_limit_gib", "the test block"):
            try:
                while True:  # a process holding torch is past 64 MiB: the first tick stops it
                    sum(range(1000))
            finally:
                raise RuntimeError("trying to set the current FakeTensorMode, but one already "
                                   "exists")


def test_a_block_within_its_bound_and_no_bound_run_to_their_end():
    with PeakRss() as before:
        pass
    with memory_limit(before.bytes + 1024 * MIB, "k", "w"):
        assert len(_grow(32)) == 32
    with memory_limit(0, "k", "w"):  # 0: no bound
        assert len(_grow(32)) == 32


def test_off_the_main_thread_the_block_runs_unbounded():
    done = []

    def run():
        with memory_limit(1, "k", "w"):  # 1 byte: any tick would stop it
            done.append(len(_grow(16)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert done == [16]


def test_peak_rss_is_the_blocks_own_high_water_mark():
    with PeakRss() as big:
        held = _grow(256)
        inside = psutil.Process().memory_info().rss
        for mapping in held:
            mapping.close()  # unmapped: the process's RSS drops by 256 MiB
    with PeakRss() as small:
        _grow(8)
    assert big.bytes >= inside - 4 * MIB  # the kernel syncs its RSS counters in batches
    if small.method == "vmhwm":  # the mark was reset: the first block's peak is not counted
        assert small.bytes < inside - 200 * MIB
