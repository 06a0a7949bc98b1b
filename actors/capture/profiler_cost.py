"""The profiler's own cost per recorded op, measured in the capture rank.

The host time between ops that capture records (rank-<r>.kineto.json.gz) comes from an
iteration under torch.profiler, whose per-op bookkeeping (a record-function enter and exit,
an event kept) lands in that host time. To take it off without using the original's iteration
time (the figure a replay's time is then judged by), capture measures it directly: a fixed
loop of small ops timed bare and under the same profiler configuration as capture's timing
iterations, in the same process; the difference over the events the profiler recorded is the
cost of one event. The replay's host-gap calibration multiplies it by the events of the
profiled step (actors/replay/host_gaps.py).
"""
from __future__ import annotations

import time

import torch
from torch.profiler import profile

NUM_OPS = 2000  # small ops per loop: ~5 ms bare here, long enough for the clock
NUM_REPEATS = 15  # loops of each kind; the fastest counts (a preempted loop is only slower)


def _loop(num_ops: int) -> float:
    """Seconds for ``num_ops`` one-element adds (one aten op each)."""
    x, y = torch.ones(1), torch.ones(1)
    add = torch.add
    start = time.perf_counter()
    for _ in range(num_ops):
        add(x, y)
    return time.perf_counter() - start


def profiler_op_cost(activities, num_ops: int = NUM_OPS, repeats: int = NUM_REPEATS) -> dict:
    """``{"profiler_op_cost_s", "num_ops", "events_per_op", "bare_s", "profiled_s"}``: the
    profiler's cost per recorded event (>= 0), from the fastest bare loops (before and after)
    and the fastest loop under ``profile(activities=...)``."""
    bare = [_loop(num_ops) for _ in range(repeats)]
    with profile(activities=activities) as prof:
        profiled = [_loop(num_ops) for _ in range(repeats)]
    bare += [_loop(num_ops) for _ in range(repeats)]
    events = sum(1 for e in prof.events() if e.name == "aten::add")
    per_op = max(1.0, events / (num_ops * repeats))  # aten::add: one event per call
    bare_s, profiled_s = min(bare), min(profiled)
    return {"profiler_op_cost_s": max(0.0, profiled_s - bare_s) / (num_ops * per_op),
            "num_ops": num_ops, "events_per_op": per_op, "bare_s": bare_s,
            "profiled_s": profiled_s}
