"""The results table store and the sweep's bookkeeping helpers (no Ray, no Hydra run)."""
from __future__ import annotations

import os
import subprocess

import pandas as pd

from orchestrator.outputs import RESULTS_CSV, RESULTS_PARQUET
from orchestrator.results import (ResultsStore, RowKind, make_row, override_columns, point_key,
                                  summary_columns)
from orchestrator.status import RunStatus
from orchestrator.studies.sweep import exit_code, with_sweep_dir


def test_point_key_ignores_override_order():
    assert point_key(["b=2", "a=1"]) == point_key(["a=1", "b=2"])
    assert point_key(["a=1"]) != point_key(["a=2"])


def test_override_values_are_typed():
    cols = override_columns(["replay.iters=3", "replay.allocation.device_memory_threshold=0.5",
                             "replay.device_memory_capacity=64MiB", "+x=null", "replay=lazy",
                             "replay.strict=true"])
    assert cols == {"replay.iters": 3, "replay.allocation.device_memory_threshold": 0.5,
                    "replay.device_memory_capacity": "64MiB", "x": None, "replay": "lazy",
                    "replay.strict": True}


def test_summary_columns_take_the_contract_keys_and_zero3():
    summary = {"status": "ok", "iteration_time_s": 0.2, "measured_peak_bytes": None,
               "accounted_peak_bytes": 100, "timings_s": {"total_s": 3.0},
               "zero3": {"strategy": "leaf_coalesced", "num_allgathers_per_iteration": 10}}
    cols = summary_columns(summary)
    assert cols["iteration_time_s"] == 0.2 and cols["accounted_peak_bytes"] == 100
    assert cols["measured_peak_bytes"] is None and cols["run_s"] == 3.0
    assert cols["zero3_strategy"] == "leaf_coalesced" and cols["zero3_num_allgathers_per_iteration"] == 10
    assert "zero3_strategy" not in summary_columns({"status": "ok", "zero3": None})


def test_rows_are_kept_replaced_and_tabled(tmp_path):
    store = ResultsStore(tmp_path)
    a = ["replay.device_memory_capacity=1MiB"]
    b = ["replay.device_memory_capacity=1e9"]
    store.put(make_row("point", point_key(a), a, "oom", "rank 0 oom at node 7", "0",
                       {"peak_memory_bytes": 10}))
    store.put(make_row("point", point_key(b), b, "ok", None, "1", {"peak_memory_bytes": 20}))
    assert store.get(point_key(a))["status"] == "oom"
    assert store.get(point_key(["replay.device_memory_capacity=2MiB"])) is None
    # a re-run of a point replaces its row
    store.put(make_row("point", point_key(a), a, "ok", None, "0", {"peak_memory_bytes": 11}))
    csv = pd.read_csv(tmp_path / RESULTS_CSV)
    parquet = pd.read_parquet(tmp_path / RESULTS_PARQUET)
    assert len(csv) == len(parquet) == 2
    assert sorted(parquet["status"]) == ["ok", "ok"]
    # "1MiB" and "1e9" (a float) in one column: stored as text so parquet takes it
    assert set(parquet["replay.device_memory_capacity"]) == {"1MiB", "1000000000.0"}
    assert not list(tmp_path.glob(".*.tmp")) and not list((tmp_path / "rows").glob(".*.tmp"))


def test_long_reasons_are_cut():
    row = make_row("point", "k", [], "failed", "x" * 5000, None)
    assert len(row["reason"]) == 500 and row["reason"].endswith("...")


def test_exit_code_summarises_the_sweep():
    assert exit_code(["ok", "ok"]) == 0
    assert exit_code(["ok", "oom"]) == 1
    assert exit_code(["timeout", "failed"]) == 1
    assert exit_code(["ok", "oom", "invalid"]) == 2
    assert exit_code([]) == 0


def test_sweep_dir_depends_on_the_overrides_only():
    one = with_sweep_dir(["--multirun", "a=1,2", "b=x"])
    again = with_sweep_dir(["b=x", "--multirun", "a=1,2", "hydra/launcher=ray",
                            "+hydra.launcher.ray.init.num_cpus=8", "experiment.resume=false"])
    other = with_sweep_dir(["-m", "a=1,3", "b=x"])
    sweep_dir = [a for a in one if a.startswith("hydra.sweep.dir=")]
    assert len(sweep_dir) == 1 and sweep_dir[0].startswith("hydra.sweep.dir=multirun/sweep-")
    assert sweep_dir[0] in again and sweep_dir[0] not in other
    assert with_sweep_dir(["a=1"]) == ["a=1"]  # not a multirun
    given = ["-m", "a=1,2", "hydra.sweep.dir=/x"]
    assert with_sweep_dir(given) == given


def test_temp_files_of_a_killed_writer_are_removed_and_rows_kept(tmp_path):
    """A writer killed between writing a temp file and its rename leaves the temp behind; the
    next rebuild removes it (tables: always; rows: when its writer's pid is gone)."""
    store = ResultsStore(tmp_path)
    a = ["replay.iters=1"]
    store.put(make_row("point", point_key(a), a, "ok", None, "0"))
    dead_pid = _a_dead_pid()
    stale = [tmp_path / f".{RESULTS_CSV}.{dead_pid}.tmp",
             tmp_path / f".{RESULTS_PARQUET}.{dead_pid}.tmp",
             store.rows_dir / f".0123456789abcdef.json.{dead_pid}.tmp"]
    live_row_tmp = store.rows_dir / f".fedcba9876543210.json.{os.getpid()}.tmp"
    for path in [*stale, live_row_tmp]:
        path.write_bytes(b'{"half": ')  # what a kill mid-write leaves
    b = ["replay.iters=2"]
    store.put(make_row("point", point_key(b), b, "ok", None, "1"))
    assert not any(p.exists() for p in stale)
    assert live_row_tmp.exists()  # a live writer's row is not touched
    assert list(pd.read_csv(tmp_path / RESULTS_CSV)["replay.iters"]) == [1, 2]
    assert len(store.rows()) == 2


def _a_dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_cut_or_corrupt_row_is_named_skipped_and_its_point_runs_again(tmp_path, caplog):
    store = ResultsStore(tmp_path)
    for key in ("a=1", "a=2", "a=3"):
        store.put(make_row(RowKind.point, key, [key], RunStatus.ok, None, None))
    cut, wrong = store._row_path("a=2"), store._row_path("a=3")
    cut.write_bytes(cut.read_bytes()[:40])  # a disk that filled mid-write
    wrong.write_bytes(b"[1, 2]")
    with caplog.at_level("WARNING", logger="tracefleet"):
        assert store.get("a=2") is None and store.get("a=3") is None  # resume runs them
        assert [r["point"] for r in store.rows()] == ["a=1"]
    assert f"skipped {cut}: a results row that is not valid JSON (cut short" in caplog.text
    assert f"skipped {wrong}: a results row is a JSON object; this file holds a list" \
        in caplog.text
    store.write_tables()  # the tables rebuild from the readable rows
    assert list(pd.read_csv(tmp_path / RESULTS_CSV)["point"]) == ["a=1"]
    store.put(make_row(RowKind.point, "a=2", ["a=2"], RunStatus.ok, None, None))
    assert store.get("a=2")["status"] == "ok"  # re-run: the row is whole again
