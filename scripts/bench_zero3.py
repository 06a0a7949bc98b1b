"""ZeRO-3 fetch/release: our replay's strategies against real DeepSpeed, on 2 ranks, one run.

A fine-grained model (actors/capture/workloads/finegrained_model.py: Linear stacks and an 8-expert
MoE block) is captured once with data parallel on 2 gloo ranks. Then, on 2 gloo ranks:

* our replay of that trace (replay.mode=full) with zero3.strategy per_param, per_module,
  bucketed and leaf_coalesced (leaves: the Linear stacks and the MoE block);
* DeepSpeed ZeRO-3 training the same model, without and with ``set_z3_leaf_modules`` on the
  same classes. Its coordinator's ``fetch_sub_module``/``release_sub_module`` are wrapped
  here (in this script only) with timers, and its all-gather function with a counter whose
  handles time their waits: host time = time in fetch and release minus time waiting.

Both sides: every parameter partitioned (persistence threshold 0), no prefetch (DeepSpeed's
prefetch bucket 0), and no reuse (DeepSpeed's max_reuse_distance 0: released after every
use, as our replay does). The trace is captured without the data-parallel gradient
all-reduces: the emulation reduce-scatters gradients itself, as DeepSpeed does, so both
steps communicate alike. Engines of one side alternate step by step in one process, so
load changes hit them alike; ``step_s`` is the slowest rank's time per step (a synchronous
step ends when its slowest rank does), median over the timed steps; host times are medians
per rank, averaged over the ranks. Prints one JSON line:

    {"allgathers_per_step": {...}, "fetch_release_host_s_per_step": {...}, "step_s": {...},
     "leaf_over_per_module_host": x}

each object keyed per_param, per_module, bucketed, leaf_coalesced, deepspeed, deepspeed_leaf.

    python scripts/bench_zero3.py [--steps 12] [--warmup 3]
    python scripts/bench_zero3.py --quick   # 1 warm-up and 2 timed steps
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.trace.conventions import trace_file_name  # noqa: E402
from actors.rank_base import free_port  # noqa: E402
from actors.capture.finegrained_capture import capture_data_parallel  # noqa: E402
from actors.capture.workloads import finegrained_model as fg  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

OURS = ["per_param", "per_module", "bucketed", "leaf_coalesced"]
ENGINES = OURS + ["deepspeed", "deepspeed_leaf"]
# the keys of the JSON line (scripts/json_layout.py)
KEYS = {**{figure: dict.fromkeys(ENGINES) for figure in
           ("allgathers_per_step", "fetch_release_host_s_per_step", "step_s")},
        "leaf_over_per_module_host": None}
BUCKET_NUMEL = 100_000  # bucketed: about a fifth of the model per all-gather
WORLD = 2


def _quiet_child() -> None:
    """Children write nothing to stdout (the script's one JSON line); logs go to stderr."""
    os.dup2(2, 1)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def _init(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))


# --- our replay --------------------------------------------------------------------------
def _ours_rank(rank: int, port: int, trace_dir: str, steps: int, warmup: int, out: str) -> None:
    _quiet_child()
    from actors.replay.comm.rank_comm import rank_comm
    from actors.replay.config import ReplayConfig
    from actors.replay.session import RankSession
    from actors.trace import load_trace
    from actors.zero3.config import Zero3Config
    from actors.zero3.extension import zero3_extensions

    _init(rank, port)
    trace = load_trace(Path(trace_dir) / trace_file_name(rank), rank=rank)
    comm = rank_comm(trace.process_groups, rank, WORLD, torch.device("cpu"), timeout_s=120.0,
                     ops=trace.ops)
    cfg = ReplayConfig(mode="full", device="cpu", iters=1, warmup_iters=0, measure_memory=False)
    engines = {}
    for s in OURS:
        z = Zero3Config(strategy=s, param_persistence_threshold=0, prefetch=False,
                        leaf_modules=fg.LEAF_PATTERNS, prefetch_bucket_size=BUCKET_NUMEL)
        session = RankSession(cfg, rank=rank, extensions=lambda t, z=z: zero3_extensions(z, t))
        engines[s] = session.compile(trace, comm)
    step_s = {s: [] for s in OURS}
    for k in range(warmup + steps):
        for s, engine in engines.items():  # alternate: load changes hit every strategy alike
            report = engine.run().to_dict()
            if report["status"] != "ok":
                raise RuntimeError(f"{s}: {report['error']}")
            if k >= warmup:
                step_s[s].append(report["iteration_time_s"])
    result = {}
    for s, engine in engines.items():
        zero3 = next(e for e in engine.extensions if e.name == "zero3")
        its = zero3.runtime.metrics.iterations[warmup:]
        result[s] = {"allgathers": its[-1]["num_allgathers"],
                     "host_s": statistics.median(i["fetch_host_s"] + i["release_host_s"] for i in its),
                     "steps_s": step_s[s]}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


