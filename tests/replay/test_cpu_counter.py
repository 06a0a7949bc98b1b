"""The CPU allocation counter (actors/cpu_counter.py) and its builder (actors/native.py):
exact bytes, frees in other threads (a Python thread, gloo's worker thread), blocks from
before the install, nesting and restore, torch paths that need simple data pointers, and
clear errors when the library cannot be built."""
from __future__ import annotations

import gc
import json
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors import cpu_counter, native
from actors.errors import ConfigError

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_engine_left_counting():
    """Replay engines of earlier tests hold the counter until collected: collect them."""
    gc.collect()
    assert not cpu_counter.installed()


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_peak_and_current_are_exact_to_the_byte():
    """8, 4 and 2 MiB (+3 bytes each, to see bytes not rounding), free the 4, then 1 MiB:
    alive 11 MiB + 9, peak 14 MiB + 9; blocks counted one by one."""
    with cpu_counter.counting():
        base = cpu_counter.reset_peak()
        blocks = cpu_counter.num_live_blocks()
        a, b, c = _bytes(8 * MiB + 3), _bytes(4 * MiB + 3), _bytes(2 * MiB + 3)
        assert cpu_counter.current_bytes() - base == 14 * MiB + 9
        assert cpu_counter.num_live_blocks() - blocks == 3
        del b
        d = _bytes(MiB)
        assert cpu_counter.current_bytes() - base == 11 * MiB + 6
        assert cpu_counter.peak_bytes() - base == 14 * MiB + 9
        assert cpu_counter.num_live_blocks() - blocks == 3
        assert cpu_counter.reset_peak() == cpu_counter.peak_bytes() == base + 11 * MiB + 6
        del a, c, d
        assert cpu_counter.current_bytes() == base


def test_a_free_in_another_thread_is_seen():
    with cpu_counter.counting():
        base = cpu_counter.current_bytes()
        box = [_bytes(16 * MiB)]
        assert cpu_counter.current_bytes() == base + 16 * MiB
        worker = threading.Thread(target=box.clear)  # the last reference dies over there
        worker.start()
        worker.join(timeout=30)
        assert not box
        assert cpu_counter.current_bytes() == base


def test_blocks_from_before_the_install_are_never_subtracted():
    old = _bytes(4 * MiB)
    with cpu_counter.counting():
        assert cpu_counter.current_bytes() == 0  # the first install starts from zero
        kept = _bytes(2 * MiB)
        del old  # freed by torch's own deleter: not counted, not subtracted
        assert cpu_counter.current_bytes() == 2 * MiB
    with cpu_counter.counting():  # a new count: the earlier one's block is not its own
        assert cpu_counter.current_bytes() == 0
        del kept
        assert cpu_counter.current_bytes() == 0 and cpu_counter.num_live_blocks() == 0


def test_installs_nest_and_the_last_uninstall_restores_torch_allocator():
    assert not cpu_counter.installed()
    with cpu_counter.counting():
        x = _bytes(MiB)
        with cpu_counter.counting():  # nested: a fresh count, x is not its own
            assert cpu_counter.installed() and cpu_counter.current_bytes() == 0
            w = _bytes(MiB)
        assert cpu_counter.installed()
        del x  # an earlier count's block: not subtracted
        assert cpu_counter.current_bytes() == MiB
        del w
        assert cpu_counter.current_bytes() == 0
    assert not cpu_counter.installed()
    before = cpu_counter.current_bytes()
    y = _bytes(MiB)  # torch's own allocator again: not counted
    assert cpu_counter.current_bytes() == before
    del y


def test_torch_paths_keep_working_under_the_counter():
    """oneDNN allocates through raw_allocate (needs data == context), copy-on-write clones need
    simple data pointers, empty tensors keep no block, resize reallocates, numpy shares."""
    with cpu_counter.counting():
        conv = torch.nn.Conv2d(3, 4, 3)
        x = torch.randn(2, 3, 16, 16)
        want = conv(x)
        if torch.backends.mkldnn.is_available():
            torch.testing.assert_close(conv(x.to_mkldnn()).to_dense(), want)
        z = torch.arange(10.0)
        lazy = z._lazy_clone()
        lazy.add_(1)
        assert z[3].item() == 3.0 and lazy[3].item() == 4.0
        assert torch.empty(0).data_ptr() == 0
        y = torch.arange(10.0)
        y.resize_(1000)
        assert y.numpy().shape == (1000,) and y[9].item() == 9.0
        assert y.data_ptr() % 64 == 0  # the header keeps the CPU allocator's alignment


def _worker_thread_free(rank: int, init_file: str, out_dir: str) -> None:
    """Rank 1 starts an async reduce-scatter and drops its input and work at once; rank 0 joins
    late, so gloo's worker thread holds the last reference and frees the input there, a moment
    after the collective completes: rank 1 waits (bounded) for the counter to see it. Without
    a wait the output is not copied back: only the free matters here."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    try:
        numel = 2 * MiB  # float32: 8 MiB of input
        out = torch.empty(numel // 2)
        if rank == 0:
            time.sleep(1.0)
            dist.reduce_scatter_tensor(out, torch.ones(numel), async_op=True).wait()
        else:
            with cpu_counter.counting(), profile(activities=[ProfilerActivity.CPU],
                                                 profile_memory=True) as prof:
                base = cpu_counter.current_bytes()
                inp = torch.ones(numel)
                work = dist.reduce_scatter_tensor(out, inp, async_op=True)
                del inp, work
                deadline = time.monotonic() + 30
                while cpu_counter.current_bytes() != base and time.monotonic() < deadline:
                    time.sleep(0.01)
                alive = cpu_counter.current_bytes() - base
            events = [e.nbytes() for e in prof.profiler.kineto_results.events()
                      if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
            with open(os.path.join(out_dir, "1.json"), "w") as f:
                json.dump({"counter_alive": alive, "profiler_sum": sum(events)}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_free_in_gloo_worker_thread_is_seen(tmp_path):
    mp.spawn(_worker_thread_free, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    got = json.loads((tmp_path / "1.json").read_text())
    assert got["counter_alive"] == 0
    # the profiler's events never saw that free: proof it happened off the profiled thread
    assert got["profiler_sum"] >= 8 * MiB


def test_no_compiler_is_a_clear_config_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler.*none found on PATH"):
        native.load_library("nocompiler_probe", "int f() { return 1; }", "testing")


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEFLEET_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="testing: building broken_probe .* failed: .*error"):
        native.load_library("broken_probe", "this is not C++", "testing")
    assert not list((tmp_path / "native").glob("broken_probe*"))  # nothing half-built is left
