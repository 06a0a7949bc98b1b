"""``from tracefleet import predict``: the CLI's figures, the same cache, the snapshot, and user
errors as TracefleetError."""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import types

import pytest

import tracefleet
from actors.errors import ConfigError, TracefleetError
from orchestrator.cli.predict import predict_config
from orchestrator.config import DEMO_TRACES, REPO_ROOT
from orchestrator.reports.snapshot_file import read_snapshot
from orchestrator.studies.predict import predict as study_predict
from tests.support.memory_viz import replay_history
from tracefleet import Prediction, predict
from tracefleet.api import job_config

DEMO = DEMO_TRACES / "gpt_dp_4"
TINY = dict(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32)
FIGURES = ("predicted_allocated_peak_bytes", "predicted_reserved_peak_bytes",
           "usable_capacity_bytes", "headroom_bytes", "verdict", "error_band", "breakdown",
           "peak_op", "world_size", "num_predicted_ooms", "accounted_peak_bytes")


def test_the_api_gives_the_clis_figures(tmp_path):
    run = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.predict", f"trace.dir={DEMO}", "target=a100_40gb",
         f"hydra.run.dir={run}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    cli = json.loads((run / "prediction.json").read_text())
    p = predict(trace_dir=DEMO, target="a100_40gb")
    assert isinstance(p, Prediction)
    for key in FIGURES:
        assert p.result[key] == cli[key], key
    assert (p.verdict, p.fits) == (cli["verdict"], cli["verdict"] == "fits")
    assert p.reserved_peak_bytes == cli["predicted_reserved_peak_bytes"]
    assert p.headroom_bytes == cli["headroom_bytes"] and p.breakdown == cli["breakdown"]
    # the table the CLI printed, but for its time line
    assert all(line in proc.stdout for line in p.table().splitlines()[:-1])
    assert json.loads(p.to_json())["predicted_reserved_peak_bytes"] == p.reserved_peak_bytes


def test_a_preset_with_overrides_the_same_cache_and_its_snapshot(tmp_path):
    cache = tmp_path / "cache"
    extra = {f"workload__{k}": v for k, v in TINY.items()}
    first = predict("llama3_8b", world_size=4, target="a100_40gb", predict__cache_dir=cache,
                    **extra)
    assert not first.result["capture"]["reused"]
    assert first.result["workload"]["name"] == "llama3_8b" and first.result["world_size"] == 4
    assert first.result["workload"]["d_model"] == 64
    # the study (the CLI's function) on the same overrides: the same cache and figures
    same = study_predict(predict_config("workload=llama3_8b", "world_size=4", "target=a100_40gb",
                                        f"predict.cache_dir={cache}",
                                        *[f"workload.{k}={v}" for k, v in TINY.items()]))
    assert same.capture["reused"] and same.capture["dir"] == first.result["capture"]["dir"]
    for key in FIGURES:
        assert getattr(same, key) == first.result[key], key
    # the snapshot: predicted again with the snapshot on, the same peak
    path = first.snapshot(tmp_path / "llama.pickle")
    snap = read_snapshot(path)
    assert replay_history(snap)["peak_reserved"] == first.reserved_peak_bytes
    assert snap["tracefleet"]["target"] == "a100_40gb"
    # written by the prediction itself when it had an output folder and the snapshots on
    kept = predict("llama3_8b", world_size=4, target="a100_40gb", predict__cache_dir=cache,
                   predict__snapshot=True, out_dir=tmp_path / "kept", **extra)
    assert (tmp_path / "kept" / "prediction.html").is_file()
    copy = kept.snapshot(tmp_path / "copy.pickle")
    assert copy.read_bytes() == (tmp_path / "kept" / "snapshot_rank0.pickle").read_bytes()
    assert pickle.loads(copy.read_bytes())["segments"] == snap["segments"]


def _nested():
    def build(ctx):
        return ctx
    return build


