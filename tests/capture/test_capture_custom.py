"""workload=custom: the user's build(ctx) -> (model, make_batch, step), captured for real (one Ray
actor per rank, gloo) and on the fake device, where the same FSDP2 file records the same ops;
DDP for real; clear errors for bad entrypoints."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import ray
import torch

from actors.trace.conventions import trace_file_name
from actors.capture.workloads.context import CaptureContext
from actors.capture.workloads.custom import build_custom, load_build
from actors.capture.workloads.build import WorkloadConfig
from actors.errors import ConfigError
from actors.trace import load_trace
from orchestrator.run.capture import CaptureConfig, run_capture_job
from orchestrator.config import REPO_ROOT, ClusterConfig
from tests.capture.test_capture_fake import DDP_EXAMPLE, FSDP2_EXAMPLE, fake_capture
from tests.support.bounds import CAPTURE_BOUND_S, CLUSTER_START_S

REPO = REPO_ROOT
CPU_CTX = CaptureContext(torch.device("cpu"), rank=0, world_size=1, mesh=None)


@pytest.fixture(scope="module")
def real_captures(tmp_path_factory):
    """The FSDP2 and DDP examples captured on cpu, 2 ranks, one intra-op thread each (a
    parallel kernel's scratch ops on pool threads would be top-level ops of their own)."""
    temp_dir = f"/tmp/tf-custom-{os.getpid()}"  # short: Ray's socket paths are length-limited
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        outs = {}
        for name, entrypoint in (("fsdp2", FSDP2_EXAMPLE), ("ddp", DDP_EXAMPLE)):
            outs[name] = tmp_path_factory.mktemp(name)
            run_capture_job(CaptureConfig(
                workload=WorkloadConfig(model="custom", entrypoint=entrypoint), world_size=2,
                warmup_iters=2, timing_iters=1, num_threads=1, record_kineto=False,
                out_dir=str(outs[name]), capture_timeout_s=CAPTURE_BOUND_S,
                cluster=ClusterConfig(timeout_s=CLUSTER_START_S)))
        yield outs
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _main_thread_ops(trace) -> list:
    """Ops of the thread that ran the step (gloo's worker threads hold the rest)."""
    tid = Counter(op.tid for op in trace.ops).most_common(1)[0][0]
    return [op for op in trace.ops if op.tid == tid]


@pytest.mark.long
def test_fsdp2_step_on_cpu_and_on_fake_record_the_same_ops(real_captures, tmp_path):
    """Same op histogram over the top-level ops (collectives included), same collectives in
    order, same module ranges. The exceptions, each counted:

    * gloo's own work: its worker threads' ops (copies around its all-gather, the division of
      its reduce-scatter's AVG), and on the step's thread the ``chunk`` + ``copy_`` that
      complete each reduce-scatter (gloo builds it on an all-reduce). The fake process group,
      like NCCL, has none;
    * the autograd engine accumulates a gradient several uses produce in place on cpu
      (``add_``) and out of place on fake (``add``): torch treats subclass tensors as
      subclass-like and accumulates only plain tensors in place (as on meta).
    """
    fake_capture(tmp_path, 2)
    real, fake = (load_trace(d / trace_file_name(0)) for d in (real_captures["fsdp2"], tmp_path))
    assert len({op.tid for op in fake.ops}) == 1 < len({op.tid for op in real.ops})
    real_ops, fake_ops = _main_thread_ops(real), fake.ops
    # gloo's completion of each reduce-scatter, right after it on the step's thread
    completion = [i + k for i, op in enumerate(real_ops)
                  if op.name == "c10d::_reduce_scatter_base_" for k in (1, 2)]
    assert [real_ops[i].name for i in completion] == \
        ["aten::chunk", "aten::copy_"] * (len(completion) // 2)
    real_ops = [op for i, op in enumerate(real_ops) if i not in set(completion)]
    expected = Counter(op.name for op in real_ops)
    in_place = expected["aten::add_"] - Counter(op.name for op in fake_ops)["aten::add_"]
    assert in_place > 0
    expected["aten::add_"] -= in_place
    expected["aten::add"] += in_place
    assert Counter(op.name for op in fake_ops) == +expected
    assert [op.collective.signature() for op in real.collectives] == \
        [op.collective.signature() for op in fake.collectives]
    assert {op.collective.dtype for op in fake.collectives} == {"bfloat16", "float32"}
    assert Counter(op.module for op in real_ops) == Counter(op.module for op in fake_ops)
    assert [s.name for s in fake.steps] == ["ProfilerStep#1"]


@pytest.mark.long
def test_ddp_step_captured_for_real(real_captures):
    out = real_captures["ddp"]
    traces = [load_trace(out / trace_file_name(r)) for r in range(2)]
    sigs = [[op.collective.signature() for op in t.collectives if op.collective.kind == "all_reduce"]
            for t in traces]
    assert sigs[0] == sigs[1] and sigs[0]
    # DDP all-reduces every gradient once, in buckets: two 64x64 Linears and the 10-class head.
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_params"] == 2 * (64 * 64 + 64) + 64 * 10 + 10
    assert meta["entrypoint"] == DDP_EXAMPLE and meta["iteration_time_s"] > 0
    assert sum(s[1] for s in sigs[0]) == meta["num_params"]
    assert any(op.name == "aten::addcdiv_" for op in traces[0].ops)  # the AdamW step


def test_module_form_and_relative_paths(tmp_path, monkeypatch):
    assert load_build("examples.ddp_step:build") is not None
    monkeypatch.chdir(REPO)
    cfg = CaptureConfig(workload=WorkloadConfig(model="custom",
                                                entrypoint="examples/ddp_step.py:build"))
    cfg.validate()  # made absolute: rank actors may start in another directory
    assert cfg.workload.entrypoint == f"{REPO / 'examples' / 'ddp_step.py'}:build"
    assert load_build(cfg.workload.entrypoint) is load_build("examples/ddp_step.py:build")


def _user_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "step.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_bad_entrypoints_are_named_clearly(tmp_path):
    with pytest.raises(ConfigError, match=r"workload.entrypoint='nope.py:build': no such file "
                                          + str(Path.cwd() / "nope.py")):
        load_build("nope.py:build")
    with pytest.raises(ConfigError, match="expected PATH.py:FUNCTION or package.module:FUNCTION"):
        load_build("examples/ddp_step.py")
    with pytest.raises(ConfigError, match="has no function 'make'"):
        load_build("examples.ddp_step:make")
    with pytest.raises(ConfigError, match="has no function 'NUM_CLASSES' \\(found a int\\)"):
        load_build("examples.ddp_step:NUM_CLASSES")
    with pytest.raises(ConfigError, match="importing no_such_pkg.mod raised ModuleNotFoundError"):
        load_build("no_such_pkg.mod:build")
    broken = _user_file(tmp_path, "import torch\nraise RuntimeError('oops at import')\n")
    with pytest.raises(ConfigError, match=f"loading {broken} raised RuntimeError: oops at import"):
        load_build(f"{broken}:build")


@pytest.mark.parametrize("body, message", [
    ("def build(ctx):\n    raise ValueError('no GPU here')\n",
     r"build\(ctx\) raised ValueError: no GPU here at \S+\.py:2 in build "
     r"\(rank 0 of 1, device cpu\)"),
    ("def build(ctx):\n    return 1, 2\n",
     r"must return \(model, make_batch, step\); got a tuple of 2"),
    ("def build(ctx):\n    return None\n", r"must return \(model, make_batch, step\); got a NoneType"),
    ("def build(ctx):\n    return 'model', len, len\n",
     "model must be a torch.nn.Module; got a str"),
    ("import torch\ndef build(ctx):\n    return torch.nn.Linear(2, 2), len, 3\n",
     "step must be callable; got a int"),
])
def test_build_results_are_checked(tmp_path, body, message):
    spec = f"{_user_file(tmp_path, body)}:build"
    with pytest.raises(ConfigError, match=message) as err:
        build_custom(spec, CPU_CTX)
    assert str(err.value).startswith(f"workload.entrypoint={spec!r}: ")


def test_config_errors_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="workload.model=custom needs workload.entrypoint"):
        CaptureConfig(workload=WorkloadConfig(model="custom")).validate()
    with pytest.raises(ConfigError, match="only read with workload.model=custom"):
        CaptureConfig(workload=WorkloadConfig(entrypoint=DDP_EXAMPLE)).validate()
    with pytest.raises(ConfigError, match="use workload.device=fake"):
        CaptureConfig(workload=WorkloadConfig(model="custom", entrypoint=DDP_EXAMPLE,
                                              device="meta")).validate()
    proc = subprocess.run(  # the preset, with the entrypoint forgotten
        [sys.executable, "-m", "orchestrator.cli.capture", "workload=custom",
         f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "tracefleet-capture: error: workload.model=custom needs "
        "workload.entrypoint=PATH.py:FUNCTION (or package.module:FUNCTION)")
    assert not (tmp_path / "out").exists()


@pytest.mark.long
def test_fake_trace_replays_like_the_real_one(real_captures, tmp_path):
    """Replayed on cpu (compute), the fake FSDP2 trace runs every op the real one runs but
    gloo's own, and skips the same ones for the same reasons."""
    from actors.replay.config import AllocationConfig, ReplayConfig
    from actors.replay.engine import ReplayEngine

    fake_capture(tmp_path, 2)
    real, fake = (load_trace(d / trace_file_name(0)) for d in (real_captures["fsdp2"], tmp_path))
    runs = [ReplayEngine(t, ReplayConfig(mode="compute", device="cpu", iters=1, warmup_iters=0,
                                         allocation=AllocationConfig(mode="lazy"))).run().to_dict()
            for t in (real, fake)]
    assert [r["status"] for r in runs] == ["ok", "ok"], [r["error"] for r in runs]
    assert runs[0]["skipped_reasons"] == runs[1]["skipped_reasons"]
    main = _main_thread_ops(real)
    gloo_own = len(real.ops) - len(main) + 2 * sum(
        op.name == "c10d::_reduce_scatter_base_" for op in main)
    assert runs[1]["num_replayed"] == runs[0]["num_replayed"] - gloo_own


def test_cli_captures_a_custom_step_on_fake(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.capture", "workload=custom",
         "workload.entrypoint=examples/fsdp2_llama_step.py:build", "workload.device=fake",
         "world_size=3", f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tracefleet-capture: wrote 3 rank traces")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["entrypoint"] == FSDP2_EXAMPLE and meta["recorded_rank"] == 0
    assert meta["workload"]["model"] == "custom" and meta["workload"]["device"] == "fake"
