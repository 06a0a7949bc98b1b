"""Driver-side aggregation (orchestrator.run.aggregate) and run outputs (orchestrator.reports.run_report)."""
import time

import numpy as np
import orjson
import pandas as pd
import pytest
from rich.console import Console

from orchestrator.run.aggregate import aggregate, worst_status
from orchestrator.reports.run_report import (flatten_rank, human_bytes, print_summary, timeline_scale,
                                 write_run_outputs)

MiB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ok_report(rank: int, iter_s: float, peak_mib: int = 100, bound_mib: int = 80,
              coverage: float = 1.0, num_points: int = 50) -> dict:
    """A complete synthetic report of a rank that finished."""
    return {
        "rank": rank, "node_ip": f"10.0.0.{rank // 4}", "device": "cpu", "mode": "full",
        "allocation_mode": "lazy", "status": "ok", "error": None, "last_op": None,
        "num_ops": 100, "num_replayed": int(100 * coverage), "num_skipped": 100 - int(100 * coverage),
        "skipped_reasons": {"unresolved": 100 - int(100 * coverage)}, "coverage": coverage,
        "num_shape_mismatches": 1,
        "iteration_times_s": [iter_s * 0.9, iter_s, iter_s * 1.2], "iteration_time_s": iter_s,
        "compute_time_s": iter_s * 0.7, "comm_time_s": iter_s * 0.3,
        "peak_memory_bytes": peak_mib * MiB, "liveness_lower_bound_bytes": bound_mib * MiB,
        "measured_peak_bytes": peak_mib * MiB, "accounted_peak_bytes": (peak_mib - 10) * MiB,
        "peak_memory_source": "measured",
        "num_flushes": rank, "flushed_bytes": rank * MiB, "oom": None,
        "collectives": {
            "all_reduce": {"num_calls": 10, "bytes": 1000, "time_s": 0.01 * (rank + 1),
                           "algbw_gbps": 1.0 + rank, "busbw_gbps": 2.0 + rank},
            "all_gather": {"num_calls": 4, "bytes": 400, "time_s": 0.002,
                           "algbw_gbps": 5.0, "busbw_gbps": 7.0},
        },
        "memory_timeline": [[i, (i % 17) * MiB] for i in range(num_points)],
        "top_ops": [{"name": "aten::mm", "num_calls": 30, "total_s": 0.5, "mean_us": 16.6}],
        "memory_measure": {"peak_bytes_per_iteration": [peak_mib * MiB]},
    }


def test_aggregate_statistics_straggler_and_skew():
    reports = [ok_report(0, 0.10, peak_mib=100, coverage=1.0),
               ok_report(1, 0.30, peak_mib=300, bound_mib=90, coverage=0.9),
               ok_report(2, 0.20, peak_mib=200, coverage=0.95)]
    s = aggregate(reports, world_size=3)
    assert s["status"] == "ok" and s["error"] is None and s["world_size"] == 3
    # the headline is the slowest rank per iteration (0.27, 0.30, 0.36), median over iterations
    assert s["iteration_time_s"] == pytest.approx(0.30)
    assert s["iteration_time_median_s"] == pytest.approx(0.20)
    assert s["iteration_time_stats_s"] == pytest.approx({"min": 0.10, "median": 0.20, "max": 0.30})
    assert s["straggler_rank"] == 1
    assert s["skew"] == pytest.approx(3.0)
    assert s["compute_time_s"] == pytest.approx(0.14)
    assert s["comm_time_s"] == pytest.approx(0.06)
    assert s["peak_memory_bytes"] == 300 * MiB
    assert s["liveness_lower_bound_bytes"] == 90 * MiB
    assert s["num_flushes"] == 0 + 1 + 2
    assert s["coverage"] == pytest.approx(0.9)
    assert s["skipped_reasons"] == {"unresolved": 15}
    assert s["num_oom_ranks"] == 0 and s["oom"] is None
    ar = s["collectives"]["all_reduce"]
    assert ar["num_ranks"] == 3 and ar["num_calls"] == 30 and ar["bytes"] == 3000
    assert ar["time_s"] == pytest.approx(0.02) and ar["busbw_gbps"] == pytest.approx(3.0)
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2]
    assert all("memory_timeline" not in r for r in s["ranks"])
    assert "memory_timeline" in reports[0], "aggregate must not mutate the input reports"


