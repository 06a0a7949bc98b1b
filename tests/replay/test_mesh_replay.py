"""Mesh jobs captured on fake, replayed on 4 CPU ranks with gloo: tensor parallel's
functional collectives beside FSDP2's c10d ones on their own sub-groups, context parallel's
ring (all-gather and all-to-all on the cp group), pipeline stages' sends and receives."""
from __future__ import annotations

import pytest
import ray

from actors.capture.workloads.config import WorkloadConfig
from actors.replay.config import AllocationConfig, ReplayConfig
from orchestrator.config import ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
from orchestrator.run.capture import CaptureConfig, run_capture_job
from orchestrator.run.launch import run_replay
from tests.support.bounds import CLUSTER_START_S

pytestmark = pytest.mark.slow

TINY = dict(model="llama", parallel="fsdp2", precision="bf16_mixed", device="fake", vocab=64,
            d_model=64, n_layers=2, n_heads=4, seq_len=32, batch_size=2)


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()


@pytest.mark.parametrize("parallelism, kinds", [
    ({"tp": 2}, {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}),
    ({"cp": 2}, {"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}),
    ({"pp": 2}, {"all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv"}),
])
def test_mesh_traces_replay_on_gloo(ray_session, tmp_path, parallelism, kinds):
    traces = tmp_path / "traces"
    run_capture_job(CaptureConfig(workload=WorkloadConfig(**TINY, parallelism=parallelism),
                                  world_size=4, out_dir=str(traces)))
    cfg = RunConfig(cluster=ClusterConfig(timeout_s=CLUSTER_START_S), trace=TraceConfig(dir=str(traces)),
                    replay=ReplayConfig(iters=1, collective_timeout_s=30,
                                        allocation=AllocationConfig(mode="lazy")),
                    experiment=ExperimentConfig(replay_timeout_s=300, failure_grace_s=3))
    summary = run_replay(cfg, tmp_path / "run")
    assert summary["status"] == "ok", summary["error"]
    assert all(r["status"] == "ok" and r["coverage"] == 1.0 for r in summary["ranks"])
    assert kinds <= set(summary["collectives"])
