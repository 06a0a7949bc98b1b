"""Traces nobody here wrote: every public GPU trace replayed on cpu and on meta; one JSON line.

Each rank of each file under ``shared/traces/public/param/`` (the DLRM archive's eight rank
members included) is loaded and replayed through the rank's engine (`RankSession`) in compute
mode, one iteration, on ``cpu`` and on ``meta`` (after one warm-up there). Per run: coverage, ops
translated from a GPU-only kernel, stand-ins (meta ops that need values), skipped ops by name
and reason, load and iteration time. Then the DLRM archive runs on 8 ranks through the CLI
(``tracefleet trace.dir=<archive> replay=dry_run``). Target: coverage >= 0.99 everywhere.

    python scripts/bench_foreign.py [--traces DIR] [--no-cli] [--quick]

``--quick``: the same on the smallest file only, its CLI run included (seconds, for the smoke
test). ``cli`` is null when the CLI run is skipped (``--no-cli``, or no archive).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.replay.config import AllocationConfig, ReplayConfig  # noqa: E402
from actors.replay.ops.translate import TRANSLATIONS  # noqa: E402
from actors.replay.session import RankSession  # noqa: E402
from actors.trace import load_trace  # noqa: E402
from actors.trace.source import discover  # noqa: E402
from orchestrator.outputs import RunDir  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

TARGET_COVERAGE = 0.99
CLI_TIMEOUT_S = 900
DLRM_ARCHIVE = "dlrm_pytorch_et.tar.gz"
RUN_KEYS = {k: None for k in ("trace", "rank", "load_s", "device", "status", "error",
                              "coverage", "num_in_scope", "translated", "standins", "skipped",
                              "iteration_s", "wall_s")}
CLI_KEYS = {k: None for k in ("archive", "exit_code", "status", "world_size", "coverage",
                              "translated", "standins", "wall_s", "error")}
# the keys of the JSON line (scripts/json_layout.py); by op name or device where data-keyed
KEYS = {"traces": None, "num_runs": None, "min_coverage": {"cpu": None, "meta": None},
        "target_met": None, "skipped_total": None, "equivalents": None, "runs": [RUN_KEYS],
        "cli": CLI_KEYS, "torch": None, "threads": None}


def _default_traces() -> Path:
    shared = os.environ.get("TRACEFLEET_SHARED_DIR")
    candidates = [Path(shared)] if shared else [ROOT.parent / "shared", Path("/work/shared")]
    folder = next((c for c in candidates if c.is_dir()), candidates[0])
    return folder / "traces" / "public" / "param"


def skipped_by_name(engine) -> dict[str, int]:
    """'op name: reason' -> count, over the ops in scope that did not run."""
    return dict(Counter(f"{s.op.name}: {s.reason}" for s in engine.steps
                        if s.kind in ("skip", "failed") and s.reason != "out of scope"))


def replay(trace, device: str) -> dict:
    """One measured iteration; on meta after one warm-up (the first meta call of an op pays
    one-time setup in torch, seconds per process), on cpu without (a GPT-2 step is a minute)."""
    cfg = ReplayConfig(mode="compute", device=device, iters=1,
                       warmup_iters=1 if device == "meta" else 0, measure_memory=False,
                       allocation=AllocationConfig(mode="lazy"))
    t0 = time.perf_counter()
    engine = RankSession(cfg).compile(trace)
    report = engine.run().to_dict()
    return {"device": device, "status": report["status"], "error": report["error"],
            "coverage": round(report["coverage"], 4), "num_in_scope": report["num_in_scope"],
            "translated": report["translated_ops"], "standins": report["standin_ops"],
            "skipped": skipped_by_name(engine),
            "iteration_s": round(report["iteration_time_s"], 3)
            if report["iteration_time_s"] is not None else None,
            "wall_s": round(time.perf_counter() - t0, 2)}


def engine_runs(folder: Path, quick: bool = False) -> list[dict]:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if quick:
        files = [min(files, key=lambda p: p.stat().st_size)]
    runs = []
    for path in files:
        for rank, source in sorted(discover(path).items()):
            t0 = time.perf_counter()
            trace = load_trace(source)
            load_s = round(time.perf_counter() - t0, 2)
            for device in ("cpu", "meta"):
                runs.append({"trace": path.name, "rank": rank, "load_s": load_s,
                             **replay(trace, device)})
    return runs


def cli_run(archive: Path) -> dict:
    """The archive on all its ranks through the CLI, dry run on meta; summary.json's figures
    (null where the run gave none, ``error`` then says why)."""
    out = dict.fromkeys(CLI_KEYS, None) | {"archive": archive.name}
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [str(Path(sys.executable).with_name("tracefleet")), f"trace.dir={archive}",
               "replay=dry_run", f"hydra.run.dir={run_dir}"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return out | {"error": f"no result within {CLI_TIMEOUT_S} s"}
        out.update(exit_code=proc.returncode, wall_s=round(time.perf_counter() - t0, 1))
        summary_path = RunDir(run_dir).summary
        if not summary_path.is_file():
            return out | {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        summary = json.loads(summary_path.read_text())
    return out | {"status": summary["status"], "world_size": summary["world_size"],
                  "coverage": round(summary["coverage"], 4),
                  "translated": summary.get("translated_ops"),
                  "standins": summary.get("standin_ops"), "error": summary.get("error")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=_default_traces())
    ap.add_argument("--no-cli", action="store_true", help="skip the 8-rank CLI run")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the smallest trace file only, also through the CLI")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.traces.is_dir():
        raise SystemExit(f"bench_foreign: no trace folder {args.traces} (shared/traces/public)")
    runs = engine_runs(args.traces, args.quick)
    min_coverage = {d: min(r["coverage"] for r in runs if r["device"] == d)
                    for d in ("cpu", "meta")}
    skipped = Counter()
    for r in runs:
        skipped.update({f"{r['device']} {k}": v for k, v in r["skipped"].items()})
    translated = sorted({name for r in runs for name in r["translated"]})
    result = {"traces": str(args.traces), "num_runs": len(runs), "min_coverage": min_coverage,
              "target_met": all(r["status"] == "ok" and r["coverage"] >= TARGET_COVERAGE
                                for r in runs),
              "skipped_total": dict(skipped),
              "equivalents": {name: TRANSLATIONS[name].target for name in translated},
              "runs": runs, "cli": None}
    # --quick: the CLI on the file the engine runs had (the smallest)
    archive = args.traces / runs[0]["trace"] if args.quick else args.traces / DLRM_ARCHIVE
    if not args.no_cli and archive.is_file():
        result["cli"] = cli_run(archive)
        result["target_met"] = result["target_met"] and result["cli"]["status"] == "ok" \
            and result["cli"]["coverage"] >= TARGET_COVERAGE
    result.update(torch=torch.__version__, threads=torch.get_num_threads())
    emit(result, KEYS if result["cli"] else {**KEYS, "cli": None})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