def test_slowest_iteration_uses_iterations_every_rank_finished():
    fast, slow = ok_report(0, 0.1), ok_report(1, 0.2)
    fast["iteration_times_s"] = [0.1, 0.5, 0.1, 0.1]  # one hiccup on the fast rank
    slow["iteration_times_s"] = [0.2, 0.2, 0.2]  # and one iteration fewer
    s = aggregate([fast, slow], world_size=2)
    assert s["iteration_time_s"] == pytest.approx(0.2)  # median of (0.2, 0.5, 0.2)


def test_memory_figures_measured_beside_accounted():
    measured = {**ok_report(0, 0.1), "measured_peak_bytes": 150 * MiB,
                "accounted_peak_bytes": 100 * MiB, "peak_memory_bytes": 150 * MiB,
                "memory_measure_method": "cpu_allocator_counter"}
    meta = {**ok_report(1, 0.1), "measured_peak_bytes": None, "accounted_peak_bytes": 120 * MiB,
            "peak_memory_bytes": 120 * MiB, "peak_memory_source": "accounted"}
    s = aggregate([measured, meta], world_size=2)
    assert s["measured_peak_bytes"] == 150 * MiB and s["accounted_peak_bytes"] == 120 * MiB
    assert s["peak_memory_bytes"] == 150 * MiB and s["peak_memory_source"] == "measured"
    only_meta = aggregate([meta], world_size=1)
    assert only_meta["measured_peak_bytes"] is None
    assert only_meta["peak_memory_source"] == "accounted"


@pytest.mark.parametrize("statuses, expected", [
    (["ok", "ok"], "ok"),
    (["ok", "timeout"], "timeout"),
    (["timeout", "failed", "ok"], "failed"),
    (["failed", "oom", "timeout"], "oom"),
    (["ok", "weird"], "failed"),
])
def test_status_precedence(statuses, expected):
    assert worst_status(statuses) == expected
    reports = [{"rank": i, "status": st, "error": None if st == "ok" else "boom", "last_op": None}
               for i, st in enumerate(statuses)]
    assert aggregate(reports, world_size=len(statuses))["status"] == expected


def test_run_level_override_and_error_win():
    s = aggregate([ok_report(0, 0.1), ok_report(1, 0.1)], world_size=2,
                  run_status_override="timeout", error="driver deadline of 60 s expired",
                  extra={"device_memory_capacity_bytes": 1 << 30})
    assert s["status"] == "timeout"
    assert s["error"] == "driver deadline of 60 s expired"
    assert s["device_memory_capacity_bytes"] == 1 << 30
    with pytest.raises(ValueError, match="shadow"):
        aggregate([ok_report(0, 0.1)], world_size=1, extra={"status": "ok"})
    with pytest.raises(ValueError, match="run_status_override"):
        aggregate([ok_report(0, 0.1)], world_size=1, run_status_override="great")


