"""A worker group across two Ray nodes (head + a worker node on 127.0.0.2) from `ray start`."""
import pytest
from ray_nodes import WORKER_IP, GlooProbe, two_node_cluster  # noqa: F401 (fixture)

from orchestrator.cluster import ClusterConfig, connect
from orchestrator.worker_group import WorkerGroup

pytestmark = pytest.mark.slow


def test_four_ranks_spread_over_two_nodes_all_reduce(two_node_cluster):
    cfg = ClusterConfig(address=two_node_cluster.address, placement_strategy="SPREAD",
                        timeout_s=60.0, log_to_driver=False)
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
