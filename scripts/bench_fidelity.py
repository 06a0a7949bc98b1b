"""Fidelity benchmark: the replay against the original run it was captured from; one JSON line.

For every trace folder whose meta.json names its capture workload (the demos, and any folder
given on the command line), in one run on one Ray cluster:

* **time, side by side**: the original (the capture workload, re-built from meta.json: same
  config, same world size, same threads per rank, trained the same way; orchestrator/run/original.py)
  and the replay (faithful, and faithful with ``replay.host_gaps``) run alternately, for
  ``--rounds`` rounds. Both sides give the same statistic: the slowest rank per iteration,
  median over ``--iters`` (>= 10) iterations. Each round's ratio (replay / the original of
  that round) and the median of the rounds' ratios are reported, with the spread of the rounds.
  The original's time recorded in meta.json is shown beside it, never used as the reference:
  it was measured on another machine or hours earlier, and this machine's speed drifts.
* **host gaps**: whether they were calibrated (from the profiler's own cost measured at
  capture: actors/replay/host_gaps.py), by which scale, and the share of the replay's
  iteration spent spinning (median over ranks).
* **memory** (each allocation mode, once): replay measured peak / original measured peak
  (max over ranks of each, both from the CPU allocator's events; memory does not drift).

Targets in faithful mode: memory_ratio 0.9-1.1 on every folder; time_ratio 0.85-1.15 with
host gaps on every folder, and without them on the data-parallel one.

    python scripts/bench_fidelity.py [FOLDER ...] [--rounds 3] [--iters 10]

``--quick``: one round of 2 iterations per side on the first folder (every figure; the other
folders run the same code on other inputs).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.replay.config import AllocationConfig, ReplayConfig  # noqa: E402
from actors.replay.timed_iterations import median_interval  # noqa: E402
from orchestrator.config import RunConfig, TraceConfig  # noqa: E402
from orchestrator.outputs import RunDir  # noqa: E402
from orchestrator.run.launch import run_replay  # noqa: E402
from orchestrator.run.sinks import file_sinks  # noqa: E402
from orchestrator.run.aggregate import slowest_series_s  # noqa: E402
from orchestrator.run.original import OriginalWorkload  # noqa: E402
from orchestrator.run.session import ReplaySession  # noqa: E402
from scripts.json_layout import EACH, emit  # noqa: E402

DEMOS = ("gpt_dp_4", "gpt_zero3_2", "gpt_zero3_leaf_2")
TIMED = (("faithful", False), ("faithful", True))  # replays timed against the original
MEMORY_ONLY = ("lazy", "pre_allocate")
MEMORY_TARGET = (0.9, 1.1)
TIME_TARGET = (0.85, 1.15)
_STAT = {"s": None, "n": None, "ci95": None}
_TIMED_KEYS = [mode + ("+host_gaps" if gaps else "") for mode, gaps in TIMED]
_FOLDER = {
    "rounds": [{"original": _STAT, **{k: {**_STAT, "ratio": None} for k in _TIMED_KEYS}}],
    **{f"{mode}_memory_ratio": None for mode in ("faithful", *MEMORY_ONLY)},
    "machine_warnings": None,
    "host_gaps": dict.fromkeys(("calibrated", "scale", "calibration", "spin_share")),
    **{f"{k}_time_ratio{tail}": None for k in _TIMED_KEYS for tail in ("", "_range")},
    "recorded_original": dict.fromkeys(("s", "captured_at", "faithful_ratio_to_it",
                                        "original_now_to_it")),
    "targets_met": None}
# the keys of the JSON line (scripts/json_layout.py); folders by name
KEYS = {"folders": {EACH: _FOLDER}, "rounds": None, "iters": None, "memory_target": None,
        "time_target": None, "all_targets_met": None}


def _meta(folder: Path) -> dict:
    meta = json.loads(RunDir(folder).meta.read_text())
    if not (meta.get("memory") or {}).get("peak_bytes") or not meta.get("workload"):
        raise SystemExit(f"{folder}/meta.json names no capture workload or measured memory "
                         "(memory.peak_bytes): re-capture it with tracefleet-capture")
    return meta


def _recorded_s(meta: dict) -> float:
    """The original's time as meta.json recorded it: slowest rank per iteration, median."""
    ranks = [{"iteration_times_s": r["iteration_times_s"]} for r in meta["ranks"]]
    return statistics.median(slowest_series_s(ranks))


def _stat(series: list[float]) -> dict:
    ci = median_interval(series)
    return {"s": round(statistics.median(series), 6), "n": len(series),
            "ci95": [round(ci.low, 6), round(ci.high, 6)] if ci else None}