def test_partial_failure_keeps_measurements_and_names_failed_ranks():
    oom = {"rank": 2, "status": "oom", "error": "out of memory: 3 GiB held\nsecond line",
           "last_op": "node 123 aten::mm", "peak_memory_bytes": 900 * MiB,
           "oom": {"node_id": 123, "op": "aten::mm", "held_bytes": 3 << 30, "requested_bytes": 1 << 20}}
    crashed = {"rank": 1, "status": "failed", "error": "RuntimeError: connection reset",
               "last_op": "node 77 c10d::allreduce_"}
    s = aggregate([ok_report(0, 0.1), crashed, oom, ok_report(3, 0.3)], world_size=5)
    assert s["status"] == "oom"
    assert s["iteration_time_s"] == pytest.approx(0.3)  # the slowest of the two ok ranks
    assert s["iteration_time_median_s"] == pytest.approx(0.2)  # their medians' median
    assert s["straggler_rank"] == 3 and s["skew"] == pytest.approx(3.0)
    assert s["peak_memory_bytes"] == 900 * MiB  # measured by the OOM rank, not lost
    assert s["num_oom_ranks"] == 1
    assert s["oom"] == {"rank": 2, **oom["oom"]}
    err = s["error"]
    assert err.startswith("3 of 5 ranks did not finish: rank 2 oom at node 123 aten::mm")
    assert "rank 1 failed at node 77 c10d::allreduce_: RuntimeError: connection reset" in err
    assert "rank 4 failed" in err and "no report" in err  # the silent rank is named too
    assert "second line" not in err
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2, 3, 4]
    assert s["num_ranks_by_status"] == {"ok": 2, "failed": 2, "oom": 1}


def test_error_message_summarizes_many_failed_ranks():
    reports = [{"rank": i, "status": "timeout", "error": "no progress", "last_op": None}
               for i in range(10)]
    err = aggregate(reports, world_size=10)["error"]
    assert "rank 0 timeout: no progress" in err and "rank 3 timeout" in err
    assert "rank 4 timeout" not in err
    assert "and 6 more (timeout on ranks 4, 5, 6, 7, 8, 9)" in err


def test_flatten_rank_columns():
    row = flatten_rank({k: v for k, v in ok_report(1, 0.2).items() if k != "memory_timeline"})
    assert row["coll_all_reduce_busbw_gbps"] == pytest.approx(3.0)
    assert row["coll_all_gather_num_calls"] == 4
    assert row["num_iterations"] == 3
    assert orjson.loads(row["top_ops_json"])[0]["name"] == "aten::mm"
    assert orjson.loads(row["skipped_reasons_json"]) == {"unresolved": 0}
    assert all(not isinstance(v, (dict, list)) for v in row.values())


