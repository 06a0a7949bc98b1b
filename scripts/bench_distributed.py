"""Distributed replay benchmarks through the real run path; prints one JSON line.

* End to end: ``tracefleet trace.dir=...`` (default config: full mode, embedded local Ray
  cluster) on the 4-rank demo trace and on an 8-rank capture of the same workload
  (``tracefleet-capture world_size=8``), each split into the phases the run records in
  ``summary.json["timings_s"]``.
* Collective bus bandwidth of a ``comms``-mode replay (``run_replay``) vs a raw
  ``torch.distributed`` loop issuing the same calls (same kinds, element counts, dtype and
  group), alternated round by round in the same rank actors of that run. The trace is a real
  4-rank gloo capture of all_reduce and all_gather_into_tensor of 1, 4 and 16 MiB.

    python scripts/bench_distributed.py [--traces8 DIR] [--rounds 10] [--iters 3]
    python scripts/bench_distributed.py --quick

``--quick`` (about a minute, for the smoke test): every part on tiny inputs: 1 replay
iteration of the 4-rank demo, the capture and its run at 2 ranks instead of 8 (``e2e_8`` and
``capture_8_s`` keep their names; ``world_size`` says 2), the comms trace on 2 ranks with
1 MiB collectives, 2 rounds of 1 iteration.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.rank_actor import RankActor  # noqa: E402
from actors.rank_base import free_port  # noqa: E402
from actors.replay.comm.bandwidth import CommStats, message_bytes  # noqa: E402
from actors.replay.comm.rank_comm import rank_comm  # noqa: E402
from actors.replay.config import ReplayConfig  # noqa: E402
from actors.replay.session import RankSession  # noqa: E402
from actors.replay.ops.resolve import torch_dtype_or_none  # noqa: E402
from orchestrator.config import DEMO_TRACES, ClusterConfig, ExperimentConfig, RunConfig, TraceConfig  # noqa: E402
from orchestrator.outputs import RunDir  # noqa: E402
from orchestrator.run.launch import run_replay  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

COMM_WORLD_SIZE = 4
CAPTURE_WORLD_SIZE = 8
QUICK_WORLD_SIZE = 2  # --quick: the captured run's and the comms trace's ranks
COMM_SIZES_MIB = (1, 4, 16)
TARGET_RATIO = 0.8
CAPTURE_TIMEOUT_S = 600
RUN_TIMEOUT_S = 900
# 8 rank actors on a small, shared machine can take minutes to start: the phase is measured,
# not bounded by the default 120 s.
ACTOR_START_TIMEOUT_S = 600
# A constant, not torch.device() in CommsBenchRank.replay: cloudpickle takes `torch` + `.ops`
# in one function for the submodule torch.ops, which cannot be pickled.
CPU = torch.device("cpu")
_E2E = dict.fromkeys(("world_size", "preflight_s", "cluster_start_s", "actor_start_s",
                      "trace_load_s", "rendezvous_s", "replay_s", "teardown_s", "aggregation_s",
                      "total_s", "actors_start_rendezvous_s", "command_wall_s",
                      "iteration_time_s"))
_KIND = dict.fromkeys(("replay_busbw_gbps", "raw_busbw_gbps", "ratio", "num_calls_per_rank"))
_KINDS = ("all_gather_into_tensor", "all_reduce")
# the keys of the JSON line (scripts/json_layout.py)
KEYS = {"quick": None, "e2e_4": _E2E, "e2e_8": _E2E, "capture_8_s": None,
        "comms": {"world_size": None, "sizes_mib": None, "rounds": None, "iters_per_round": None,
                  "kinds": dict.fromkeys(_KINDS, _KIND), "run_busbw_gbps": dict.fromkeys(_KINDS),
                  "iteration_speed_ratio": None, "min_busbw_ratio": None, "target_ratio": None,
                  "meets_target": None}}


def end_to_end(trace_dir: Path, work: Path, name: str, overrides: tuple = ()) -> dict:
    """`tracefleet trace.dir=...` as a user runs it (default config: full mode, embedded
    cluster): the phase times of its summary.json, actor start + rendezvous also combined,
    and the command's wall time (interpreter start and imports included).

    A subprocess, not run_replay() here: pre-flight loads the traces in spawned processes,
    which re-import the caller's __main__, and this script's imports would inflate it.
    """
    run_dir = work / name
    cmd = [str(Path(sys.executable).with_name("tracefleet")), f"trace.dir={trace_dir}",
           f"hydra.run.dir={run_dir}", f"cluster.temp_dir={work / ('ray-' + name)}",
           "cluster.log_to_driver=false", f"cluster.timeout_s={ACTOR_START_TIMEOUT_S}",
           *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench_distributed: {' '.join(cmd)} failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    summary = json.loads(RunDir(run_dir).summary.read_text())
    t = summary["timings_s"]
    out = {"world_size": summary["world_size"], **{k: round(v, 3) for k, v in t.items()}}
    out["actors_start_rendezvous_s"] = round(t["actor_start_s"] + t["trace_load_s"]
                                             + t["rendezvous_s"], 3)
    out["command_wall_s"] = round(wall_s, 3)
    out["iteration_time_s"] = round(summary["iteration_time_s"], 4)
    return out


def capture_gpt(work: Path, world_size: int) -> tuple[Path, float]:
    """A ``world_size``-rank trace of the demo's workload via ``tracefleet-capture``;
    (dir, seconds)."""
    workload = json.loads(RunDir(DEMO_TRACES / "gpt_dp_4").meta.read_text())["workload"]
    out = work / f"gpt_dp_{world_size}"
    cmd = [sys.executable, "-m", "orchestrator.cli.capture", f"world_size={world_size}",
           f"out_dir={out}",
           f"hydra.run.dir={work / 'capture8'}", f"cluster.temp_dir={work / 'ray-capture8'}",
           "warmup_iters=1", "timing_iters=1",
           *(f"workload.{k}={json.dumps(v)}" for k, v in workload.items())]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CAPTURE_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"bench_distributed: {world_size}-rank capture failed:\n"
                         f"{proc.stderr[-3000:]}")
    return out, time.perf_counter() - t0


# --- collective bandwidth: replay vs raw loop ---------------------------------------------
def _capture_comms_rank(rank: int, world_size: int, port: int, out_dir: str,
                        sizes_mib: tuple) -> None:
    """One rank of the comms trace: all_reduce and all_gather_into_tensor per size."""
    from torch.profiler import ExecutionTraceObserver, record_function

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    bufs = []
    for mib in sizes_mib:
        numel = mib * 2**20 // 4  # float32
        bufs.append((torch.zeros(numel), torch.zeros(numel // world_size), torch.empty(numel)))

    def step():
        for reduced, shard, gathered in bufs:
            dist.all_reduce(reduced)
            dist.all_gather_into_tensor(gathered, shard)

    step()
    et = ExecutionTraceObserver()
    et.register_callback(f"{out_dir}/rank-{rank}.et.json")
    et.start()
    with record_function("ProfilerStep#1"):
        step()
    et.stop()
    et.unregister_callback()
    dist.destroy_process_group()


def capture_comms(work: Path, sizes_mib: tuple, world_size: int) -> Path:
    import torch.multiprocessing as mp

    out = work / f"comms_{world_size}"
    out.mkdir()
    mp.spawn(_capture_comms_rank, args=(world_size, free_port(), str(out), sizes_mib),
             nprocs=world_size)
    return out


def _raw_calls(trace, world_size: int) -> list:
    """(kind, message bytes, call) per collective of the trace, on plain tensors of the same
    element counts and dtype, issued on the default group (the trace's group "0")."""
    calls = []
    for op in trace.collectives:
        c = op.collective
        dtype = torch_dtype_or_none(c.dtype or next(t.dtype for t in op.input_tensors()))
        nbytes = message_bytes(c.kind, c.in_nelems, c.out_nelems, dtype.itemsize, world_size)
        if c.kind == "all_reduce":
            t = torch.zeros(c.in_nelems, dtype=dtype)
            calls.append((c.kind, nbytes, lambda t=t: dist.all_reduce(t)))
        elif c.kind == "all_gather_into_tensor":
            out, inp = torch.zeros(c.out_nelems, dtype=dtype), torch.zeros(c.in_nelems, dtype=dtype)
            calls.append((c.kind, nbytes, lambda o=out, i=inp: dist.all_gather_into_tensor(o, i)))
        else:
            raise ValueError(f"raw loop: collective kind {c.kind!r} not in the bench trace")
    return calls


class CommsBenchRank(RankActor):
    """After the product's replay, alternates rounds of the replay engine and of the raw loop
    over the same calls, in this very process and group; adds each round's per-kind stats
    to the report. The order flips every round so drift in machine load hits both alike."""

    rounds = 10  # replay/raw alternations; comms_vs_raw sets it before the class is shipped

    def replay(self, request):
        out = super().replay(request)
        if out["status"] != "ok":
            return out
        cfg = request.cfg
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        trace_bytes = request.trace_bytes
        if isinstance(trace_bytes, ray.ObjectRef):  # as RankActor.replay: not resolved by Ray
            trace_bytes = ray.get(trace_bytes)
        trace = self._load(request.trace_path, rank, trace_bytes)  # the replay's own parse
        comm = rank_comm(request.pg_table, rank, world_size, CPU,
                         timeout_s=cfg.collective_timeout_s, group_map=request.group_map,
                         ops=trace.ops)
        calls = _raw_calls(trace, world_size)
        engine = RankSession(dataclasses.replace(cfg, warmup_iters=0), rank=rank,
                             device=CPU).compile(trace, comm)
        engine.run()  # warm-up of both sides
        _raw_round(calls, CommStats(), 1, world_size)

        def replay_side():
            comm.stats.reset()
            times = engine.run().iteration_times_s
            return comm.stats.to_dict(), statistics.median(times)

        def raw_side():
            stats = CommStats()
            times = _raw_round(calls, stats, cfg.iters, world_size)
            return stats.to_dict(), statistics.median(times)

        rounds = []
        for i in range(self.rounds):
            if i % 2:
                raw, replay = raw_side(), replay_side()
            else:
                replay, raw = replay_side(), raw_side()
            rounds.append({"replay": replay[0], "raw": raw[0], "replay_iteration_s": replay[1],
                           "raw_iteration_s": raw[1]})
        out["bench_rounds"] = rounds
        return out


def _raw_round(calls, stats: CommStats, iters: int, world_size: int) -> list:
    """``iters`` iterations of the raw calls, timed per call like the replayer; their times."""
    times = []
    for _ in range(iters):
        t_iter = time.perf_counter()
        for kind, nbytes, call in calls:
            t0 = time.perf_counter()
            call()
            stats.add(kind, nbytes, time.perf_counter() - t0, world_size)
        times.append(time.perf_counter() - t_iter)
    return times


def _median_ratio(reports: list[dict], value) -> float:
    """Median over ranks of the median over rounds of value(round) (a replay/raw ratio)."""
    return statistics.median(statistics.median(value(r) for r in report["bench_rounds"])
                             for report in reports)


def comms_vs_raw(work: Path, rounds: int, iters: int, sizes_mib: tuple = COMM_SIZES_MIB,
                 world_size: int = COMM_WORLD_SIZE) -> dict:
    """Per-kind busbw of replay and raw loop (median over ranks of the median over rounds),
    their ratio (median of the per-round ratios), and the run's own busbw figures."""
    CommsBenchRank.rounds = rounds
    cfg = RunConfig(cluster=ClusterConfig(temp_dir=str(work / "ray-comms"), log_to_driver=False),
                    trace=TraceConfig(dir=str(capture_comms(work, sizes_mib, world_size))),
                    replay=ReplayConfig(mode="comms", iters=iters, warmup_iters=1),
                    experiment=ExperimentConfig(name="comms", replay_timeout_s=RUN_TIMEOUT_S))
    summary = run_replay(cfg, work / "comms", console=Console(file=io.StringIO()),
                         actor_cls=CommsBenchRank)
    if summary["status"] != "ok":
        raise SystemExit(f"bench_distributed: comms run {summary['status']}: {summary['error']}")
    ranks = summary["ranks"]
    kinds = {}
    for kind in sorted(ranks[0]["bench_rounds"][0]["raw"]):
        def busbw(side, r, kind=kind):
            return statistics.median(x[side][kind]["busbw_gbps"] for x in r["bench_rounds"])
        kinds[kind] = {
            "replay_busbw_gbps": round(statistics.median(busbw("replay", r) for r in ranks), 3),
            "raw_busbw_gbps": round(statistics.median(busbw("raw", r) for r in ranks), 3),
            "ratio": round(_median_ratio(ranks, lambda x, k=kind: x["replay"][k]["busbw_gbps"]
                                         / x["raw"][k]["busbw_gbps"]), 3),
            "num_calls_per_rank": sum(x["replay"][kind]["num_calls"]
                                      for x in ranks[0]["bench_rounds"])}
    min_ratio = min(k["ratio"] for k in kinds.values())
    return {"world_size": summary["world_size"], "sizes_mib": list(sizes_mib),
            "rounds": rounds, "iters_per_round": iters, "kinds": kinds,
            "run_busbw_gbps": {k: round(c["busbw_gbps"], 3)
                               for k, c in summary["collectives"].items()},
            "iteration_speed_ratio": round(_median_ratio(
                ranks, lambda x: x["raw_iteration_s"] / x["replay_iteration_s"]), 3),
            "min_busbw_ratio": min_ratio, "target_ratio": TARGET_RATIO,
            "meets_target": min_ratio >= TARGET_RATIO}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces4", type=Path, default=DEMO_TRACES / "gpt_dp_4")
    parser.add_argument("--traces8", type=Path, default=None,
                        help="an 8-rank trace folder (default: capture one, ~50 s)")
    parser.add_argument("--rounds", type=int, default=10, help="replay/raw alternations")
    parser.add_argument("--iters", type=int, default=3, help="iterations per side and round")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: every part on tiny inputs (see the docstring)")
    args = parser.parse_args(argv)
    overrides = ("replay.iters=1", "replay.warmup_iters=0") if args.quick else ()
    sizes = (1,) if args.quick else COMM_SIZES_MIB
    rounds, iters = (2, 1) if args.quick else (args.rounds, args.iters)
    world8 = QUICK_WORLD_SIZE if args.quick else CAPTURE_WORLD_SIZE
    comm_world = QUICK_WORLD_SIZE if args.quick else COMM_WORLD_SIZE
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="tfbd-", dir="/tmp") as tmp:  # short: Ray sockets
        work = Path(tmp)
        result = {"quick": args.quick, "e2e_4": end_to_end(args.traces4, work, "e2e4", overrides)}
        traces8, capture_s = (args.traces8, None) if args.traces8 else capture_gpt(work, world8)
        result["e2e_8"] = end_to_end(traces8, work, "e2e8", overrides)
        result["capture_8_s"] = None if capture_s is None else round(capture_s, 1)
        result["comms"] = comms_vs_raw(work, rounds, iters, sizes, comm_world)
    emit(result, KEYS)


if __name__ == "__main__":
    main()
