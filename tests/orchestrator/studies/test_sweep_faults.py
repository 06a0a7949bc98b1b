"""Faults during a sweep (``tracefleet --multirun``), end to end through the CLI:

- a Ray worker node killed in the middle of a point (two-node local cluster): that point is
  ``failed`` with a reason naming the node, and the sweep goes on; the next points run on the
  surviving node, or fail cleanly (bounded by ``cluster.timeout_s``) when they do not fit;
- the driver SIGKILLed in the middle of a point: the results tables stay whole, and the same
  command resumes, skipping the recorded point, re-running the lost one, and stopping what the
  killed driver's embedded Ray left running.

Every wait is on an observable event (a rank actor replaying, a row on disk), each bounded.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import orjson
import pandas as pd
import psutil
import pytest
from tests.support.bounds import CLUSTER_START_S, LOAD_MARGIN_S
from tests.support.ray_nodes import WORKER_IP, kill_node, ray_two_node_cluster, wait_for_title

from orchestrator.config import DEMO_TRACES, REPO_ROOT
from orchestrator.outputs import RESULTS_CSV, RESULTS_PARQUET, ROWS_DIR
from orchestrator.cluster.stale_cluster import RECORD_NAME
from tests.orchestrator.studies.test_sweep_cli import ENTRY, ray_temp  # noqa: F401 (fixture)

# whole sweeps through the CLI on clusters of their own, killed mid-point: CI's second job
pytestmark = [pytest.mark.slow, pytest.mark.long]

REPO = REPO_ROOT
REPLAYING = "ray::RankActor.replay"  # a rank actor's process title while it replays
LONG_ITERS = 100000  # a point that is still replaying whenever it is killed
DEMO = DEMO_TRACES / "gpt_zero3_leaf_2"  # the smallest demo world: 2 ranks


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0"}


def _table(root: Path) -> pd.DataFrame:
    return pd.read_csv(root / RESULTS_CSV)


@pytest.mark.parametrize("cpus_per_rank, after", [(1, "ok"), (2, "failed")],
                         ids=["next-point-fits-on-the-survivor", "next-point-cannot-be-placed"])
def test_worker_node_killed_mid_point(tmp_path, cpus_per_rank, after):
    """The 2-rank demo spread over head and worker node (2 CPUs each); the worker node dies
    while the first point replays. With 1 CPU per rank the next point fits on the head; with 2 it
    cannot be placed and fails as soon as Ray has marked the node dead, well before
    cluster.timeout_s, naming the dead node."""
    root = tmp_path / "sweep"
    with ray_two_node_cluster() as cluster:
        cmd = [*ENTRY, "--multirun", f"cluster.address={cluster.address}", f"trace.dir={DEMO}",
               "cluster.placement_strategy=SPREAD", f"cluster.cpus_per_rank={cpus_per_rank}",
               f"cluster.timeout_s={CLUSTER_START_S:g}", "cluster.log_to_driver=false",
               f"replay.iters={LONG_ITERS},1", "replay.warmup_iters=0",
               "experiment.replay_timeout_s=60", "experiment.failure_grace_s=5",
               "experiment.report=false", f"hydra.sweep.dir={root}"]
        log_path = tmp_path / "driver.log"
        with open(log_path, "wb") as log:
            driver = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # the driver starts its actors first: the suite's bound for that, on a busy machine
            wait_for_title(cluster.pids[1], REPLAYING, timeout_s=CLUSTER_START_S + LOAD_MARGIN_S,
                           alive=lambda: driver.poll() is None)
            killed_at = time.monotonic()
            kill_node(cluster, 1)
            # the killed point fails within its replay timeout and grace; a next point that
            # fits starts a new actor set (the cluster bound) and replays one iteration, one
            # that cannot be placed fails well before cluster.timeout_s
            after_kill_s = 60 + 5 + (CLUSTER_START_S if after == "ok" else LOAD_MARGIN_S)
            driver.wait(timeout=after_kill_s + LOAD_MARGIN_S)
            print(f"sweep ended {time.monotonic() - killed_at:.1f} s after the node was killed")
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait(timeout=30)
    out = log_path.read_text(errors="replace")
    assert driver.returncode == 1, out[-3000:]  # points failed; none was a user error
    table = _table(root).set_index("replay.iters")
    killed, nxt = table.loc[LONG_ITERS], table.loc[1]
    assert killed["status"] == "failed"
    # the reason starts with the lost node (the head's ranks' broken collectives come after):
    # its actors died at once; Ray may or may not have marked the node dead by then
    node = rf"Ray node {re.escape(WORKER_IP)} \(node id [0-9a-f]{{56}}\)"
    assert re.fullmatch(rf"the actors of rank\(s\) 1 died on {node}|{node} is dead: rank\(s\) 1 "
                        rf"ran there", killed["reason"].split(";")[0]), killed["reason"]
    ranks = orjson.loads((root / str(killed["run_dir"]) / "summary.json").read_bytes())["ranks"]
    assert [r["node_ip"] for r in ranks] == [cluster.head_ip, WORKER_IP]  # the dead rank's too
    assert nxt["status"] == after, nxt["reason"]
    if after == "ok":  # a new actor set, all on the surviving head node
        ranks = orjson.loads((root / str(nxt["run_dir"]) / "summary.json").read_bytes())["ranks"]
        assert {r["node_ip"] for r in ranks} == {cluster.head_ip}
        assert all(r["status"] == "ok" for r in ranks)
    else:  # refused once it cannot fit on what is left, naming the dead node
        assert "could not reserve 2 bundles of {'CPU': 2.0}" in nxt["reason"]
        assert "cannot fit on the alive node(s)" in nxt["reason"], nxt["reason"]
        assert f"dead node(s): {WORKER_IP} (node id " in nxt["reason"]
        assert nxt["point_s"] < 60


@pytest.mark.timeout(3000)  # two sweeps of two points, each bounded by point_s below
def test_driver_killed_mid_point_resumes_losing_only_that_point(tmp_path, ray_temp):  # noqa: F811
    """SIGKILL the driver (alone, as the OOM killer would) while the second point replays; the
    tables hold the first point whole; the same command skips it, re-runs the second, and
    stops the processes the killed driver's Ray left behind."""
    # one rank, operators only: the cheapest replay that still lasts seconds at 200 iterations
    # the sweep's own bounds: cluster and actors, one replay (200 iterations took over 120 s
    # beside two busy processes)
    start_s, replay_s = CLUSTER_START_S, 600
    cmd = [*ENTRY, "--multirun", "trace.ranks=[0]", "replay.mode=compute",
           "replay.iters=1,200", "replay.warmup_iters=0",
           f"cluster.temp_dir={ray_temp}", f"cluster.timeout_s={start_s}",
           f"experiment.replay_timeout_s={replay_s}", "experiment.report=false",
           "cluster.log_to_driver=false"]
    point_s = start_s + replay_s + LOAD_MARGIN_S  # one point, start to row, on a loaded machine
    with open(tmp_path / "first.log", "wb") as log:
        driver = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + point_s
        while not list(tmp_path.glob(f"multirun/*/{RESULTS_CSV}")):  # the first point's row
            assert driver.poll() is None and time.monotonic() < deadline, "no first row"
            time.sleep(0.2)
        wait_for_title(driver.pid, REPLAYING, timeout_s=start_s + LOAD_MARGIN_S,
                       alive=lambda: driver.poll() is None)
        (root,) = (tmp_path / "multirun").iterdir()
        record = orjson.loads((root / RECORD_NAME).read_bytes())
    finally:
        driver.kill()  # SIGKILL, the driver only: its Ray is left to fend for itself
        driver.wait(timeout=30)
    for table in (_table(root), pd.read_parquet(root / RESULTS_PARQUET)):
        assert list(table["replay.iters"]) == [1] and list(table["status"]) == ["ok"]
    first_finished = _table(root)["finished_at"][0]
    # what the killed driver's Ray left running (Ray 2.60: the raylet's agents outlive it)
    left = [e for e in record["processes"] if _running(e)]
    assert left, "expected processes of the killed driver's cluster to still run"

    try:
        resumed = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                                 timeout=point_s)
        survivors = [e for e in left if _running(e)]
    finally:  # whatever the resume did, nothing the killed driver started outlives the test
        for entry in record["processes"]:
            if _running(entry):
                psutil.Process(entry["pid"]).kill()
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert out.count("already recorded") == 1  # the first point is not run again
    assert "left running by the Ray cluster of a killed sweep" in out
    assert not survivors
    table = _table(root).set_index("replay.iters")
    assert list(table["status"]) == ["ok", "ok"] and table.loc[1, "finished_at"] == first_finished
    assert len(list((root / ROWS_DIR).glob("*.json"))) == 2
    assert not list(root.rglob("*.tmp")) and not (root / RECORD_NAME).exists()


def _running(entry: dict) -> bool:
    """Whether the recorded process still runs (same pid and start time)."""
    try:
        return abs(psutil.Process(entry["pid"]).create_time() - entry["create_time"]) < 0.01
    except psutil.Error:
        return False