def _replay(folder: Path, mode: str, host_gaps: bool, iters: int, measure: bool,
            session, out: Path) -> dict:
    cfg = RunConfig(trace=TraceConfig(dir=str(folder)),
                    replay=ReplayConfig(mode="full", iters=iters, warmup_iters=2,
                                        measure_memory=measure, host_gaps=host_gaps,
                                        allocation=AllocationConfig(mode=mode)))
    summary = run_replay(cfg, out, session=session, sinks=file_sinks())
    if summary["status"] != "ok":
        raise SystemExit(f"{folder.name} {mode}: {summary['status']}: {summary['error']}")
    return summary


def _host_gaps(summary: dict) -> dict:
    """Calibration and spin share of a host-gap replay (median over ranks)."""
    rows = [(r["host_gaps"], r["iteration_time_s"]) for r in summary["ranks"] if r.get("host_gaps")]
    first = rows[0][0]
    return {"calibrated": first["calibrated"], "scale": round(first["scale"], 4),
            "calibration": first["calibration"],
            "spin_share": round(statistics.median(g["added_s_per_iteration"] / t
                                                  for g, t in rows), 3)}


def bench_folder(folder: Path, rounds: int, iters: int, session, tmp: Path) -> dict:
    """Side-by-side time rounds, host-gap figures and memory ratios of one folder."""
    meta = _meta(folder)
    row = {"rounds": []}
    with OriginalWorkload(meta) as original:
        for k in range(rounds):
            entry = {"original": _stat(original.time(iters))}
            for mode, gaps in TIMED:
                key = mode + ("+host_gaps" if gaps else "")
                measure = k == 0 and not gaps  # memory once, in faithful mode
                s = _replay(folder, mode, gaps, iters, measure, session, tmp / f"{key}-{k}")
                entry[key] = {**_stat(slowest_series_s(s["ranks"])),
                              "ratio": round(s["iteration_time_s"] / entry["original"]["s"], 3)}
                if measure:
                    row[f"{mode}_memory_ratio"] = round(
                        s["measured_peak_bytes"] / meta["memory"]["peak_bytes"], 3)
                    row["machine_warnings"] = s.get("machine_warnings") or []
                if gaps:
                    row["host_gaps"] = _host_gaps(s)
            row["rounds"].append(entry)
    for mode, gaps in TIMED:
        key = mode + ("+host_gaps" if gaps else "")
        ratios = [r[key]["ratio"] for r in row["rounds"]]
        row[f"{key}_time_ratio"] = round(statistics.median(ratios), 3)
        row[f"{key}_time_ratio_range"] = [min(ratios), max(ratios)]
    recorded = _recorded_s(meta)
    row["recorded_original"] = {
        "s": round(recorded, 6), "captured_at": meta.get("captured_at"),
        "faithful_ratio_to_it": round(statistics.median(
            r["faithful"]["s"] for r in row["rounds"]) / recorded, 3),
        "original_now_to_it": round(statistics.median(
            r["original"]["s"] for r in row["rounds"]) / recorded, 3)}
    for mode in MEMORY_ONLY:
        s = _replay(folder, mode, False, 1, True, session, tmp / mode)
        row[f"{mode}_memory_ratio"] = round(s["measured_peak_bytes"] / meta["memory"]["peak_bytes"], 3)
    ok = MEMORY_TARGET[0] <= row["faithful_memory_ratio"] <= MEMORY_TARGET[1]
    ok &= TIME_TARGET[0] <= row["faithful+host_gaps_time_ratio"] <= TIME_TARGET[1]
    if meta["workload"].get("parallel") == "ddp":
        ok &= TIME_TARGET[0] <= row["faithful_time_ratio"] <= TIME_TARGET[1]
    row["targets_met"] = ok
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", help="trace folders with a meta.json (default: the demos)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations original/replay (>= 3)")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per side (>= 10)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the first folder, one round of 2 iterations per side")
    args = ap.parse_args()
    if not args.quick and (args.rounds < 3 or args.iters < 10):
        raise SystemExit("--rounds must be >= 3 and --iters >= 10 (a median of fewer says little)")
    logging.disable(logging.INFO)
    folders = [Path(f) for f in args.folders] or [ROOT / "demo" / "traces" / d for d in DEMOS]
    if args.quick:
        folders, args.rounds, args.iters = folders[:1], 1, 2
    worlds = [json.loads(RunDir(f).meta.read_text())["world_size"] for f in folders]
    # both groups (the original's, the replay's) at once: one logical CPU per rank each
    ray.init(num_cpus=2 * max(worlds), include_dashboard=False, log_to_driver=False)
    session, results = ReplaySession(), {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for folder in folders:
                results[folder.name] = bench_folder(folder, args.rounds, args.iters, session,
                                                    Path(tmp) / folder.name)
    finally:
        session.close()
        ray.shutdown()
    emit({"folders": results, "rounds": args.rounds, "iters": args.iters,
          "memory_target": MEMORY_TARGET, "time_target": TIME_TARGET,
          "all_targets_met": all(r["targets_met"] for r in results.values())}, KEYS)


if __name__ == "__main__":
    main()
