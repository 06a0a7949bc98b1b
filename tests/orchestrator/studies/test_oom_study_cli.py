"""The presets through the CLI on tiny cases: experiment=oom_study on a tiny Llama traced on
meta (the cache, the estimate, the report) and experiment=zero3_compare's five strategies;
both presets compose as the README shows them."""
from __future__ import annotations

import subprocess

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.engine import ReplayEngine
from actors.trace import load_trace
from actors.zero3.config import Zero3Config
from actors.zero3.extension import zero3_extensions
from orchestrator.studies import study_traces
from orchestrator.cli.schemas import register_all
from orchestrator.config import CONF_DIR, DEMO_TRACES
from orchestrator.outputs import RESULTS_CSV
from tests.orchestrator.studies.test_oom_study import TINY_LLAMA
from tests.orchestrator.studies.test_sweep_cli import ENTRY, _env, ray_temp  # noqa: F401 (ray_temp: a fixture)


def test_presets_compose():
    register_all()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        study = OmegaConf.to_object(compose("tracefleet", overrides=["experiment=oom_study"]))
        compare = compose("tracefleet", overrides=["experiment=zero3_compare"],
                          return_hydra_config=True)
    osc = study.experiment.oom_study
    assert (study.experiment.search, osc.workload, osc.device_memory_capacity) == \
        ("oom_study", "llama_70b", "80GiB")
    assert osc.workload_overrides["parallel"] == "local"
    assert (str(study.zero3.strategy), study.zero3.world_size, str(study.replay.device),
            str(study.replay.mode)) == ("per_module", 64, "meta", "compute")
    assert [str(m) for m in osc.allocation_modes] == ["pre_allocate", "faithful", "lazy"]
    assert compare.hydra.sweeper.params["zero3"].split(",") == \
        ["none", "per_param", "per_module", "bucketed", "leaf_coalesced"]
    assert compare.zero3.param_persistence_threshold == 0


def _tiny_overrides() -> str:
    return "{" + ",".join(f"{k}:{v}" for k, v in TINY_LLAMA.items()) + "}"


@pytest.mark.slow
@pytest.mark.long  # a whole study: CI's second job
def test_oom_study_runs_on_a_tiny_llama(tmp_path, ray_temp):  # noqa: F811
    cache = tmp_path / "cache"
    # the preset's recipe (its workload overrides merge under the tiny shapes) and ZeRO-3 knobs
    preset = OmegaConf.load(CONF_DIR / "experiment" / "oom_study.yaml")
    overrides = {**preset.experiment.oom_study.workload_overrides, **TINY_LLAMA}
    folder = study_traces.cached_capture("llama_8b", overrides, 1, str(cache))
    trace = load_trace(folder / "rank-0.et.json.gz")
    peaks = {}  # what the preset's replay (ZeRO-3 per_module, 64 ranks emulated) holds
    for mode in ("lazy", "pre_allocate"):
        zero3 = zero3_extensions(Zero3Config(strategy="per_module",
                                             **OmegaConf.to_container(preset.zero3)), trace)
        peaks[mode] = ReplayEngine(trace, ReplayConfig(
            mode="compute", device="meta", iters=1, warmup_iters=1,
            allocation=AllocationConfig(mode=mode)), extensions=zero3).run().to_dict()[
            "accounted_peak_bytes"]
    device = (peaks["lazy"] + peaks["pre_allocate"]) // 2  # lazy fits, pre_allocate does not
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*ENTRY, "experiment=oom_study", "experiment.oom_study.workload=llama_8b",
         f"++experiment.oom_study.workload_overrides={_tiny_overrides()}",
         f"experiment.oom_study.trace_cache_dir={cache}",
         f"experiment.oom_study.device_memory_capacity={device}",
         "experiment.oom_study.allocation_modes=[pre_allocate,lazy]",
         "experiment.min_memory.tolerance=0.05", f"hydra.run.dir={run_dir}",
         f"cluster.temp_dir={ray_temp}"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in cache.iterdir()] == [folder.name]  # the cached capture, reused
    table = pd.read_csv(run_dir / RESULTS_CSV)
    device_rows = table[table["study_part"] == "device"].set_index("replay.allocation.mode")
    assert device_rows.loc["pre_allocate", "status"] == "oom"
    assert device_rows.loc["lazy", "status"] == "ok"
    assert device_rows.loc["lazy", "accounted_peak_bytes"] == peaks["lazy"]
    estimates = table[table["kind"] == "estimate"]
    assert len(estimates) == 3 and (estimates["world_size"] == 64).all()
    assert (estimates["num_nodes"] == 8).all()
    # Without flushing a replay fits exactly when its peak does, so lazy's minimum is its
    # peak, replayed above in this process (the search stops within its 5% tolerance).
    threshold = "replay.allocation.device_memory_threshold"
    answers = table[(table["kind"] == "min_memory") & (table["replay.allocation.mode"] == "lazy")] \
        .set_index(threshold)
    assert peaks["lazy"] <= answers.loc[1.0, "min_capacity_bytes"] <= 1.05 * peaks["lazy"]
    # the flush replays run at lazy's minimum with threshold 0.5: that one completes; without
    # a threshold it is OOM exactly when that capacity is under lazy's peak (here the largest
    # op alone needs the liveness bound, so flushing may buy nothing)
    flush = table[table["study_part"] == "flush"].set_index(threshold)
    capacity = answers.loc[0.5, "min_capacity_bytes"]
    assert (flush["replay.device_memory_capacity"] == capacity).all()
    assert flush.loc[0.5, "status"] == "ok"
    assert flush.loc[1.0, "status"] == ("oom" if capacity < peaks["lazy"] else "ok")
    assert "| replay pre_allocate |" in proc.stdout and "DeepSpeed ZeRO-3 estimate" in proc.stdout
    assert "<h2>OOM study</h2>" in (run_dir / "report.html").read_text()


@pytest.mark.slow
@pytest.mark.long  # a whole study: CI's second job
def test_zero3_compare_runs_every_strategy(tmp_path, ray_temp):  # noqa: F811
    """On one rank of the demo, emulating its 4-rank ZeRO-3 job on meta: a tiny case."""
    root = tmp_path / "sweep"
    proc = subprocess.run(
        [*ENTRY, "--multirun", "experiment=zero3_compare", f"trace.dir={DEMO_TRACES / 'gpt_dp_4'}",
         "trace.ranks=[0]", "replay=dry_run", "replay.warmup_iters=0", "replay.iters=1",
         "zero3.world_size=4", f"hydra.sweep.dir={root}", "experiment.report=false",
         f"cluster.temp_dir={ray_temp}"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = pd.read_csv(root / RESULTS_CSV)
    rows = rows.set_index(rows["zero3"].fillna("none"))  # the table reads the choice none as null
    assert sorted(rows.index) == sorted(["none", "per_param", "per_module", "bucketed",
                                         "leaf_coalesced"])
    assert (rows["status"] == "ok").all()
    gathers = rows["zero3_num_allgathers_per_iteration"]
    # coarser units, fewer all-gathers: one per parameter, per module, per bucket, per block
    assert gathers["per_param"] > gathers["per_module"] > gathers["leaf_coalesced"]
    assert gathers["per_module"] > gathers["bucketed"]
    assert pd.isna(gathers["none"])
