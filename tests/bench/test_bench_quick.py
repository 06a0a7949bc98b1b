"""Every benchmark script runs whole: ``scripts/bench_*.py --quick`` runs each of the script's
benchmarks end to end on tiny inputs, and its one JSON line must hold exactly the keys the
script declares for a full run (its ``KEYS``, scripts/json_layout.py: a key it stops printing
fails here), with sane values. Figures are not asserted: quick runs are too short to measure
anything (docs/benchmarks.md has the real runs). scripts/bench_predict.py keeps its own check."""
from __future__ import annotations

import pytest

from tests.support.bench import positive, run_bench

# each runs a whole benchmark script: CI's second job (scripts/test.sh --long)
pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_bench_load(public_trace_dir):
    from scripts.bench_load import layout
    out = run_bench("load", "--source", str(public_trace_dir / "hf_GPT2_et.json.tar.gz"),
                    "--gc-ab", "--large", layout=layout(gc_ab=True, large=True))
    assert out["nodes"] == 20_000 and out["reps"] == 1
    large = out["large"]
    assert large["file_mb"] >= 8 and large["nodes"] > 0
    assert positive(large["load_s"], large["whole_load_s"], large["peak_rss_gib"],
                    large["whole_peak_rss_gib"], large["mb_per_s"], large["rewrite_s"],
                    large["rewrite_peak_rss_gib"], large["whole_rewrite_s"],
                    large["whole_rewrite_peak_rss_gib"], large["cache_write_load_s"],
                    large["cached_load_s"], large["cached_peak_rss_gib"])
    assert positive(out["json_load_s"], out["load_trace_s"], out["ratio"], out["file_mb"],
                     out["load_trace_gc_on_s"], out["gc_off_speedup"])
    assert all(positive(v) for k, v in out.items() if k.startswith("peak_rss_mb_"))


def test_bench_preflight():
    out = run_bench("preflight")
    assert set(out["preflight_driver_rss_gib"]) == set(out["preflight_s"]) == {"8"}
    assert positive(out["preflight_driver_rss_gib"]["8"], out["rank_file_kib"],
                     out["all_traces_held_rss_gib"]["8"])
    assert out["preflight_s"]["8"] >= 0 and out["layers"] == 20


def test_bench_foreign(public_trace_dir):
    out = run_bench("foreign", "--traces", str(public_trace_dir))
    assert out["num_runs"] == 2 and {r["device"] for r in out["runs"]} == {"cpu", "meta"}
    assert all(r["status"] == "ok" and 0 < r["coverage"] <= 1 for r in out["runs"])
    assert isinstance(out["target_met"], bool)
    cli = out["cli"]  # the same (smallest) file through the CLI
    assert cli["archive"] == out["runs"][0]["trace"] and cli["exit_code"] == 0
    assert cli["status"] == "ok" and cli["world_size"] == 1 and 0 < cli["coverage"] <= 1


def test_bench_replay():
    out = run_bench("replay")
    assert out["quick"] and out["num_ranks"] == 4
    assert positive(out["eager_compute_s"], out["replay_compute_s"], out["replay_over_eager"],
                     out["demo_meta_over_cpu"], out["large_meta_over_cpu"],
                     out["host_overhead_tiny_ops"], out["host_overhead_tiny_ops_lazy"])
    # measured peaks: pre_allocate holds at least lazy's intermediates; measured >= accounted
    assert out["pre_allocate_over_lazy_measured_min"] >= 1.0
    assert out["lazy_measured_over_accounted_max"] >= 1.0


def test_bench_host_gaps():
    out = run_bench("host_gaps")
    for kind in ("gpt_dp", "gpt_zero3"):
        row = out[kind]
        assert positive(row["eager_ms"], row["eager_with_ranges_ms"], row["timing_step_ms"])
        assert row["gaps_ms"] >= 0 and row["gaps_with_observer_ms"] >= 0
    assert out["per_gap_us"]["busy_us"] == 50.0 and out["per_gap_us"]["recorded_gap_us"] > 0


def test_bench_cpu_meter():
    out = run_bench("cpu_meter")
    assert out["quick"] and len(out["full"]) == 4  # every rank of demo/traces/gpt_dp_4
    for row in (out["compute_rank0"], *out["full"]):
        assert all(positive(p["counter"], p["profiler"]) for p in row.values())
    cost = out["cost"]
    assert cost["repeats"] == 2 and positive(cost["iteration_s_with_counter"],
                                              cost["iteration_s_without_counter"],
                                              cost["with_over_without"])


def test_bench_cuda_allocator():
    out = run_bench("cuda_allocator")
    assert [r["conf"] for r in out["synthetic"]] == ["default", "expandable_segments:True",
                                                     "max_split_size_mb:128"]
    for row in out["synthetic"]:  # a free follows at most each malloc
        assert 1_000 <= row["num_events"] <= 2_000 and positive(row["us_per_event"])
        assert row["reserved_peak_mib"] >= row["allocated_peak_mib"] > 0
    assert [r["mode"] for r in out["dry_run"]] == ["faithful", "lazy", "pre_allocate"]
    for row in out["dry_run"]:
        assert positive(row["num_ops"], row["num_events"], row["accounted_peak_gib"])
        assert (row["predicted_reserved_peak_gib"] >= row["predicted_allocated_peak_gib"]
                >= row["accounted_peak_gib"])
        assert row["num_ooms"] == 0


def test_bench_meta_dry_run():
    out = run_bench("meta_dry_run")
    assert out["same_accounting"] is True and out["num_ops"] > 0 and out["n_layers"] == 2
    assert positive(out["meta_us_per_op_70b"], out["meta_us_per_op_70b_kernels"],
                     out["accounted_peak_bytes"])


def test_bench_fit_search():
    from scripts.bench_predict_speed import FIT_SEARCH_KEY

    out = run_bench("fit_search")
    assert out["quick"] is True and out["workload"] == "llama3_8b"
    assert FIT_SEARCH_KEY in out  # the figure bench_predict_speed.py reports as its own
    assert positive(out["fit_search_s"], out["fit_search_cold_s"])
    assert out["num_captured"] > 0 and out["num_captured_cached_run"] == 0  # cold, then cached
    assert out["same_answers"] is True
    assert set(out["answers"]) == {"batch_size", "seq_len", "world_size",
                                   "activation_checkpointing"}
    assert out["num_probes"] == sum(a["num_probes"] for a in out["answers"].values())


def test_bench_snapshot():
    out = run_bench("snapshot", "--repeats", "1")  # its one benchmark, at 2 layers
    assert positive(out["plain_cpu_s"], out["page_cpu_s"], out["snapshot_cpu_s"],
                     out["snapshot_s"], out["snapshot_bytes"], out["snapshot_events"],
                     out["reserved_peak_bytes"])
    assert "n_layers=2" in out["job"]


def test_bench_roles():
    out = run_bench("roles")
    assert [r["num_workers"] for r in out["runs"]] == [1, 2]
    assert all(r["num_roles"] == 2 and positive(r["s"], r["cpu_s"], r["rss_gib"],
                                                 r["max_role_rss_gib"], r["capture_s"])
               for r in out["runs"])
    assert out["same_prediction"] is True and positive(out["at_once_over_in_order"])
    # predict.roles reaches the capture: one process records both roles, then one each
    assert [r["num_role_processes"] for r in out["runs"]] == [1, 2]
