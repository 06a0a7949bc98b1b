"""Pre-flight at scale: the driver's peak RSS and wall time of ``experiment.preflight_only=true``
over 8, 64 and 512 generated rank files; prints one JSON line.

Each rank count runs in a fresh driver process (its peak RSS is its own) through `run_replay`,
as ``tracefleet experiment.preflight_only=true trace.dir=...`` does. Side by side, in the same
run, another fresh process holds every rank's loaded trace, as pre-flight did before the
per-rank signatures (``all_traces_held_rss_gib``): the contrast shows what no longer grows.

The rank files are a data-parallel step: a chain of ops and one gradient all-reduce per layer
(gloo-shaped ``c10d::allreduce_``), with a world-sized process-group table.

    python scripts/bench_preflight.py [--counts 8 64 512] [--layers 200] [--ray]

``--ray`` starts a local Ray in each driver first, so folders too large for in-process
pre-flight are reduced in Ray tasks instead of a process pool.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.json_layout import EACH, emit  # noqa: E402

SCHEMA = "1.1.1-chakra.0.0.4"
RELU = "aten::relu(Tensor self) -> Tensor"
ALLREDUCE = ("c10d::allreduce_(Tensor[] tensors, __torch__.torch.classes.c10d.ProcessGroup "
             "process_group, __torch__.torch.classes.c10d.ReduceOp reduce_op, Tensor? "
             "sparse_indices, bool asyncOp, int timeout=-1) -> (Tensor[], "
             "__torch__.torch.classes.c10d.Work)")
DRIVER_TIMEOUT_S = 1800
GIB = 1 << 30
# the keys of the JSON line (scripts/json_layout.py); figures keyed by rank count
KEYS = {"preflight_driver_rss_gib": {EACH: None}, "preflight_s": {EACH: None},
        "all_traces_held_rss_gib": {EACH: None}, "executor": {EACH: None},
        "rank_file_kib": None, "layers": None, "ray": None}


def _side(args):
    return {"values": [a[0] for a in args], "shapes": [a[1] for a in args],
            "types": [a[2] for a in args], "strides": [[1] if a[2].startswith("Tensor") else []
                                                        for a in args]}


def _node(nid, name, parent, inputs=(), outputs=(), schema=""):
    return {"id": nid, "name": name, "ctrl_deps": parent, "inputs": _side(inputs),
            "outputs": _side(outputs),
            "attrs": [{"name": "rf_id", "type": "uint64", "value": nid},
                      {"name": "op_schema", "type": "string", "value": schema}]}


def _tensor(tid, numel):
    return ([tid, tid, 0, numel, 4, "cpu"], [numel], "Tensor(float)")


def rank_trace(world: int, num_layers: int) -> dict:
    """One rank's trace: per layer a relu and the all-reduce of a 1024-element gradient."""
    table = json.dumps([{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cpu:gloo",
                         "ranks": [], "group_size": world, "group_count": 1}])
    nodes = [_node(1, "[pytorch|profiler|execution_trace|process]", 1),
             _node(2, "[pytorch|profiler|execution_trace|thread]", 1),
             _node(3, "## process_group:init ##", 1, inputs=[(table, [], "String")]),
             _node(4, "ProfilerStep#0", 2)]
    nid = 5
    for layer in range(num_layers):
        x, y, grad = 10 + 3 * layer, 11 + 3 * layer, 12 + 3 * layer
        nodes.append(_node(nid, "aten::relu", 4, [_tensor(x, 1024)], [_tensor(y, 1024)], RELU))
        grads = ([[grad, grad, 0, 1024, 4, "cpu"]], [[1024]], "GenericList[Tensor(float)]")
        obj = ("<Object>", [], "Object")
        nodes.append(_node(nid + 1, "c10d::allreduce_", 4,
                           [grads, obj, obj, (None, [], "None"), (False, [], "Bool"), (-1, [], "Int")],
                           [grads, obj], ALLREDUCE))
        nid += 2
    return {"schema": SCHEMA, "pid": 1, "time": "generated", "nodes": nodes}


def write_rank_files(folder: Path, world: int, num_layers: int) -> int:
    """``rank-<r>.et.json`` for r < world; returns the size of one file in bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    data = orjson.dumps(rank_trace(world, num_layers))
    for rank in range(world):
        (folder / f"rank-{rank}.et.json").write_bytes(data)
    return len(data)


def drive(folder: str, hold: bool, use_ray: bool) -> dict:
    """One driver: pre-flight only through run_replay, or (``hold``) every trace loaded and kept."""
    from actors.trace import load_trace
    from actors.trace.source import discover
    from orchestrator.config import ExperimentConfig, RunConfig, TraceConfig
    from orchestrator.run.launch import run_replay
    from orchestrator.run.sinks import file_sinks
    from orchestrator.preflight.signature_pool import pick_executor

    if use_ray:
        import ray
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    executor = pick_executor(discover(folder))
    t0 = time.perf_counter()
    if hold:
        held = [load_trace(src, rank=r) for r, src in discover(folder).items()]
        assert len(held) == len(os.listdir(folder))
    else:
        cfg = RunConfig(trace=TraceConfig(dir=folder),
                        experiment=ExperimentConfig(preflight_only=True))
        with tempfile.TemporaryDirectory() as out:
            summary = run_replay(cfg, Path(out), sinks=file_sinks())
        assert summary["status"] == "ok" and summary["num_collectives"]
    wall_s = time.perf_counter() - t0
    return {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "wall_s": wall_s, "executor": executor}


def _run_driver(folder: Path, hold: bool, use_ray: bool) -> dict:
    cmd = [sys.executable, __file__, "--drive", str(folder)] + ["--hold"] * hold + ["--ray"] * use_ray
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"driver failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--layers", type=int, default=200, help="layers (relu + all-reduce) per rank")
    parser.add_argument("--ray", action="store_true", help="a local Ray is up in each driver")
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: smallest inputs, seconds (the test suite runs it)")
    args = parser.parse_args()
    if args.quick:
        args.counts, args.layers = [8], 20
    if args.drive:
        print(json.dumps(drive(args.drive, args.hold, args.ray)))
        return
    rss, wall, held, executors = {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_preflight_") as tmp:
        for count in args.counts:
            folder = Path(tmp) / str(count)
            file_bytes = write_rank_files(folder, count, args.layers)
            pre = _run_driver(folder, hold=False, use_ray=args.ray)
            base = _run_driver(folder, hold=True, use_ray=args.ray)
            rss[str(count)] = round(pre["rss_bytes"] / GIB, 3)
            wall[str(count)] = round(pre["wall_s"], 2)
            held[str(count)] = round(base["rss_bytes"] / GIB, 3)
            executors[str(count)] = pre["executor"]
    emit({"preflight_driver_rss_gib": rss, "preflight_s": wall,
          "all_traces_held_rss_gib": held, "executor": executors,
          "rank_file_kib": round(file_bytes / 1024, 1), "layers": args.layers,
          "ray": args.ray}, KEYS)


if __name__ == "__main__":
    main()
