"""A 1,024-rank dry run of a meta capture: wall time end to end, the driver's peak RSS and the
number of replays; prints one JSON line.

The traces come from ``tracefleet-capture workload=<workload> world_size=<N>
workload.kind=llama_local`` (meta: rank 0 recorded, hard-linked for every rank), captured into
``--trace-dir`` unless it already holds them. The dry run is the ``tracefleet`` CLI
(``replay=dry_run``, replay.mode=compute on meta) in a fresh driver process; the wall time
covers all of it (imports, pre-flight, Ray start, actors, replay, aggregation, outputs). The
driver's RSS is its own peak (``RUSAGE_SELF``): Ray's processes are not in it.

    python scripts/bench_dry_run_scale.py [--workload llama_70b] [--world-size 1024]
        [--iters 1] [--trace-dir ~/.cache/tracefleet/bench_dry_run/llama_70b-1024]
        [--compare-ranks 8]
    python scripts/bench_dry_run_scale.py --quick   # llama_8b shapes, 2 layers, 8 ranks, in a
                                                    # temporary folder, compared at 2 ranks

The keys name no input (``world_size``, ``compare.num_ranks`` do): a quick run prints the keys
of a full one. ``compare`` is null without ``--compare-ranks``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.outputs import RunDir  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

BIN = Path(sys.executable).parent
TIMEOUT_S = 1800
GIB = 1 << 30
# --quick: a small preset cut to a few layers at a small world, captured afresh each run
QUICK_WORKLOAD, QUICK_WORLD_SIZE, QUICK_LAYERS, QUICK_COMPARE_RANKS = "llama_8b", 8, 2, 2
# the keys of the JSON line (scripts/json_layout.py)
KEYS = {**dict.fromkeys(("quick", "workload", "world_size", "iters", "capture_s", "dry_run_s",
                         "driver_rss_gib", "num_replays")),
        "compare": dict.fromkeys(("num_ranks", "dedup_s", "every_rank_s")),
        "timings_s": dict.fromkeys(("preflight_s", "cluster_start_s", "actor_start_s",
                                    "trace_load_s", "rendezvous_s", "replay_s", "teardown_s",
                                    "aggregation_s", "total_s"))}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def capture(workload: str, world_size: int, out_dir: Path, *extra: str) -> float | None:
    """Capture the meta world into out_dir unless its last rank is there; seconds, or None.
    ``extra``: more ``tracefleet-capture`` overrides (--quick's layer count)."""
    if any(out_dir.glob(f"rank-{world_size - 1}.et.json*")):
        return None
    t0 = time.perf_counter()
    subprocess.run([str(BIN / "tracefleet-capture"), f"workload={workload}",
                    f"world_size={world_size}", "workload.kind=llama_local", f"out_dir={out_dir}",
                    *extra],
                   check=True, env=_env(), cwd=ROOT, timeout=TIMEOUT_S, capture_output=True)
    return time.perf_counter() - t0


def drive(rss_file: str, overrides: list[str]) -> None:
    """The tracefleet CLI in this process; its peak RSS written to rss_file on the way out."""
    from orchestrator.cli.main import main as tracefleet_main

    sys.argv = ["tracefleet", *overrides]
    try:
        tracefleet_main()
    finally:
        Path(rss_file).write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def dry_run(trace_dir: Path, iters: int, out_dir: Path, *extra: str) -> dict:
    """One dry run in a fresh driver: wall seconds, driver peak RSS, the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rss_file = out_dir / "driver_rss_bytes"
    overrides = [f"trace.dir={trace_dir}", "replay=dry_run", f"replay.iters={iters}",
                 f"hydra.run.dir={out_dir / 'run'}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--drive", str(rss_file), *overrides],
                          env=_env(), cwd=ROOT, timeout=TIMEOUT_S, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"dry run failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(RunDir(out_dir / "run").summary.read_text())
    return {"wall_s": wall_s, "rss_bytes": int(rss_file.read_text()), "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="llama_70b")
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=1, help="replay.iters of the dry run")
    parser.add_argument("--trace-dir", type=Path)
    parser.add_argument("--compare-ranks", type=int, default=0,
                        help="also dry-run this many ranks of the folder (trace.ranks) with and "
                             "without experiment.dedup_identical_ranks, side by side")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_WORKLOAD} with {QUICK_LAYERS} layers at "
                             f"{QUICK_WORLD_SIZE} ranks, captured into a temporary folder, "
                             f"compared at {QUICK_COMPARE_RANKS} ranks: for the smoke test")
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.drive:
        drive(args.drive, rest)
        return
    extra = []
    if args.quick:
        args.workload, args.world_size = QUICK_WORKLOAD, QUICK_WORLD_SIZE
        args.compare_ranks = QUICK_COMPARE_RANKS
        extra = [f"workload.n_layers={QUICK_LAYERS}"]
    with tempfile.TemporaryDirectory(prefix="bench_dry_run_") as tmp:
        trace_dir = args.trace_dir or (Path(tmp) / "traces" if args.quick else
                                       Path.home() / ".cache" / "tracefleet" / "bench_dry_run" /
                                       f"{args.workload}-{args.world_size}")
        capture_s = capture(args.workload, args.world_size, trace_dir, *extra)
        compare = None
        run = dry_run(trace_dir, args.iters, Path(tmp) / "all")
        if args.compare_ranks:
            ranks = f"trace.ranks=[{','.join(map(str, range(args.compare_ranks)))}]"
            compare = {"num_ranks": args.compare_ranks}
            for dedup in (True, False):
                small = dry_run(trace_dir, args.iters, Path(tmp) / f"dedup-{dedup}", ranks,
                                f"experiment.dedup_identical_ranks={str(dedup).lower()}")
                compare[f"{'dedup' if dedup else 'every_rank'}_s"] = round(small["wall_s"], 2)
    summary = run["summary"]
    assert summary["status"] == "ok", summary.get("error")
    assert len(summary["ranks"]) == args.world_size
    emit({
        "quick": args.quick, "workload": args.workload, "world_size": args.world_size,
        "iters": args.iters, "capture_s": capture_s,  # None: the traces were already there
        "dry_run_s": round(run["wall_s"], 2), "driver_rss_gib": round(run["rss_bytes"] / GIB, 3),
        "num_replays": summary["num_replays"], "compare": compare,
        "timings_s": {k: round(v, 2) for k, v in summary["timings_s"].items()}},
        KEYS if compare else {**KEYS, "compare": None})


if __name__ == "__main__":
    main()
