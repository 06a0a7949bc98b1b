"""Fidelity benchmark: the replay against the original run it was captured from; one JSON line.

For every trace folder whose meta.json holds the original's eager iteration time and its
measured peak memory (the demos, and any folder given on the command line), a full replay
through the CLI path (`orchestrator.launch.run_replay` on a local Ray cluster, one actor per
rank, the trace's process groups) in each allocation mode, and in faithful mode once more
with ``replay.host_gaps=true``. Per folder and mode:

* ``time_ratio`` = replay iteration time / original eager time, both the slowest rank's per
  iteration (a synchronous step ends when its slowest rank does), median over iterations; the
  original's from the per-rank iteration times meta.json records (measured at capture with
  nothing attached);
* ``memory_ratio`` = replay measured peak / original measured peak (max over ranks of each,
  both from the CPU allocator's events).

Same machine and thread count as the capture (one CPU slot, one intra-op thread per rank).
Targets in faithful mode: memory_ratio 0.9-1.1 on every folder; time_ratio 0.85-1.15 with
host gaps on every folder, and without them on the data-parallel one.

    python scripts/bench_fidelity.py [FOLDER ...] [--iters 5]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.replay.config import AllocationConfig, ReplayConfig  # noqa: E402
from orchestrator.config import RunConfig, TraceConfig  # noqa: E402
from orchestrator.launch import run_replay  # noqa: E402
from orchestrator.session import ReplaySession  # noqa: E402

DEMOS = ("gpt_dp_4", "gpt_zero3_2", "gpt_zero3_leaf_2")
RUNS = (("faithful", False), ("faithful", True), ("lazy", False), ("pre_allocate", False))
MEMORY_TARGET = (0.9, 1.1)
TIME_TARGET = (0.85, 1.15)


def _original(folder: Path) -> dict:
    meta = json.loads((folder / "meta.json").read_text())
    memory = meta.get("memory") or {}
    if not memory.get("peak_bytes") or not meta.get("iteration_time_s"):
        raise SystemExit(f"{folder}/meta.json has no measured memory (memory.peak_bytes) or "
                         "eager time: re-capture it with tracefleet-capture")
    series = [r["iteration_times_s"] for r in meta.get("ranks", []) if r.get("iteration_times_s")]
    slowest = statistics.median(max(s[k] for s in series) for k in range(min(map(len, series)))) \
        if series else meta["iteration_time_s"]
    return {"iteration_s": slowest, "peak_bytes": memory["peak_bytes"],
            "data_parallel": meta.get("workload", {}).get("kind", "").endswith("_dp")}


def _replay(folder: Path, mode: str, host_gaps: bool, iters: int, session, out: Path) -> dict:
    cfg = RunConfig(trace=TraceConfig(dir=str(folder)),
                    replay=ReplayConfig(mode="full", iters=iters, warmup_iters=2,
                                        allocation=AllocationConfig(mode=mode),
                                        host_gaps=host_gaps))
    summary = run_replay(cfg, out, session=session, quiet=True)
    if summary["status"] != "ok":
        raise SystemExit(f"{folder.name} {mode}: {summary['status']}: {summary['error']}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", help="trace folders with a meta.json (default: the demos)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the first folder only, one iteration per mode")
    args = ap.parse_args()
    logging.disable(logging.INFO)
    folders = [Path(f) for f in args.folders] or [ROOT / "demo" / "traces" / d for d in DEMOS]
    if args.quick:
        folders, args.iters = folders[:1], 1
    results, met = {}, True
    session = ReplaySession()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for folder in folders:
                original = _original(folder)
                rows = results[folder.name] = {}
                for mode, host_gaps in RUNS:
                    s = _replay(folder, mode, host_gaps, args.iters, session,
                                Path(tmp) / f"{folder.name}-{mode}-{host_gaps}")
                    key = mode + ("+host_gaps" if host_gaps else "")
                    rows[key] = {
                        "time_ratio": round(s["iteration_time_s"] / original["iteration_s"], 3),
                        "memory_ratio": round(s["measured_peak_bytes"] / original["peak_bytes"], 3),
                        "replay_iteration_s": round(s["iteration_time_s"], 5),
                        "replay_measured_peak_bytes": s["measured_peak_bytes"],
                        "replay_accounted_peak_bytes": s["accounted_peak_bytes"]}
                rows["original"] = original
                faithful, gapped = rows["faithful"], rows["faithful+host_gaps"]
                ok = MEMORY_TARGET[0] <= faithful["memory_ratio"] <= MEMORY_TARGET[1]
                ok &= TIME_TARGET[0] <= gapped["time_ratio"] <= TIME_TARGET[1]
                if original["data_parallel"]:
                    ok &= TIME_TARGET[0] <= faithful["time_ratio"] <= TIME_TARGET[1]
                rows["targets_met"] = ok
                met &= ok
    finally:
        session.close()
    print(json.dumps({"folders": results, "memory_target": MEMORY_TARGET,
                      "time_target": TIME_TARGET, "all_targets_met": met}))


if __name__ == "__main__":
    main()
