"""Replay benchmarks on the demo traces, measured side by side in one run; prints one JSON line.

* lazy peak / liveness lower bound, and pre_allocate peak / lazy peak (every demo rank);
* replay iteration time (compute mode) / the original model's eager compute time, both in
  this process with one intra-op thread (the capture ran one CPU slot per rank);
* host overhead per op: replay of a trace of tiny ops / the same overloads called directly;
* meta dry run time / CPU replay time.

    python scripts/bench_replay.py [--traces demo/traces/gpt_dp_4] [--iters 10]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.capture.workloads import WorkloadConfig, build_workload  # noqa: E402
from actors.replay.config import AllocationConfig, ReplayConfig  # noqa: E402
from actors.replay.engine import ReplayEngine  # noqa: E402
from actors.trace import load_trace  # noqa: E402


def _replay(path, alloc="lazy", device="cpu", iters=3, warmup=1):
    cfg = ReplayConfig(mode="compute", device=device, iters=iters, warmup_iters=warmup,
                       allocation=AllocationConfig(mode=alloc))
    t0 = time.perf_counter()
    report = ReplayEngine(load_trace(path), cfg).run().to_dict()
    report["wall_s"] = time.perf_counter() - t0
    assert report["status"] == "ok", report["error"]
    return report


def memory_ratios(rank_files):
    lazy_vs_bound, pre_vs_lazy = [], []
    for path in rank_files:
        lazy = _replay(path, "lazy", iters=1, warmup=0)
        pre = _replay(path, "pre_allocate", iters=1, warmup=0)
        lazy_vs_bound.append(lazy["peak_memory_bytes"] / lazy["liveness_lower_bound_bytes"])
        pre_vs_lazy.append(pre["peak_memory_bytes"] / lazy["peak_memory_bytes"])
    return max(lazy_vs_bound), min(pre_vs_lazy)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eager_compute_s(workload: dict, iters: int) -> float:
    """The captured model's own iteration on one rank (world of 1: the all-reduce is a no-op)."""
    cfg = WorkloadConfig(**workload)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        w = build_workload(cfg, rank=0, world_size=1)
        for _ in range(3):
            w.step(w.next_batch())
        times = []
        for _ in range(iters):
            batch = w.next_batch()
            t0 = time.perf_counter()
            w.step(batch)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        dist.destroy_process_group()


def tiny_op_overhead(num_ops: int = 3000, iters: int = 5) -> float:
    """Replay time of a trace of tiny ops / calling the same overloads directly in a loop."""
    from torch.profiler import ExecutionTraceObserver
    a, b = torch.ones(16), torch.full((16,), 2.0)
    ops = [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.sub.Tensor]

    def program():
        x = a
        for i in range(num_ops):
            x = ops[i % 3](x, b)
        return x

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny.et.json"
        et = ExecutionTraceObserver()
        et.register_callback(str(path))
        et.start()
        program()
        et.stop()
        et.unregister_callback()
        replay = _replay(path, "pre_allocate", iters=iters, warmup=1)
    direct = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        program()
        direct.append(time.perf_counter() - t0)
    return replay["iteration_time_s"] / statistics.median(direct[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=str(ROOT / "demo" / "traces" / "gpt_dp_4"))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = Path(args.traces)
    rank_files = sorted(folder.glob("rank-*.et.json*"))
    meta = json.loads((folder / "meta.json").read_text())
    lazy_vs_bound, pre_vs_lazy = memory_ratios(rank_files)
    eager_s = eager_compute_s(meta["workload"], args.iters)
    cpu = _replay(rank_files[0], "pre_allocate", iters=args.iters, warmup=2)
    meta_run = _replay(rank_files[0], "lazy", device="meta", iters=1, warmup=0)
    cpu_once = _replay(rank_files[0], "lazy", iters=1, warmup=0)
    print(json.dumps({
        "traces": str(folder), "num_ranks": len(rank_files),
        "lazy_peak_over_bound_max": round(lazy_vs_bound, 4),
        "pre_allocate_peak_over_lazy_peak_min": round(pre_vs_lazy, 3),
        "eager_compute_s": round(eager_s, 5), "replay_compute_s": round(cpu["iteration_time_s"], 5),
        "replay_over_eager": round(cpu["iteration_time_s"] / eager_s, 3),
        "eager_iteration_s_from_meta": meta.get("iteration_time_s"),
        "host_overhead_tiny_ops": round(tiny_op_overhead(), 3),
        "meta_dry_run_s": round(meta_run["wall_s"], 3), "cpu_replay_s": round(cpu_once["wall_s"], 3),
        "meta_over_cpu": round(meta_run["wall_s"] / cpu_once["wall_s"], 3),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
