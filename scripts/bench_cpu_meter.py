"""The CPU memory meter on a demo trace, side by side in one run; prints one JSON line.

* Peaks per replay mode and allocation mode: the replay's ``measured_peak_bytes`` (the CPU
  allocation counter, one warm-up then one measured iteration) beside the torch profiler's
  figure taken the way the replay used to (``profile_memory=True`` over two iterations, the
  peak of the running sum of allocator events within the second). compute: one rank in
  this process; full: every rank, spawned with gloo, where gloo's worker thread frees
  collective temporaries the profiler never sees freed.
* Cost: iteration time of one engine with the counter installed / without, alternating,
  median over repeats (compute mode, lazy).

    python scripts/bench_cpu_meter.py [--traces demo/traces/gpt_dp_4] [--repeats 10]
        [--quick]   # the same, 2 cost repeats (one of each order): seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors import cpu_counter  # noqa: E402
from actors.replay.comm.process_groups import merge_group_tables  # noqa: E402
from actors.replay.comm.rank_comm import rank_comm  # noqa: E402
from actors.replay.config import AllocationConfig, ReplayConfig  # noqa: E402
from actors.replay.session import RankSession  # noqa: E402
from actors.trace import load_trace  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

MODES = ("lazy", "faithful", "pre_allocate")
QUICK_REPEATS = 2
MARK = "bench::measured_iteration"
_PEAKS = {mode: {"counter": None, "profiler": None} for mode in MODES}
# the keys of the JSON line (scripts/json_layout.py); "full": one row per rank
KEYS = {"traces": None, "quick": None, "compute_rank0": _PEAKS, "full": [_PEAKS],
        "cost": dict.fromkeys(("iteration_s_with_counter", "iteration_s_without_counter",
                               "with_over_without", "repeats"))}


def _cfg(mode: str, alloc: str, measure: bool, warmup: int) -> ReplayConfig:
    return ReplayConfig(mode=mode, device="cpu", iters=1, warmup_iters=warmup,
                        measure_memory=measure, allocation=AllocationConfig(mode=alloc))


def counter_peak(make_engine, mode: str, alloc: str) -> int:
    """The replay's measured peak (the counter): one warm-up, one measured iteration."""
    engine = make_engine(_cfg(mode, alloc, measure=True, warmup=1))
    report = engine.run().to_dict()
    engine.close()
    assert report["status"] == "ok", report["error"]
    return report["measured_peak_bytes"]


def profiler_peak(make_engine, mode: str, alloc: str) -> int:
    """The old method: the profiler runs from before the first of two iterations; the peak
    of the running sum of CPU allocator events, counted from the start of the second."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    engine = make_engine(_cfg(mode, alloc, measure=False, warmup=0))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert engine.run().status == "ok"
        with record_function(MARK):
            pass
        assert engine.run().status == "ok"
    events, since = [], 0
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU:
            events.append((e.start_ns(), e.nbytes()))
        elif e.name() == MARK:
            since = e.start_ns()
    running = peak = 0
    for ts, nbytes in sorted(events):
        running += nbytes
        if ts >= since:
            peak = max(peak, running)
    return peak


def peaks(make_engine, mode: str) -> dict:
    """{allocation mode: {"counter": bytes, "profiler": bytes}} for each of MODES."""
    return {alloc: {"counter": counter_peak(make_engine, mode, alloc),
                    "profiler": profiler_peak(make_engine, mode, alloc)} for alloc in MODES}


def _full_rank(rank: int, files: list[str], init_file: str, out_dir: str) -> None:
    """One rank of the full-mode replay: its peaks into out_dir/<rank>.json."""
    world = len(files)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        torch.set_num_threads(1)
        traces = [load_trace(f, rank=r) for r, f in enumerate(files)]
        table = merge_group_tables([t.process_groups for t in traces], world)
        trace = traces[rank]
        comm = rank_comm(table, rank, world, torch.device("cpu"), timeout_s=120, ops=trace.ops)

        def make_engine(cfg):
            return RankSession(cfg, rank=rank).compile(trace, comm)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(peaks(make_engine, "full")))
    finally:
        dist.destroy_process_group()


def full_peaks(files: list[str]) -> list[dict]:
    """Per rank, the full-mode peaks (every rank of the trace, spawned with gloo)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_full_rank, args=(files, os.path.join(tmp, "init"), tmp),
                 nprocs=len(files), join=True)
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(len(files))]


def counter_cost(trace_file: str, repeats: int) -> dict:
    """Iteration time with the counter installed / without, alternating on one engine."""
    engine = RankSession(_cfg("compute", "lazy", False, warmup=0)).compile(load_trace(trace_file))
    engine.run()  # warm-up
    with_s, without_s = [], []
    for i in range(repeats):
        for counted in ((True, False) if i % 2 else (False, True)):
            if counted:
                cpu_counter.install()
            try:
                times = engine.run().iteration_times_s
            finally:
                if counted:
                    cpu_counter.uninstall()
            (with_s if counted else without_s).append(times[-1])
    with_med, without_med = statistics.median(with_s), statistics.median(without_s)
    return {"iteration_s_with_counter": with_med, "iteration_s_without_counter": without_med,
            "with_over_without": with_med / without_med, "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=str(ROOT / "demo" / "traces" / "gpt_dp_4"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REPEATS} cost repeats: seconds, for the smoke test")
    args = parser.parse_args()
    repeats = QUICK_REPEATS if args.quick else args.repeats
    files = sorted(str(p) for p in Path(args.traces).glob("rank-*.et.json.gz"))
    torch.set_num_threads(1)
    rank0 = load_trace(files[0], rank=0)
    out = {"traces": args.traces, "quick": args.quick,
           "compute_rank0": peaks(lambda cfg: RankSession(cfg).compile(rank0), "compute"),
           "full": full_peaks(files),
           "cost": counter_cost(files[0], repeats)}
    emit(out, KEYS)


if __name__ == "__main__":
    main()
