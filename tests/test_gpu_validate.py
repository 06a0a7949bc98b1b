"""scripts/gpu_validate.sh / gpu_validate.py: its no-GPU mode end to end, and the parts that
run on the CPU (the cases' configs and predictions, the comparison, the JSON line)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from actors.capture.workloads.config import validate as validate_workload
from orchestrator.cli.predict import predict_config
from orchestrator.config import REPO_ROOT
from orchestrator.studies.predict import capture_workload
from tests.support.memory_viz import replay_history

SCRIPT = REPO_ROOT / "scripts" / "gpu_validate.py"
_spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
gv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gv)
GiB = 1 << 30
TINY = {"vocab": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "ffn_dim": 128, "seq_len": 32, "batch_size": 2}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU mode")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_validate.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.splitlines() == [gv.NO_GPU], proc.stderr
    direct = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert direct.returncode == 0 and direct.stdout.splitlines() == [gv.NO_GPU]


def test_the_cases_compose_to_predictions_of_this_gpu():
    for ac in gv.AC_MODES:
        cfg = predict_config(*gv.workload_overrides(ac), *gv.target_overrides(80 * GiB, 9))
        cfg.validate()
        wl = capture_workload(cfg.workload)
        validate_workload(wl)
        assert (str(wl.parallel), str(wl.precision), str(wl.activation_checkpointing),
                str(wl.device), cfg.world_size) == ("fsdp2", "bf16_mixed", ac, "fake", 1)
        assert (wl.d_model, wl.batch_size, wl.seq_len) == (1024, 8, 1024)
        real = gv.real_workload(ac)  # what the GPU trains: the same recipe on cuda
        validate_workload(real)
        assert str(real.device) == "cuda" and all(
            getattr(real, f) == getattr(wl, f) for f in ("parallel", "precision", "d_model",
                                                         "n_layers", "seq_len", "batch_size",
                                                         "activation_checkpointing"))
        figures = cfg.target.figures()
        # the GPU's caching allocator alone: no context, no NCCL buffers; Hopper's workspace
        assert figures["usable_capacity_bytes"] == 80 * GiB
        assert figures["cublas_workspace_bytes"] == 32 << 20
    ampere = predict_config(*gv.workload_overrides("none"), *gv.target_overrides(40 * GiB, 8))
    assert ampere.target.figures()["cublas_workspace_bytes"] == 8 * (1 << 20) + 128 * 1024


def test_a_case_predicted_and_compared_on_the_cpu(tmp_path):
    out = tmp_path / "predicted"
    p = gv.predict_case(gv.workload_overrides("full", TINY) + gv.target_overrides(GiB, 9), out,
                        tmp_path / "cache")
    assert p["snapshots"] == {"0": "snapshot_rank0.pickle"}
    peak = replay_history(__import__("pickle").loads((out / "snapshot_rank0.pickle")
                                                     .read_bytes()))["peak_reserved"]
    assert peak == p["predicted_reserved_peak_bytes"]
    # the predicted snapshot stands for a recorded one: the streams agree, the ratios are 1
    measured = {"reserved_bytes": p["predicted_reserved_peak_bytes"],
                "allocated_bytes": p["predicted_allocated_peak_bytes"]}
    case = gv.against(measured, p, out / "snapshot_rank0.pickle", out)
    assert case["ratio_reserved"] == case["ratio_allocated"] == 1.0 and case["within_band"]
    assert case["snapshots"]["first_divergence"] is None
    assert case["snapshots"]["ratio_reserved"] == 1.0
    off = gv.against({**measured, "reserved_bytes": int(measured["reserved_bytes"] * 1.1)}, p,
                     None, None)
    assert not off["within_band"] and "snapshots" not in off
    line = gv.summarize([{"case": "a", **case}, {"case": "b", "skipped": "time budget spent"}],
                        {"returncode": 0}, "GPU", 1.0)
    assert line["ok"] and line["max_abs_error_reserved"] == 0 and line["skipped"] == ["b"]
    json.dumps(line)  # the last line is JSON
    assert not gv.summarize([{"case": "a", **off}], None, "GPU", 1.0)["ok"]
    assert not gv.summarize([{"case": "a", "error": "boom"}], None, "GPU", 1.0)["ok"]
    assert not gv.summarize([{"case": "a", **case}], {"returncode": 1}, "GPU", 1.0)["ok"]


def test_the_transformers_case_is_predicted_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    p = gv.predict_case(gv.hf_overrides(gv.target_overrides(80 * GiB, 9)), tmp_path / "hf",
                        tmp_path / "cache")
    assert p["capture"]["device"] == "fake" and p["verdict"] == "fits"
    assert p["coverage"] > 0.95 and (tmp_path / "hf" / "snapshot_rank0.pickle").is_file()
    assert p["breakdown"]["optimizer_state"] > 0 and p["breakdown"]["parameters"] > 0


def test_the_transformers_entrypoint_trains_a_step(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(gv, "HF_CONFIG", {**gv.HF_CONFIG, "vocab_size": 128, "hidden_size": 32,
                                          "intermediate_size": 64, "num_hidden_layers": 1,
                                          "num_attention_heads": 4, "num_key_value_heads": 2})
    monkeypatch.setattr(gv, "HF_BATCH", (2, 8))
    model, make_batch, step = gv.hf_build(SimpleNamespace(device=torch.device("cpu"), rank=0))
    before = [p.detach().clone() for p in model.parameters()]
    step(make_batch())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_encoder_case_is_predicted_with_the_gpus_kernels(tmp_path, monkeypatch):
    """The dropout case's prediction (small sizes here) runs this GPU's kernels on fake."""
    for name in gv.ENCODER:  # the example's tiny defaults
        monkeypatch.delenv(name, raising=False)
    target = gv.target_overrides(80 * GiB, 8, 6)
    assert "target.arch=sm86" in target and not any(
        o.startswith("target.arch") for o in gv.target_overrides(80 * GiB, 7, 5))
    p = gv.predict_case(gv.encoder_overrides(target), tmp_path / "enc", tmp_path / "cache")
    assert p["capture"]["gpu_kernels"] == "sm86"
    assert {(r["op"], r["kernel"]) for r in p["kernel_dispatch"]} == {
        ("aten::scaled_dot_product_attention", "flash"), ("aten::dropout", "native_dropout"),
        ("torch.optim step", "foreach")}
