"""Sweep benchmarks (issue 10); prints ONE JSON line.

    .venv/bin/python scripts/bench_sweep.py [--only sweep,min_memory,dry_run_70b,preflight]

- ``sweep_over_3x_single``: a 3-point threshold sweep of the demo through the CLI, total wall
  time / the wall times of the same three points run one command each (one before the sweep,
  two after it, so machine drift hits both sides).
  Target < 0.6: the sweep starts Ray and the rank actors once and the ranks parse their
  traces once.
- ``min_memory_steps``, ``min_memory_s``: ``tracefleet experiment=min_memory`` on the demo
  (meta device): replays over all allocation modes, and the command's wall time.
- ``dry_run_70b_s``, ``max_actor_rss_gib``, ``driver_rss_gib``: the llama_70b preset (data
  parallel, bf16, seq 8192) captured on meta for 8 ranks (not timed), then
  ``tracefleet replay=dry_run`` of one iteration on 8 ranks: the command's wall time, and the
  peak RSS of each rank actor (max over them) and of the driver. Peak RSS is the kernel's
  high-water mark (``VmHWM`` in /proc/<pid>/status), read every 0.2 s from the driver process
  and from every descendant of it that Ray titled ``ray::RankActor``: a process's high-water
  mark only grows, so the last reading before it exits is its peak up to then.
  Targets: < 120 s, < 4 GiB per actor.
- ``preflight_driver_rss_gib``, ``preflight_s``: ``experiment.preflight_only=true`` over 8,
  64 and 512 small rank files (scripts/bench_preflight.py): the driver's peak RSS (flat is
  the target) and wall time, keyed by rank count.

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
import psutil

REPO = Path(__file__).resolve().parents[1]
ENTRY = [sys.executable, "-c", "from orchestrator.cli.main import main; main()"]
# One point of the demo at 12MiB: faithful completes only when it flushes (threshold < 1).
POINT = ["replay.allocation.mode=faithful", "replay.device_memory_capacity=12MiB"]
THRESHOLDS = ("1.0", "0.5", "0.25")
TIMEOUT_S = 900
GIB = 2**30
QUICK = False  # --quick: the smallest inputs (set by main)
RSS_POLL_S = 0.2


def _tracefleet(args: list[str], cwd: Path, peaks: dict | None = None) -> float:
    """Run ``tracefleet`` with ``args`` in ``cwd``; returns its wall time in seconds. With
    ``peaks``, fills ``{"driver": bytes, "actors": {pid: bytes}}`` with peak RSS (see
    ``_watch_peaks``)."""
    ray_tmp = tempfile.mkdtemp(prefix="tfb", dir="/tmp")  # short: Ray's socket paths
    err = tempfile.TemporaryFile(mode="w+")
    try:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*ENTRY, *args, f"cluster.temp_dir={ray_tmp}"], cwd=cwd,
                                env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            if peaks is not None:
                _watch_peaks(proc, peaks, t0 + TIMEOUT_S)
            returncode = proc.wait(timeout=max(1.0, t0 + TIMEOUT_S - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            sys.exit(f"tracefleet {' '.join(args)} ran past {TIMEOUT_S} s")
        wall_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if returncode not in (0, 1):  # 1: a point not ok is a result here
        err.seek(0)
        sys.exit(f"tracefleet {' '.join(args)} exited {returncode}:\n{err.read()[-3000:]}")
    return wall_s


def _hwm_bytes(pid: int) -> int | None:
    """The peak RSS (VmHWM) of process ``pid`` so far; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def _watch_peaks(proc: subprocess.Popen, peaks: dict, deadline: float) -> None:
    """Until ``proc`` exits (or ``deadline``): the driver's VmHWM and that of each of its
    descendants titled ``ray::RankActor`` (Ray sets the title when the actor is created)."""
    driver = psutil.Process(proc.pid)
    peaks.update(driver=0, actors={})
    while proc.poll() is None and time.perf_counter() < deadline:
        peaks["driver"] = max(peaks["driver"], _hwm_bytes(proc.pid) or 0)
        try:
            children = driver.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for child in children:
            try:
                if "RankActor" not in " ".join(child.cmdline()):
                    continue
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            hwm = _hwm_bytes(child.pid)
            if hwm is not None:
                peaks["actors"][child.pid] = max(peaks["actors"].get(child.pid, 0), hwm)
        time.sleep(RSS_POLL_S)


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


def bench_dry_run_70b(work: Path) -> dict:
    """``dry_run_70b_s``, ``max_actor_rss_gib``, ``driver_rss_gib`` (see the module docstring)."""
    from orchestrator.run.capture import CaptureConfig, run_capture_job
    from orchestrator.studies.study_traces import workload_config

    traces = work / "llama_70b_dp_8"
    run_capture_job(CaptureConfig(workload=workload_config("llama_70b"), world_size=8,
                                  out_dir=str(traces)))
    peaks: dict = {}
    run_dir = work / "dry_run"
    wall_s = _tracefleet([f"trace.dir={traces}", "replay=dry_run", "replay.warmup_iters=0",
                          "replay.iters=1", f"hydra.run.dir={run_dir}"], work, peaks)
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary["status"] != "ok" or summary["world_size"] != 8:
        sys.exit(f"the 70B dry run ended {summary['status']} on {summary['world_size']} ranks: "
                 f"{summary.get('error')}")
    if len(peaks["actors"]) != 8:
        sys.exit(f"saw {len(peaks['actors'])} rank actors, expected 8")
    phases = ", ".join(f"{k} {v:.1f}" for k, v in summary["timings_s"].items())
    print(f"70B dry run on 8 ranks: {wall_s:.1f} s ({phases}); actor peak RSS "
          f"{', '.join(f'{b / GIB:.2f}' for b in sorted(peaks['actors'].values()))} GiB",
          file=sys.stderr)
    return {"dry_run_70b_s": round(wall_s, 1),
            "max_actor_rss_gib": round(max(peaks["actors"].values()) / GIB, 2),
            "driver_rss_gib": round(peaks["driver"] / GIB, 2)}


def bench_preflight(work: Path) -> dict:
    """``preflight_driver_rss_gib`` and ``preflight_s`` at 8, 64 and 512 rank files, from
    scripts/bench_preflight.py (each rank count in a fresh driver process)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_preflight.py"),
                           *(["--quick"] if QUICK else [])], cwd=work,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"bench_preflight.py failed:\n{proc.stderr[-3000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: figures[k] for k in ("preflight_driver_rss_gib", "preflight_s")}


BENCHES = {"sweep": bench_sweep, "min_memory": bench_min_memory, "dry_run_70b": bench_dry_run_70b,
           "preflight": bench_preflight}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None,
                        help=f"comma-separated subset of {', '.join(BENCHES)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the pre-flight bench at 8 small rank files only (the "
                             "others start Ray and replay through the CLI: minutes)")
    args = parser.parse_args()
    global QUICK
    QUICK = args.quick
    only = args.only if args.only is not None else "preflight" if args.quick else ",".join(BENCHES)
    names = [n for n in only.split(",") if n]
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
