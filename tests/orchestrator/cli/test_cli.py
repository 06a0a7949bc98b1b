"""The `tracefleet` console script: user errors are one line and exit 2, before any Ray work."""
from __future__ import annotations

import os
import subprocess
import sys

from orchestrator.config import DEMO_TRACES

ENTRY = [sys.executable, "-c", "from orchestrator.cli.main import main; main()"]


def _run(tmp_path, *overrides):
    return subprocess.run([*ENTRY, f"hydra.run.dir={tmp_path}/run", *overrides],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_missing_trace_dir_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "no-such-traces"
    proc = _run(tmp_path, f"trace.dir={missing}")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("tracefleet: error:") and str(missing) in lines[-1]
    assert "Traceback" not in proc.stderr


def test_bad_mode_names_the_key(tmp_path):
    proc = _run(tmp_path, "replay.mode=everything")
    assert proc.returncode == 2, proc.stderr
    assert "replay.mode" in proc.stderr and "Traceback" not in proc.stderr


def test_debug_flag_shows_the_traceback(tmp_path):
    proc = _run(tmp_path, "--debug", f"trace.dir={tmp_path / 'none'}")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    assert "ConfigError" in proc.stderr or "TraceError" in proc.stderr


def test_fewer_ranks_than_the_traces_is_refused(tmp_path):
    proc = _run(tmp_path, "experiment.world_size=2")  # the demo folder has 4 ranks
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.splitlines()[-1]
    # the one line names the folder, both counts and the fix (a lone "4" could be anything)
    assert last.startswith("tracefleet: error: the trace in ") and "Traceback" not in proc.stderr
    assert str(DEMO_TRACES / "gpt_dp_4") in last
    assert "has 4 ranks to replay; a run on 2 ranks cannot replay it" in last
    assert last.endswith("set the world size to 4, or select ranks with trace.ranks")
