"""A mesh job's roles recorded at once against one after another; prints ONE JSON line.

``tracefleet-predict`` of one pipelined job, cold (a fresh capture cache each time), run side
by side with ``predict.roles.num_workers`` = 1 (every role recorded in the driver, one after
another), 2, and 0 (the first role alone, the rest sized by its measured peak). Each run gives
``s`` (wall), ``cpu_s`` (user + system CPU of the command and its worker processes, from
``wait4``), ``rss_gib`` (the largest peak RSS among those processes, ``wait4``),
``max_role_rss_gib`` (the largest role's peak resident memory as meta.json records it:
measured in the process that recorded it), ``num_role_processes`` (how many processes
recorded the roles, by meta.json's pids) and ``capture_s`` (the prediction's capture
phase). ``at_once_over_in_order``: num_workers=2's wall time over
num_workers=1's; ``same_prediction``: every run predicts the same reserved peak (the traces
do not depend on where they were recorded). On a machine shared with other jobs, the wall
times follow the load: compare them within one run of this script.

The job: ``workload=llama3_8b world_size=16 workload.parallelism.pp=4``: four stages of eight
layers each, four roles (each role's own process costs ~4 CPU s of start-up: torch, the fake
device, the model; roles of a few seconds gain nothing, roles of minutes close to the number
of cores). ``--quick``: 2 stages of the 8B cut to 2 layers, at
world 4, with num_workers 1 and 2 (seconds, for the smoke test).

    python scripts/bench_roles.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.trace.meta_file import META_JSON  # noqa: E402
from scripts.bench_predict_speed import GIB, predict  # noqa: E402
from scripts.json_layout import emit  # noqa: E402

JOB = ["workload=llama3_8b", "world_size=16", "workload.parallelism.pp=4"]
QUICK_JOB = ["workload=llama3_8b", "world_size=4", "workload.parallelism.pp=2",
             "workload.n_layers=2"]
WORKERS, QUICK_WORKERS = (1, 2, 0), (1, 2)
RUN_KEYS = dict.fromkeys(("num_workers", "s", "cpu_s", "rss_gib", "max_role_rss_gib",
                          "capture_s", "num_roles", "num_role_processes",
                          "predicted_reserved_peak_bytes"))
KEYS = {"quick": None, "job": None, "runs": [RUN_KEYS], "at_once_over_in_order": None,
        "same_prediction": None}


def _run(tmp: Path, job: list[str], num_workers: int) -> dict:
    cache = tmp / f"cache-{num_workers}"
    run = predict(tmp, f"workers-{num_workers}", cache, *job,
                  f"predict.roles.num_workers={num_workers}")
    prediction = run["prediction"]
    [folder] = [p.parent for p in cache.glob(f"*/{META_JSON}")]
    recordings = json.loads((folder / META_JSON).read_text())["role_recordings"]
    return {"num_workers": num_workers, "s": run["s"], "cpu_s": run["cpu_s"],
            "rss_gib": run["rss_gib"],
            "max_role_rss_gib": max(r["peak_rss_bytes"] for r in recordings) / GIB,
            "capture_s": prediction["timings_s"]["capture_s"], "num_roles": len(recordings),
            "num_role_processes": len({r["pid"] for r in recordings}),
            "predicted_reserved_peak_bytes": prediction["predicted_reserved_peak_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 stages of 2 layers: seconds")
    args = parser.parse_args()
    job = QUICK_JOB if args.quick else JOB
    with tempfile.TemporaryDirectory(prefix="bench_roles_") as tmp:
        runs = [_run(Path(tmp), job, n) for n in (QUICK_WORKERS if args.quick else WORKERS)]
    by_workers = {r["num_workers"]: r for r in runs}
    emit({"quick": args.quick, "job": " ".join(job), "runs": runs,
          "at_once_over_in_order": by_workers[2]["s"] / by_workers[1]["s"],
          "same_prediction": len({r["predicted_reserved_peak_bytes"] for r in runs}) == 1}, KEYS)


if __name__ == "__main__":
    main()
