"""Across two Ray nodes (head + a worker node on 127.0.0.2, from `ray start`): a worker group's
gloo all-reduce, and the demo trace replayed end to end with ranks on both nodes."""
import dataclasses
import sys
from collections import Counter
from pathlib import Path

import pytest
import ray.cloudpickle
from tests.support.ray_nodes import WORKER_IP, GlooProbe, two_node_cluster  # noqa: F401 (fixture)

from actors.rank_actor import RankActor
from actors.replay.config import ReplayConfig
from actors.trace import load_trace
from orchestrator.config import DEMO_TRACES, ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
from orchestrator.cluster.connect import connect
from orchestrator.run.launch import run_replay
from orchestrator.cluster.worker_group import WorkerGroup
from tests.support.bounds import CLUSTER_START_S

pytestmark = pytest.mark.slow

DEMO_DIR = DEMO_TRACES / "gpt_dp_4"
# Ray workers cannot import modules under tests/: ship this one's classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_four_ranks_spread_over_two_nodes_all_reduce(two_node_cluster):
    cfg = ClusterConfig(address=two_node_cluster.address, placement_strategy="SPREAD",
                        timeout_s=CLUSTER_START_S, log_to_driver=False)
    handle = connect(cfg, world_size=4)
    try:
        assert not handle.started_ray
        with WorkerGroup(GlooProbe, 4, cfg) as group:
            ips = [info["node_ip"] for info in group.node_infos]
            # The driver runs on the head's machine, so the head's ranks come first.
            assert ips == [two_node_cluster.head_ip] * 2 + [WORKER_IP] * 2
            envs = [r.value for r in group.run("env", timeout_s=30)]
            assert [(e["RANK"], e["NODE_RANK"], e["LOCAL_RANK"]) for e in envs] == [
                ("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
            assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
            assert {e["MASTER_ADDR"] for e in envs} == {two_node_cluster.head_ip}
            sums = group.run("all_reduce", timeout_s=60)
            assert [r.kind for r in sums] == ["ok"] * 4, [r.error for r in sums]
            assert {r.value for r in sums} == {10.0}
    finally:
        handle.shutdown()


class BytesOnlyRank(RankActor):
    """Gets its trace only through the object store: the path it is given does not exist."""

    def replay(self, request):
        missing = Path("/nonexistent-tracefleet") / Path(request.trace_path).name
        return super().replay(dataclasses.replace(request, trace_path=str(missing)))


@pytest.mark.parametrize("transfer,actor_cls", [("path", RankActor),
                                                ("object_store", BytesOnlyRank)])
def test_demo_replay_spread_over_two_nodes(two_node_cluster, tmp_path, transfer, actor_cls):
    cfg = RunConfig(
        cluster=ClusterConfig(address=two_node_cluster.address, placement_strategy="SPREAD",
                              timeout_s=CLUSTER_START_S, log_to_driver=False),
        trace=TraceConfig(dir=str(DEMO_DIR), transfer=transfer),
        replay=ReplayConfig(iters=2, warmup_iters=0, collective_timeout_s=30),
        experiment=ExperimentConfig(replay_timeout_s=60, failure_grace_s=5))
    summary = run_replay(cfg, tmp_path, actor_cls=actor_cls)
    assert summary["status"] == "ok", summary["error"]
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["node_ip"] for r in ranks] == [two_node_cluster.head_ip] * 2 + [WORKER_IP] * 2
    node_ids = [r["node_id"] for r in ranks]
    assert node_ids[0] == node_ids[1] != node_ids[2] == node_ids[3]
    assert summary["coverage"] == 1.0 and all(r["coverage"] == 1.0 for r in ranks)
    for rank in ranks:  # every recorded collective ran once per iteration, across the nodes
        trace = load_trace(DEMO_DIR / f"rank-{rank['rank']}.et.json.gz", rank["rank"])
        expected = Counter(op.collective.kind for op in trace.collectives)
        assert expected, "the demo trace has collectives"
        got = {kind: c["num_calls"] for kind, c in rank["collectives"].items()}
        assert got == {kind: 2 * n for kind, n in expected.items()}
    assert summary["collectives"]["all_reduce"]["busbw_gbps"] > 0
