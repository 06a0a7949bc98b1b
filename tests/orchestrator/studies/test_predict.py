"""tracefleet-predict: presets compose, the capture is cached, the verdict follows the numbers,
prediction.json has its keys, and the CLI's exit codes (tiny shapes through the real path)."""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from actors.capture.workloads.config import validate as validate_workload
from actors.errors import ConfigError
from actors.replay.memory.target import TargetConfig
from orchestrator.config import CONF_DIR, REPO_ROOT
from orchestrator.studies.predict import PredictConfig, capture_workload, predict, verdict
from orchestrator.cli.predict import predict_config
from orchestrator.reports.predict_table import prediction_table

REPO = REPO_ROOT
TINY = dict(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32)
KEYS = {"predicted_allocated_peak_bytes", "predicted_reserved_peak_bytes", "usable_capacity_bytes",
        "headroom_bytes", "verdict", "error_band", "breakdown", "peak_op", "world_size",
        "workload"}


def _compose(*overrides: str) -> PredictConfig:
    cfg = predict_config(*overrides)
    assert isinstance(cfg, PredictConfig)
    return cfg


def _tiny(preset: str, cache, *overrides: str) -> PredictConfig:
    return _compose(f"workload={preset}", f"predict.cache_dir={cache}",
                    *[f"workload.{k}={v}" for k, v in TINY.items()], *overrides)


def _bare_target(device_memory: int) -> TargetConfig:
    """A target whose usable capacity is exactly ``device_memory`` (no context, no NCCL)."""
    return TargetConfig(name="custom", device_memory=str(device_memory), cuda_context="0",
                        nccl_num_peers=0)


@pytest.mark.parametrize("preset", ["llama3_8b", "llama3_70b", "llama2_70b", "deepspeed_70b",
                                    "llama_8b", "llama_70b", "gpt"])
def test_presets_compose_and_validate(preset):
    cfg = _compose(f"workload={preset}", "world_size=64")
    cfg.validate()
    validate_workload(capture_workload(cfg.workload))
    # the capture CLI composes the same group
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        capture = compose(config_name="capture", overrides=[f"workload={preset}"])
    assert capture.workload.model == str(cfg.workload.model)


def test_reference_presets_carry_the_public_recipes():
    l3 = _compose("workload=llama3_8b", "world_size=8").workload
    assert (str(l3.parallel), str(l3.precision), str(l3.activation_checkpointing)) == \
        ("fsdp2", "bf16_mixed", "selective_op")
    assert (l3.vocab, l3.d_model, l3.n_layers, l3.n_heads, l3.n_kv_heads, l3.ffn_dim,
            l3.seq_len, l3.rope_theta) == (128256, 4096, 32, 32, 8, 14336, 8192, 500000.0)
    assert l3.batch_size == 2  # torchtitan's performance.md Table 1: local batch size 2
    l70 = _compose("workload=llama3_70b", "world_size=64").workload
    assert (str(l70.activation_checkpointing), l70.batch_size, l70.seq_len, l70.d_model,
            l70.n_layers, l70.ffn_dim) == ("full", 1, 8192, 8192, 80, 28672)
    l2 = _compose("workload=llama2_70b", "world_size=64").workload
    assert (l2.vocab, l2.seq_len, l2.rope_theta) == (32000, 4096, 10000.0)
    ds = _compose("workload=deepspeed_70b", "world_size=64").workload
    assert str(ds.parallel) == "local"
    assert (str(ds.zero3_emulation.strategy), str(ds.zero3_emulation.layout)) == \
        ("per_module", "deepspeed")
    # fsdp2 and bf16_mixed capture on fake, the plain bf16 DeepSpeed trace on meta
    assert str(capture_workload(l3).device) == "fake"
    assert str(capture_workload(ds).device) == "meta"


def test_verdict_rule():
    assert verdict(100, 1000, 0.03, 0) == "fits"
    assert verdict(29, 1000, 0.03, 0) == "too_close"
    assert verdict(0, 1000, 0.03, 0) == "too_close"
    assert verdict(-1, 1000, 0.03, 0) == "oom"
    assert verdict(500, 1000, 0.03, 2) == "oom"  # the model ran out, even after a release


