"""Meta dry-run speed: one measured iteration of a Llama-3-70B-shaped step, per op, with the
meta kernels (replay.meta_recorded_outputs=false) and with recorded outputs (true, the
default), side by side in one run; prints one JSON line.

The setting is the OOM study's probe: compute mode on meta, faithful allocation, ZeRO-3
per_module emulation over 64 ranks. The trace is captured here on meta (seconds) unless
``--trace`` names a rank trace; ``--n-layers`` shrinks the model (``n_layers`` says so; null
with ``--trace``). ``--quick``: 2 layers, one measured iteration, the same keys.

    python scripts/bench_meta_dry_run.py [--n-layers 80] [--iters 3] [--trace rank-0.et.json.gz]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.replay.config import AllocationConfig, ReplayConfig  # noqa: E402
from actors.replay.session import RankSession  # noqa: E402
from actors.trace import load_trace  # noqa: E402
from actors.zero3.config import Zero3Config  # noqa: E402
from actors.zero3.extension import zero3_extensions  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

# what a dry run decides: both variants must agree on every one of these
SAME = ("status", "accounted_peak_bytes", "peak_breakdown", "peak_op", "num_flushes",
        "num_materialized", "coverage", "num_shape_mismatches")
# the keys of the JSON line (scripts/json_layout.py)
KEYS = dict.fromkeys((
    "meta_us_per_op_70b", "meta_us_per_op_70b_kernels", "speedup", "num_ops", "n_layers",
    "iteration_s", "iteration_s_kernels", "first_iteration_note", "setup_s", "setup_s_kernels",
    "load_s", "same_accounting", "accounted_peak_bytes", "trace"))


def capture(out_dir: Path, n_layers: int) -> Path:
    """Capture the 70B-shaped step on meta (tracefleet-capture, one process)."""
    exe = Path(sys.executable).with_name("tracefleet-capture")
    subprocess.run([str(exe), "workload=llama_70b", "world_size=8", "workload.kind=llama_local",
                    f"workload.n_layers={n_layers}", f"out_dir={out_dir}"], check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                   timeout=1800)
    return out_dir / "rank-0.et.json.gz"


def dry_run(trace, recorded: bool, iters: int) -> tuple[dict, float]:
    """The report of one warm-up + ``iters`` measured iterations, and the engine's setup s."""
    cfg = ReplayConfig(mode="compute", device="meta", iters=iters, warmup_iters=1,
                       measure_memory=False, meta_recorded_outputs=recorded,
                       allocation=AllocationConfig(mode="faithful"))
    t0 = time.perf_counter()
    zero3 = Zero3Config(strategy="per_module", world_size=64)
    engine = RankSession(cfg, extensions=lambda t: zero3_extensions(zero3, t)).compile(trace)
    setup_s = time.perf_counter() - t0
    report = engine.run().to_dict()
    if report["status"] != "ok":
        raise SystemExit(f"dry run failed: {report['error']}")
    return report, setup_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layers", type=int, default=80)
    parser.add_argument("--iters", type=int, default=3, help="measured iterations (median)")
    parser.add_argument("--trace", help="a captured rank trace instead of capturing one")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 layers, one measured iteration")
    args = parser.parse_args()
    if args.quick:
        args.n_layers, args.iters = 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.trace) if args.trace else capture(Path(tmp), args.n_layers)
        t0 = time.perf_counter()
        trace = load_trace(path)
        load_s = time.perf_counter() - t0
        kernels, kernels_setup_s = dry_run(trace, False, args.iters)
        recorded, recorded_setup_s = dry_run(trace, True, args.iters)
    num_ops = len(trace.ops)
    us = {k: r["iteration_time_s"] / num_ops * 1e6 for k, r in
          (("kernels", kernels), ("recorded", recorded))}
    emit({
        "meta_us_per_op_70b": round(us["recorded"], 2),
        "meta_us_per_op_70b_kernels": round(us["kernels"], 2),
        "speedup": round(us["kernels"] / us["recorded"], 2),
        "num_ops": num_ops, "n_layers": None if args.trace else args.n_layers,
        "iteration_s": round(recorded["iteration_time_s"], 3),
        "iteration_s_kernels": round(kernels["iteration_time_s"], 3),
        "first_iteration_note": "warm-up runs the kernels either way (not timed here)",
        "setup_s": round(recorded_setup_s, 1), "setup_s_kernels": round(kernels_setup_s, 1),
        "load_s": round(load_s, 1),
        "same_accounting": all(kernels[k] == recorded[k] for k in SAME),
        "accounted_peak_bytes": recorded["accounted_peak_bytes"],
        "trace": str(path) if args.trace else f"llama_70b n_layers={args.n_layers} (captured)",
    }, KEYS)


if __name__ == "__main__":
    main()
