"""SIGINT (Ctrl-C: the whole process group) and SIGTERM (the driver alone) mid-replay: the run
stops within a bound, writes ``summary.json`` with status ``interrupted``, prints one line,
exits 130 / 143, and every process it started (Ray's GCS, raylet, dashboard and runtime-env
agents, the rank actors) is gone. Each test starts a real embedded Ray (~40 s here)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from tests.support.bounds import CLUSTER_START_S, LOAD_MARGIN_S

from orchestrator.config import DEMO_TRACES

ENTRY = [sys.executable, "-c", "from orchestrator.cli.main import main; main()"]
# Ray's node start and the 2 actors' start, bounded by cluster.timeout_s (the suite's
# CLUSTER_START_S), within pytest's 900 s: beside two busy processes Ray's node missed its own
# 30 s start bound twice, and the run ended before its ranks started
START_TIMEOUT_S = CLUSTER_START_S + LOAD_MARGIN_S
STOP_BOUND_S = 30  # the run must be gone this soon after the signal
GONE_GRACE_S = 5  # Ray's processes exit moments after the driver


def _wait_for(log_path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log_path.read_text(errors="replace"):
            return
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} within {timeout_s} s:\n"
                         + log_path.read_text(errors="replace")[-3000:])


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signum, to_group, code", [(signal.SIGINT, True, 130),
                                                     (signal.SIGTERM, False, 143)])
@pytest.mark.long
def test_signal_mid_replay_stops_everything(tmp_path, signum, to_group, code):
    run_dir, log_path = tmp_path / "run", tmp_path / "out.log"
    ray_dir = tempfile.mkdtemp(prefix="tf-sig-", dir="/tmp")  # Ray's socket paths are short
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            # the smallest demo: two rank actors, each replaying until it is stopped
            [*ENTRY, f"trace.dir={DEMO_TRACES / 'gpt_zero3_leaf_2'}", f"hydra.run.dir={run_dir}",
             f"cluster.temp_dir={ray_dir}",
             f"cluster.timeout_s={CLUSTER_START_S:g}", "replay.iters=100000",
             "experiment.replay_timeout_s=600"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()})
    started: list[psutil.Process] = []
    try:
        _wait_for(log_path, "worker group of 2 ranks", proc, START_TIMEOUT_S)
        time.sleep(2)  # the ranks are replaying now
        started = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in _alive(started)}
        assert "raylet" in names and any("RankActor" in n for n in names), names
        t0 = time.monotonic()
        if to_group:  # what a terminal's Ctrl-C does
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        rc = proc.wait(STOP_BOUND_S)
        took_s = time.monotonic() - t0
        deadline = time.monotonic() + GONE_GRACE_S
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p.pid, p.name()) for p in _alive(started)]
        out = log_path.read_text(errors="replace")
        assert rc == code, out[-3000:]
        assert took_s < STOP_BOUND_S
        assert left == [], f"still running after the run exited: {left}"
        name = signal.Signals(signum).name
        lines = [line for line in out.splitlines() if line.startswith("tracefleet:")]
        assert lines == [f"tracefleet: interrupted by {name}: {run_dir / 'summary.json'} has "
                         "status interrupted, 0 of 2 rank(s) finished"], out[-3000:]
        assert "Traceback" not in out and "SIGTERM received" not in out
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["world_size"] == 2
        assert summary["error"].startswith(f"interrupted by {name}")
        assert [r["status"] for r in summary["ranks"]] == ["interrupted"] * 2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for p in _alive(started):  # by pid, only what this run started
            p.kill()
        shutil.rmtree(ray_dir, ignore_errors=True)
