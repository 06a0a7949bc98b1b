"""Host gaps at capture: what recording adds to them, side by side in one run; one JSON line.

Per workload (the demo GPT, data parallel and ZeRO-3, as one gloo rank in this process with
one intra-op thread):

* ``eager_ms``: an iteration with nothing attached (median; alternating with the next);
* ``eager_with_ranges_ms``: the same with the module ranges' hooks attached but neither the
  ET observer nor the profiler (the recorded iterations run these hooks, eager does not);
* ``gaps_ms``: the sum of :func:`actors.trace.kineto.host_gaps_s` as capture writes it (the
  timing of a bare profiler-only iteration keyed to the ET, see
  actors/capture/host_profile.py), and ``timing_step_ms``, that iteration's duration
  (medians of ``--records``);
* ``gaps_with_observer_ms``: the same sum taken from the profile of the ET's own iteration
  (observer, module ranges' hooks and profiler together), what capture would write without
  the bare timing iteration;
* ``*_over_eager``: each sum / eager_ms: the share of the eager iteration the replay will
  busy-wait with ``replay.host_gaps=true``.

Calibration (``per_gap_us``): tiny ops separated by a busy-wait of known length; the median
recorded gap minus the busy-wait is what recording adds per gap (Python's own call overhead
between two ops included).

    python scripts/bench_host_gaps.py [--iters 7] [--records 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.capture.recorder import ModuleRanges, record_iteration  # noqa: E402
from actors.capture.workloads.build import WorkloadConfig, build_workload  # noqa: E402
from actors.rank_base import free_port  # noqa: E402
from actors.trace import load_trace  # noqa: E402
from actors.trace.kineto import host_gaps_s, read_kineto  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

BUSY_US = 50.0
NUM_TINY_OPS = 400
WORKLOADS = ("gpt_dp", "gpt_zero3")
_ROW = dict.fromkeys(("eager_ms", "eager_with_ranges_ms", "timing_step_ms", "gaps_ms",
                      "gaps_with_observer_ms", "timing_step_over_eager", "gaps_over_eager",
                      "gaps_with_observer_over_eager"))
# the keys of the JSON line (scripts/json_layout.py)
KEYS = {**{kind: _ROW for kind in WORKLOADS},
        "per_gap_us": dict.fromkeys(("busy_us", "recorded_gap_us", "recording_adds_us"))}


def _timed(workload) -> float:
    batch = workload.next_batch()
    start = time.perf_counter()
    workload.step(batch)
    return time.perf_counter() - start


def _gaps_with_observer(workload, work: Path, name: str) -> float:
    """Sum of host gaps read from the profile of the ET's own iteration."""
    et, kineto = work / f"{name}.et.json", work / f"{name}.kineto.json"
    observer = ExecutionTraceObserver().register_callback(str(et))
    with ModuleRanges(workload.model), profile(activities=[ProfilerActivity.CPU],
                                               execution_trace_observer=observer) as prof:
        with record_function("ProfilerStep#0"):
            workload.step(workload.next_batch())
    prof.export_chrome_trace(str(kineto))
    return sum(host_gaps_s(load_trace(et), kineto))


def measure_workload(kind: str, iters: int, records: int, work: Path) -> dict:
    """The figures of one workload (see the module docstring)."""
    workload = build_workload(WorkloadConfig(kind=kind), rank=0, world_size=1)
    for _ in range(3):
        workload.step(workload.next_batch())
    eager, ranged = [], []
    for _ in range(iters):  # alternately, so a busy machine slows both alike
        eager.append(_timed(workload))
        with ModuleRanges(workload.model):
            ranged.append(_timed(workload))
    gaps, with_observer, steps = [], [], []
    for i in range(records):
        et, kineto = work / f"{kind}-{i}.et.json.gz", work / f"{kind}-{i}.kineto.json.gz"
        record_iteration(workload.step, workload.next_batch(), workload.model, 0, str(et),
                         kineto_path=str(kineto))
        gaps.append(sum(host_gaps_s(load_trace(et), kineto)))
        steps.append(next(e["dur"] for e in read_kineto(kineto)
                          if str(e.get("name")).startswith("ProfilerStep")) / 1e3)
        with_observer.append(_gaps_with_observer(workload, work, f"{kind}-{i}-same"))
    eager_ms = statistics.median(eager) * 1e3
    out = {"eager_ms": eager_ms, "eager_with_ranges_ms": statistics.median(ranged) * 1e3,
           "timing_step_ms": statistics.median(steps),
           "gaps_ms": statistics.median(gaps) * 1e3,
           "gaps_with_observer_ms": statistics.median(with_observer) * 1e3}
    for key in ("timing_step_ms", "gaps_ms", "gaps_with_observer_ms"):
        out[key.replace("_ms", "_over_eager")] = out[key] / eager_ms
    return {k: round(v, 3) for k, v in out.items()}


def _busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def calibrate(work: Path) -> dict:
    """Per-gap addition of recording, on tiny ops separated by a BUSY_US busy-wait."""
    x = torch.zeros(4)
    model = torch.nn.Linear(2, 2)  # ModuleRanges needs a module; it is not called

    def step(_):
        for _ in range(NUM_TINY_OPS):
            x.add_(1.0)
            _busy(BUSY_US)

    step(None)
    et, kineto = work / "tiny.et.json.gz", work / "tiny.kineto.json.gz"
    record_iteration(step, None, model, 0, str(et), kineto_path=str(kineto))
    gap_us = statistics.median(host_gaps_s(load_trace(et), kineto)[1:]) * 1e6
    return {"busy_us": BUSY_US, "recorded_gap_us": round(gap_us, 2),
            "recording_adds_us": round(gap_us - BUSY_US, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=7, help="timed eager iterations per side")
    ap.add_argument("--records", type=int, default=3, help="recorded iterations per workload")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: one iteration per side, one record per workload")
    args = ap.parse_args()
    if args.quick:
        args.iters, args.records = 1, 1
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")  # DeepSpeed reads them
    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          os.path.expanduser("~/.cache/tracefleet/torch_extensions"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-host-gaps-") as tmp:
            work = Path(tmp)
            out = {kind: measure_workload(kind, args.iters, args.records, work)
                   for kind in WORKLOADS}
            out["per_gap_us"] = calibrate(work)
    finally:
        dist.destroy_process_group()
    emit(out, KEYS)


if __name__ == "__main__":
    main()