def test_write_run_outputs_round_trip(tmp_path):
    reports = [ok_report(r, 0.1 + 0.01 * r) for r in range(3)]
    reports.append({"rank": 3, "status": "failed", "error": "boom", "last_op": "node 5 aten::add"})
    summary = aggregate(reports, world_size=4, extra={"device_memory_capacity_bytes": 64 * MiB})
    written = write_run_outputs(summary, reports, tmp_path, "replay:\n  iterations: 3\n")

    loaded = orjson.loads((tmp_path / "summary.json").read_bytes())
    for key in ("status", "world_size", "iteration_time_s", "peak_memory_bytes",
                "liveness_lower_bound_bytes", "num_flushes", "coverage", "error", "ranks",
                "straggler_rank", "skew", "collectives", "device_memory_capacity_bytes"):
        assert key in loaded, key
    assert loaded["status"] == "failed" and "rank 3 failed at node 5 aten::add" in loaded["error"]

    csv = pd.read_csv(tmp_path / "ranks.csv")
    parquet = pd.read_parquet(tmp_path / "ranks.parquet")
    assert len(csv) == len(parquet) == 4
    assert list(parquet["rank"]) == [0, 1, 2, 3]
    assert parquet["peak_memory_bytes"].iloc[0] == 100 * MiB
    assert pd.isna(parquet["peak_memory_bytes"].iloc[3])
    # Types follow the values, not their luck: coverage stays float even when all are 1.0.
    assert str(parquet["peak_memory_bytes"].dtype) == "Int64"
    assert str(parquet["coverage"].dtype) == "Float64"
    assert "coll_all_reduce_busbw_gbps" in csv.columns
    assert (tmp_path / "config.yaml").read_text() == "replay:\n  iterations: 3\n"

    mem = pd.read_csv(tmp_path / "memory" / "rank-1.csv")
    assert list(mem.columns) == ["op_index", "bytes", "max_bytes", "min_bytes"]
    assert len(mem) == 50 and (mem["bytes"] == mem["max_bytes"]).all()  # points of two values
    assert not (tmp_path / "memory" / "rank-3.csv").exists()
    for name in ("memory_timeline.png", "iteration_times.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    assert written["memory_timeline_plot"] == tmp_path / "memory_timeline.png"


def test_timeline_extremes_reach_the_csv_and_the_plot(tmp_path, monkeypatch):
    """A downsampled point's extremes (most, fewest held since the previous point) go to
    memory/rank-<r>.csv and back; the plot's line reaches the peak, which it marks."""
    from orchestrator.reports import plots
    from orchestrator.reports.html_report import load_run
    report = ok_report(0, 0.1)
    # after-op values stay at 2 MiB; the peak (5 MiB) lived between two points
    report["memory_timeline"] = [[i, 2 * MiB, (5 if i == 29 else 3) * MiB, MiB]
                                 for i in range(9, 100, 10)]
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or True)
    summary = aggregate([report], world_size=1)
    write_run_outputs(summary, [report], tmp_path, None)
    mem = pd.read_csv(tmp_path / "memory" / "rank-0.csv")
    assert mem["max_bytes"].max() == 5 * MiB and mem["min_bytes"].min() == MiB
    _, ranks = load_run(tmp_path)
    assert [list(p) for p in ranks[0]["memory_timeline"]] == report["memory_timeline"]
    ax = figures[0].axes[0]
    scale = 1.0 * MiB  # 5 MiB is drawn in MiB
    rank_line = next(ln for ln in ax.get_lines() if ln.get_label() == "rank 0")
    assert max(rank_line.get_ydata()) == pytest.approx(5 * MiB / scale)
    peak = next(ln for ln in ax.get_lines() if ln.get_label().startswith("peak"))
    assert list(peak.get_xdata()) == [29] and list(peak.get_ydata()) == [5 * MiB / scale]
    assert "5.0 MiB" in peak.get_label() or "5 MiB" in peak.get_label(), peak.get_label()


def test_numpy_scalars_and_all_zero_timeline(tmp_path):
    report = ok_report(0, 0.1, num_points=5)
    report.update(coverage=np.float64(1.0), peak_memory_bytes=np.int64(0),
                  liveness_lower_bound_bytes=0, memory_timeline=[[i, 0] for i in range(5)])
    summary = aggregate([report], world_size=1)
    written = write_run_outputs(summary, [report], tmp_path, None)
    assert "memory_timeline_plot" in written
    frame = pd.read_parquet(tmp_path / "ranks.parquet")
    assert str(frame["coverage"].dtype) == "Float64"
    assert str(frame["peak_memory_bytes"].dtype) == "Int64"
    assert orjson.loads((tmp_path / "summary.json").read_bytes())["peak_memory_bytes"] == 0


def test_failed_run_without_measurements_skips_plots(tmp_path):
    reports = [{"rank": 0, "status": "failed", "error": "bad trace", "last_op": None}]
    written = write_run_outputs(aggregate(reports, world_size=1), reports, tmp_path, None)
    assert "memory_timeline_plot" not in written and not (tmp_path / "iteration_times.png").exists()
    assert len(pd.read_parquet(tmp_path / "ranks.parquet")) == 1
    assert not (tmp_path / "config.yaml").exists()


def test_plots_are_quick_for_8_ranks_10k_points(tmp_path):
    reports = [ok_report(r, 0.1, num_points=10_000) for r in range(8)]
    summary = aggregate(reports, world_size=8)
    write_run_outputs(summary, reports[:1], tmp_path / "warmup", None)  # font cache, imports
    start = time.process_time()  # CPU, not wall: the parallel suite's other workers share it
    written = write_run_outputs(summary, reports, tmp_path / "run", None)
    elapsed_s = time.process_time() - start
    assert "memory_timeline_plot" in written and "iteration_times_plot" in written
    assert elapsed_s < 3.0, f"writing the run outputs took {elapsed_s:.2f} s of CPU"