# --- DeepSpeed -----------------------------------------------------------------------------
class _Timed:
    """Accumulates seconds spent in wrapped calls, and all-gathers issued."""

    def __init__(self):
        self.fetch_release_s = 0.0
        self.wait_s = 0.0
        self.allgathers = 0


class _TimedWork:
    """A collective's work handle whose ``wait`` is timed (DeepSpeed waits inside fetch)."""

    def __init__(self, work, timed: _Timed):
        self._work, self._timed = work, timed

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timed.wait_s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def _instrument_deepspeed(timed: _Timed) -> None:
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.zero.partitioned_param_coordinator import \
        PartitionedParameterCoordinator as Coordinator

    gather = pp._dist_allgather_fn

    def counted_gather(*args, **kwargs):
        timed.allgathers += 1
        return _TimedWork(gather(*args, **kwargs), timed)
    pp._dist_allgather_fn = counted_gather
    for name in ("fetch_sub_module", "release_sub_module"):
        original = getattr(Coordinator, name)

        def timed_call(self, *args, _original=original, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                timed.fetch_release_s += time.perf_counter() - t0
        setattr(Coordinator, name, timed_call)


def _skip_shm_comm_op() -> None:
    """DeepSpeed's CPU accelerator JIT-builds a shm comm op at start-up (slow, needs g++);
    only inference all-reduces use it: mark it incompatible so DeepSpeed skips it."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def _ds_rank(rank: int, port: int, steps: int, warmup: int, out: str) -> None:
    _quiet_child()
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    _init(rank, port)
    _skip_shm_comm_op()
    timers = {"deepspeed": _Timed(), "deepspeed_leaf": _Timed()}
    current = _Timed()
    _instrument_deepspeed(current)
    engines = {}
    for name in timers:
        model, next_batch = fg.build(fg.FineGrainedConfig(), rank)
        if name == "deepspeed_leaf":
            deepspeed.utils.set_z3_leaf_modules(model, fg.leaf_classes())
        config = {
            "train_micro_batch_size_per_gpu": fg.FineGrainedConfig().batch_size,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 0,
                                  "stage3_max_reuse_distance": 0},
            "steps_per_print": 2**31 - 1,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config, dist_init_required=False)
        engines[name] = (engine, next_batch)
    samples = {name: [] for name in timers}
    for k in range(warmup + steps):
        for name, (engine, next_batch) in engines.items():
            batch = next_batch()
            current.__init__()
            t0 = time.perf_counter()
            engine.backward(engine(*batch))
            engine.step()
            step_s = time.perf_counter() - t0
            if k >= warmup:
                samples[name].append((current.allgathers, current.fetch_release_s - current.wait_s,
                                      step_s))
    result = {name: {"allgathers": s[-1][0], "host_s": statistics.median(x[1] for x in s),
                     "steps_s": [x[2] for x in s]} for name, s in samples.items()}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _run_ranks(fn, *args) -> dict:
    """Run ``fn(rank, port, *args, out)`` on WORLD processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"rank-{r}.json") for r in range(WORLD)]
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=fn, args=(r, port, *args, outs[r])) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=900)
            if p.is_alive():
                p.kill()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"{fn.__name__} failed: exit codes {[p.exitcode for p in procs]}")
        ranks = [json.loads(Path(o).read_text()) for o in outs]
    # per key: all-gathers from rank 0 (ranks agree), host time the mean of the ranks' medians,
    # step time the slowest rank's per step, median over the steps
    return {k: {"allgathers": ranks[0][k]["allgathers"],
                "host_s": statistics.mean(r[k]["host_s"] for r in ranks),
                "step_s": statistics.median(max(per_rank) for per_rank in
                                            zip(*(r[k]["steps_s"] for r in ranks)))}
            for k in ranks[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="timed steps per engine")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per engine first")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up, 2 timed steps")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup = 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = capture_data_parallel(Path(tmp) / "trace", WORLD, fg.FineGrainedConfig(),
                                          grad_all_reduce=False)
        figures = _run_ranks(_ours_rank, str(trace_dir), args.steps, args.warmup)
    figures.update(_run_ranks(_ds_rank, args.steps, args.warmup))
    out = {"allgathers_per_step": {k: figures[k]["allgathers"] for k in ENGINES},
           "fetch_release_host_s_per_step": {k: figures[k]["host_s"] for k in ENGINES},
           "step_s": {k: figures[k]["step_s"] for k in ENGINES}}
    out["leaf_over_per_module_host"] = (figures["leaf_coalesced"]["host_s"]
                                        / figures["per_module"]["host_s"])
    emit(out, KEYS)


if __name__ == "__main__":
    main()
