"""Sweep benchmarks (issues 10 and 25); prints ONE JSON line.

    .venv/bin/python scripts/bench_sweep.py [--only sweep,min_memory,dry_run,preflight] [--quick]

- ``sweep_over_singles``: a threshold sweep (``sweep_points``: 3) of the demo through the CLI,
  total wall time / the wall times of the same points run one command each (one before the
  sweep, the others after it, so machine drift hits both sides). Target < 0.6: the sweep
  starts Ray and the rank actors once and the ranks parse their traces once.
- ``min_memory_steps``, ``min_memory_s``: ``tracefleet experiment=min_memory`` on the demo
  (meta device): replays over all allocation modes, and the command's wall time.
- ``dry_run``: the llama_70b preset (data parallel, bf16, seq 8192) captured on meta for 8
  ranks (not timed: rank 0 recorded, its trace hard-linked for every rank), then
  ``tracefleet replay=dry_run`` of one iteration on the 8 ranks. Identical ranks replay once
  (pre-flight's grouping, orchestrator/preflight/dedup.py): one rank actor serves all eight.
  ``dry_run_2_traces``: the same with ranks 4-7 from a second capture at half the sequence
  length, so two distinct traces and two actors; ranks 0-3 must report rank 0's replay, ranks
  4-7 rank 4's, and the shorter sequence the lower accounted peak. Each holds the command's
  wall time ``s``, ``num_traces`` (distinct traces), ``num_actors`` (rank actors seen
  running: it must equal num_traces and the run's ``num_replays``), ``actor_rss_gib`` (the
  peak RSS of each actor, in start order), ``max_actor_rss_gib`` and ``driver_rss_gib``.
  Peak RSS is the kernel's high-water mark (``VmHWM`` in /proc/<pid>/status), read every
  0.2 s from the driver process and from every descendant of it that Ray titled
  ``ray::RankActor``: a process's high-water mark only grows, so the last reading before it
  exits is its peak up to then. Targets: ``s`` < 120 s, < 4 GiB per actor.
- ``preflight_driver_rss_gib``, ``preflight_s``: ``experiment.preflight_only=true`` over 8,
  64 and 512 small rank files (scripts/bench_preflight.py): the driver's peak RSS (flat is
  the target) and wall time, keyed by rank count.

``--quick`` runs every benchmark on tiny inputs (minutes, for the smoke test): the sweep of
2 points and min_memory on the demo's rank 0 in compute mode (one actor each), the dry runs of
llama_8b cut to 2 layers, pre-flight at 8 files. Every command runs in a temp dir of its own
with its own Ray temp dir.
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
sys.path.insert(0, str(REPO))

from orchestrator.outputs import RunDir  # noqa: E402
from actors.memory_limit import vm_hwm_bytes  # noqa: E402
from scripts.json_layout import EACH, emit  # noqa: E402

ENTRY = [sys.executable, "-c", "from orchestrator.cli.main import main; main()"]
# One point of the demo at 12MiB: faithful completes only when it flushes (threshold < 1).
POINT = ["replay.allocation.mode=faithful", "replay.device_memory_capacity=12MiB"]
THRESHOLDS = ("1.0", "0.5", "0.25")
QUICK_THRESHOLDS = ("1.0", "0.5")
QUICK_DEMO = ["replay.mode=compute", "trace.ranks=[0]"]  # --quick: rank 0 alone, one actor
DRY_RUN_WORLD_SIZE = 8
# (preset, its overrides) of the dry runs; --quick's is cut to a few layers
DRY_RUN_WORKLOAD, QUICK_DRY_RUN_WORKLOAD = ("llama_70b", {}), ("llama_8b", {"n_layers": 2})
TIMEOUT_S = 900
GIB = 2**30
QUICK = False  # --quick: the smallest inputs (set by main)
RSS_POLL_S = 0.2
DRY_RUN_KEYS = {"workload": None, "world_size": None, "num_traces": None, "num_actors": None,
                "s": None, "actor_rss_gib": [None], "max_actor_rss_gib": None,
                "driver_rss_gib": None}
# the layout of the JSON line (scripts/json_layout.py), each benchmark's keys; --quick prints
# the same
BENCH_KEYS = {
    "sweep": {"sweep_over_singles": None, "sweep_points": None},
    "min_memory": {"min_memory_steps": None, "min_memory_s": None},
    "dry_run": {"dry_run": DRY_RUN_KEYS, "dry_run_2_traces": DRY_RUN_KEYS},
    "preflight": {"preflight_driver_rss_gib": {EACH: None}, "preflight_s": {EACH: None}},
}
KEYS = {"quick": None, **{k: v for keys in BENCH_KEYS.values() for k, v in keys.items()}}


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


def _watch_peaks(proc: subprocess.Popen, peaks: dict, deadline: float) -> None:
    """Until ``proc`` exits (or ``deadline``): the driver's VmHWM and that of each of its
    descendants titled ``ray::RankActor`` (Ray sets the title when the actor is created)."""
    driver = psutil.Process(proc.pid)
    peaks.update(driver=0, actors={})
    while proc.poll() is None and time.perf_counter() < deadline:
        peaks["driver"] = max(peaks["driver"], vm_hwm_bytes(proc.pid) or 0)
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
            hwm = vm_hwm_bytes(child.pid)
            if hwm is not None:
                peaks["actors"][child.pid] = max(peaks["actors"].get(child.pid, 0), hwm)
        time.sleep(RSS_POLL_S)


def bench_sweep(work: Path) -> dict:
    """``sweep_over_singles`` and ``sweep_points`` (see the module docstring)."""
    thresholds = QUICK_THRESHOLDS if QUICK else THRESHOLDS
    point = [*POINT, *(QUICK_DEMO if QUICK else [])]
    key = "replay.allocation.device_memory_threshold"
    singles = []
    for i, threshold in enumerate(thresholds):
        if i == 1:  # the sweep between the single runs: drift hits both sides
            sweep_s = _tracefleet(["--multirun", *point, f"{key}={','.join(thresholds)}",
                                   f"hydra.sweep.dir={work / 'sweep'}"], work)
        singles.append(_tracefleet([*point, f"{key}={threshold}",
                                    f"hydra.run.dir={work / f'single{i}'}"], work))
    rows = pd.read_csv(RunDir(work / "sweep").results_csv)
    if len(rows) != len(thresholds):
        sys.exit(f"the sweep recorded {len(rows)} rows, expected {len(thresholds)}")
    print(f"single runs {', '.join(f'{s:.1f}' for s in singles)} s; {len(thresholds)}-point "
          f"sweep {sweep_s:.1f} s ({', '.join(rows['status'])})", file=sys.stderr)
    return {"sweep_over_singles": round(sweep_s / sum(singles), 3),
            "sweep_points": len(thresholds)}


def bench_min_memory(work: Path) -> dict:
    """``min_memory_steps`` and ``min_memory_s`` (see the module docstring)."""
    run_dir = work / "min_memory"
    wall_s = _tracefleet(["experiment=min_memory", *(QUICK_DEMO[1:] if QUICK else []),
                          f"hydra.run.dir={run_dir}"], work)
    rows = pd.read_csv(RunDir(run_dir).results_csv)
    answers = rows[rows["kind"] == "min_memory"]
    if answers.empty:
        sys.exit(f"experiment=min_memory recorded no answer in {RunDir(run_dir).results_csv}")
    for _, a in answers.iterrows():
        print(f"min_memory {a['replay.allocation.mode']}: {int(a['min_capacity_bytes'])} B in "
              f"{int(a['num_steps'])} replays ({a['status']})", file=sys.stderr)
    return {"min_memory_steps": int(answers["num_steps"].sum()), "min_memory_s": round(wall_s, 2)}


def _workload(overrides: dict):
    """The dry runs' workload (--quick's when QUICK) with ``overrides``, on meta."""
    from orchestrator.cli.schemas import register_all
    from orchestrator.studies.study_traces import workload_config

    register_all()  # the preset composes with its schema, as tracefleet registers it
    preset, base = QUICK_DRY_RUN_WORKLOAD if QUICK else DRY_RUN_WORKLOAD
    return workload_config(preset, {**base, **overrides})


def _capture(work: Path, name: str, workload) -> Path:
    """``workload`` captured on meta for every rank (rank 0 recorded, hard-linked); its folder."""
    from orchestrator.run.capture import CaptureConfig, run_capture_job

    out = work / name
    run_capture_job(CaptureConfig(workload=workload, world_size=DRY_RUN_WORLD_SIZE,
                                  out_dir=str(out)))
    return out


def _dry_run(work: Path, traces: Path, name: str,
             groups: dict[int, list[int]]) -> tuple[dict, list[dict]]:
    """``tracefleet replay=dry_run`` of ``traces`` with its peak RSS; checks the dedupe's
    rules: one actor per distinct trace, each rank of ``groups[rep]`` reporting ``rep``'s
    replay. Returns the run's figures and its per-rank reports."""
    peaks: dict = {}
    run_dir = work / name
    wall_s = _tracefleet([f"trace.dir={traces}", "replay=dry_run", "replay.warmup_iters=0",
                          "replay.iters=1", f"hydra.run.dir={run_dir}"], work, peaks)
    summary = json.loads(RunDir(run_dir).summary.read_text())
    if summary["status"] != "ok" or summary["world_size"] != DRY_RUN_WORLD_SIZE:
        sys.exit(f"{name} ended {summary['status']} on {summary['world_size']} ranks: "
                 f"{summary.get('error')}")
    actors = list(peaks["actors"].values())  # dicts keep insertion order: start order
    if not len(actors) == summary["num_replays"] == len(groups):
        sys.exit(f"{name}: {len(groups)} distinct trace(s) should start as many rank actors; "
                 f"saw {len(actors)} actor(s), the run says {summary['num_replays']} replay(s)")
    expected = {rank: rep for rep, ranks in groups.items() for rank in ranks}
    replayed = {r["rank"]: r.get("replayed_as_rank") for r in summary["ranks"]}
    if replayed != expected:
        sys.exit(f"{name}: ranks reported the replays of {replayed}, expected {expected}")
    phases = ", ".join(f"{k} {v:.1f}" for k, v in summary["timings_s"].items())
    print(f"{name} on {DRY_RUN_WORLD_SIZE} ranks: {wall_s:.1f} s ({phases}); actor peak RSS "
          f"{', '.join(f'{b / GIB:.2f}' for b in actors)} GiB", file=sys.stderr)
    preset, base = QUICK_DRY_RUN_WORKLOAD if QUICK else DRY_RUN_WORKLOAD
    figures = {"workload": " ".join([preset, *(f"{k}={v}" for k, v in base.items())]),
               "world_size": summary["world_size"], "num_traces": len(groups),
               "num_actors": len(actors), "s": round(wall_s, 1),
               "actor_rss_gib": [round(b / GIB, 2) for b in actors],
               "max_actor_rss_gib": round(max(actors) / GIB, 2),
               "driver_rss_gib": round(peaks["driver"] / GIB, 2)}
    return figures, summary["ranks"]


