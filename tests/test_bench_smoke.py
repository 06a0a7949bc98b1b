"""Every benchmark script runs: ``scripts/bench_*.py --quick`` (smallest inputs), its one JSON
line parsed and checked for its keys and sane values, so a signature change in the code a
benchmark calls cannot break it silently. Figures are not asserted: quick runs are too short
to measure anything (docs/benchmarks.md has the real runs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600


def run_bench(name: str, *args: str) -> dict:
    """``scripts/bench_<name>.py --quick *args`` in a fresh interpreter; its last stdout line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"bench_{name}.py"), "--quick",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"bench_{name}.py --quick failed:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"bench_{name}.py printed nothing; stderr:\n{proc.stderr[-2000:]}"
    return json.loads(lines[-1])


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


def test_bench_load(public_trace_dir):
    out = run_bench("load", "--source", str(public_trace_dir / "hf_GPT2_et.json.tar.gz"))
    assert out["nodes"] == 20_000 and out["reps"] == 1
    assert _positive(out["json_load_s"], out["load_trace_s"], out["ratio"], out["file_mb"])
    assert all(_positive(out[f"peak_rss_mb_{r}"]) for r in ("json_load", "load_trace"))


def test_bench_preflight():
    out = run_bench("preflight")
    assert set(out["preflight_driver_rss_gib"]) == set(out["preflight_s"]) == {"8"}
    assert _positive(out["preflight_driver_rss_gib"]["8"], out["rank_file_kib"])
    assert out["preflight_s"]["8"] >= 0 and out["layers"] == 20


def test_bench_sweep():
    out = run_bench("sweep")
    assert set(out) == {"preflight_driver_rss_gib", "preflight_s"}
    assert _positive(out["preflight_driver_rss_gib"]["8"])


def test_bench_foreign(public_trace_dir):
    out = run_bench("foreign", "--traces", str(public_trace_dir))
    assert out["num_runs"] == 2 and {r["device"] for r in out["runs"]} == {"cpu", "meta"}
    assert all(r["status"] == "ok" and 0 < r["coverage"] <= 1 for r in out["runs"])
    assert set(out["min_coverage"]) == {"cpu", "meta"} and isinstance(out["target_met"], bool)
    assert "cli" not in out


def test_bench_replay():
    out = run_bench("replay")
    assert out["quick"] and out["num_ranks"] == 4
    assert _positive(out["eager_compute_s"], out["replay_compute_s"], out["replay_over_eager"],
                     out["demo_meta_over_cpu"], out["large_meta_over_cpu"],
                     out["host_overhead_tiny_ops"], out["host_overhead_tiny_ops_lazy"])
    # measured peaks: pre_allocate holds at least lazy's intermediates; measured >= accounted
    assert out["pre_allocate_over_lazy_measured_min"] >= 1.0
    assert out["lazy_measured_over_accounted_max"] >= 1.0


def test_bench_host_gaps():
    out = run_bench("host_gaps")
    dp = out["gpt_dp"]
    assert _positive(dp["eager_ms"], dp["eager_with_ranges_ms"], dp["timing_step_ms"])
    assert dp["gaps_ms"] >= 0 and dp["gaps_with_observer_ms"] >= 0
    assert out["per_gap_us"]["busy_us"] == 50.0 and out["per_gap_us"]["recorded_gap_us"] > 0


def test_bench_cpu_meter():
    out = run_bench("cpu_meter")
    assert out["quick"] and len(out["full"]) == 4  # every rank of demo/traces/gpt_dp_4
    for row in (out["compute_rank0"], *out["full"]):
        assert set(row) == {"lazy"} and _positive(row["lazy"]["counter"], row["lazy"]["profiler"])
    cost = out["cost"]
    assert cost["repeats"] == 2 and _positive(cost["iteration_s_with_counter"],
                                              cost["iteration_s_without_counter"],
                                              cost["with_over_without"])


def test_bench_cuda_allocator():
    out = run_bench("cuda_allocator")
    assert [r["conf"] for r in out["synthetic"]] == ["default", "expandable_segments:True",
                                                     "max_split_size_mb:128"]
    for row in out["synthetic"]:  # a free follows at most each malloc
        assert 1_000 <= row["num_events"] <= 2_000 and _positive(row["us_per_event"])
        assert row["reserved_peak_mib"] >= row["allocated_peak_mib"] > 0
    assert [r["mode"] for r in out["dry_run"]] == ["faithful", "lazy", "pre_allocate"]
    for row in out["dry_run"]:
        assert _positive(row["num_ops"], row["num_events"], row["accounted_peak_gib"])
        assert (row["predicted_reserved_peak_gib"] >= row["predicted_allocated_peak_gib"]
                >= row["accounted_peak_gib"])
        assert row["num_ooms"] == 0


