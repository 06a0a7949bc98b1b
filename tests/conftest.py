"""Shared fixtures: the public GPU traces beside the repo, the 8-rank DLRM folder, a gloo capture.

CI runs in a fresh clone with a copy of ``shared/`` beside it, so the public traces are
found relative to this file (``<repo>/../shared``); tests that need them skip when absent.
"""
from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

import pytest

from tests.support.trace_factory import et_tail, run_rank_script


def _shared_dir() -> Path:
    """$TRACEFLEET_SHARED_DIR, else ``shared/`` beside the checkout, else the workplace's."""
    candidates = [Path(os.environ["TRACEFLEET_SHARED_DIR"])] if "TRACEFLEET_SHARED_DIR" in os.environ \
        else []
    candidates += [Path(__file__).resolve().parents[1].parent / "shared", Path("/work/shared")]
    return next((c for c in candidates if c.is_dir()), candidates[0])


SHARED_DIR = _shared_dir()
PUBLIC_TRACE_DIR = SHARED_DIR / "traces" / "public" / "param"
DLRM_ARCHIVE = "dlrm_pytorch_et.tar.gz"
DLRM_WORLD_SIZE = 8
GLOO_WORLD_SIZE = 2
CAPTURE_TIMEOUT_S = 180

# One training step plus one call of each tensor collective, recorded after a warm-up step.
# Rank r sends 1 + j + 2r elements to rank j, so in and out splits differ (uneven all_to_all).
# Then an async all_reduce, a float64 scatter from rank 0, and functional (eager
# _c10d_functional) all_gather_into_tensor / reduce_scatter_tensor, each with its wait_tensor.
_GLOO_CAPTURE = r'''
import os, sys
from datetime import timedelta
os.environ["ENABLE_PYTORCH_EXECUTION_TRACE_SAVE_INTEGRAL_TENSOR_RANGE"] = "1"
import torch, torch.distributed as dist, torch.nn as nn
from torch.profiler import ExecutionTraceObserver

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=60))
torch.manual_seed(0)
emb, lin = nn.Embedding(50, 8), nn.Linear(8, 8)

def step():
    h = lin(emb(torch.randint(0, 50, (4, 2))))
    h.sum().backward()
    dist.all_reduce(lin.weight.grad)
    gathered = torch.empty(world * 8)
    dist.all_gather_into_tensor(gathered, lin.bias.grad)
    shard = torch.empty(4)
    dist.reduce_scatter_tensor(shard, torch.ones(4 * world))
    dist.broadcast(lin.bias.data, src=0)
    in_splits = [1 + j + 2 * rank for j in range(world)]
    out_splits = [1 + rank + 2 * j for j in range(world)]
    received = torch.empty(sum(out_splits), dtype=torch.int64)
    dist.all_to_all_single(received, torch.arange(sum(in_splits)), out_splits, in_splits)
    dist.all_reduce(lin.bias.grad, async_op=True).wait()
    scattered = torch.empty(3, dtype=torch.float64)  # rank 1 passes no input list
    dist.scatter(scattered, [torch.full((3,), float(j), dtype=torch.float64) for j in range(world)]
                 if rank == 0 else None, src=0)
    fc, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
    fc.wait_tensor(fc.all_gather_into_tensor(torch.ones(5), world, group))
    fc.wait_tensor(fc.reduce_scatter_tensor(torch.ones(6 * world), "sum", world, group))
''' + et_tail()


def pytest_collection_modifyitems(config, items):
    """The files holding a ``slow`` test run first (scripts/test.sh keeps this order with
    ``--no-loadscope-reorder``): xdist otherwise starts the files with the most tests first,
    which leaves the minutes-long multi-actor and benchmark files to the end, one worker
    running them while the others idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: collection order kept


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    """One local Ray for a module's replays (run_replay reuses an initialized Ray), with its
    own temp dir; stopped when the module ends."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared data folder (skips the test when it is absent)."""
    if not SHARED_DIR.is_dir():
        pytest.skip(f"shared data folder {SHARED_DIR} is absent")
    return SHARED_DIR


@pytest.fixture(scope="session")
def public_trace_dir(shared_dir) -> Path:
    """The public PARAM GPU traces (see ``shared/traces/public/README.md``)."""
    if not PUBLIC_TRACE_DIR.is_dir():
        pytest.skip(f"public traces folder {PUBLIC_TRACE_DIR} is absent")
    return PUBLIC_TRACE_DIR


@pytest.fixture(scope="session")
def dlrm_rank_dir(public_trace_dir, tmp_path_factory) -> Path:
    """The 8-rank DLRM archive extracted as ``rank-<r>.json`` (r = 0..7)."""
    archive = public_trace_dir / DLRM_ARCHIVE
    if not archive.is_file():
        pytest.skip(f"{archive} is absent")
    out = tmp_path_factory.mktemp("dlrm")
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            m = re.search(r"_(\d+)\.json$", member.name)
            if member.isfile() and m:
                (out / f"rank-{int(m.group(1))}.json").write_bytes(tar.extractfile(member).read())
    assert sorted(p.name for p in out.iterdir()) == [f"rank-{r}.json" for r in range(DLRM_WORLD_SIZE)]
    return out


@pytest.fixture(scope="session")
def gloo_trace_dir(tmp_path_factory) -> Path:
    """A 2-rank gloo capture (``rank-0.json``, ``rank-1.json``, schema 1.1.1 with tensor ranges):
    an embedding + linear step, then all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
    broadcast (src 0), an uneven all_to_all_single, an async all_reduce, a scatter (src 0) and
    functional all_gather_into_tensor / reduce_scatter_tensor. Takes ~10 s (two torch processes)."""
    out = tmp_path_factory.mktemp("gloo")
    run_rank_script(_GLOO_CAPTURE, out, GLOO_WORLD_SIZE, "gloo capture", CAPTURE_TIMEOUT_S)
    return out
