"""How long ``tracefleet-predict`` and the dry runs behind it take; one JSON line.

Every figure runs the real command in a fresh process (Python, imports and Hydra included: what
the user waits for) and times it from outside; each driver's peak RSS is its own (``wait4``'s
rusage of that child, or RUSAGE_SELF inside it):

* ``predict_8b_cold_s``: ``tracefleet-predict workload=llama3_8b world_size=8`` with an empty
  capture cache (``predict.cache_dir`` a fresh temporary folder): capture on fake included;
* ``predict_8b_cached_s``: the same command again, the capture now in that cache;
* ``predict_70b_cold_s``: ``workload=llama3_70b world_size=64``, empty cache;
* ``predict_405b_cold_s``: ``workload=llama3_405b_tp8 world_size=128`` (8-way tensor parallel
  under FSDP2), empty cache;
* ``predict_405b_pp8_cold_s`` (``--pp8``: about a quarter of an hour): ``workload=llama3_405b_tp8_pp8
  world_size=512`` (8 pipeline stages, tp 8, FSDP2 over 8), empty cache, its eight roles
  recorded two at once (``predict.roles.num_workers=2``); ``_rss_gib`` is the largest process's
  peak (the driver's or a role's: wait4 counts the reaped workers), ``_verdict`` and
  ``_reserved_gib_by_role`` its answer (each stage's reserved peak), ``load_avg_1m`` the
  machine's load when it started;
* ``dry_run_1024_s``, ``driver_rss_1024_gib``: ``tracefleet replay=dry_run`` of 1,024 rank
  traces of a 70B meta capture (scripts/bench_dry_run_scale.py, whose traces are cached in
  ``~/.cache/tracefleet/bench_dry_run/``);
* ``meta_us_per_op_70b``: one meta iteration of the OOM study's 70B step per op
  (scripts/bench_meta_dry_run.py on rank 0 of those traces);
* ``fit_search_70b_s``: from scripts/bench_fit_search.py when that script exists (else null).

Beside the wall times, ``*_cpu_s`` (the command's user + system CPU) and ``*_rss_gib``; on a
machine shared with other jobs compare CPU seconds, the wall time follows the load.

The targets (issue 14): 8B cold < 60 s, cached < 10 s, 70B cold < 180 s, the 1,024-rank dry
run < 60 s with the driver < 1 GiB, <= 40 us per op. ``--quick``: the same commands on the
presets cut to 2 layers at small worlds, and bench_fit_search.py's ``--quick`` on one axis
(minutes; the keys keep their names, ``quick`` says so). A figure ``--skip`` skips is null.

    python scripts/bench_predict_speed.py [--quick] [--skip 70b dry_run meta fit_search]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from scripts import bench_dry_run_scale as scale  # noqa: E402
from scripts import bench_meta_dry_run as meta_bench  # noqa: E402
from orchestrator.outputs import RunDir  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

GIB = 1 << 30
TIMEOUT_S = 1800
TARGETS = {"predict_8b_cold_s": 60, "predict_8b_cached_s": 10, "predict_70b_cold_s": 180,
           "predict_405b_cold_s": 180, "predict_405b_pp8_cold_s": 720,
           "predict_405b_pp8_cold_rss_gib": 4.0,
           "dry_run_1024_s": 60, "driver_rss_1024_gib": 1.0, "meta_us_per_op_70b": 40,
           "fit_search_70b_s": 60}
QUICK_LAYERS = 2  # --quick: every model cut to this many layers
# the keys of the JSON line (scripts/json_layout.py)
KEYS = {**dict.fromkeys((
    "quick", "predict_8b_cold_s", "predict_8b_cached_s", "predict_8b_cold_cpu_s",
    "predict_8b_cached_cpu_s", "predict_8b_cold_rss_gib", "predict_8b_cached_rss_gib")),
    "predict_8b_timings_s": {"cold": None, "cached": None},
    **dict.fromkeys((
        "predicted_reserved_8b_bytes", "predict_70b_cold_s", "predict_70b_cold_cpu_s",
        "predict_70b_cold_rss_gib", "predict_70b_timings_s", "dry_run_1024_s",
        "driver_rss_1024_gib", "dry_run_num_ranks", "dry_run_num_replays", "meta_us_per_op_70b",
        "meta_num_ops", "fit_search_70b_s", "predict_405b_cold_s", "predict_405b_cold_cpu_s",
        "predict_405b_cold_rss_gib", "predict_405b_timings_s", "predict_405b_pp8_cold_s",
        "predict_405b_pp8_cold_cpu_s", "predict_405b_pp8_cold_rss_gib",
        "predict_405b_pp8_timings_s", "predict_405b_pp8_verdict",
        "predict_405b_pp8_reserved_gib_by_role", "load_avg_1m")),
    "targets": dict.fromkeys(TARGETS), "targets_met": dict.fromkeys(TARGETS)}
FIT_SEARCH_KEY = "fit_search_s"  # bench_fit_search.py's figure, cached search's wall time
# --quick: its --quick on one axis (every axis is tests/bench/'s own check of it)
QUICK_FIT_SEARCH_ARGS = ["--quick", "--axes", "batch_size"]


def timed_command(cmd: list[str], log: Path) -> tuple[float, float, float]:
    """Run ``cmd`` (stdout and stderr to ``log``); ``(wall s, CPU s, its peak RSS GiB)``: the
    CPU time (user + system) is the figure to compare across runs on a loaded machine, where
    the wall time follows the load. SystemExit with the log's tail when it fails or outlives
    TIMEOUT_S."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = t0 + TIMEOUT_S
        while True:  # wait4 gives this child's own rusage (RUSAGE_CHILDREN is the max of all)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise SystemExit(f"timed out after {TIMEOUT_S} s: {' '.join(cmd)}")
            time.sleep(0.05)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n"
                         f"{log.read_text()[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024 / GIB


