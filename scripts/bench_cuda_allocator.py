"""Cost of the caching allocator model (actors/replay/memory/cuda_allocator.py) per event, and its
predictions on a meta dry run of a captured trace; prints one JSON line (each measurement
also goes to stderr as it finishes).

The synthetic stream is training-shaped: request sizes drawn from a fixed menu (layers repeat
their shapes), frees mostly of recent blocks, a few hundred blocks live. With ``--trace``, the
trace's rank (default: demo/traces/gpt_dp_4's rank 0) replays on meta once per allocation
mode, without and with the model (side by side in one process), on ``--target``.

    python scripts/bench_cuda_allocator.py [--events 2000000] [--trace rank-0.et.json.gz]
        [--quick]   # 2,000 events: seconds
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.replay.memory.cuda_alloc_conf import AllocatorSettings, parse_alloc_conf  # noqa: E402
from actors.replay.memory.cuda_allocator import CachingAllocatorModel  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

MiB = 1 << 20
DEMO_TRACE = ROOT / "demo" / "traces" / "gpt_dp_4" / "rank-0.et.json.gz"
QUICK_EVENTS = 2_000
CONFS = ("", "expandable_segments:True", "max_split_size_mb:128")
_SYNTHETIC = dict.fromkeys(("bench", "conf", "num_events", "us_per_event", "reserved_peak_mib",
                            "allocated_peak_mib"))
_DRY_RUN = dict.fromkeys((
    "bench", "trace", "target", "mode", "num_ops", "num_events", "accounted_peak_gib",
    "predicted_allocated_peak_gib", "predicted_reserved_peak_gib", "num_alloc_retries",
    "num_ooms", "replay_s", "replay_with_model_s"))
# the keys of the JSON line (scripts/json_layout.py): one row per setting
KEYS = {"synthetic": [_SYNTHETIC], "dry_run": [_DRY_RUN]}


def synthetic(num_events: int, conf: str) -> dict:
    """Microseconds per malloc/free of the model over a synthetic stream."""
    rng = random.Random(1)
    menu = [rng.choice((rng.randrange(1, MiB), rng.randrange(MiB, 64 * MiB))) for _ in range(300)]
    sizes = [menu[rng.randrange(300)] for _ in range(num_events // 2)]
    picks = [rng.random() for _ in sizes]
    model = CachingAllocatorModel(parse_alloc_conf(conf) if conf else AllocatorSettings(), 80 << 30)
    live, n = [], 0
    t0 = time.perf_counter()
    for size, pick in zip(sizes, picks):
        live.append(model.malloc(size))
        n += 1
        if len(live) > 400 or pick < 0.5:
            model.free(live.pop(-1 - int(pick * 8) % len(live)))
            n += 1
    elapsed = time.perf_counter() - t0
    return {"bench": "synthetic", "conf": conf or "default", "num_events": n,
            "us_per_event": round(elapsed / n * 1e6, 2),
            "reserved_peak_mib": model.reserved_peak_bytes // MiB,
            "allocated_peak_mib": model.allocated_peak_bytes // MiB}


def dry_runs(path: str, target_name: str) -> list[dict]:
    """Accounted vs predicted peaks of a meta replay of ``path`` per allocation mode."""
    from actors.replay.config import AllocationConfig, ReplayConfig
    from actors.replay.memory.target import TargetConfig
    from actors.replay.session import RankSession
    from actors.trace import load_trace

    trace = load_trace(path)
    rows = []
    for mode in ("faithful", "lazy", "pre_allocate"):
        times = []
        for with_model in (False, True):
            cfg = ReplayConfig(mode="compute", device="meta", iters=1, warmup_iters=0,
                               allocation=AllocationConfig(mode=mode))
            target = TargetConfig(name=target_name) if with_model else None
            t0 = time.perf_counter()
            report = RankSession(cfg, target=target).compile(trace).run().to_dict()
            times.append(time.perf_counter() - t0)
        model = report["cuda_allocator"]
        rows.append({"bench": "dry_run", "trace": path, "target": target_name, "mode": mode,
                     "num_ops": len(trace.ops), "num_events": 2 * model["num_allocs"],
                     "accounted_peak_gib": round(report["accounted_peak_bytes"] / 2**30, 3),
                     "predicted_allocated_peak_gib":
                         round(report["predicted_allocated_peak_bytes"] / 2**30, 3),
                     "predicted_reserved_peak_gib":
                         round(report["predicted_reserved_peak_bytes"] / 2**30, 3),
                     "num_alloc_retries": report["num_alloc_retries"],
                     "num_ooms": model["num_ooms"], "replay_s": round(times[0], 2),
                     "replay_with_model_s": round(times[1], 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2_000_000, help="0: no synthetic stream")
    parser.add_argument("--trace", default=str(DEMO_TRACE), help="a rank trace to dry-run on meta")
    parser.add_argument("--target", default="h200_141gb")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_EVENTS} events: seconds, for the smoke test")
    args = parser.parse_args()
    events = min(args.events, QUICK_EVENTS) if args.quick else args.events
    out = {"synthetic": [], "dry_run": []}
    for conf in CONFS if events else ():
        out["synthetic"].append(synthetic(events, conf))
        print(json.dumps(out["synthetic"][-1]), file=sys.stderr, flush=True)
    for row in dry_runs(args.trace, args.target):
        out["dry_run"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    emit(out, KEYS if events else {**KEYS, "synthetic": None})  # --events 0: none


if __name__ == "__main__":
    main()
