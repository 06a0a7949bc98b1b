"""Llama-style traces captured on the meta device: a fake process group records real all-reduce
sizes, storage ids stay distinct, every rank's trace is the same program, the presets compose,
pre-flight accepts the folder, and a large preset takes seconds."""
from __future__ import annotations

import json
import resource
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from actors.trace.conventions import trace_file_name
from actors.capture.fake.meta_storage import unique_meta_storages
from actors.capture.fake_rank import record_meta_rank
from actors.capture.workloads.build import WorkloadConfig, build_model
from actors.errors import ConfigError
from actors.trace import load_trace
from actors.trace.stats import trace_stats
from orchestrator.config import CONF_DIR
from orchestrator.cli.schemas import register_all
from orchestrator.run.capture import CaptureConfig, run_capture_job
from orchestrator.preflight.validate import preflight
from tests.support.bounds import CLUSTER_START_S

SMALL_LLAMA = dict(kind="llama_dp", vocab=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   ffn_dim=64, seq_len=16, batch_size=2, dp_bucket_numel=3000)


def meta_capture(out_dir: Path, world_size: int, **workload) -> dict:
    cfg = CaptureConfig(workload=WorkloadConfig(**{**SMALL_LLAMA, "device": "meta", **workload}),
                        world_size=world_size, out_dir=str(out_dir))
    return run_capture_job(cfg).meta


def _signatures(trace) -> list[tuple]:
    return [op.collective.signature() for op in trace.collectives]


@pytest.fixture(scope="module")
def llama_meta_4(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_meta_4")
    return out, meta_capture(out, 4, dtype="bfloat16")


def test_meta_capture_writes_every_rank_and_honest_meta(llama_meta_4):
    out, meta = llama_meta_4
    assert sorted(p.name for p in out.iterdir()) == \
        ["meta.json"] + [trace_file_name(r) for r in range(4)]
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk["workload"]["device"] == "meta" and on_disk["recorded_rank"] == 0
    # Nothing is measured on meta: no eager time, no memory, no profiler trace.
    assert on_disk["iteration_time_s"] is None and on_disk["memory"]["peak_bytes"] is None
    assert on_disk["memory"]["method"].startswith("not measured")
    assert all(r["kineto_file"] is None for r in on_disk["ranks"])
    model, _ = build_model(WorkloadConfig(**SMALL_LLAMA))
    assert on_disk["num_params"] == sum(p.numel() for p in model.parameters())


def test_meta_all_reduces_cover_every_gradient_in_buckets(llama_meta_4):
    out, meta = llama_meta_4
    trace = load_trace(out / trace_file_name(2))
    assert trace.rank == 2
    assert [(g.name, g.group_size) for g in trace.process_groups] == [("0", 4)]
    assert {op.name for op in trace.collectives} == {"c10d::allreduce_"}
    sigs = _signatures(trace)
    assert {(s[0], s[3]) for s in sigs} == {("all_reduce", "bfloat16")}
    assert sum(s[1] for s in sigs) == meta["num_params"]
    # Buckets of at most 3000 elements, unless one gradient alone is larger (the embedding).
    model, _ = build_model(WorkloadConfig(**SMALL_LLAMA))
    largest = max(p.numel() for p in model.parameters())
    assert all(s[1] <= 3000 or s[1] == largest for s in sigs)
    assert len(sigs) < len(list(model.parameters()))  # some gradients share a bucket


def test_meta_traces_name_storages_like_real_ones(llama_meta_4):
    """Distinct storage ids: every parameter is found as one (the optimizer updates it in
    place), which fails when every meta tensor shares the null data pointer's id."""
    out, meta = llama_meta_4
    stats = trace_stats(load_trace(out / trace_file_name(0)))
    model, _ = build_model(WorkloadConfig(**SMALL_LLAMA))
    assert stats["params"]["num_storages"] == len(list(model.parameters()))
    assert stats["params"]["bytes"] == 2 * meta["num_params"]  # bfloat16
    with unique_meta_storages():
        a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
        assert len({a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}) == 2
        assert a[1:].untyped_storage().data_ptr() == a.untyped_storage().data_ptr()  # a view
    assert torch.empty(4, device="meta").untyped_storage().data_ptr() == 0  # restored


def test_another_rank_recorded_separately_is_the_same_program(llama_meta_4, tmp_path):
    """Ranks 1..N-1 are written from rank 0's recording; rank 3 recorded on its own agrees."""
    out, meta = llama_meta_4
    cfg = CaptureConfig(workload=WorkloadConfig(**{**SMALL_LLAMA, "device": "meta",
                                                   "dtype": "bfloat16"}), world_size=4)
    record_meta_rank(cfg.request(), str(tmp_path), 3, 4)
    alone, copied = load_trace(tmp_path / trace_file_name(3)), load_trace(out / trace_file_name(3))
    names = [op.name for op in alone.ops]
    # a real step on both sides: two empty recordings would agree too
    assert len(names) == len(copied.ops) and names.count("aten::mm") >= 2 * SMALL_LLAMA["n_layers"]
    assert names == [op.name for op in copied.ops]
    assert [[t.shape for t in op.input_tensors()] for op in alone.ops] == \
        [[t.shape for t in op.input_tensors()] for op in copied.ops]
    assert _signatures(alone) == _signatures(copied)
    # Equal up to the 0-dim CPU scalars ops wrap Python numbers in: where the CPU allocator
    # reuses their addresses differs from run to run, shifting storage generations by bytes.
    bounds = [trace_stats(t)["memory"]["lower_bound_bytes"] for t in (alone, copied)]
    assert bounds[0] == pytest.approx(bounds[1], abs=64)


def test_local_kind_records_no_collectives(tmp_path):
    meta_capture(tmp_path, 2, kind="llama_local")
    trace = load_trace(tmp_path / trace_file_name(1))
    assert trace.collectives == [] and trace.ops
    assert any(op.name == "aten::addcdiv_" for op in trace.ops)  # the AdamW step is there


def test_preflight_accepts_a_meta_world_larger_than_the_machine(tmp_path):
    meta_capture(tmp_path, 16, n_layers=1)
    result = preflight(tmp_path)
    assert result.world_size == 16
    assert result.num_collectives  # the all-reduces agree across all 16 ranks


def test_presets_compose_and_typos_are_refused(tmp_path):
    register_all()  # what tracefleet-capture does on start (orchestrator/cli/capture.py)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("capture", overrides=["workload=llama_70b",
                                                                 f"out_dir={tmp_path}"]))
        assert (cfg.workload.model, cfg.workload.parallel, cfg.workload.device,
                cfg.workload.precision) == ("llama", "ddp", "meta", "bf16")
        assert (cfg.workload.d_model, cfg.workload.n_layers, cfg.workload.n_kv_heads) == \
            (8192, 80, 8)
        # The demo GPT by default.
        assert (compose("capture").workload.model, compose("capture").workload.parallel) == \
            ("gpt", "ddp")
        for typo in ("kind=llama_nope", "parallel=fsdp3", "precision=bf17",
                     "activation_checkpointing=fulll"):
            with pytest.raises(Exception, match=typo.split("=")[1]):
                compose("capture", overrides=[f"workload.{typo}"])
    with pytest.raises(ConfigError, match="needs real tensors"):
        CaptureConfig(workload=WorkloadConfig(kind="llama_zero3", device="meta")).validate()
    with pytest.raises(ConfigError, match="n_heads=4 is not divisible by workload.n_kv_heads=3"):
        CaptureConfig(workload=WorkloadConfig(kind="llama_dp", n_kv_heads=3)).validate()


