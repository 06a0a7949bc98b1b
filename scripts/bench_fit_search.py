"""Wall time of a whole ``experiment=fit_search`` on the llama3_70b preset (world size 64,
target h100_80gb), cold (the probes' captures made) then cached (the same search again, every
capture reused), in one process; prints one JSON line.

    python scripts/bench_fit_search.py [--cache-dir DIR] [--seq-len-step 1024] [--max-probes 12]
        [--axes batch_size,seq_len,world_size,activation_checkpointing] [--quick]

``--quick``: a small llama3_8b-shaped job (d_model 256, 2 layers) on a small custom target in a
temporary cache (the same keys; ``quick`` and ``workload`` say so). A cold run whose captures
are already in ``--cache-dir`` is not cold: ``num_captured`` says how many captures it made.
"""
from __future__ import annotations

import argparse
import resource
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.studies.fit_search import fit_search  # noqa: E402
from orchestrator.cli.predict import predict_config  # noqa: E402
from scripts.json_layout import EACH, emit  # noqa: E402

QUICK = ["workload=llama3_8b", "world_size=4", "target=custom", "target.device_memory=160MiB",
         "target.cuda_context=0", "target.nccl_num_peers=0",
         "workload.vocab=4096", "workload.d_model=256", "workload.n_layers=2",
         "workload.n_heads=4", "workload.n_kv_heads=2", "workload.ffn_dim=1024",
         "workload.seq_len=512", "fit_search.max_batch_size=8", "fit_search.max_seq_len=2048"]
FULL = ["workload=llama3_70b", "world_size=64", "target=h100_80gb"]
# the keys of the JSON line (scripts/json_layout.py); answers by axis, probes by axis=value
KEYS = {**dict.fromkeys(("quick", "workload", "fit_search_s", "fit_search_cold_s",
                         "fit_search_cpu_s", "fit_search_cold_cpu_s", "num_probes",
                         "num_predictions", "num_captured", "num_captured_cached_run",
                         "same_answers")),
        "answers": {EACH: dict.fromkeys(("best", "first_failing", "num_probes", "reason"))},
        "probe_s_cached": {EACH: None}, "overrides": None}


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the search's workers)."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed_search(overrides: list[str]) -> tuple[float, float, list, list[dict]]:
    """``(wall seconds, CPU seconds of this process, answers, probe records)`` of one
    fit_search (the machine is shared: CPU time is what it would take alone)."""
    cfg = predict_config("experiment=fit_search", *overrides)
    records: list[dict] = []

    def on_probe(record: dict) -> None:
        records.append(record)
        print(f"{record['axis']}={record['value']}: {record['verdict']} in "
              f"{record['probe_s']:.1f} s", file=sys.stderr, flush=True)
    t0, cpu0 = time.perf_counter(), _cpu_s()
    answers = fit_search(cfg, name=overrides[0].split("=", 1)[1], on_probe=on_probe)
    return time.perf_counter() - t0, _cpu_s() - cpu0, answers, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--axes", default="batch_size,seq_len,world_size,activation_checkpointing")
    parser.add_argument("--cache-dir", default="~/.cache/tracefleet/traces")
    parser.add_argument("--seq-len-step", type=int, default=1024)
    parser.add_argument("--max-probes", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a small model, a temporary cache")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        cache = tmp if args.quick else str(Path(args.cache_dir).expanduser())
        overrides = (QUICK if args.quick else FULL) + [
            f"fit_search.axes=[{args.axes}]", f"predict.cache_dir={cache}",
            f"fit_search.seq_len_step={256 if args.quick else args.seq_len_step}",
            f"fit_search.max_probes={args.max_probes}"]
        cold_s, cold_cpu_s, answers, cold = timed_search(overrides)
        cached_s, cached_cpu_s, again, cached = timed_search(overrides)
    emit({
        "quick": args.quick, "workload": overrides[0].split("=", 1)[1],
        "fit_search_s": round(cached_s, 2), "fit_search_cold_s": round(cold_s, 2),
        "fit_search_cpu_s": round(cached_cpu_s, 2), "fit_search_cold_cpu_s": round(cold_cpu_s, 2),
        "num_probes": len(cold),
        "num_predictions": sum(not r["memoized"] for r in cold),
        "num_captured": sum(not (r["capture_reused"] or r["memoized"]) for r in cold),
        "num_captured_cached_run": sum(not (r["capture_reused"] or r["memoized"])
                                       for r in cached),
        "same_answers": [(a.best, a.first_failing) for a in answers]
        == [(a.best, a.first_failing) for a in again],
        "answers": {a.axis: {"best": a.best, "first_failing": a.first_failing,
                             "num_probes": a.num_probes, "reason": a.reason} for a in answers},
        "probe_s_cached": {f"{r['axis']}={r['value']}": round(r["probe_s"], 2) for r in cached},
        "overrides": overrides,
    }, KEYS)


if __name__ == "__main__":
    main()