def _timed(report: dict, num_iterations: int) -> dict:
    t = report["iteration_time_s"]
    return {**report, "iteration_times_s": [t * (0.9 + 0.1 * (k % 3)) for k in range(num_iterations)]}


def test_print_summary_rows_footer_and_error():
    reports = [_timed(ok_report(0, 0.1), 8), _timed(ok_report(1, 0.25), 8),
               {"rank": 2, "status": "oom", "error": "needs [1 GiB] more", "last_op": "node 9 aten::cat"}]
    console = Console(record=True, width=160)
    print_summary(aggregate(reports, world_size=3), console=console)
    text = console.export_text()
    lines = text.splitlines()
    row0 = next(line for line in lines if "10.0.0.0" in line and " ok " in line)
    # iteration, compute, comm ms; measured, accounted, bound MiB; flushes; coverage %
    assert row0.split()[3:] == ["100.0", "70.0", "30.0", "100.0", "90.0", "80.0", "0", "100.0"]
    assert any(line.split()[:4] == ["1", "10.0.0.0", "ok", "250.0"] for line in lines)
    assert any(" oom " in line and "2" in line for line in lines)
    assert "all_reduce" in text and "all_gather" in text
    assert "straggler rank 1 (skew 2.50x, beyond noise)" in " ".join(text.split())  # wrapped
    # the headline is the step's time: each iteration's slowest rank, said so
    assert "iter 250.0 ms (slowest rank per iteration; 95% CI " in text
    assert "rank medians 100.0-250.0 ms)" in text
    # 3 timed iterations: too few to call a rank a straggler
    console = Console(record=True, width=300)
    print_summary(aggregate([ok_report(0, 0.1), ok_report(1, 0.25)], world_size=2), console=console)
    few = console.export_text()
    assert "straggler" not in few and "ranks not compared (3 timed iteration(s), 6 needed)" in few
    assert "status oom" in text
    assert "peak 100.0 MiB measured, 90.0 MiB accounted" in text
    assert "zero3" not in text  # no emulation, no ZeRO-3 line
    assert "rank 2 oom at node 9 aten::cat: needs [1 GiB] more" in text


def test_the_liveness_bound_is_called_a_bound_only_where_it_bounds():
    """It is drawn and named a bound in full and compute replays; a comms replay (no compute
    op) and a lazy one that flushed hold less, so there it is a figure with the reason."""
    from orchestrator.reports.plots import not_a_bound

    full = aggregate([ok_report(0, 0.1)], world_size=1)
    assert not_a_bound({**full, "mode": "full"}) is None
    assert not_a_bound({**full, "mode": "compute", "allocation_mode": "lazy",
                        "num_flushes": 0}) is None
    assert "comms runs no compute op" in not_a_bound({**full, "mode": "comms"})
    assert "flushed" in not_a_bound({**full, "allocation_mode": "lazy", "num_flushes": 3})
    for summary, said in (({**full, "mode": "full"}, "accounted, bound 80.0 MiB"),
                          ({**full, "mode": "comms"}, "accounted, liveness 80.0 MiB (not a "
                                                      "bound: replay.mode=comms runs no")):
        console = Console(record=True, width=300)
        print_summary(summary, console=console)
        assert said in console.export_text()


def test_print_summary_names_the_zero3_figures():
    summary = aggregate([ok_report(0, 0.1)], world_size=1, extra={"zero3": {
        "strategy": "leaf_coalesced", "world_size": 4, "num_allgathers_per_iteration": 12,
        "allgather_bytes_per_iteration": 4 * MiB, "fetch_host_s": 0.0056, "release_host_s": 0.0002,
        "wait_s": 0.0567, "bubble_s": 0.0635, "gathered_peak_bytes": 774 * 1024,
        "shard_bytes": 524 * 1024, "num_params": 30, "num_partitioned": 30,
        "grad_shard_bytes": 524 * 1024, "optimizer_state_bytes": 1048 * 1024}})
    console = Console(record=True, width=300)
    print_summary(summary, console=console)
    assert ("zero3 leaf_coalesced (world 4) | 12 all-gathers/iter, 4.0 MiB | host fetch 5.60 ms "
            "+ release 0.20 ms, wait 56.7 ms, bubble 63.5 ms | gathered peak 774.0 KiB, "
            "shard 524.0 KiB, grad shards 524.0 KiB, optimizer state 1.0 MiB") \
        in console.export_text()


