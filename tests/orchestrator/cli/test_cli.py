"""The `tracefleet` console script: user errors are one line and exit 2, before any Ray work."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.config import CONF_DIR, DEMO_TRACES

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
    assert last.startswith("tracefleet: error: the trace in ") and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    assert str(DEMO_TRACES / "gpt_dp_4") in last
    assert "has 4 ranks to replay; a run on 2 ranks cannot replay it" in last
    assert last.endswith("set the world size to 4, or select ranks with trace.ranks")


@pytest.mark.parametrize("override, line", [
    ("replay=nope", "tracefleet: error: In 'tracefleet': Could not find 'replay/nope'; "
                    "Available options in 'replay': default, dry_run, faithful, lazy, "
                    "pre_allocate"),
    ("replay.itrs=5", "tracefleet: error: Could not override 'replay.itrs'; To append to your "
                      "config use +replay.itrs=5; Key 'itrs' not in 'ReplayConfig'"),
    ("experiment.world_size=abc", "tracefleet: error: Error merging override "
                                  "experiment.world_size=abc; Value 'abc' of type 'str' could "
                                  "not be converted to Integer"),
])
def test_compose_errors_are_one_line_and_exit_2(tmp_path, override, line):
    proc = _run(tmp_path, override)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [line]


def test_an_output_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    for run_dir, reason in ((tmp_path / "a_file" / "run", "Not a directory"),
                            ("/proc/tracefleet-run", "No such file or directory")):
        proc = subprocess.run([*ENTRY, f"hydra.run.dir={run_dir}"], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"tracefleet: error: cannot use {run_dir}: {reason} (the run's output folder: give "
            "a writable one with hydra.run.dir=DIR, or hydra.sweep.dir=DIR with --multirun)"]


def test_runs_started_in_the_same_second_get_their_own_run_dirs(tmp_path):
    """The default run dir is the timestamp, through conf's ``tracefleet_run_dir`` resolver; a
    run that finds its folder taken takes ``<it>-1``, ``-2`` (an atomic mkdir), so concurrent
    runs never share one. Three runs started together on one fixed name: three dirs."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    same = "hydra.run.dir=${tracefleet_run_dir:outputs/same}"
    procs = [subprocess.Popen([*ENTRY, same, "experiment.preflight_only=true",
                               f"experiment.name=run{k}"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for k in range(3)]
    assert [p.wait(180) for p in procs] == [0, 0, 0], [p.stderr.read() for p in procs]
    dirs = {p.parent.name: json.loads(p.read_text())["experiment"]
            for p in (tmp_path / "outputs").glob("*/summary.json")}
    assert sorted(dirs) == ["same", "same-1", "same-2"]
    assert sorted(dirs.values()) == ["run0", "run1", "run2"]  # nothing overwritten
    assert "${tracefleet_run_dir:outputs/" in (CONF_DIR / "tracefleet.yaml").read_text()


def test_the_run_dir_resolver_claims_a_fresh_name(tmp_path):
    from orchestrator.cli.app import unique_run_dir

    base = tmp_path / "day" / "12-00-00"
    assert unique_run_dir(str(base)) == str(base) and base.is_dir()
    assert unique_run_dir(str(base)) == f"{base}-1"
    assert unique_run_dir(str(base)) == f"{base}-2"
