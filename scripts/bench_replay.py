"""Replay benchmarks on the demo traces, measured side by side in one run; prints one JSON line.

* measured peaks per allocation mode (every demo rank): pre_allocate / lazy and faithful /
  lazy, and measured / accounted (what accounting cannot see: op temporaries);
* replay iteration time (compute mode) / the original model's eager compute time, both in
  this process with one intra-op thread (the capture ran one CPU slot per rank);
* host overhead per op: replay of a trace of tiny ops / the same overloads called directly
  (through OpOverload, and through the raw C++ callable the replay uses);
* meta dry run time / CPU replay time, on the demo and on a wider decoder captured here.

Timed pairs run alternately (eager, replay, eager, ...) and report medians, so a busy
machine slows both sides alike.

    python scripts/bench_replay.py [--traces demo/traces/gpt_dp_4] [--iters 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.capture.recorder import record_iteration  # noqa: E402
from actors.capture.workloads.build import WorkloadConfig, build_workload  # noqa: E402
from actors.rank_base import free_port  # noqa: E402
from actors.replay.config import AllocationConfig, ReplayConfig  # noqa: E402
from actors.replay.session import RankSession, replay_rank  # noqa: E402
from actors.trace import load_trace  # noqa: E402
from orchestrator.outputs import RunDir  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

# the keys of the JSON line (scripts/json_layout.py)
KEYS = dict.fromkeys((
    "traces", "num_ranks", "quick", "pre_allocate_over_lazy_measured_min",
    "faithful_over_lazy_measured_min", "lazy_measured_over_accounted_max", "eager_compute_s",
    "replay_compute_s", "replay_over_eager", "eager_iteration_s_from_meta",
    *(f"host_overhead_tiny_ops{raw}{mode}" for mode in ("", "_lazy") for raw in ("", "_vs_raw_op")),
    "demo_meta_iteration_s", "demo_cpu_iteration_s", "demo_meta_over_cpu",
    "large_meta_iteration_s", "large_cpu_iteration_s", "large_meta_over_cpu", "torch", "threads"))


def _cfg(alloc="lazy", device="cpu", iters=3, warmup=1, measure=False):
    return ReplayConfig(mode="compute", device=device, iters=iters, warmup_iters=warmup,
                        allocation=AllocationConfig(mode=alloc), measure_memory=measure)


def _replay(path, alloc="lazy", device="cpu", iters=3, warmup=1, measure=False):
    t0 = time.perf_counter()
    report = replay_rank(path, _cfg(alloc, device, iters, warmup, measure))
    report["wall_s"] = time.perf_counter() - t0
    assert report["status"] == "ok", report["error"]
    return report


def interleaved(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    """Median seconds of fn_a and fn_b, called alternately so load changes hit both alike."""
    a, b = [], []
    for _ in range(repeats):
        a.append(fn_a())
        b.append(fn_b())
    return statistics.median(a), statistics.median(b)


def _engine_iteration(engine):
    """A callable timing one replay iteration of ``engine`` (compute mode, one iteration)."""
    def once():
        report = engine.run()
        assert report.status == "ok", report.error
        return report.iteration_times_s[-1]
    return once


def memory_ratios(rank_files) -> dict:
    """Measured peaks per mode, as ratios over every rank (min or max, whichever is worse)."""
    pre_lazy, faithful_lazy, measured_accounted = [], [], []
    for path in rank_files:
        peaks = {mode: _replay(path, mode, iters=1, warmup=0, measure=True)
                 for mode in ("lazy", "faithful", "pre_allocate")}
        lazy = peaks["lazy"]["measured_peak_bytes"]
        pre_lazy.append(peaks["pre_allocate"]["measured_peak_bytes"] / lazy)
        faithful_lazy.append(peaks["faithful"]["measured_peak_bytes"] / lazy)
        measured_accounted.append(lazy / peaks["lazy"]["accounted_peak_bytes"])
    return {"pre_allocate_over_lazy_measured_min": round(min(pre_lazy), 3),
            "faithful_over_lazy_measured_min": round(min(faithful_lazy), 3),
            "lazy_measured_over_accounted_max": round(max(measured_accounted), 3)}


class _World1:
    """A one-rank gloo group, so the captured workloads build outside a worker group."""

    def __enter__(self):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)

    def __exit__(self, *exc):
        dist.destroy_process_group()


def _eager_iteration(workload):
    """A callable timing one training step of the original model (world of 1: the
    gradient all-reduce is a no-op, like the collectives a compute-mode replay skips)."""
    def once():
        batch = workload.next_batch()
        t0 = time.perf_counter()
        workload.step(batch)
        return time.perf_counter() - t0
    for _ in range(3):
        once()
    return once


def replay_vs_eager(rank_file, workload: dict, repeats: int) -> tuple[float, float]:
    """(eager s, replay s) per iteration of the demo decoder, measured alternately."""
    engine = RankSession(_cfg("pre_allocate", iters=1, warmup=0)).compile(load_trace(rank_file))
    replay = _engine_iteration(engine)
    replay()  # warm-up (and the one iteration that checks output shapes)
    return interleaved(_eager_iteration(build_workload(WorkloadConfig(**workload), 0, 1)),
                       replay, repeats)


def _capture_large(out_path: Path, workload: dict, quick: bool = False) -> None:
    """Record one step of a wider decoder: compute-bound, where a meta dry run pays off
    (``quick``: a quarter of the width and length)."""
    size = {"d_model": 128, "n_layers": 2, "seq_len": 64, "batch_size": 4} if quick else \
        {"d_model": 512, "n_layers": 4, "seq_len": 256, "batch_size": 8}
    w = build_workload(WorkloadConfig(**{**workload, **size}), 0, 1)
    w.step(w.next_batch())
    record_iteration(w.step, w.next_batch(), w.model, step_index=1, out_path=str(out_path))


def meta_vs_cpu(trace_path, repeats: int) -> tuple[float, float]:
    """(meta s, cpu s) per replay iteration of one trace, measured alternately."""
    trace = load_trace(trace_path)
    engines = [RankSession(_cfg("lazy", device, iters=1, warmup=0)).compile(trace)
               for device in ("meta", "cpu")]
    runs = [_engine_iteration(e) for e in engines]
    for run in runs:
        run()
    return interleaved(*runs, repeats)


def tiny_op_overhead(num_ops: int = 3000, iters: int = 15) -> dict:
    """Replay time of a trace of tiny ops / calling the same overloads directly in a loop,
    both through ``OpOverload.__call__`` (how Python code calls them) and through the raw C++
    callable the replay itself uses (``._op``: the stricter baseline), in lazy and
    pre_allocate mode."""
    from torch.profiler import ExecutionTraceObserver
    a, b = torch.ones(16), torch.full((16,), 2.0)
    overloads = [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.sub.Tensor]
    raw = [op._op for op in overloads]

    def program(ops):
        x = a
        for i in range(num_ops):
            x = ops[i % 3](x, b)
        return x

    def timed(ops):
        def once():
            t0 = time.perf_counter()
            program(ops)
            return time.perf_counter() - t0
        return once

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny.et.json"
        et = ExecutionTraceObserver()
        et.register_callback(str(path))
        et.start()
        program(overloads)
        et.stop()
        et.unregister_callback()
        trace = load_trace(path)
    out = {}
    for mode in ("pre_allocate", "lazy"):
        replay = _engine_iteration(RankSession(_cfg(mode, iters=1, warmup=0)).compile(trace))
        replay()
        for name, direct in (("", timed(overloads)), ("_vs_raw_op", timed(raw))):
            direct()
            replay_s, direct_s = interleaved(replay, direct, iters)
            out[f"host_overhead_tiny_ops{name}" + ("" if mode == "pre_allocate" else "_lazy")] = \
                round(replay_s / direct_s, 3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=str(ROOT / "demo" / "traces" / "gpt_dp_4"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: one rank, 1 repeat, a short tiny-op trace, a small 'large'")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.iters = 1
    folder = Path(args.traces)
    rank_files = sorted(folder.glob("rank-*.et.json*"))
    meta = json.loads(RunDir(folder).meta.read_text())
    memory = memory_ratios(rank_files[:1] if args.quick else rank_files)
    with _World1():
        eager_s, replay_s = replay_vs_eager(rank_files[0], meta["workload"], args.iters)
        meta_s, cpu_s = meta_vs_cpu(rank_files[0], args.iters)
        with tempfile.TemporaryDirectory() as tmp:
            large = Path(tmp) / "large.et.json.gz"
            _capture_large(large, meta["workload"], args.quick)
            large_meta_s, large_cpu_s = meta_vs_cpu(large, 1 if args.quick
                                                    else max(3, args.iters // 3))
    emit({
        "traces": str(folder), "num_ranks": len(rank_files), "quick": args.quick,
        **memory,
        "eager_compute_s": round(eager_s, 5), "replay_compute_s": round(replay_s, 5),
        "replay_over_eager": round(replay_s / eager_s, 3),
        "eager_iteration_s_from_meta": meta.get("iteration_time_s"),
        **(tiny_op_overhead(300, 3) if args.quick else tiny_op_overhead()),
        "demo_meta_iteration_s": round(meta_s, 5), "demo_cpu_iteration_s": round(cpu_s, 5),
        "demo_meta_over_cpu": round(meta_s / cpu_s, 3),
        "large_meta_iteration_s": round(large_meta_s, 5),
        "large_cpu_iteration_s": round(large_cpu_s, 5),
        "large_meta_over_cpu": round(large_meta_s / large_cpu_s, 4),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }, KEYS)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