def test_verdicts_around_the_predicted_peak_and_the_cache(tmp_path):
    cache = tmp_path / "cache"
    cfg = _tiny("llama3_8b", cache, "world_size=4")
    first = predict(cfg, tmp_path / "run0", name="llama3_8b")
    assert KEYS <= set(first.to_dict()) and not first.capture["reused"]
    assert first.capture["device"] == "fake" and first.world_size == 4
    written = json.loads((tmp_path / "run0" / "prediction.json").read_text())
    assert KEYS <= set(written) and written["verdict"] == first.verdict == "fits"
    assert written["workload"]["name"] == "llama3_8b"
    folders = sorted(p.name for p in cache.iterdir())
    files = sorted(p.name for p in (cache / folders[0]).iterdir())
    assert len(folders) == 1 and files == ["meta.json", "rank-0.et.json.gz"]  # rank 0 stands for all
    trace_mtime = (cache / folders[0] / "rank-0.et.json.gz").stat().st_mtime_ns
    assert first.predicted_reserved_peak_bytes >= first.predicted_allocated_peak_bytes > 0
    assert sum(first.breakdown.values()) > 0 and first.peak_op["op"]

    cfg.target = _bare_target(1 << 40)  # the bare target's own workspace: its reserved peak
    reserved = predict(cfg).predicted_reserved_peak_bytes
    outcomes = {}
    for label, device in (("roomy", 2 * reserved), ("tight", int(reserved * 1.01)),
                          ("small", first.predicted_allocated_peak_bytes // 2)):
        cfg.target = _bare_target(device)
        p = predict(cfg)
        assert p.capture["reused"]  # no re-capture
        assert p.usable_capacity_bytes == device
        assert p.headroom_bytes == device - p.predicted_reserved_peak_bytes
        outcomes[label] = p.verdict
        assert p.verdict == verdict(p.headroom_bytes, p.predicted_reserved_peak_bytes,
                                    p.error_band, p.num_predicted_ooms)
    assert outcomes == {"roomy": "fits", "tight": "too_close", "small": "oom"}
    assert sorted(p.name for p in cache.iterdir()) == folders
    assert (cache / folders[0] / "rank-0.et.json.gz").stat().st_mtime_ns == trace_mtime
    table = prediction_table(p.to_dict())
    assert "**oom**" in table and "reserved peak*" in table and "error band 3%" in table

    cfg.predict.error_band = 0.5  # a wider band turns the roomy target's answer too_close
    cfg.target = _bare_target(int(reserved * 1.3))
    assert predict(cfg).verdict == "too_close"


def test_deepspeed_preset_emulates_zero3_at_the_job_world_size(tmp_path):
    cache = tmp_path / "cache"
    every_param = "workload.zero3_emulation.param_persistence_threshold=0"  # tiny parameters
    small = predict(_tiny("deepspeed_70b", cache, "world_size=2", every_param))
    large = predict(_tiny("deepspeed_70b", cache, "world_size=8", every_param))
    # a plain local trace, captured once for every world size
    assert small.capture["world_size"] == large.capture["world_size"] == 1
    assert not small.capture["reused"] and large.capture["reused"]
    assert small.zero3_emulation["world_size"] == 2 and large.zero3_emulation["world_size"] == 8
    assert small.zero3_emulation["layout"] == "deepspeed"
    # 1/8 of the model states is less than 1/2 of them
    assert large.accounted_peak_bytes < small.accounted_peak_bytes


def test_a_plain_trace_folder_predicts_with_zero3_at_the_job_world_size(tmp_path):
    every_param = "workload.zero3_emulation.param_persistence_threshold=0"  # tiny parameters
    preset = predict(_tiny("deepspeed_70b", tmp_path / "cache", "world_size=8", every_param))
    folder = preset.capture["dir"]  # one plain (parallel=local) rank trace

    def given(*overrides):
        return predict(_compose(f"trace.dir={folder}", "zero3=per_module",
                                "zero3.param_persistence_threshold=0", *overrides))

    large, small = given("world_size=8"), given("world_size=2")
    assert large.world_size == 8 and large.ranks_per_trace == {"0": 8}
    assert large.zero3_emulation["world_size"] == 8 and small.zero3_emulation["world_size"] == 2
    # the preset's path (capture + workload.zero3_emulation) and the given trace + zero3= agree
    for key in ("accounted_peak_bytes", "predicted_reserved_peak_bytes", "breakdown"):
        assert getattr(large, key) == getattr(preset, key), key
    assert large.accounted_peak_bytes < small.accounted_peak_bytes  # 1/8 < 1/2 of states
    plain = predict(_compose(f"trace.dir={folder}"))  # no emulation: the trace as recorded
    assert plain.zero3_emulation is None and plain.world_size == 1
    assert plain.accounted_peak_bytes != large.accounted_peak_bytes
    with pytest.raises(ConfigError, match="holds 1 rank trace"):
        predict(_compose(f"trace.dir={folder}", "world_size=8"))  # 8 ranks need zero3 or 8 traces
    with pytest.raises(ConfigError, match="workload.zero3_emulation.strategy=per_module"):
        _compose("workload=llama3_8b", "world_size=8", "zero3=per_module").validate()


def test_a_trace_folder_replays_each_distinct_trace_once(tmp_path):
    cfg = _compose("trace.dir=" + str(REPO / "demo" / "traces" / "gpt_dp_4"), "target=a100_40gb")
    p = predict(cfg)
    assert p.world_size == 4 and p.capture is None
    assert sum(p.ranks_per_trace.values()) == 4
    assert 1 <= p.num_distinct_traces <= 4 and p.verdict == "fits"
    with pytest.raises(ConfigError, match="holds 4 rank trace"):
        predict(_compose("trace.dir=" + str(REPO / "demo" / "traces" / "gpt_dp_4"),
                         "world_size=8"))


def test_a_missing_or_unreadable_rank_is_named_never_left_out(tmp_path):
    """Ranks 0, 1, 3 of a 4-rank capture used to be predicted as a 3-rank job; a rank file
    that is a link to /dev/zero was silently dropped."""
    demo = REPO / "demo" / "traces" / "gpt_dp_4"
    gap = tmp_path / "gap"
    gap.mkdir()
    for rank in (0, 1, 3):
        shutil.copyfile(demo / f"rank-{rank}.et.json.gz", gap / f"rank-{rank}.et.json.gz")
    with pytest.raises(ConfigError, match=r"no trace of rank\(s\) \[2\] \(it holds rank 3; "
                                          r"found ranks \[0, 1, 3\]\)"):
        predict(_compose(f"trace.dir={gap}"))
    (gap / "rank-3.et.json.gz").unlink()  # 0, 1 of a capture meta.json says has 4 ranks
    shutil.copyfile(demo / "meta.json", gap / "meta.json")
    with pytest.raises(ConfigError, match=r"no trace of rank\(s\) \[2, 3\] \(meta.json "
                                          r"records world_size 4"):
        predict(_compose(f"trace.dir={gap}"))
    zero = tmp_path / "zero"
    zero.mkdir()
    for rank in range(4):
        shutil.copyfile(demo / f"rank-{rank}.et.json.gz", zero / f"rank-{rank}.et.json.gz")
    p = predict(_compose(f"trace.dir={zero}", "target=a100_40gb"))
    assert p.ranks == [0, 1, 2, 3]  # the prediction says which ranks it read
    (zero / "rank-2.et.json.gz").unlink()
    (zero / "rank-2.et.json.gz").symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match=r"rank-2.et.json.gz: not a regular file \(a link to "
                                          r"/dev/zero, a character device\)"):
        predict(_compose(f"trace.dir={zero}"))


def test_the_collector_stays_paused_from_the_load_to_the_end_of_the_run(monkeypatch):
    """predict's dry run pauses the cyclic GC once over the load, the engine's build and its
    run (between them it would rescan the trace's objects), and resumes it afterwards."""
    import actors.trace
    from actors.replay.engine import ReplayEngine

    seen = []
    load, run = actors.trace.load_trace, ReplayEngine.run

    def loaded(*args, **kwargs):
        trace = load(*args, **kwargs)
        seen.append(("after load", gc.isenabled()))
        return trace

    def ran(engine):
        seen.append(("before run", gc.isenabled()))
        return run(engine)
    monkeypatch.setattr(actors.trace, "load_trace", loaded)
    monkeypatch.setattr(ReplayEngine, "run", ran)
    demo = REPO / "demo" / "traces" / "gpt_dp_4"
    p = predict(_compose(f"trace.dir={demo}", "target=a100_40gb"))
    assert p.verdict == "fits" and gc.isenabled()
    assert seen[:2] == [("after load", False), ("before run", False)]


def test_identical_rank_traces_replay_once(tmp_path):
    demo = REPO / "demo" / "traces" / "gpt_dp_4"
    for rank in range(3):  # ranks 0-2 share rank 0's trace, rank 3 has rank 1's
        shutil.copyfile(demo / "rank-0.et.json.gz", tmp_path / f"rank-{rank}.et.json.gz")
    shutil.copyfile(demo / "rank-1.et.json.gz", tmp_path / "rank-3.et.json.gz")
    p = predict(_compose(f"trace.dir={tmp_path}", "target=a100_40gb"))
    assert p.world_size == 4 and p.num_distinct_traces == 2
    assert p.ranks_per_trace == {"0": 3, "3": 1}


def test_capture_key_follows_what_changes_the_trace(tmp_path):
    from orchestrator.studies.study_traces import capture_key

    wl = capture_workload(_compose("workload=llama3_8b", "world_size=8").workload)
    key = capture_key(wl, 8, True)
    assert capture_key(wl, 16, True) != key and capture_key(wl, 8, False) != key
    wl.seq_len = 4096
    assert capture_key(wl, 8, True) != key
    wl.seq_len = 8192
    wl.zero3_emulation.strategy = "per_module"  # a replay setting: the same capture
    assert capture_key(wl, 8, True) == key
    step = tmp_path / "step.py"
    step.write_text("def build(ctx):\n    pass\n")
    custom = capture_workload(_compose("workload=custom", f"workload.entrypoint={step}:build",
                                       "world_size=2").workload)
    before = capture_key(custom, 2)
    step.write_text("def build(ctx):\n    return None\n")  # the user edited the step
    assert capture_key(custom, 2) != before


def test_a_gpu_targets_captures_are_keyed_by_what_runs_as_the_gpus_kernels(monkeypatch):
    """When more runs as the GPU's kernels (a revision), a GPU target's cached captures are
    taken again; a CPU target's keys do not move."""
    from orchestrator.studies import study_traces

    cpu = capture_workload(_compose("workload=llama3_8b", "world_size=8").workload)
    gpu = capture_workload(_compose("workload=llama3_8b", "world_size=8").workload, "sm90")
    keys = (study_traces.capture_key(cpu, 8), study_traces.capture_key(gpu, 8))
    monkeypatch.setattr(study_traces, "GPU_DISPATCH_REVISION",
                        study_traces.GPU_DISPATCH_REVISION + 1)
    assert study_traces.capture_key(cpu, 8) == keys[0]
    assert study_traces.capture_key(gpu, 8) not in keys


def test_user_errors_are_config_errors():
    with pytest.raises(ConfigError, match="world_size=N is required"):
        _compose("workload=llama3_8b").validate()
    with pytest.raises(ConfigError, match="target=none"):
        _compose("workload=llama3_8b", "world_size=8", "target=none").validate()
    with pytest.raises(ConfigError, match="error_band"):
        _compose("world_size=8", "predict.error_band=1.5").validate()


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.predict", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=240)


def test_cli_on_a_custom_step_writes_prediction_json_and_reuses_its_capture(tmp_path):
    args = ["workload=custom", "workload.entrypoint=" + str(REPO / "examples" /
                                                            "fsdp2_llama_step.py") + ":build",
            "world_size=2", "target=a100_40gb", f"predict.cache_dir={tmp_path / 'cache'}"]
    runs = []
    for i in range(2):
        proc = _cli(*args, f"hydra.run.dir={tmp_path / f'run{i}'}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(proc)
        p = json.loads((tmp_path / f"run{i}" / "prediction.json").read_text())
        assert KEYS <= set(p) and p["workload"]["model"] == "custom"
        assert p["capture"]["device"] == "fake" and p["capture"]["reused"] == bool(i)
        # the fsdp:: ops resolve in a process that did not capture (nothing imported FSDP2)
        assert p["coverage"] == 1.0
        assert "| reserved peak* |" in proc.stdout and f"| verdict | **{p['verdict']}** |" \
            in proc.stdout
        # the user's step, not the built-in recipe's knobs, and nothing the replay left out
        title = next(line for line in proc.stdout.splitlines()
                     if line.startswith("tracefleet-predict: "))
        assert "(your step " in title and "AC none" not in proc.stdout
        # on meta only AdamW's step reads (aten::item) are stand-ins: no bytes, no warning
        assert p["num_dropped_ops"] == 0 and "warning" not in proc.stdout
        assert {(r["op"], r["kind"], r["bytes"]) for r in p["not_run_ops"]} == {
            ("aten::item", "stand-in", 0)}
        # it ends by saying where its files are: the last lines, where the eye lands
        assert proc.stdout.splitlines()[-2:] == [
            f"prediction: {tmp_path / f'run{i}' / 'prediction.json'}",
            f"page: {tmp_path / f'run{i}' / 'prediction.html'}"]
        assert (tmp_path / f"run{i}" / "prediction.html").is_file()
    assert "captured on fake" in runs[0].stdout + runs[0].stderr
    assert "capture reused from the cache" in runs[1].stdout + runs[1].stderr
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_cli_user_error_exits_2(tmp_path):
    proc = _cli("workload=llama3_8b", "target=none", "world_size=8",
                f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "tracefleet-predict: error: target=none" in proc.stderr


def test_a_world_no_capture_can_serve_is_refused_before_any_capture(tmp_path):
    cfg = _compose("workload=llama3_8b", "world_size=1000000000",
                   f"predict.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ConfigError, match=r"world_size=1,000,000,000 exceeds 1,048,576 ranks, "
                                          "the most a capture serves"):
        predict(cfg)
    assert not (tmp_path / "cache").exists()  # refused before a byte was captured


@pytest.mark.parametrize("bad, error, message", [
    ("hang", "TimeLimitError", r"predict.capture_timeout_s=20: the fake capture's recording of "
                               r"rank 0 did not finish within 20 s \(stopped at \S+my_step.py:\d+ in step\)"),
    ("raise_recorded", "ConfigError", r"step\(batch\) raised ValueError: boom in the recorded "
                                      r"step at \S+my_step.py:\d+ in step"),
])
def test_a_custom_step_that_hangs_or_raises_leaves_no_temp_capture(tmp_path, bad, error,
                                                                   message):
    from actors.time_limit import TimeLimitError
    from tests.capture.test_user_code import STEP

    step = tmp_path / "my_step.py"
    step.write_text(STEP.format(bad=bad))
    cfg = _compose("workload=custom", f"workload.entrypoint={step}:build", "world_size=2",
                   f"predict.cache_dir={tmp_path / 'cache'}", "predict.capture_timeout_s=20")
    with pytest.raises((TimeLimitError, ConfigError), match=message) as err:
        predict(cfg)
    assert type(err.value).__name__ == error
    assert list((tmp_path / "cache").iterdir()) == []  # no .<name>.<pid>.tmp left behind
    with pytest.raises(ConfigError, match="predict.capture_timeout_s=0; expected seconds > 0"):
        _compose("world_size=8", "predict.capture_timeout_s=0").validate()


def test_a_gpu_target_captures_with_the_gpus_kernels_and_says_so(tmp_path):
    """nn.TransformerEncoder with torch's default dropout and AdamW: the prediction for an
    H100 ran flash attention, CUDA's fused dropout and AdamW's foreach kernels on fake, and
    names them with their bytes; the breakdown's categories are explained on the console and
    the page."""
    step = str(REPO / "examples" / "fsdp2_transformer_encoder_step.py") + ":build"
    cfg = _compose("workload=custom", f"workload.entrypoint={step}", "world_size=2",
                   "target=h100_80gb", f"predict.cache_dir={tmp_path / 'cache'}")
    p = predict(cfg, tmp_path / "out")
    assert p.capture["gpu_kernels"] == "sm90"
    kernels = {(r["op"], r["kernel"], r["cpu_kernel"]) for r in p.kernel_dispatch}
    assert kernels == {("aten::scaled_dot_product_attention", "flash", "cpu_math"),
                       ("aten::dropout", "native_dropout", "mul by noise"),
                       ("torch.optim step", "foreach", "for-loop")}
    assert p.coverage == 1.0  # the fused kernels' ops dry-run on meta
    from orchestrator.studies.study_traces import capture_key

    table = prediction_table(p.to_dict())
    assert "ran as CUDA's flash attention on sm90" in table
    assert "the CPU's math path would have made" in table
    assert "ran as torch.optim's multi-tensor (foreach) kernels on sm90; the CPU would have " \
        "run torch.optim's single-tensor for-loop" in table
    assert set(p.breakdown_help) == {k for k, b in p.breakdown.items() if b}
    for name, text in p.breakdown_help.items():
        assert f"  {name}: {text}" in table
    page = (tmp_path / "out" / "prediction.html").read_text()
    assert "Kernels of the target GPU" in page and "CUDA&#x27;s fused dropout" in page
    # the user's own choice of architecture wins over the target's, and keys the cache
    custom = capture_workload(cfg.workload, cfg.target.gpu_arch)
    a100 = capture_workload(_compose("workload=custom", f"workload.entrypoint={step}",
                                     "world_size=2", "workload.gpu_kernels=sm80").workload,
                            cfg.target.gpu_arch)
    assert (custom.gpu_kernels, a100.gpu_kernels) == ("sm90", "sm80")
    assert capture_key(custom, 2) != capture_key(a100, 2)
    assert p.capture["dir"].endswith(capture_key(custom, 2, rank0_only=True))
