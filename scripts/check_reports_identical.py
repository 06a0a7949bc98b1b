"""Reports byte-identical before and after a refactor, over a fixed set of configurations.

Runs >= 20 small configurations (the demo traces on one local Ray: compute/full modes, lazy,
faithful and pre-allocated allocation, ZeRO-3 on and off, a target, an OOM and failing ranks,
pre-flight only, a sweep's second point on a kept session; ``predict`` on tiny workloads, a
mesh one, a custom step and given traces), writes each one's reports (summary.json with its
rank rows, prediction.json, the memory timeline files' names and, on meta, their bytes) with
the volatile fields (times, timestamps, paths, pids, hosts, RSS) replaced by a placeholder,
and compares them, as text with their key order, with a reference folder.

    python scripts/check_reports_identical.py --record /tmp/house23a_ref   # on the old code
    python scripts/check_reports_identical.py --ref /tmp/house23a_ref      # after a change

Prints one JSON line: ``{"num_configs", "num_identical", "differing"}`` (exit 1 when any
differs); with ``--out DIR`` the normalized reports of this run are kept in DIR.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.outputs import MEMORY_DIR, PREDICTION_JSON, PREFLIGHT_JSON, SUMMARY_JSON, \
    RunDir  # noqa: E402

VOLATILE = "<volatile>"
# keys whose values are measured times, places or hosts: replaced, their place kept
_VOLATILE_KEYS = re.compile(
    r"(_s|_us|_ms|_gbps)$|^(skew|node_ip|node_id|machine|machine_warnings|hostname|pid|"
    r"straggler_rank|timing_stop_reason|ci_.*|iteration_times_s|seconds|reused|dir|"
    r"trace_dir|memory_measure|measured_peak_bytes|total_ns|snapshots|memory_timelines|"
    r"started_at|finished_at|timestamp|rss_.*|top_ops|traceback)$")
# where in the code a defect was raised (actors.errors.describe): moves with any edit
_CODE_PLACE = re.compile(r" \[[^\]\s]+:\d+ in [^\]]+\]")
# the custom step at one path whichever checkout runs (the path is part of its capture)
_STEP = Path(tempfile.gettempdir()) / "house23a_check_steps" / "ddp_step.py"
TINY = dict(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32,
            batch_size=1, activation_checkpointing="none")


def normalize(value, tmp: str, key: str = ""):
    """``value`` with volatile entries replaced (keys and their order kept) and ``tmp``
    (this run's folder) written as ``<tmp>``."""
    if key and _VOLATILE_KEYS.search(key) and value is not None:
        return VOLATILE
    if isinstance(value, dict):
        return {k: normalize(v, tmp, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v, tmp) for v in value]
    if isinstance(value, str):
        text = value.replace(tmp, "<tmp>").replace(str(REPO), "<repo>")
        # a duration inside a message (a timeout's, a progress line's)
        text = _CODE_PLACE.sub(" [<code>]", text)
        return re.sub(r"\d+\.\d+ s\b", "<t> s", text)
    return value


def _run_cfg(trace_dir, mode="compute", device="meta", alloc="lazy", **kw):
    from actors.replay.config import AllocationConfig, ReplayConfig
    from orchestrator.config import ClusterConfig, ExperimentConfig, RunConfig, TraceConfig

    experiment = kw.pop("experiment", {})
    replay = dict(iters=1, warmup_iters=1, collective_timeout_s=30)
    replay.update(kw.pop("replay", {}))
    return RunConfig(cluster=ClusterConfig(timeout_s=180),  # a loaded machine starts actors slowly
                     trace=TraceConfig(dir=str(trace_dir)),
                     replay=ReplayConfig(mode=mode, device=device,
                                         allocation=AllocationConfig(mode=alloc), **replay),
                     experiment=ExperimentConfig(replay_timeout_s=120, failure_grace_s=3,
                                                 **experiment), **kw)


def run_configs() -> dict:
    """name -> (kind, make config); kinds: run (run_replay), predict, fail (a failing actor)."""
    from actors.replay.memory.target import TargetConfig
    from actors.zero3.config import Zero3Config
    from orchestrator.config import DEMO_TRACES

    dp4, z2, zl2 = (DEMO_TRACES / n for n in ("gpt_dp_4", "gpt_zero3_2", "gpt_zero3_leaf_2"))
    h100 = TargetConfig(name="h100_80gb")
    runs = {
        "dp4_meta_lazy": lambda: _run_cfg(dp4),
        "dp4_meta_faithful": lambda: _run_cfg(dp4, alloc="faithful"),
        "dp4_meta_preallocate": lambda: _run_cfg(dp4, alloc="pre_allocate"),
        "dp4_meta_target": lambda: _run_cfg(dp4, alloc="faithful", target=h100),
        "dp4_meta_oom": lambda: _run_cfg(dp4, replay={"device_memory_capacity": "2MiB"}),
        "dp4_meta_threshold": lambda: _run_cfg(
            dp4, replay={"device_memory_capacity": "64MiB"}),
        "dp4_meta_zero3_per_module": lambda: _run_cfg(
            dp4, zero3=Zero3Config(strategy="per_module")),
        "dp4_meta_zero3_leaf": lambda: _run_cfg(
            dp4, alloc="faithful", target=h100,
            zero3=Zero3Config(strategy="leaf_coalesced", leaf_modules=["blocks.*"],
                              param_persistence_threshold=0)),
        # a sweep's second point: the same session (kept actors), another allocation mode
        "dp4_sweep_point2": lambda: _run_cfg(dp4, alloc="faithful", replay={"iters": 2}),
        "dp4_preflight_only": lambda: _run_cfg(dp4, experiment={"preflight_only": True}),
        # two actors from here on (the ranks' traces differ)
        "z2_meta_none": lambda: _run_cfg(z2),
        "zl2_meta_faithful": lambda: _run_cfg(zl2, alloc="faithful"),
        "z2_cpu_compute": lambda: _run_cfg(z2, device="cpu", replay={"measure_memory": False}),
        "z2_cpu_full": lambda: _run_cfg(z2, mode="full", device="cpu",
                                        replay={"measure_memory": False}),
    }
    out = {name: ("run", make) for name, make in runs.items()}

    def full():
        return _run_cfg(z2, mode="full", device="cpu", replay={"measure_memory": False})
    for how in ("raises", "times_out", "no_trace"):
        out[f"z2_full_rank1_{how}"] = (f"fail_{how}", full)
    predicts = {
        "predict_llama_tiny": ("workload=llama3_8b", "world_size=8", "target=h100_80gb"),
        "predict_gpt_tiny": ("workload=gpt", "world_size=2", "target=a100_40gb",
                             "workload.n_kv_heads=0"),
        "predict_mesh_cp": ("workload=llama3_8b", "world_size=4", "target=h100_80gb",
                            "workload.parallelism.cp=2"),
        # pipeline stages (1f1b) over tp x FSDP2, fully checkpointed: first, middle, last
        "predict_mesh_pp": ("workload=llama3_8b", "world_size=16", "target=h100_80gb",
                            "workload.parallelism.pp=4", "workload.parallelism.tp=2",
                            "workload.parallelism.pp_microbatches=8", "workload.n_layers=6",
                            "workload.activation_checkpointing=full"),
        "predict_custom_step": ("workload=custom", "world_size=2", "target=a100_40gb",
                                f"workload.entrypoint={_STEP}:build"),
        "predict_trace_dir": (f"trace.dir={dp4}", "target=h100_80gb"),
        "predict_trace_zero3": (f"trace.dir={z2}", "target=h100_80gb"),
        "predict_one_trace_zero3": (f"trace.dir={dp4 / 'rank-0.et.json.gz'}", "world_size=8",
                                    "zero3=per_module", "target=a100_40gb"),
    }
    for name, overrides in predicts.items():
        out[name] = ("predict", overrides)
    return out


def _failing_actor(how: str):
    """A rank actor whose rank 1 fails: ``raises`` (a RuntimeError) or ``times_out`` (a
    TimeoutError) before replaying, or ``no_trace`` (given a path that does not exist: the
    rank's own failure report)."""
    from actors.rank_actor import RankActor

    class Failing(RankActor):
        def replay(self, *args, **kwargs):
            import dataclasses
            import os
            if os.environ.get("RANK") == "1":
                if how == "times_out":
                    raise TimeoutError("rank 1 waited too long (injected)")
                if how == "raises":
                    raise RuntimeError("rank 1 broke (injected)")
                missing = "/nonexistent-house23a/rank-1.et.json.gz"
                # a ReplayRequest, or (before it) the trace's source as the first argument
                args = (dataclasses.replace(args[0], trace_path=missing), *args[1:]) \
                    if hasattr(args[0], "pg_table") else (missing, *args[1:])
            return super().replay(*args, **kwargs)
    Failing.__name__ = Failing.__qualname__ = f"Failing_{how}"
    return Failing


def _collect_run(out: Path, tmp: str, meta: bool) -> dict:
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    got = {"files": [f for f in files if not f.endswith(".png")]}
    for name in (SUMMARY_JSON, PREFLIGHT_JSON):
        if (out / name).is_file():
            got[name] = normalize(json.loads((out / name).read_text()), tmp)
    if meta:  # accounted timelines: ticks and bytes, no clock
        for f in sorted((out / MEMORY_DIR).glob("*.csv")) if (out / MEMORY_DIR).is_dir() else []:
            got[f"memory/{f.name}"] = f.read_text()
    return got


def run_all(work: Path, only: list[str] | None) -> dict[str, dict]:
    import ray
    import ray.cloudpickle

    from orchestrator.cli.predict import predict_config
    from orchestrator.run.launch import run_replay
    from orchestrator.run.session import ReplaySession
    from orchestrator.cli.schemas import register_all

    register_all()  # the capture schemas too, as tracefleet-capture registers them

    _STEP.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO / "examples" / "ddp_step.py", _STEP)
    predict = _predict_fn()
    tmp = str(work)
    cache = Path(tempfile.gettempdir()) / "house23a_check_cache"  # captures kept across runs
    # CPUs beyond the 4 actors: pre-flight reduces a new folder in Ray tasks while a kept
    # group holds its actors (with none left over, those tasks would wait for an hour)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(work / "ray"))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    session = ReplaySession()
    results = {}
    try:
        for name, (kind, make) in run_configs().items():
            if only and name not in only:
                continue
            out = work / name
            start = time.perf_counter()
            try:
                got = _run_one(work, name, kind, make, session, predict, cache)
            except Exception as exc:  # noqa: BLE001 (a refusal is a result to compare too)
                got = {"raised": normalize(f"{type(exc).__name__}: {exc}", tmp)}
            results[name] = got
            print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    finally:
        session.close()
        ray.shutdown()
    return results


