"""`tracefleet --multirun` end to end: every point recorded (OOM and refused ones included),
the exit code, the cluster kept across points, resume, and a sweep killed mid-way keeping its
finished rows."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pandas as pd
import psutil
import pytest

from orchestrator.config import REPO_ROOT
from orchestrator.outputs import RESULTS_CSV, RESULTS_PARQUET, ROWS_DIR
from tests.support.chain_trace import TENSOR_BYTES, capture_chain
from tests.support.bounds import CLUSTER_START_S

pytestmark = [pytest.mark.slow, pytest.mark.long]  # whole sweeps: CI's second job

ENTRY = [sys.executable, "-c", "from orchestrator.cli.main import main; main()"]
REPO = REPO_ROOT
# faithful (the default) holds the demo's 8 MiB of parameters before the first op: 1MiB is an OOM
# before any collective, 1GiB fits.
SWEEP = ["--multirun", "replay.device_memory_capacity=1MiB,1GiB", "replay.warmup_iters=0",
         f"cluster.timeout_s={CLUSTER_START_S:g}", "experiment.replay_timeout_s=120"]


@pytest.fixture
def ray_temp():
    """A short Ray temp dir of this test's own (socket paths are limited to ~107 bytes); any
    Ray process still using it at the end was started by this test and is ended by PID."""
    path = tempfile.mkdtemp(prefix="tfs", dir="/tmp")
    yield path
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(path in part for part in proc.info["cmdline"] or []):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    shutil.rmtree(path, ignore_errors=True)


def _cmd(ray_temp, *extra):
    return [*ENTRY, *SWEEP, f"cluster.temp_dir={ray_temp}", *extra]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0"}


def _sweep_root(cwd: Path) -> Path:
    (root,) = (cwd / "multirun").iterdir()
    return root


def test_multirun_records_every_point_and_resumes(tmp_path, ray_temp):
    cmd = _cmd(ray_temp, "replay.iters=1")
    first = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert first.returncode == 1, first.stderr[-3000:]  # one point is OOM: not all ok
    root = _sweep_root(tmp_path)
    table = pd.read_csv(root / RESULTS_CSV)
    assert len(table) == len(pd.read_parquet(root / RESULTS_PARQUET)) == 2
    by_capacity = table.set_index("replay.device_memory_capacity")
    assert by_capacity.loc["1MiB", "status"] == "oom" and "oom" in by_capacity.loc["1MiB", "reason"]
    assert by_capacity.loc["1GiB", "status"] == "ok" and pd.isna(by_capacity.loc["1GiB", "reason"])
    assert by_capacity.loc["1GiB", "iteration_time_s"] > 0
    assert (root / "report.html").stat().st_size > 10_000
    # the second point ran on the first one's cluster and actors: no start-up paid again
    second = orjson.loads((root / str(by_capacity.loc["1GiB", "run_dir"]) / "summary.json").read_bytes())
    assert second["timings_s"]["cluster_start_s"] < 0.5 and second["timings_s"]["actor_start_s"] < 2.0
    # ... and its ranks reused the traces they had parsed for the first point
    first_run = orjson.loads((root / str(by_capacity.loc["1MiB", "run_dir"]) / "summary.json").read_bytes())
    load_s = [max(r["timings_s"]["trace_load_s"] for r in s["ranks"]) for s in (first_run, second)]
    assert load_s[1] < 0.2 * load_s[0], load_s
    finished = sorted(table["finished_at"])

    again = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert again.returncode == 1, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("already recorded") == 2
    assert _sweep_root(tmp_path) == root  # same command, same root
    table = pd.read_csv(root / RESULTS_CSV)
    assert sorted(table["finished_at"]) == finished  # nothing ran again


def test_killed_sweep_keeps_its_finished_rows(tmp_path, ray_temp):
    # the OOM point ends at once; the next one replays for minutes and is killed
    proc = subprocess.Popen(_cmd(ray_temp, "replay.iters=100000", "experiment.report=false"),
                            cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        rows = []
        while time.monotonic() < deadline and not rows and proc.poll() is None:
            time.sleep(0.5)
            if (tmp_path / "multirun").is_dir():
                rows = list((_sweep_root(tmp_path) / ROWS_DIR).glob("*.json"))
        assert rows, "the first point's row never appeared"
        time.sleep(2)  # well into the second point
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    root = _sweep_root(tmp_path)
    for table in (pd.read_csv(root / RESULTS_CSV), pd.read_parquet(root / RESULTS_PARQUET)):
        assert list(table["status"]) == ["oom"]
        assert list(table["replay.device_memory_capacity"]) == ["1MiB"]


def test_a_refused_point_is_recorded_and_the_sweep_exits_2(tmp_path, ray_temp):
    """pre_allocate never flushes, so threshold 0.5 is a config error for it alone: that point
    is an 'invalid' row naming the key, the lazy point still runs, the exit code is 2."""
    trace_dir = capture_chain(tmp_path / "rank-0.et.json").parent
    cmd = [*ENTRY, "--multirun", f"trace.dir={trace_dir}", "replay=dry_run", "replay.iters=1",
           "replay.device_memory_capacity=1MiB", "replay.allocation.device_memory_threshold=0.5",
           "replay.allocation.mode=pre_allocate,lazy", f"cluster.temp_dir={ray_temp}",
           "experiment.report=false", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    table = pd.read_csv(tmp_path / "sweep" / RESULTS_CSV).set_index("replay.allocation.mode")
    assert table.loc["pre_allocate", "status"] == "invalid"
    assert "device_memory_threshold" in table.loc["pre_allocate", "reason"]
    assert table.loc["lazy", "status"] == "ok"
    assert "tracefleet: error: point #0" in proc.stderr


def test_min_memory_run_finds_the_known_answer_on_one_cluster(tmp_path, ray_temp):
    """experiment=min_memory through the CLI and Ray: the hand-computed capacities (see
    tests/support/chain_trace.py), every probe after the first on the same cluster and actors."""
    trace_dir = capture_chain(tmp_path / "rank-0.et.json").parent
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*ENTRY, "experiment=min_memory", f"trace.dir={trace_dir}", f"hydra.run.dir={run_dir}",
         "experiment.min_memory.allocation_modes=[lazy,pre_allocate]",
         "experiment.min_memory.tolerance=0", "experiment.min_memory.tolerance_bytes=1",
         f"cluster.temp_dir={ray_temp}"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(run_dir / RESULTS_CSV)
    answers = table[table["kind"] == "min_memory"].set_index("replay.allocation.mode")
    assert answers.loc["lazy", "min_capacity_bytes"] == 3 * TENSOR_BYTES
    assert answers.loc["pre_allocate", "min_capacity_bytes"] == 4 * TENSOR_BYTES
    assert answers.loc["pre_allocate", "max_failing_capacity_bytes"] == 4 * TENSOR_BYTES - 1
    probes = table[table["kind"] == "probe"]
    # without a threshold a replay fits iff its peak does: the reference (and one probe below
    # its peak) settle each search (tests/orchestrator/studies/test_min_memory.py covers the bisection itself)
    assert len(probes) == answers["num_steps"].sum() <= 4
    timings = [orjson.loads((run_dir / d / "summary.json").read_bytes())["timings_s"]
               for d in probes["run_dir"]]
    assert all(t["cluster_start_s"] < 0.5 and t["actor_start_s"] < 2.0 for t in timings[1:])
    assert (run_dir / "report.html").stat().st_size > 10_000
    assert "min_memory lazy threshold 1: 12288 B" in proc.stdout


def test_resume_names_a_cut_row_and_runs_its_point_again(tmp_path):
    """A row file cut short (a disk that filled) is named in a warning, its point runs again
    and its row is whole afterwards; the intact point is skipped as recorded. Pre-flight-only
    points: no Ray."""
    cmd = [*ENTRY, "--multirun", "experiment.preflight_only=true", "experiment.name=a,b",
           "experiment.report=false"]
    first = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    root = _sweep_root(tmp_path)
    rows = {orjson.loads(p.read_bytes())["experiment.name"]: p
            for p in (root / ROWS_DIR).glob("*.json")}
    cut = rows["b"]
    cut.write_bytes(cut.read_bytes()[:50])
    again = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=240)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "Traceback" not in out and out.count("already recorded") == 1
    assert f"skipped {cut}: a results row that is not valid JSON (cut short" in out
    assert orjson.loads(cut.read_bytes())["status"] == "ok"  # run again, written whole
    assert sorted(pd.read_csv(root / RESULTS_CSV)["experiment.name"]) == ["a", "b"]