def bench_dry_run(work: Path) -> dict:
    """``dry_run`` and ``dry_run_2_traces`` (see the module docstring)."""
    from actors.hardlink import link_or_copy
    from actors.trace.conventions import trace_file_name

    world, half = DRY_RUN_WORLD_SIZE, DRY_RUN_WORLD_SIZE // 2
    workload = _workload({})
    same = _capture(work, "same", workload)
    one, _ = _dry_run(work, same, "dry_run", {0: list(range(world))})
    seq_len = workload.seq_len
    shorter = _capture(work, "shorter", _workload({"seq_len": seq_len // 2}))
    mixed = work / "mixed"
    mixed.mkdir()
    for rank in range(world):  # ranks 0-3 from the first capture, 4-7 from the second
        link_or_copy(str((same if rank < half else shorter) / trace_file_name(rank)),
                     str(mixed / trace_file_name(rank)))
    two, ranks = _dry_run(work, mixed, "dry_run_2_traces",
                          {0: list(range(half)), half: list(range(half, world))})
    peak = {r["rank"]: r["accounted_peak_bytes"] for r in ranks}
    if not (len({peak[r] for r in range(half)}) == len({peak[r] for r in range(half, world)})
            == 1 and peak[half] < peak[0]):
        sys.exit(f"dry_run_2_traces: accounted peaks per rank {peak}: expected ranks 0-{half - 1}"
                 f" alike (seq {seq_len}) above ranks {half}-{world - 1} (seq {seq_len // 2})")
    return {"dry_run": one, "dry_run_2_traces": two}


def bench_preflight(work: Path) -> dict:
    """``preflight_driver_rss_gib`` and ``preflight_s`` at 8, 64 and 512 rank files, from
    scripts/bench_preflight.py (each rank count in a fresh driver process)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_preflight.py"),
                           *(["--quick"] if QUICK else [])], cwd=work,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"bench_preflight.py failed:\n{proc.stderr[-3000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: figures[k] for k in BENCH_KEYS["preflight"]}


BENCHES = {"sweep": bench_sweep, "min_memory": bench_min_memory, "dry_run": bench_dry_run,
           "preflight": bench_preflight}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None,
                        help=f"comma-separated subset of {', '.join(BENCHES)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: every benchmark on tiny inputs (see the docstring)")
    args = parser.parse_args()
    global QUICK
    QUICK = args.quick
    names = [n for n in (args.only or ",".join(BENCHES)).split(",") if n]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; expected among {sorted(BENCHES)}")
    out: dict = {"quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="bench_sweep") as tmp:
        for name in names:
            work = Path(tmp) / name
            work.mkdir()
            out.update(BENCHES[name](work))
    emit(out, {"quick": None, **{k: v for n in names for k, v in BENCH_KEYS[n].items()}})


if __name__ == "__main__":
    main()