def _run_one(work: Path, name: str, kind: str, make, session, predict, cache: Path) -> dict:
    """One configuration's normalized reports."""
    from orchestrator.cli.predict import predict_config
    from orchestrator.run.launch import run_replay

    tmp, out = str(work), work / name
    if kind == "predict":
        given = {o.split("=", 1)[0] for o in make}
        tiny = [] if any(o.startswith(("trace.dir", "workload=custom")) for o in make) else \
            [f"workload.{k}={v}" for k, v in TINY.items() if f"workload.{k}" not in given]
        predict(predict_config(*make, f"predict.cache_dir={cache}", *tiny), out)
        got = {PREDICTION_JSON: normalize(json.loads(RunDir(out).prediction.read_text()), tmp)}
        got["files"] = sorted(p.name for p in out.iterdir() if p.suffix != ".png")
        return got
    cfg = make()
    actor = _failing_actor(kind.removeprefix("fail_")) if kind.startswith("fail") else None
    run_replay(cfg, out, session=session, **_quiet(), **({"actor_cls": actor} if actor else {}))
    return _collect_run(out, tmp, str(cfg.replay.device) == "meta")


def _quiet() -> dict:
    """``run_replay``'s arguments for the files alone, as this version of the code takes them."""
    try:
        from orchestrator.run.sinks import file_sinks
    except ImportError:
        return {"quiet": True}
    return {"sinks": file_sinks()}


def _predict_fn():
    """``predict``, wherever this version of the code keeps it."""
    try:
        from orchestrator.studies.predict import predict
    except ImportError:
        from orchestrator.run.predict import predict
    return predict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", type=Path, help="write the reference here")
    group.add_argument("--ref", type=Path, help="compare with this reference")
    parser.add_argument("--out", type=Path, help="also keep this run's normalized reports")
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="check_reports_"))
    try:
        results = run_all(work, args.only)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    texts = {name: json.dumps(got, indent=1) + "\n" for name, got in results.items()}
    keep = args.record or args.out
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (keep / f"{name}.json").write_text(text)
    differing = []
    if args.ref:
        for name, text in texts.items():
            ref = args.ref / f"{name}.json"
            if not ref.is_file() or ref.read_text() != text:
                differing.append(name)
    print(json.dumps({"num_configs": len(texts), "num_identical": len(texts) - len(differing),
                      "differing": differing}))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
