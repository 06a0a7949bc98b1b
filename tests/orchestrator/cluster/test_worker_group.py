"""WorkerGroup on an embedded local Ray: placement, rank env, gloo, failures, shutdown."""
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import ray
import torch.distributed as dist
from ray.exceptions import RayActorError
from tests.support.bounds import CLUSTER_START_S, LOAD_MARGIN_S
from tests.support.ray_nodes import GlooProbe

from actors.errors import ConfigError
from actors.rank_base import RankWorkerBase
from orchestrator.config import REPO_ROOT, ClusterConfig
from orchestrator.cluster.connect import connect
from orchestrator.errors import ClusterError
from orchestrator.cluster.node_state import lost_nodes
from orchestrator.run.session import ReplaySession
from orchestrator.cluster.rank_result import Result
from orchestrator.cluster.worker_group import WorkerGroup, rank_envs, rank_order, \
    shared_visible_devices

NUM_CPUS = 4

pytestmark = pytest.mark.slow  # actors on a local Ray, one group after another


@pytest.fixture(scope="module")
def cluster_cfg():
    temp_dir = tempfile.mkdtemp(prefix="tf-wg-", dir="/tmp")
    cfg = ClusterConfig(num_cpus=NUM_CPUS, temp_dir=temp_dir, timeout_s=CLUSTER_START_S,
                        log_to_driver=False)
    handle = connect(cfg, world_size=NUM_CPUS)
    try:
        yield cfg
    finally:
        handle.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# Run in a fresh interpreter: connect() reuses a Ray session this process may already have
# (another module's fixture), which would hide the unreachable address.
_UNREACHABLE = """
import socket, sys, time
import ray
from orchestrator.config import ClusterConfig
from orchestrator.cluster.connect import connect
from orchestrator.errors import ClusterError
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
    start = time.monotonic()
    try:
        connect(ClusterConfig(address=address), world_size=1)
    except ClusterError as e:
        print(f"{time.monotonic() - start:.3f} {ray.is_initialized()} {e}")
    else:
        sys.exit("connect() did not raise")
"""


def test_connect_rejects_bad_config_and_unreachable_address_fast():
    with pytest.raises(ConfigError, match="placement_strategy='BOGUS'"):
        connect(ClusterConfig(placement_strategy="BOGUS"), world_size=1)
    root = REPO_ROOT
    proc = subprocess.run([sys.executable, "-c", _UNREACHABLE], cwd=root, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    elapsed_s, initialized, message = proc.stdout.strip().splitlines()[-1].split(" ", 2)
    assert "no Ray cluster answers" in message
    assert float(elapsed_s) < 5 and initialized == "False"


@pytest.mark.parametrize("world_size", [2, 4])
def test_env_rank_order_gloo_all_reduce_and_shutdown(cluster_cfg, world_size):
    with WorkerGroup(GlooProbe, world_size, cluster_cfg) as group:
        node_ip = group.node_infos[0]["node_ip"]
        assert group.master_addr == node_ip
        assert len({info["pid"] for info in group.node_infos}) == world_size
        envs = group.run("env", timeout_s=30)
        for rank, result in enumerate(envs):
            assert result.ok, result.error
            assert result.value == {
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size), "NODE_RANK": "0",
                "MASTER_ADDR": node_ip, "MASTER_PORT": str(group.master_port)}
        sums = group.run("all_reduce", timeout_s=60)
        assert [r.kind for r in sums] == ["ok"] * world_size, [r.error for r in sums]
        assert {r.value for r in sums} == {world_size * (world_size + 1) / 2}
        last = group.workers[-1].__ray_call__.remote(repr)
        assert ray.get(last, timeout=30) == (
            f"GlooProbe(rank={world_size - 1}, world={world_size}, node={node_ip})")
        workers, pg = list(group.workers), group.placement_group
        assert ray.available_resources().get("CPU", 0) <= NUM_CPUS - world_size
    # Leaving the block shut the group down: actors gone, bundles freed.
    for worker in workers:
        with pytest.raises(RayActorError):
            ray.get(worker.ping.remote(), timeout=30)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    deadline = time.monotonic() + 15
    while ray.available_resources().get("CPU", 0) < NUM_CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == NUM_CPUS


