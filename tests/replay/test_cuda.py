"""GPU code paths: CUDA device selection, allocator stats, NCCL replay. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine, pick_device
from actors.trace import load_trace
from orchestrator.config import DEMO_TRACES
from tests.support.bounds import CLUSTER_START_S

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEMO = DEMO_TRACES / "gpt_dp_4"


def _engine(device="cuda", **alloc):
    cfg = ReplayConfig(mode="compute", device=device, iters=2, warmup_iters=1,
                       allocation=AllocationConfig(**alloc))
    return ReplayEngine(load_trace(DEMO / "rank-0.et.json.gz"), cfg)


def test_auto_picks_the_gpu():
    assert pick_device("auto").type == "cuda"


def test_compute_replay_on_cuda_reports_allocator_stats():
    report = _engine(mode="lazy").run().to_dict()
    assert report["status"] == "ok", report["error"]
    assert report["coverage"] == 1.0 and report["num_shape_mismatches"] == 0
    assert report["memory_measure_method"] == "cuda_allocator_stats"
    stats = report["memory_measure"]
    assert len(stats["allocated_peak_bytes_per_iteration"]) == 2  # every timed iteration
    # the caching allocator held at least the storages the replay accounted at its peak
    assert report["measured_peak_bytes"] == stats["allocated_peak_bytes"]
    assert stats["reserved_peak_bytes"] >= report["measured_peak_bytes"] >= report["accounted_peak_bytes"] > 0
    assert report["peak_memory_source"] == "measured"


def test_emulated_small_gpu_is_an_oom_result():
    cfg = ReplayConfig(mode="compute", device="cuda", device_memory_capacity="1MiB", iters=1,
                       warmup_iters=0, allocation=AllocationConfig(mode="lazy"))
    report = ReplayEngine(load_trace(DEMO / "rank-0.et.json.gz"), cfg).run().to_dict()
    assert report["status"] == "oom" and report["oom"]["node_id"] is not None


@pytest.mark.parametrize("mode", ["lazy", "pre_allocate"])
def test_allocator_model_predicts_max_memory_reserved(mode):
    """The caching allocator model fed by the replay's stream against the real allocator's
    ``max_memory_reserved`` of the same replay (reserved_model.py; 3% is the target)."""
    import os

    from actors.replay.memory.reserved_model import ReservedMemoryModel
    from actors.replay.memory.target import TargetConfig

    props = torch.cuda.get_device_properties(0)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG") or \
        (":4096:8" if props.major >= 9 else ":4096:2:16:8")  # PyTorch's defaults
    target = TargetConfig(name="custom", device_memory=str(props.total_memory),
                          cuda_context="0", nccl_num_peers=0, cublas_workspace_config=workspace)
    ext = ReservedMemoryModel(target)
    cfg = ReplayConfig(mode="compute", device="cuda", iters=2, warmup_iters=1,
                       measure_memory=False, allocation=AllocationConfig(mode=mode))
    engine = ReplayEngine(load_trace(DEMO / "rank-0.et.json.gz"), cfg, extensions=[ext])
    torch.cuda.synchronize()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # re-made inside the replay
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    report = engine.run().to_dict()
    assert report["status"] == "ok", report["error"]
    real = torch.cuda.max_memory_reserved() - before
    assert report["predicted_reserved_peak_bytes"] == pytest.approx(real, rel=0.03)
    assert report["predicted_allocated_peak_bytes"] <= report["predicted_reserved_peak_bytes"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_rank_nccl_replay(tmp_path):
    import ray

    from orchestrator.config import ClusterConfig, RunConfig, TraceConfig
    from orchestrator.run.launch import run_replay
    from tests.support.trace_factory import capture_ranks

    traces = capture_ranks(tmp_path / "tr", 2)
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, _temp_dir=str(tmp_path / "ray"))
    try:
        summary = run_replay(RunConfig(cluster=ClusterConfig(timeout_s=CLUSTER_START_S),
                                       trace=TraceConfig(dir=str(traces)),
                                       replay=ReplayConfig(device="cuda", iters=2)), tmp_path / "out")
    finally:
        ray.shutdown()
    assert summary["status"] == "ok", summary["error"]
    assert all(r["device"].startswith("cuda") for r in summary["ranks"])
    assert summary["collectives"]["all_reduce"]["num_calls"] > 0
    # one node: both ranks see both GPUs (NCCL peer-to-peer) and use different ones
    assert sorted(r["device"] for r in summary["ranks"]) == ["cuda:0", "cuda:1"]
