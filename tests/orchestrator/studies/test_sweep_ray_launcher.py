"""Sweep points in parallel with hydra/launcher=ray: on a Ray it starts, and on a running
cluster joined through conf/hydra/launcher/ray_cluster.yaml (object_store_memory=null)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import psutil
import pytest

from orchestrator.config import REPO_ROOT
from orchestrator.outputs import RESULTS_CSV
from tests.support.chain_trace import TENSOR_BYTES, capture_chain
from tests.support.ray_nodes import ray_two_node_cluster
from tests.support.bounds import CLUSTER_START_S

# whole sweeps through the CLI on Ray's launcher (a local and a joined cluster): CI's second job
pytestmark = [pytest.mark.slow, pytest.mark.long]

ENTRY = [sys.executable, "-c", "from orchestrator.cli.main import main; main()"]
REPO = REPO_ROOT


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory):
    """A one-rank trace folder: meta-device points take well under a second each."""
    return capture_chain(tmp_path_factory.mktemp("chain") / "rank-0.et.json").parent


def _points(trace_dir, sweep_dir) -> list[str]:
    # lazy needs 3 tensors at once: 2 of them is an OOM, 4 fits
    return ["--multirun", f"trace.dir={trace_dir}", "replay=dry_run", "replay.iters=1",
            f"replay.device_memory_capacity={2 * TENSOR_BYTES},{4 * TENSOR_BYTES}",
            f"hydra.sweep.dir={sweep_dir}", "experiment.report=false", f"cluster.timeout_s={CLUSTER_START_S:g}"]


def _check(proc, sweep_dir: Path):
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    table = pd.read_csv(sweep_dir / RESULTS_CSV)
    assert sorted(table["status"]) == ["ok", "oom"]
    # each point ran in its own Ray task (the launcher's), not in the launching process
    assert "_run_job pid=" in proc.stdout + proc.stderr


def test_ray_launcher_on_a_local_ray(chain_dir, tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="tfl", dir="/tmp")
    try:
        proc = subprocess.run(
            [*ENTRY, *_points(chain_dir, tmp_path / "sweep"), "hydra/launcher=ray",
             "+hydra.launcher.ray.init.num_cpus=4", "+hydra.launcher.ray.init.include_dashboard=false",
             f"+hydra.launcher.ray.init._temp_dir={ray_tmp}"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
            text=True, timeout=240)
        _check(proc, tmp_path / "sweep")
    finally:
        for p in psutil.process_iter(["cmdline"]):  # Ray processes of this test's own session
            try:
                if any(ray_tmp in part for part in p.info["cmdline"] or []):
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_ray_launcher_joins_a_running_cluster(chain_dir, tmp_path):
    with ray_two_node_cluster(num_cpus_per_node=2) as cluster:
        env = {**os.environ, **cluster.env, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [*ENTRY, *_points(chain_dir, tmp_path / "sweep"), "hydra/launcher=ray_cluster",
             f"hydra.launcher.ray.init.address={cluster.address}", "cluster=existing",
             f"cluster.address={cluster.address}"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    _check(proc, tmp_path / "sweep")