def test_raising_rank_is_error_and_hanging_rank_is_timeout(cluster_cfg):
    with WorkerGroup(GlooProbe, 2, cluster_cfg) as group:
        results = group.run("misbehave", 1, "raise", timeout_s=30)
        assert [r.kind for r in results] == ["ok", "error"]
        assert results[0].value == 0
        assert results[1].error == "ValueError: rank 1 fails on purpose"
        start = time.monotonic()
        calls = []
        results = group.wait(group.execute_async("misbehave", 1, "hang"), timeout_s=3,
                             poll_s=0.5, on_progress=lambda *a: calls.append(a))
        assert [r.kind for r in results] == ["ok", "timeout"]
        assert results[1].error == "rank 1 did not finish within 3.0 s"
        assert 3 <= time.monotonic() - start < 3 + LOAD_MARGIN_S
        assert calls[-1][:2] == (1, 2)
        group.shutdown(graceful_timeout_s=1)


def test_dead_actor_is_died_and_its_blocked_peer_aborted(cluster_cfg):
    with WorkerGroup(GlooProbe, 2, cluster_cfg) as group:
        start = time.monotonic()
        # Rank 0 waits in a collective that rank 1 never joins.
        refs = group.execute_async("misbehave", 1, "exit", then_all_reduce=True)
        results = group.wait(refs, timeout_s=60, poll_s=0.2, failure_grace_s=1)
        assert [r.kind for r in results] == ["aborted", "died"]
        assert results[1].error.startswith("rank 1 actor died")
        assert "1.0 s after rank 1 failed (died)" in results[0].error
        assert time.monotonic() - start < 1 + LOAD_MARGIN_S  # failure_grace_s=1
        group.shutdown(graceful_timeout_s=1)


def test_unsatisfiable_placement_raises_cluster_error_at_once(cluster_cfg):
    """Bundles larger than the alive nodes fail as soon as that is seen, not at the timeout."""
    cfg = dataclasses.replace(cluster_cfg, cpus_per_rank=float(NUM_CPUS), timeout_s=600.0)
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"2 bundles of \{'CPU': 4.0\}.*cannot fit on the "
                                           r"alive node\(s\) \(\S+ \{'CPU': 4.0\}\).*of "
                                           r"cluster.timeout_s=600.0 s"):
        WorkerGroup(GlooProbe, 2, cfg).start()
    assert time.monotonic() - start < LOAD_MARGIN_S  # at once: far below the 600 s bound
    states = {pg["state"] for pg in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}


class _NoNodeInfo(GlooProbe):
    """An actor that cannot say where it runs (a broken rank class, a node without its GPU)."""

    def node_info(self) -> dict:
        raise ValueError("no device visible on this node")


def test_an_actor_failing_at_start_is_a_cluster_error_naming_its_cause(cluster_cfg):
    """The group's own calls (start, setup) name the actor's exception, not Ray's wrapper
    (it was a NameError from inside the error path)."""
    with pytest.raises(ClusterError, match=r"rank actors failed to start: ValueError: no "
                                           r"device visible on this node"):
        WorkerGroup(_NoNodeInfo, 2, cluster_cfg).start()
    states = {pg["state"] for pg in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}


def test_placement_that_fits_but_is_busy_waits_out_the_timeout(cluster_cfg):
    """Bundles that fit the cluster but not its free resources wait (the holder may finish)."""
    with WorkerGroup(GlooProbe, NUM_CPUS, cluster_cfg):
        cfg = dataclasses.replace(cluster_cfg, timeout_s=3.0)
        start = time.monotonic()
        with pytest.raises(ClusterError, match=r"1 bundles of \{'CPU': 1.0\}.*within 3.0 s: "
                                               r"the cluster has \{'CPU': 4.0\} in total"):
            WorkerGroup(GlooProbe, 1, cfg).start()
        assert 3.0 <= time.monotonic() - start < 3.0 + LOAD_MARGIN_S


def test_rank_order_puts_driver_node_first_then_ip_then_gpu():
    infos = [
        {"node_id": "b", "node_ip": "10.0.0.10", "gpu_ids": ["1"]},
        {"node_id": "c", "node_ip": "10.0.0.9", "gpu_ids": ["0"]},
        {"node_id": "b", "node_ip": "10.0.0.10", "gpu_ids": ["0"]},
        {"node_id": "d", "node_ip": "10.0.0.99", "gpu_ids": ["0"]},
        {"node_id": "c", "node_ip": "10.0.0.9", "gpu_ids": ["1"]},
    ]
    order = rank_order(infos, first_node_id="d")
    assert order == [3, 1, 4, 2, 0]
    envs = rank_envs([infos[i] for i in order])
    assert [(e["node_rank"], e["local_rank"], e["local_world_size"]) for e in envs] == [
        (0, 0, 1), (1, 0, 2), (1, 1, 2), (2, 0, 2), (2, 1, 2)]
    assert {e["world_size"] for e in envs} == {5}


