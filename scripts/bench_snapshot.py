"""What the predicted snapshot and prediction.html cost a prediction; one JSON line.

One process, the capture cached first (not timed), then the job predicted alternately three
ways, ``--repeats`` times each, CPU seconds (this process's user + system) and wall seconds:

* ``plain``: no output folder (what fit_search's probes and ``tracefleet.predict`` run): the
  plain caching allocator model, no timeline, no page;
* ``page``: an output folder: prediction.json with the predicted timeline, and prediction.html;
* ``snapshot``: the same with ``predict.snapshot=true``: the model's history kept and
  ``snapshot_rank<r>.pickle`` written.

Also ``snapshot_s`` (building and pickling the snapshot, inside the dry run), the snapshot's
size and its number of events.

    python scripts/bench_snapshot.py [--quick] [--repeats 2] [--cache-dir DIR]
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.json_layout import emit  # noqa: E402

JOB = ["workload=llama3_70b", "world_size=64", "target=h100_80gb"]
QUICK = ["workload=llama3_8b", "world_size=8", "target=h100_80gb", "workload.n_layers=2",
         "workload.seq_len=1024"]


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


KEYS = dict.fromkeys(("job", "repeats", "capture_or_cache_s", "plain_cpu_s", "plain_wall_s",
                      "page_cpu_s", "page_wall_s", "snapshot_cpu_s", "snapshot_wall_s",
                      "snapshot_s", "snapshot_bytes", "snapshot_events", "reserved_peak_bytes",
                      "load_avg_1m"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer 8B job (seconds)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", default=None, help="capture cache (default: a new one)")
    args = parser.parse_args()
    from orchestrator.cli.predict import predict_config
    from orchestrator.studies.predict import predict

    tmp = Path(tempfile.mkdtemp(prefix="bench_snapshot_"))
    cache = args.cache_dir or str(tmp / "cache")
    job = QUICK if args.quick else JOB
    t0 = time.perf_counter()
    predict(predict_config(*job, f"predict.cache_dir={cache}"))  # the capture, cached
    capture_s = time.perf_counter() - t0
    runs: dict[str, list] = {"plain": [], "page": [], "snapshot": []}
    facts = {}
    for i in range(args.repeats):
        for variant in runs:
            extra = ["predict.snapshot=true"] if variant == "snapshot" else []
            cfg = predict_config(*job, f"predict.cache_dir={cache}", *extra)
            out = None if variant == "plain" else tmp / f"{variant}{i}"
            c0, w0 = _cpu_s(), time.perf_counter()
            result = predict(cfg, out)
            runs[variant].append((_cpu_s() - c0, time.perf_counter() - w0))
            if variant == "snapshot":
                path = out / result.snapshots[str(result.rank)]
                facts = {"snapshot_s": round(result.timings_s["snapshot_s"], 3),
                         "snapshot_bytes": path.stat().st_size,
                         "snapshot_events": len(pickle.loads(path.read_bytes())
                                                ["device_traces"][0]),
                         "reserved_peak_bytes": result.predicted_reserved_peak_bytes}
    line = {"job": " ".join(job), "repeats": args.repeats, "capture_or_cache_s": round(capture_s, 1)}
    for variant, times in runs.items():
        line[f"{variant}_cpu_s"] = round(statistics.median(t[0] for t in times), 2)
        line[f"{variant}_wall_s"] = round(statistics.median(t[1] for t in times), 2)
    emit({**line, **facts, "load_avg_1m": round(os.getloadavg()[0], 1)}, KEYS)


if __name__ == "__main__":
    main()