def test_bench_dry_run_scale():
    out = run_bench("dry_run_scale")
    assert out["quick"] and out["workload"] == "llama_8b" and out["world_size"] == 8
    assert out["num_replays"] == 1  # rank 0 hard-linked for every rank: one replay
    assert _positive(out["capture_s"], out["dry_run_8_s"], out["driver_rss_8_gib"])
    assert out["timings_s"]["replay_s"] >= 0


@pytest.mark.slow
def test_bench_fidelity():
    out = run_bench("fidelity")
    row = out["folders"]["gpt_dp_4"]
    assert len(row["rounds"]) == 1  # quick: one round, original then the replays
    for key in ("original", "faithful", "faithful+host_gaps"):
        assert _positive(row["rounds"][0][key]["s"]), key
    assert _positive(row["faithful_time_ratio"], row["faithful+host_gaps_time_ratio"],
                     row["faithful_memory_ratio"], row["lazy_memory_ratio"],
                     row["pre_allocate_memory_ratio"])
    assert isinstance(row["targets_met"], bool) and isinstance(out["all_targets_met"], bool)


@pytest.mark.slow
def test_bench_zero3():
    out = run_bench("zero3")
    keys = {"per_param", "per_module", "bucketed", "leaf_coalesced", "deepspeed",
            "deepspeed_leaf"}
    for figure in ("allgathers_per_step", "fetch_release_host_s_per_step", "step_s"):
        assert set(out[figure]) == keys and _positive(*out[figure].values()), figure
    gathers = out["allgathers_per_step"]  # same model, same units: same all-gather counts
    assert gathers["per_module"] == gathers["deepspeed"]
    assert gathers["leaf_coalesced"] == gathers["deepspeed_leaf"]


@pytest.mark.slow
def test_bench_distributed():
    out = run_bench("distributed")
    e2e = out["e2e_4"]
    assert out["quick"] and out["e2e_8"] is None and e2e["world_size"] == 4
    assert _positive(e2e["replay_s"], e2e["total_s"], e2e["iteration_time_s"],
                     e2e["actors_start_rendezvous_s"])
    comms = out["comms"]
    assert comms["world_size"] == 4 and set(comms["kinds"]) == {"all_reduce",
                                                                 "all_gather_into_tensor"}
    assert all(_positive(k["replay_busbw_gbps"], k["raw_busbw_gbps"], k["ratio"])
               for k in comms["kinds"].values())


@pytest.mark.slow
def test_bench_predict():
    out = run_bench("predict")
    row = out["configs"]["ddp_fp32"]
    assert set(out["configs"]) == {"ddp_fp32"}
    assert _positive(row["predicted"], row["measured"], row["ratio"])
    assert isinstance(out["max_abs_error"], (int, float)) and out["max_abs_error"] >= 0


def test_bench_meta_dry_run():
    out = run_bench("meta_dry_run")
    assert out["same_accounting"] is True and out["num_ops"] > 0
    assert _positive(out["meta_us_per_op_70b_2l"], out["meta_us_per_op_70b_2l_kernels"],
                     out["accounted_peak_bytes"])


@pytest.mark.slow
def test_bench_predict_speed():
    out = run_bench("predict_speed", "--skip", "fit_search")
    assert out["quick"] is True and out["fit_search_70b_s"] is None
    assert _positive(out["predict_8b_cold_s"], out["predict_8b_cached_s"],
                     out["predict_70b_cold_s"], out["dry_run_1024_s"],
                     out["driver_rss_1024_gib"], out["meta_us_per_op_70b"],
                     out["predict_8b_cached_rss_gib"], out["predicted_reserved_8b_bytes"],
                     out["predict_405b_cold_s"])  # the 405B TP 8 x FSDP2 preset, cut to 2 layers
    # the cached run reused the capture: no capture time in its own timings
    assert out["predict_8b_timings_s"]["cached"]["capture_s"] < 1
    assert out["predict_8b_timings_s"]["cold"]["capture_s"] > 0
    assert out["dry_run_num_ranks"] == 8 and out["dry_run_num_replays"] == 1
    assert set(out["targets_met"]) == set(out["targets"]) - {"fit_search_70b_s"}


def test_bench_fit_search():
    out = run_bench("fit_search")
    assert _positive(out["fit_search_quick_s"], out["fit_search_quick_cold_s"])
    assert out["num_captured"] > 0 and out["num_captured_cached_run"] == 0  # cold, then cached
    assert out["same_answers"] is True
    assert set(out["answers"]) == {"batch_size", "seq_len", "world_size",
                                   "activation_checkpointing"}
    assert out["num_probes"] == sum(a["num_probes"] for a in out["answers"].values())
