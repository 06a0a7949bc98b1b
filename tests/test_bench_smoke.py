"""Every benchmark script runs whole: ``scripts/bench_*.py --quick`` runs each of the script's
benchmarks end to end on tiny inputs, and its one JSON line must hold exactly the keys the
script declares for a full run (its ``KEYS``, scripts/json_layout.py: a key it stops printing
fails here), with sane values. Figures are not asserted: quick runs are too short to measure
anything (docs/benchmarks.md has the real runs). scripts/bench_predict.py keeps its own check."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.json_layout import mismatches

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
# pytest's bound on the tests that start Ray many times (the default is 300 s): above
# run_bench's own, which fails first and says which script
SLOW_TIMEOUT_S = TIMEOUT_S + 60
SCRIPT_KEYS = object()  # run_bench's default layout: the script's own KEYS


def run_bench(name: str, *args: str, layout=SCRIPT_KEYS) -> dict:
    """``scripts/bench_<name>.py --quick *args`` in a fresh interpreter; its last stdout line,
    checked against ``layout`` (by default the script's ``KEYS``; None: unchecked)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"bench_{name}.py"), "--quick",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"bench_{name}.py --quick failed:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"bench_{name}.py printed nothing; stderr:\n{proc.stderr[-2000:]}"
    out = json.loads(lines[-1])
    if layout is SCRIPT_KEYS:
        layout = importlib.import_module(f"scripts.bench_{name}").KEYS
    assert mismatches(out, layout) == [], f"bench_{name}.py's line strays from its KEYS"
    return out


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


def test_layout_check_names_every_stray_key():
    """The check the smoke tests rest on: a missing, an extra and a nested key each named."""
    layout = {"a": None, "rows": [{"x": None}], "by_rank": {"*": {"s": None}}}
    assert mismatches({"a": 1, "rows": [{"x": 2}], "by_rank": {"8": {"s": 1}}}, layout) == []
    assert mismatches({"rows": [{"x": 2, "y": 3}], "by_rank": {}, "b": 0}, layout) == [
        "line: missing ['a']", "line: not in KEYS ['b']", "line.rows[0]: not in KEYS ['y']",
        "line.by_rank: expected at least one key"]
    assert mismatches({"a": 1, "rows": [], "by_rank": None}, layout) == [
        "line.rows: expected a non-empty list, got list",
        "line.by_rank: expected an object, got null"]


def test_bench_load(public_trace_dir):
    from scripts.bench_load import layout
    out = run_bench("load", "--source", str(public_trace_dir / "hf_GPT2_et.json.tar.gz"),
                    "--gc-ab", layout=layout(gc_ab=True))
    assert out["nodes"] == 20_000 and out["reps"] == 1
    assert _positive(out["json_load_s"], out["load_trace_s"], out["ratio"], out["file_mb"],
                     out["load_trace_gc_on_s"], out["gc_off_speedup"])
    assert all(_positive(v) for k, v in out.items() if k.startswith("peak_rss_mb_"))


def test_bench_preflight():
    out = run_bench("preflight")
    assert set(out["preflight_driver_rss_gib"]) == set(out["preflight_s"]) == {"8"}
    assert _positive(out["preflight_driver_rss_gib"]["8"], out["rank_file_kib"],
                     out["all_traces_held_rss_gib"]["8"])
    assert out["preflight_s"]["8"] >= 0 and out["layers"] == 20


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_sweep():
    out = run_bench("sweep")
    assert out["quick"] and out["sweep_points"] == 2 and _positive(out["sweep_over_singles"])
    assert out["min_memory_steps"] >= 3 and _positive(out["min_memory_s"])  # >= 1 per mode
    # identical ranks replay once; two distinct traces, two actors (the script checks that
    # every rank reports its own trace's replay)
    for key, num_traces in (("dry_run", 1), ("dry_run_2_traces", 2)):
        run = out[key]
        assert run["world_size"] == 8 and run["num_traces"] == run["num_actors"] == num_traces
        assert len(run["actor_rss_gib"]) == num_traces and _positive(*run["actor_rss_gib"])
        assert run["max_actor_rss_gib"] == max(run["actor_rss_gib"])
        assert _positive(run["s"], run["driver_rss_gib"])
    assert set(out["preflight_driver_rss_gib"]) == {"8"}
    assert _positive(out["preflight_driver_rss_gib"]["8"])


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
    assert _positive(out["eager_compute_s"], out["replay_compute_s"], out["replay_over_eager"],
                     out["demo_meta_over_cpu"], out["large_meta_over_cpu"],
                     out["host_overhead_tiny_ops"], out["host_overhead_tiny_ops_lazy"])
    # measured peaks: pre_allocate holds at least lazy's intermediates; measured >= accounted
    assert out["pre_allocate_over_lazy_measured_min"] >= 1.0
    assert out["lazy_measured_over_accounted_max"] >= 1.0


def test_bench_host_gaps():
    out = run_bench("host_gaps")
    for kind in ("gpt_dp", "gpt_zero3"):
        row = out[kind]
        assert _positive(row["eager_ms"], row["eager_with_ranges_ms"], row["timing_step_ms"])
        assert row["gaps_ms"] >= 0 and row["gaps_with_observer_ms"] >= 0
    assert out["per_gap_us"]["busy_us"] == 50.0 and out["per_gap_us"]["recorded_gap_us"] > 0


def test_bench_cpu_meter():
    out = run_bench("cpu_meter")
    assert out["quick"] and len(out["full"]) == 4  # every rank of demo/traces/gpt_dp_4
    for row in (out["compute_rank0"], *out["full"]):
        assert all(_positive(p["counter"], p["profiler"]) for p in row.values())
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


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_dry_run_scale():
    out = run_bench("dry_run_scale")
    assert out["quick"] and out["workload"] == "llama_8b" and out["world_size"] == 8
    assert out["num_replays"] == 1  # rank 0 hard-linked for every rank: one replay
    assert _positive(out["capture_s"], out["dry_run_s"], out["driver_rss_gib"])
    assert out["timings_s"]["replay_s"] >= 0
    compare = out["compare"]
    assert compare["num_ranks"] == 2 and _positive(compare["dedup_s"], compare["every_rank_s"])


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_fidelity():
    out = run_bench("fidelity")
    assert set(out["folders"]) == {"gpt_dp_4"}  # quick: the first demo
    for row in out["folders"].values():
        assert len(row["rounds"]) == 1  # quick: one round, original then the replays
        for key in ("original", "faithful", "faithful+host_gaps"):
            assert _positive(row["rounds"][0][key]["s"]), key
        assert _positive(row["faithful_time_ratio"], row["faithful+host_gaps_time_ratio"],
                         row["faithful_memory_ratio"], row["lazy_memory_ratio"],
                         row["pre_allocate_memory_ratio"])
        assert isinstance(row["targets_met"], bool)
    assert isinstance(out["all_targets_met"], bool)


@pytest.mark.slow
def test_bench_zero3():
    out = run_bench("zero3")
    for figure in ("allgathers_per_step", "fetch_release_host_s_per_step", "step_s"):
        assert _positive(*out[figure].values()), figure
    gathers = out["allgathers_per_step"]  # same model, same units: same all-gather counts
    assert gathers["per_module"] == gathers["deepspeed"]
    assert gathers["leaf_coalesced"] == gathers["deepspeed_leaf"]
    assert _positive(out["leaf_over_per_module_host"])


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_distributed():
    out = run_bench("distributed")
    assert out["quick"] and out["e2e_4"]["world_size"] == 4
    assert out["e2e_8"]["world_size"] == 2 and _positive(out["capture_8_s"])  # quick: 2 ranks
    for e2e in (out["e2e_4"], out["e2e_8"]):
        assert _positive(e2e["replay_s"], e2e["total_s"], e2e["iteration_time_s"],
                         e2e["actors_start_rendezvous_s"])
    comms = out["comms"]
    assert comms["world_size"] == 2 and comms["sizes_mib"] == [1]
    assert all(_positive(k["replay_busbw_gbps"], k["raw_busbw_gbps"], k["ratio"])
               for k in comms["kinds"].values())


@pytest.mark.slow
def test_bench_predict():
    from scripts.bench_predict import QUICK_CONFIGS

    out = run_bench("predict")
    assert list(out["configs"]) == QUICK_CONFIGS
    for row in out["configs"].values():
        assert _positive(row["predicted"], row["measured"], row["ratio"], row["world_size"])
    assert out["configs"]["fsdp2_tp_sp_bf16_mixed"]["world_size"] == 4
    tracked = out["configs"]["nn_transformer_encoder_fsdp2_checkpoint"]["fsdp_mem_tracker_ratio"]
    assert _positive(tracked)
    assert isinstance(out["max_abs_error"], (int, float)) and out["max_abs_error"] >= 0


def test_bench_meta_dry_run():
    out = run_bench("meta_dry_run")
    assert out["same_accounting"] is True and out["num_ops"] > 0 and out["n_layers"] == 2
    assert _positive(out["meta_us_per_op_70b"], out["meta_us_per_op_70b_kernels"],
                     out["accounted_peak_bytes"])


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_predict_speed():
    out = run_bench("predict_speed")
    assert out["quick"] is True
    assert _positive(out["predict_8b_cold_s"], out["predict_8b_cached_s"],
                     out["predict_70b_cold_s"], out["dry_run_1024_s"],
                     out["driver_rss_1024_gib"], out["meta_us_per_op_70b"],
                     out["predict_8b_cached_rss_gib"], out["predicted_reserved_8b_bytes"],
                     out["fit_search_70b_s"],
                     out["predict_405b_cold_s"])  # the 405B TP 8 x FSDP2 preset, cut to 2 layers
    # the cached run reused the capture: no capture time in its own timings
    assert out["predict_8b_timings_s"]["cached"]["capture_s"] < 1
    assert out["predict_8b_timings_s"]["cold"]["capture_s"] > 0
    assert out["dry_run_num_ranks"] == 8 and out["dry_run_num_replays"] == 1
    assert all(isinstance(met, bool) for met in out["targets_met"].values())


def test_bench_fit_search():
    out = run_bench("fit_search")
    assert out["quick"] is True and out["workload"] == "llama3_8b"
    assert _positive(out["fit_search_s"], out["fit_search_cold_s"])
    assert out["num_captured"] > 0 and out["num_captured_cached_run"] == 0  # cold, then cached
    assert out["same_answers"] is True
    assert set(out["answers"]) == {"batch_size", "seq_len", "world_size",
                                   "activation_checkpointing"}
    assert out["num_probes"] == sum(a["num_probes"] for a in out["answers"].values())


def test_bench_snapshot():
    out = run_bench("snapshot", "--repeats", "1")  # its one benchmark, at 2 layers
    assert _positive(out["plain_cpu_s"], out["page_cpu_s"], out["snapshot_cpu_s"],
                     out["snapshot_s"], out["snapshot_bytes"], out["snapshot_events"],
                     out["reserved_peak_bytes"])
    assert "n_layers=2" in out["job"]