def test_rank_base_setup_exports_env_and_shutdown_destroys_group(monkeypatch, tmp_path):
    for key in GlooProbe.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    worker = RankWorkerBase()
    worker.setup(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                 master_addr="127.0.0.1", master_port=worker.find_free_port())
    assert os.environ["WORLD_SIZE"] == "1" and os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    worker.shutdown()
    assert not dist.is_initialized()
    assert repr(worker) == "RankWorkerBase(rank=0, world=1, node=None)"


def test_gpu_ranks_share_their_nodes_visible_devices():
    """Ray Train's share_cuda_visible_devices: every GPU of the node visible to each rank,
    each rank's device index pointing at its own GPU."""
    infos = [{"node_id": "a", "gpu_ids": ["3"]}, {"node_id": "a", "gpu_ids": ["1"]},
             {"node_id": "b", "gpu_ids": ["0"]}, {"node_id": "a", "gpu_ids": ["10"]}]
    shared = shared_visible_devices(infos)
    assert [d["cuda_visible_devices"] for d in shared] == ["1,3,10", "1,3,10", "0", "1,3,10"]
    assert [d["device_index"] for d in shared] == [1, 0, 0, 2]


def test_session_replaces_kept_actors_when_one_died_between_replays(cluster_cfg):
    """A kept actor set with a dead member (its node lost while idle between sweep points) is
    found unusable when re-wired for the next replay, and a new set is started."""
    session = ReplaySession()
    try:
        group = session.worker_group(GlooProbe, 2, cluster_cfg, use_gpu=False)
        clean = [Result(rank, "ok", {"status": "ok"}) for rank in range(2)]
        session.release(group, clean, timeout_s=10)
        assert session.worker_group(GlooProbe, 2, cluster_cfg, use_gpu=False) is group
        session.release(group, clean, timeout_s=10)
        ray.kill(group.workers[1], no_restart=True)
        again = session.worker_group(GlooProbe, 2, cluster_cfg, use_gpu=False)
        assert again is not group and not group.workers  # the old set was shut down
        sums = again.run("all_reduce", timeout_s=60)
        assert [r.value for r in sums] == [3.0, 3.0], [r.error for r in sums]
    finally:
        session.close()


def test_lost_nodes_names_the_node_of_dead_actors_only(cluster_cfg):
    """The run-level reason: nodes where an actor died, with their ranks; none when the ranks
    only failed (their node is alive and no actor died)."""
    ip, node = "10.0.0.7", "ab" * 28
    died = [Result(0, "ok", {"status": "ok"}, node_ip="10.0.0.1", node_id="cd" * 28),
            Result(1, "died", error="rank 1 actor died", node_ip=ip, node_id=node),
            Result(2, "aborted", node_ip=ip, node_id=node),
            Result(3, "died", error="rank 3 actor died", node_ip=ip, node_id=node)]
    assert lost_nodes(died) == f"the actors of rank(s) 1, 3 died on Ray node {ip} (node id {node})"
    assert lost_nodes([Result(0, "error", node_ip=ip, node_id=node), Result(1, "timeout")]) is None


def test_a_signal_mid_wait_leaves_with_the_ranks_done_so_far(monkeypatch):
    """No Ray: ray.wait hands rank 1's result back, then a signal arrives in it."""
    from orchestrator.cluster import worker_group as wg
    from orchestrator.cluster.rank_result import Outcome

    group = WorkerGroup(RankWorkerBase, 3, ClusterConfig())
    group.node_infos = [{"node_ip": "10.0.0.1", "node_id": "n"}] * 3
    calls = []

    def fake_wait(refs, num_returns, timeout):
        calls.append(len(refs))
        if len(calls) == 1:
            return ["ref1"], []
        raise KeyboardInterrupt()

    monkeypatch.setattr(wg.ray, "wait", fake_wait)
    monkeypatch.setattr(wg, "outcome",
                        lambda rank, ref: Result(rank, Outcome.ok, value={"r": rank}))
    with pytest.raises(KeyboardInterrupt) as err:
        group.wait(["ref0", "ref1", "ref2"], timeout_s=60, poll_s=0.01)
    results = err.value.results
    assert [r.kind for r in results] == [Outcome.interrupted, Outcome.ok, Outcome.interrupted]
    assert results[1].value == {"r": 1} and results[0].node_ip == "10.0.0.1"
    assert results[2].error == "rank 2 still running when the driver was interrupted"
