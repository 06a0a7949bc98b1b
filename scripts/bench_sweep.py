"""Sweep benchmarks (issue 10); prints ONE JSON line.

    .venv/bin/python scripts/bench_sweep.py [--only sweep,min_memory]

- ``sweep_over_3x_single``: a 3-point threshold sweep of the demo through the CLI, total wall
  time / the wall times of the same three points run one command each (one before the sweep,
  two after it, so machine drift hits both sides).
  Target < 0.6: the sweep starts Ray and the rank actors once and the ranks parse their
  traces once.
- ``min_memory_steps``, ``min_memory_s``: ``tracefleet experiment=min_memory`` on the demo
  (meta device): replays over all allocation modes, and the command's wall time.

Every command runs in a temp dir of its own with its own Ray temp dir. Other benchmarks of
the issue add a function to ``BENCHES`` returning their keys.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
ENTRY = [sys.executable, "-c", "from orchestrator.main import main; main()"]
# One point of the demo at 12MiB: faithful completes only when it flushes (threshold < 1).
POINT = ["replay.allocation.mode=faithful", "replay.device_memory_capacity=12MiB"]
THRESHOLDS = ("1.0", "0.5", "0.25")
TIMEOUT_S = 900


def _tracefleet(args: list[str], cwd: Path) -> float:
    """Run ``tracefleet`` with ``args`` in ``cwd``; returns its wall time in seconds."""
    ray_tmp = tempfile.mkdtemp(prefix="tfb", dir="/tmp")  # short: Ray's socket paths
    try:
        t0 = time.perf_counter()
        proc = subprocess.run([*ENTRY, *args, f"cluster.temp_dir={ray_tmp}"], cwd=cwd,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        wall_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if proc.returncode not in (0, 1):  # 1: a point not ok is a result here
        sys.exit(f"tracefleet {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall_s


def bench_sweep(work: Path) -> dict:
    """``sweep_over_3x_single`` (see the module docstring)."""
    singles = []
    for i, threshold in enumerate(THRESHOLDS):
        if i == 1:  # the sweep between the single runs: drift hits both sides
            sweep_s = _tracefleet(["--multirun", *POINT, "replay.allocation.device_memory_threshold="
                                   + ",".join(THRESHOLDS), f"hydra.sweep.dir={work / 'sweep'}"], work)
        singles.append(_tracefleet([*POINT, f"replay.allocation.device_memory_threshold={threshold}",
                                    f"hydra.run.dir={work / f'single{i}'}"], work))
    rows = pd.read_csv(work / "sweep" / "results.csv")
    if len(rows) != len(THRESHOLDS):
        sys.exit(f"the sweep recorded {len(rows)} rows, expected {len(THRESHOLDS)}")
    print(f"single runs {', '.join(f'{s:.1f}' for s in singles)} s; 3-point sweep {sweep_s:.1f} s "
          f"({', '.join(rows['status'])})", file=sys.stderr)
    return {"sweep_over_3x_single": round(sweep_s / sum(singles), 3)}


def bench_min_memory(work: Path) -> dict:
    """``min_memory_steps`` and ``min_memory_s`` (see the module docstring)."""
    run_dir = work / "min_memory"
    wall_s = _tracefleet(["experiment=min_memory", f"hydra.run.dir={run_dir}"], work)
    rows = pd.read_csv(run_dir / "results.csv")
    answers = rows[rows["kind"] == "min_memory"]
    for _, a in answers.iterrows():
        print(f"min_memory {a['replay.allocation.mode']}: {int(a['min_capacity_bytes'])} B in "
              f"{int(a['num_steps'])} replays ({a['status']})", file=sys.stderr)
    return {"min_memory_steps": int(answers["num_steps"].sum()), "min_memory_s": round(wall_s, 2)}


BENCHES = {"sweep": bench_sweep, "min_memory": bench_min_memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHES),
                        help=f"comma-separated subset of {', '.join(BENCHES)}")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; expected among {sorted(BENCHES)}")
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_sweep") as tmp:
        for name in names:
            work = Path(tmp) / name
            work.mkdir()
            out.update(BENCHES[name](work))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