def predict(tmp: Path, tag: str, cache: Path, *overrides: str) -> dict:
    """One ``tracefleet-predict`` run; its wall time, RSS and prediction.json."""
    run_dir = tmp / f"run-{tag}"
    cmd = [sys.executable, "-m", "orchestrator.cli.predict", *overrides,
           f"predict.cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    wall, cpu, rss = timed_command(cmd, tmp / f"{tag}.log")
    prediction = json.loads(RunDir(run_dir).prediction.read_text())
    print(f"{tag}: {wall:.1f} s, CPU {cpu:.1f} s, {rss:.2f} GiB, {prediction['timings_s']}",
          file=sys.stderr, flush=True)
    return {"s": wall, "cpu_s": cpu, "rss_gib": rss, "prediction": prediction}


def fit_search(quick: bool) -> float | None:
    """``fit_search_70b_s``: the cached search's wall time of scripts/bench_fit_search.py
    (another benchmark's figure, QUICK_FIT_SEARCH_ARGS when ``quick``), or None when that
    script is not there."""
    script = SCRIPTS / "bench_fit_search.py"
    if not script.is_file():
        return None
    with tempfile.TemporaryDirectory(prefix="bench_fit_") as tmp:
        log = Path(tmp) / "fit_search.log"
        timed_command([sys.executable, str(script), *(QUICK_FIT_SEARCH_ARGS if quick else [])],
                      log)
        lines = log.read_text().strip().splitlines()
    figures = json.loads(lines[-1])  # its last line is its JSON line
    if FIT_SEARCH_KEY not in figures:
        raise SystemExit(f"bench_fit_search.py printed no {FIT_SEARCH_KEY!r}: {lines[-1][:300]}")
    return figures[FIT_SEARCH_KEY]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"models cut to {QUICK_LAYERS} layers, small worlds: seconds")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["70b", "405b", "dry_run", "meta", "fit_search"])
    parser.add_argument("--pp8", action="store_true",
                        help="also the 3-D 405B preset at 512 ranks (about a quarter of an hour)")
    parser.add_argument("--dry-run-traces", type=Path,
                        help="the 1,024 rank traces (default: bench_dry_run_scale's cache)")
    args = parser.parse_args()
    layers = [f"workload.n_layers={QUICK_LAYERS}"] if args.quick else []
    out: dict = dict.fromkeys(KEYS) | {"quick": args.quick,
                                       "load_avg_1m": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="bench_predict_speed_") as tmp_name:
        tmp = Path(tmp_name)
        cache_8b = tmp / "cache-8b"  # empty: cold
        cold = predict(tmp, "8b_cold", cache_8b, "workload=llama3_8b", "world_size=8", *layers)
        cached = predict(tmp, "8b_cached", cache_8b, "workload=llama3_8b", "world_size=8",
                         *layers)
        if not cached["prediction"]["capture"]["reused"]:
            raise SystemExit("the second 8B run did not reuse the capture")
        out.update(predict_8b_cold_s=round(cold["s"], 2), predict_8b_cached_s=round(cached["s"], 2),
                   predict_8b_cold_cpu_s=round(cold["cpu_s"], 2),
                   predict_8b_cached_cpu_s=round(cached["cpu_s"], 2),
                   predict_8b_cold_rss_gib=round(cold["rss_gib"], 3),
                   predict_8b_cached_rss_gib=round(cached["rss_gib"], 3),
                   predict_8b_timings_s={"cold": cold["prediction"]["timings_s"],
                                         "cached": cached["prediction"]["timings_s"]},
                   predicted_reserved_8b_bytes=cached["prediction"]
                   ["predicted_reserved_peak_bytes"])
        if "70b" not in args.skip:
            world = 8 if args.quick else 64
            run = predict(tmp, "70b_cold", tmp / "cache-70b", "workload=llama3_70b",
                          f"world_size={world}", *layers)
            out.update(predict_70b_cold_s=round(run["s"], 2),
                       predict_70b_cold_cpu_s=round(run["cpu_s"], 2),
                       predict_70b_cold_rss_gib=round(run["rss_gib"], 3),
                       predict_70b_timings_s=run["prediction"]["timings_s"])
        if "405b" not in args.skip:
            world = 16 if args.quick else 128
            run = predict(tmp, "405b_cold", tmp / "cache-405b", "workload=llama3_405b_tp8",
                          f"world_size={world}", "target=h100_96gb", *layers)
            out.update(predict_405b_cold_s=round(run["s"], 2),
                       predict_405b_cold_cpu_s=round(run["cpu_s"], 2),
                       predict_405b_cold_rss_gib=round(run["rss_gib"], 3),
                       predict_405b_timings_s=run["prediction"]["timings_s"])
        if args.pp8:
            cut = ["workload.n_layers=6", "workload.parallelism.pp_microbatches=8"] \
                if args.quick else []
            run = predict(tmp, "405b_pp8_cold", tmp / "cache-405b-pp8",
                          "workload=llama3_405b_tp8_pp8", "world_size=512", "target=h100_96gb",
                          "predict.roles.num_workers=2", *cut)
            out.update(predict_405b_pp8_cold_s=round(run["s"], 2),
                       predict_405b_pp8_cold_cpu_s=round(run["cpu_s"], 2),
                       predict_405b_pp8_cold_rss_gib=round(run["rss_gib"], 3),
                       predict_405b_pp8_timings_s=run["prediction"]["timings_s"],
                       predict_405b_pp8_verdict=run["prediction"]["verdict"],
                       predict_405b_pp8_reserved_gib_by_role={
                           role: round(facts["predicted_reserved_peak_bytes"] / GIB, 1)
                           for role, facts in run["prediction"]["per_role"].items()})
        world = 8 if args.quick else 1024
        workload = scale.QUICK_WORKLOAD if args.quick else "llama_70b"
        traces = args.dry_run_traces or (tmp / "traces" if args.quick else
                                         Path.home() / ".cache" / "tracefleet" / "bench_dry_run"
                                         / f"{workload}-{world}")
        if not ({"dry_run", "meta"} <= set(args.skip)):
            scale.capture(workload, world, traces, *layers)
        if "dry_run" not in args.skip:
            run = scale.dry_run(traces, 1, tmp / "dry_run")
            assert run["summary"]["status"] == "ok", run["summary"].get("error")
            out.update(dry_run_1024_s=round(run["wall_s"], 2),
                       driver_rss_1024_gib=round(run["rss_bytes"] / GIB, 3),
                       dry_run_num_ranks=world, dry_run_num_replays=run["summary"]["num_replays"])
        if "meta" not in args.skip:
            trace = meta_bench.load_trace(next(traces.glob("rank-0.et.json*")))
            report, _ = meta_bench.dry_run(trace, True, 1)
            out["meta_us_per_op_70b"] = round(report["iteration_time_s"] / len(trace.ops) * 1e6,
                                              2)
            out["meta_num_ops"] = len(trace.ops)
    out["fit_search_70b_s"] = None if "fit_search" in args.skip else fit_search(args.quick)
    out["targets"] = TARGETS
    # null: the figure was skipped
    out["targets_met"] = {k: out[k] <= v if isinstance(out[k], (int, float)) else None
                          for k, v in TARGETS.items()}
    emit(out, KEYS)


if __name__ == "__main__":
    main()