def test_llama_8b_preset_takes_little_memory(tmp_path):
    """An 8B-parameter model, 16 ranks, on this machine: well under 2 GiB (its time is
    scripts/bench_predict_speed.py's)."""
    register_all()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("capture", overrides=[
            "workload=llama_8b", "world_size=16", f"out_dir={tmp_path}"]))
    meta = run_capture_job(cfg).meta
    assert 8.0e9 < meta["num_params"] < 8.1e9
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 2 * 2**20  # KiB
    trace = load_trace(tmp_path / trace_file_name(15))
    assert sum(s[1] for s in _signatures(trace)) == meta["num_params"]
    counts = Counter(op.name for op in trace.ops)
    assert counts["aten::_scaled_dot_product_flash_attention_backward"] == 32  # the GPU's kernel


@pytest.mark.slow
def test_comms_replay_of_a_meta_capture(tmp_path):
    """The all-reduces recorded on meta replay over gloo, at their recorded sizes and dtype."""
    import ray

    from actors.replay.config import ReplayConfig
    from orchestrator.config import ClusterConfig, ExperimentConfig, RunConfig, TraceConfig
    from orchestrator.run.launch import run_replay

    traces = tmp_path / "traces"
    meta = meta_capture(traces, 2, dtype="bfloat16")
    ray_dir = tempfile.mkdtemp(prefix="tf-meta-", dir="/tmp")  # short: socket path limit
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_dir, log_to_driver=False)
    try:
        summary = run_replay(RunConfig(
            cluster=ClusterConfig(timeout_s=CLUSTER_START_S), trace=TraceConfig(dir=str(traces)),
            replay=ReplayConfig(mode="comms", iters=1, warmup_iters=0, collective_timeout_s=60),
            experiment=ExperimentConfig(replay_timeout_s=120, failure_grace_s=3)), tmp_path / "run")
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert summary["status"] == "ok", summary["error"]
    calls = len(load_trace(traces / trace_file_name(0)).collectives)
    assert summary["collectives"]["all_reduce"]["num_calls"] == 2 * calls  # both ranks, once
    assert all(r["coverage"] == 1.0 for r in summary["ranks"])
    assert meta["num_params"] > 0
