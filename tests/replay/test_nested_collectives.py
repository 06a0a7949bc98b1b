"""A real 2-rank DDP trace whose root rank nests one buffer broadcast under the previous one.

DDP with ``broadcast_buffers=True`` broadcasts a BatchNorm's float buffers and its int64
``num_batches_tracked`` separately. On the root rank the observer has been seen to record the
second ``c10d::broadcast_`` as a child of the first (issue 8); the capture is edited into
exactly that shape on rank 0 only. The loader must keep both, pre-flight must pass, and the
trace must replay in full mode on 2 ranks; a real mismatch in compute mode is a warning in
``summary.json``.
"""
from __future__ import annotations

import json
import shutil

import pytest

from actors.errors import ConfigError
from actors.replay.config import ReplayConfig
from actors.trace import load_trace
from orchestrator.config import ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
from orchestrator.preflight.validate import preflight
from tests.support.bounds import CLUSTER_START_S
from tests.support.trace_factory import et_tail, run_rank_script

CAPTURE_TIMEOUT_S = 180
_DDP_CAPTURE = r'''
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist, torch.nn as nn
from torch.profiler import ExecutionTraceObserver

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=60))
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
model = nn.parallel.DistributedDataParallel(net, broadcast_buffers=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def step():
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
''' + et_tail(".et.json")


def _buffer_broadcasts(doc: dict) -> tuple[dict, dict]:
    """(float buffers broadcast, int64 num_batches_tracked broadcast): the int64 one and the
    float broadcast right before it."""
    calls = sorted((n for n in doc["nodes"] if n["name"] == "c10d::broadcast_"), key=lambda n: n["id"])
    second = next(n for n in calls if "long int" in n["inputs"]["types"][0])
    first = next(n for n in reversed(calls) if n["id"] < second["id"]
                 and "float" in n["inputs"]["types"][0])
    return first, second


@pytest.fixture(scope="module")
def ddp_traces(tmp_path_factory):
    """``captured/`` as recorded, ``nested/`` with rank 0 edited into the nested shape."""
    root = tmp_path_factory.mktemp("ddp_bn")
    captured = root / "captured"
    captured.mkdir()
    run_rank_script(_DDP_CAPTURE, captured, 2, "DDP capture", CAPTURE_TIMEOUT_S)
    nested = root / "nested"
    shutil.copytree(captured, nested)
    doc = json.loads((nested / "rank-0.et.json").read_text())
    first, second = _buffer_broadcasts(doc)
    second["ctrl_deps"] = first["id"]  # rank 0 only, as the observer recorded it
    (nested / "rank-0.et.json").write_text(json.dumps(doc))
    return captured, nested


def _broadcast_dtypes(trace) -> list[str]:
    return [op.collective.dtype for op in trace.collectives if op.collective.kind == "broadcast"]


def test_loader_keeps_both_buffer_broadcasts(ddp_traces):
    captured, nested = ddp_traces
    doc = json.loads((nested / "rank-0.et.json").read_text())
    first, second = _buffer_broadcasts(doc)
    assert second["ctrl_deps"] == first["id"]  # the shape under test
    for folder in ddp_traces:
        for rank in (0, 1):
            trace = load_trace(folder / f"rank-{rank}.et.json")
            dtypes = _broadcast_dtypes(trace)
            assert dtypes[-2:] == ["float32", "int64"], (folder.name, rank, dtypes)
            op = next(op for op in trace.collectives if op.collective.dtype == "int64")
            # BatchNorm1d(8) has one num_batches_tracked; its module is DDP's forward, not a
            # backend node's name
            assert op.collective.in_nelems == 1 and not op.module.startswith("gloo:")


def test_preflight_passes_on_the_nested_shape(ddp_traces):
    _, nested = ddp_traces
    for mode in ("full", "comms"):
        res = preflight(nested, 2, mode=mode, executor="inline")
        assert res.warnings == [] and res.num_collectives["0"] == len(
            [op for op in load_trace(nested / "rank-1.et.json").collectives])


def _mismatched(ddp_traces, tmp_path):
    """rank 1 broadcasts 2 elements of num_batches_tracked instead of 1: a real mismatch."""
    bad = tmp_path / "bad"
    shutil.copytree(ddp_traces[1], bad)
    doc = json.loads((bad / "rank-1.et.json").read_text())
    _, second = _buffer_broadcasts(doc)
    for side in ("inputs", "outputs"):
        second[side]["values"][0][0][3] = 2
        second[side]["shapes"][0][0] = [2]
    (bad / "rank-1.et.json").write_text(json.dumps(doc))
    return bad


def test_a_real_mismatch_is_still_refused_in_full_mode(ddp_traces, tmp_path):
    bad = _mismatched(ddp_traces, tmp_path)
    with pytest.raises(ConfigError, match=r"collective #\d+ differs between rank 0 .*'broadcast', 1, 1, "
                                          r"'int64'.* and rank 1 .*'broadcast', 2, 2, 'int64'"):
        preflight(bad, 2, mode="full", executor="inline")




def _cfg(trace_dir, **replay) -> RunConfig:
    return RunConfig(cluster=ClusterConfig(timeout_s=CLUSTER_START_S, num_cpus=4),
                     trace=TraceConfig(dir=str(trace_dir)),
                     replay=ReplayConfig(iters=2, warmup_iters=1, collective_timeout_s=20, **replay),
                     experiment=ExperimentConfig(replay_timeout_s=120, failure_grace_s=3))


@pytest.mark.slow
def test_nested_trace_replays_in_full_mode_on_two_ranks(ray_session, ddp_traces, tmp_path):
    from orchestrator.run.launch import run_replay

    _, nested = ddp_traces
    summary = run_replay(_cfg(nested, mode="full", device="cpu"), tmp_path)
    assert summary["status"] == "ok", summary["error"]
    assert summary["world_size"] == 2 and summary["trace_ranks"] == [0, 1]
    assert summary["preflight_warnings"] == []
    per_rank = len(_broadcast_dtypes(load_trace(nested / "rank-0.et.json")))
    # every broadcast of both ranks ran in each of the 3 iterations (warm-up included or not,
    # the count per rank is a multiple of the trace's broadcasts)
    for rank in summary["ranks"]:
        assert rank["status"] == "ok"
        assert rank["collectives"]["broadcast"]["num_calls"] % per_rank == 0
        assert rank["collectives"]["broadcast"]["num_calls"] >= 2 * per_rank


@pytest.mark.slow
def test_compute_mode_puts_the_mismatch_into_the_summary(ray_session, ddp_traces, tmp_path):
    from orchestrator.run.launch import run_replay

    bad = _mismatched(ddp_traces, tmp_path)
    summary = run_replay(_cfg(bad, mode="compute", device="meta"), tmp_path / "out")
    assert summary["status"] == "ok", summary["error"]
    (warning,) = summary["preflight_warnings"]
    assert "differs between rank 0" in warning and "replay.mode=compute replays no collective" in warning
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk["preflight_warnings"] == [warning]
