"""ZeRO-3 through tracefleet's Ray path on the two-node local cluster: a leaf_coalesced replay of
the 4-rank demo with two ranks per node (every all-gather and the gradients' reduce-scatter run
on the world group, so they cross nodes), and the DeepSpeed-recorded demo traces still
replaying with strategy=none."""
import json
import sys

import pytest
import ray.cloudpickle
from tests.support.ray_nodes import WORKER_IP, two_node_cluster  # noqa: F401 (fixture)

from actors.replay.config import ReplayConfig
from actors.zero3.config import Zero3Config
from orchestrator.config import DEMO_TRACES, ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
from orchestrator.run.launch import run_replay
from tests.support.bounds import CLUSTER_START_S

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _run(cluster, folder, tmp_path, zero3: Zero3Config):
    cfg = RunConfig(
        cluster=ClusterConfig(address=cluster.address, placement_strategy="SPREAD",
                              timeout_s=CLUSTER_START_S, log_to_driver=False),
        trace=TraceConfig(dir=str(DEMO_TRACES / folder)),
        replay=ReplayConfig(iters=2, warmup_iters=0, collective_timeout_s=30),
        zero3=zero3, experiment=ExperimentConfig(replay_timeout_s=90, failure_grace_s=5))
    return run_replay(cfg, tmp_path)


def test_leaf_coalesced_across_two_nodes(two_node_cluster, tmp_path):
    meta = json.loads((DEMO_TRACES / "gpt_dp_4" / "meta.json").read_text())
    summary = _run(two_node_cluster, "gpt_dp_4", tmp_path,
                   Zero3Config(strategy="leaf_coalesced", leaf_modules=["blocks.*"],
                               param_persistence_threshold=0))
    assert summary["status"] == "ok", summary["error"]
    ranks = summary["ranks"]
    assert [r["node_ip"] for r in ranks] == [two_node_cluster.head_ip] * 2 + [WORKER_IP] * 2
    assert len({r["node_id"] for r in ranks}) == 2
    z = summary["zero3"]
    assert z["strategy"] == "leaf_coalesced" and z["world_size"] == 4 and not z["emulated"]
    assert z["leaf_modules"] == [f"blocks.{i}" for i in range(meta["workload"]["n_layers"])]
    # fetch units: two embeddings, the blocks (leaves), the final norm and the head; each
    # gathered in forward and in backward
    assert z["num_allgathers_per_iteration"] == 2 * (4 + meta["workload"]["n_layers"])
    assert z["shard_bytes"] * 4 >= 4 * meta["num_params"]  # a quarter each, padding included
    assert z["wait_s"] > 0 and z["fetch_host_s"] > 0 and z["release_host_s"] > 0
    # gradients reduce-scattered over the world group (one bucket holds this small model's),
    # a quarter of each kept, as of AdamW's two states
    assert z["num_reduce_scatters_per_iteration"] == 1 and z["reduce_scatter_s"] > 0
    assert z["grad_shard_bytes"] == z["shard_bytes"]
    # AdamW's two states and DeepSpeed's fp32 master copy of the partition (zero3.layout=deepspeed)
    assert z["optimizer_state_bytes"] == 3 * z["shard_bytes"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["zero3"]["num_allgathers_per_iteration"] == z["num_allgathers_per_iteration"]


@pytest.mark.parametrize("folder", ["gpt_zero3_2", "gpt_zero3_leaf_2"])
def test_deepspeed_traces_replay_with_strategy_none(two_node_cluster, tmp_path, folder):
    summary = _run(two_node_cluster, folder, tmp_path, Zero3Config())
    assert summary["status"] == "ok", summary["error"]
    assert summary["coverage"] == 1.0 and summary["zero3"] is None
    assert summary["collectives"]["all_gather_into_tensor"]["num_calls"] > 0


def test_hpz_keeps_backward_gathers_inside_each_node(two_node_cluster, tmp_path):
    summary = _run(two_node_cluster, "gpt_dp_4", tmp_path,
                   Zero3Config(strategy="leaf_coalesced", leaf_modules=["blocks.*"],
                               param_persistence_threshold=0, hpz_partition_size=2))
    assert summary["status"] == "ok", summary["error"]
    z = summary["zero3"]
    # ranks 0-1 on the head, 2-3 on the worker: groups of 2 consecutive ranks are the nodes;
    # every backward fetch found its node-local shards from the forward release
    assert z["hpz_partition_size"] == 2
    assert z["num_allgathers_intra_group_per_iteration"] * 2 == z["num_allgathers_per_iteration"]
    assert z["hpz_secondary_peak_bytes"] > z["shard_bytes"]  # 1/2 of each unit vs 1/4