def test_user_errors_are_tracefleet_errors(tmp_path):
    assert issubclass(tracefleet.ConfigError, tracefleet.TracefleetError)
    cases = [dict(workload="no_such_preset", world_size=8),
             dict(workload="llama3_8b", world_size=8, workload__no_such_field=1),
             dict(workload="llama3_8b", world_size=8, target="none"),
             dict(workload="llama3_8b"),  # no world size
             dict(workload=_nested(), world_size=2),
             dict(workload=lambda ctx: ctx, world_size=2),
             dict(workload=3, world_size=2),
             dict(workload="missing.py:build", world_size=2),
             # as strict as the command line: a number of GPUs is a whole number >= 1
             dict(workload="gpt", world_size=2.7), dict(workload="gpt", world_size=True),
             dict(workload="gpt", world_size="two"), dict(workload="gpt", world_size=0)]
    for kwargs in cases:
        with pytest.raises(TracefleetError) as raised:
            predict(**kwargs)
        assert isinstance(raised.value, ConfigError), kwargs


def test_build_functions_and_values_become_the_config(tmp_path):
    step = tmp_path / "my_step.py"
    step.write_text("def build(ctx):\n    return None\n")
    spec = importlib.util.spec_from_file_location("loaded_by_path", step)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # a function loaded from a file is named by its file; one of a package, by its module
    cfg = job_config(module.build, 2, None, None, {})
    assert (str(cfg.workload.model), cfg.workload.entrypoint) == ("custom", f"{step}:build")
    assert job_config(replay_history, 2, None, None, {}).workload.entrypoint == \
        "tests.support.memory_viz:replay_history"
    cfg = job_config("examples/fsdp2_llama_step.py:build", 8, "custom", None,
                     {"target__device_memory": "24GiB", "predict__snapshot": True,
                      "target__allocator__pytorch_cuda_alloc_conf":
                          "max_split_size_mb:128,expandable_segments:True"})
    assert cfg.workload.entrypoint.endswith("fsdp2_llama_step.py:build")
    assert cfg.predict.snapshot is True and cfg.target.device_memory == "24GiB"
    assert cfg.target.allocator.pytorch_cuda_alloc_conf == \
        "max_split_size_mb:128,expandable_segments:True"
    assert cfg.world_size == 8 and str(cfg.target.name) == "custom"


def test_values_are_applied_as_they_are_without_quoting(tmp_path):
    """A float, a list and strings holding what Hydra's override grammar reads as syntax
    (quotes, commas, brackets, braces, parentheses, '=', ':', a backslash, spaces) reach the
    config unchanged; the preset's other values stay; a value of the wrong type is refused."""
    text = "it's \"[a], {b}=c: (d)\\ e"
    cfg = job_config("gpt", 2, "a100_40gb", None, {
        "predict__error_band": 0.05, "predict__error_band_source": text,
        "target__host_categories": ["parameters", "optimizer_state"],
        "predict__cache_dir": tmp_path / "a b,c", "workload__seq_len": 48})
    assert cfg.predict.error_band == 0.05 and cfg.predict.error_band_source == text
    assert cfg.target.host_categories == ["parameters", "optimizer_state"]
    assert cfg.predict.cache_dir == str(tmp_path / "a b,c")
    preset = predict_config("workload=gpt", "target=a100_40gb")
    assert (cfg.workload.seq_len, cfg.workload.d_model) == (48, preset.workload.d_model)
    assert str(cfg.target.name) == "a100_40gb" and cfg.world_size == 2
    with pytest.raises(ConfigError, match="workload.seq_len='1,world_size=9'"):
        job_config("gpt", 2, None, None, {"workload__seq_len": "1,world_size=9"})
    with pytest.raises(ConfigError, match="no_such_field"):
        job_config("gpt", 2, None, None, {"workload__no_such_field": 1})


def test_predictions_from_several_threads(monkeypatch):
    """Composing in several threads at once works (Hydra's global state is taken in turn), and
    the predictions themselves run one at a time (the capture's state is process-wide)."""
    import threading
    import time

    from orchestrator.cli.predict import predict_config
    from orchestrator.studies import predict as study

    running, overlaps, errors = [0], [], []

    def slow_prediction(cfg, out_dir=None, name=None):
        running[0] += 1
        overlaps.append(running[0])
        time.sleep(0.2)
        running[0] -= 1
        return types.SimpleNamespace(to_dict=lambda: {"verdict": "fits",
                                                      "world_size": cfg.world_size})

    monkeypatch.setattr(study, "predict", slow_prediction)

    def call(i):
        try:
            assert predict_config("workload=gpt", f"world_size={i + 1}").world_size == i + 1
            assert predict("gpt", world_size=i + 1).result["world_size"] == i + 1
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(overlaps) == 4 and max(overlaps) == 1