@pytest.mark.parametrize("num_bytes, expected", [
    (None, "-"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * MiB, "3.0 MiB"),
    (5 << 30, "5.0 GiB"), (-2048, "-2.0 KiB"),
])
def test_human_bytes(num_bytes, expected):
    assert human_bytes(num_bytes) == expected


def test_timeline_scale_keeps_the_curves_readable():
    MiB, GiB = 1 << 20, 1 << 30
    # host RAM as capacity: the axis follows the 26 MiB peak and the capacity is only named
    assert timeline_scale(26 * MiB, 8 * MiB, 24 * GiB) == (MiB, "MiB", True)
    # an emulated capacity near the peak is drawn and sets the axis unit
    assert timeline_scale(900 * MiB, 800 * MiB, 2 * GiB) == (GiB, "GiB", False)
    assert timeline_scale(3 * MiB, None, None) == (MiB, "MiB", False)


def test_rank_errors_name_the_rank_and_op_once():
    reports = [
        {"rank": 0, "status": "oom", "last_op": "node 419 aten::linear",
         "error": "out of memory at node 419 aten::linear: 4173312 B held, 197120 B requested"},
        {"rank": 1, "status": "failed", "last_op": "node 7 aten::mm",
         "error": "rank 1 at node 7 aten::mm: shapes cannot be multiplied"},
        {"rank": 2, "status": "failed", "last_op": "node 9 aten::cat", "error": "boom"},
    ]
    err = aggregate(reports, world_size=3)["error"]
    assert "rank 0 oom: out of memory at node 419 aten::linear: 4173312 B held" in err
    assert "rank 1 failed at node 7 aten::mm: shapes cannot be multiplied" in err
    assert "rank 2 failed at node 9 aten::cat: boom" in err
    assert err.count("node 419") == err.count("node 7 ") == 1


def test_print_summary_says_when_zero3_partitioned_nothing():
    summary = aggregate([ok_report(0, 0.1)], world_size=1, extra={"zero3": {
        "strategy": "per_module", "world_size": 4, "num_params": 30, "num_partitioned": 0,
        "num_allgathers_per_iteration": 0}})
    console = Console(record=True, width=250)
    print_summary(summary, console=console)
    assert "none of the 30 parameters is partitioned" in console.export_text()


def test_a_long_rank_error_keeps_its_place():
    """The run's error cuts a long rank message, never the node, phase and code it names."""
    from orchestrator.run.aggregate import MAX_RANK_ERROR_CHARS

    place = " at node 42 aten::linear (phase iteration) [replay/engine.py:12 in _run]"
    report = {"rank": 0, "status": "failed", "error": "rank 0: KeyError: " + "x" * 400 + place}
    line = aggregate([report], world_size=1)["error"].split("did not finish: ", 1)[1]
    assert line.startswith("rank 0 failed: KeyError: xxx") and line.endswith("x..." + place)
    assert len("rank 0: " + line[len("rank 0 failed: "):]) == MAX_RANK_ERROR_CHARS


def test_print_summary_names_the_ops_that_did_not_replay():
    """Unknown ops used to show only as a coverage figure; the reasons were in summary.json."""
    reports = [ok_report(r, 0.1, coverage=0.99) for r in range(2)]
    for report in reports:
        report["skipped_reasons"] = {"aten::does_not_exist is not registered in this torch": 1,
                                     "mylib::foo is not registered in this torch": 1}
    console = Console(record=True, width=400)
    print_summary(aggregate(reports, world_size=2), console=console)
    assert ("warning: not replayed (summed over ranks): 4 op(s): aten::does_not_exist is not "
            "registered in this torch (2); mylib::foo is not registered in this torch (2)") \
        in console.export_text()
    quiet = Console(record=True, width=400)
    print_summary(aggregate([ok_report(0, 0.1)], world_size=1), console=quiet)
    assert "not replayed" not in quiet.export_text()  # full coverage: no line


def test_a_run_ends_by_saying_where_its_outputs_are(tmp_path):
    from orchestrator.reports.run_report import print_outputs

    reports = [ok_report(0, 0.1)]
    write_run_outputs(aggregate(reports, world_size=1), reports, tmp_path, "a: 1\n")
    console = Console(record=True, width=400)
    print_outputs(tmp_path, console)
    results, page = console.export_text().splitlines()
    assert results.startswith(f"results: {tmp_path.resolve()} (") and "summary.json" in results \
        and "ranks.csv" in results
    assert page.startswith(f"page: tracefleet-report {tmp_path.resolve()}")
    from orchestrator.reports.html_report import write_report

    write_report(tmp_path)  # what a run does before it prints these lines
    console = Console(record=True, width=400)
    print_outputs(tmp_path, console)
    assert console.export_text().splitlines()[1] == f"page: {tmp_path.resolve() / 'report.html'}"


def test_the_title_says_how_the_ranks_replayed():
    """A dry run replays on meta with lazy allocation: figures that mean something else than a
    faithful compute replay's, so the table's title names mode, device and allocation."""
    reports = [{**ok_report(r, 0.1), "device": "meta"} for r in range(2)]
    summary = aggregate(reports, world_size=2,
                        extra={"mode": "compute", "allocation_mode": "lazy"})
    console = Console(record=True, width=160)
    print_summary(summary, console=console)
    assert "tracefleet run: 2 ranks, compute replay, on meta, lazy allocation" in \
        console.export_text()


def test_a_slowest_rank_within_noise_is_no_straggler():
    """Ranks whose iteration times overlap (a loaded machine: one rank 7% slower in median
    with a spread of 30%) name no straggler; ranks apart beyond their medians' 95% intervals
    do, on the console, in summary.json and in the plot's title and colour."""
    from orchestrator.reports import plots

    noisy = [0.8, 1.2, 0.9, 1.1, 1.0, 0.7, 1.3, 0.95, 1.05, 1.0]
    same = [{**ok_report(r, 0.1 * (1 + 0.07 * r)),
             "iteration_times_s": [t * 0.1 * (1 + 0.07 * r) for t in noisy]} for r in range(2)]
    apart = [_timed(ok_report(0, 0.1), 10), _timed(ok_report(1, 0.2), 10)]
    for reports, distinct, said in (
            (same, False, "no straggler (rank 1 slowest, skew 1.07x within noise)"),
            (apart, True, "straggler rank 1 (skew 2.00x, beyond noise)")):
        summary = aggregate(reports, world_size=2)
        assert summary["straggler_distinct"] is distinct and summary["straggler_rank"] == 1
        console = Console(record=True, width=300)
        print_summary(summary, console=console)
        assert said in console.export_text()
        figures = []
        original = plots._save
        plots._save = lambda fig, path: figures.append(fig) or True
        try:
            plots.plot_iteration_times(summary, reports, None)
        finally:
            plots._save = original
        ax = figures[0].axes[0]
        assert ("straggler rank 1" in ax.get_title()) is distinct
        red = [p for p in ax.patches if p.get_facecolor()[0] > 0.8 > p.get_facecolor()[2]]
        assert len(red) == int(distinct)
    # too few timed iterations for an interval: not judged
    assert aggregate([ok_report(0, 0.1), ok_report(1, 0.2)],
                     world_size=2)["straggler_distinct"] is None
