"""A custom step that raises, calls sys.exit or never returns, captured on fake: one error that
names the user's file and line, nothing half-written left in out_dir, and the hang stopped at
capture_timeout_s (actors/capture/user_code.py, actors/time_limit.py)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.capture.workloads.build import WorkloadConfig
from actors.errors import ConfigError
from actors.time_limit import TimeLimitError
from orchestrator.config import REPO_ROOT
from orchestrator.run.capture import CaptureConfig, check_world_size, run_capture_job
from tests.support.bounds import LOAD_MARGIN_S

# A tiny step whose misbehaviour is chosen by BAD; ``calls`` counts steps: the warm-up is
# call 1, the recorded iteration call 2 (under the ET observer).
STEP = """\
import sys, time
import torch
BAD = {bad!r}
if BAD == "exit_import":
    sys.exit(3)


def build(ctx):
    if BAD == "exit_build":
        sys.exit(4)
    model = torch.nn.Linear(8, 8).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [0]

    def make_batch():
        return torch.randn(4, 8, device=ctx.device)

    def step(batch):
        calls[0] += 1
        if BAD == "raise_recorded" and calls[0] == 2:
            raise ValueError("boom in the recorded step")
        if BAD == "exit_step":
            sys.exit(5)
        if BAD == "hang" and calls[0] == 2:
            while True:
                try:
                    time.sleep(0.05)
                except Exception:  # a user's broad except does not swallow the bound
                    pass
        model(batch).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, make_batch, step
"""


def _step_file(tmp_path: Path, bad: str) -> Path:
    path = tmp_path / "my_step.py"
    path.write_text(STEP.format(bad=bad))
    return path


def _capture(tmp_path: Path, bad: str, **cfg) -> tuple[Path, Path]:
    step, out = _step_file(tmp_path, bad), tmp_path / "out"
    run_capture_job(CaptureConfig(
        workload=WorkloadConfig(model="custom", entrypoint=f"{step}:build", device="fake"),
        world_size=2, out_dir=str(out), **cfg))
    return step, out


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize("bad, what, marker", [
    ("raise_recorded", r"step\(batch\) raised ValueError: boom in the recorded step",
     "raise ValueError"),
    ("exit_step", r"step\(batch\) called sys.exit\(5\)", "sys.exit(5)"),
    ("exit_build", r"build\(ctx\) called sys.exit\(4\)", "sys.exit(4)"),
    ("exit_import", r"loading \S+ called sys.exit\(3\)", "sys.exit(3)"),
])
def test_a_failing_step_names_its_file_and_line_and_leaves_nothing(tmp_path, bad, what, marker):
    with pytest.raises(ConfigError, match=what) as err:
        _capture(tmp_path, bad)
    step = tmp_path / "my_step.py"
    assert f"at {step}:{_line_of(step, marker)} in " in str(err.value)
    out = tmp_path / "out"
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []  # no .partial


def test_a_step_that_never_returns_is_stopped_at_capture_timeout_s(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeLimitError, match=r"capture_timeout_s=20: the fake capture.s recording of rank 0 did not "
                                             r"finish within 20 s \(stopped at ") as err:
        _capture(tmp_path, "hang", capture_timeout_s=20)
    took_s = time.monotonic() - start
    step = tmp_path / "my_step.py"
    assert f"{step}:{_line_of(step, 'time.sleep(0.05)')} in step" in str(err.value)
    assert took_s < 20 + LOAD_MARGIN_S
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_a_step_that_waits_at_one_place_is_stopped_at_capture_stall_s(tmp_path):
    """Not after the whole 600 s bound: after 2 s at the same line, with the place named."""
    start = time.monotonic()
    with pytest.raises(TimeLimitError, match=r"capture_stall_s=2: the fake capture.s recording of "
                                             r"rank 0 made no progress for 2 s: it stayed at ") as err:
        _capture(tmp_path, "hang", capture_timeout_s=600, capture_stall_s=2)
    step = tmp_path / "my_step.py"
    assert f"{step}:{_line_of(step, 'time.sleep(0.05)')} in step" in str(err.value)
    assert time.monotonic() - start < 600 - LOAD_MARGIN_S
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
    with pytest.raises(ConfigError, match=r"capture_stall_s=-1; expected seconds >= 0"):
        CaptureConfig(capture_stall_s=-1).validate()


def test_the_world_size_bound_is_refused_up_front():
    check_world_size(1 << 20)
    with pytest.raises(ConfigError, match=r"world_size=1,000,000,000 exceeds 1,048,576 ranks, "
                                          "the most a capture serves"):
        CaptureConfig(world_size=10**9).validate()
    with pytest.raises(ConfigError, match="world_size=0: expected an integer >= 1"):
        CaptureConfig(world_size=0).validate()


def test_cli_step_failure_is_one_line_and_exit_2(tmp_path):
    step = _step_file(tmp_path, "raise_recorded")
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.capture", "workload=custom",
         f"workload.entrypoint={step}:build", "workload.device=fake", "world_size=2",
         f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tracefleet-capture: error: workload.entrypoint='{step}:build': step(batch) raised "
        f"ValueError: boom in the recorded step at {step}:{_line_of(step, 'raise ValueError')} "
        "in step (rank 0 of 2, device cpu)")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_the_recorder_removes_its_partial_trace_when_the_step_fails(tmp_path):
    import torch

    from actors.capture.recorder import record_iteration

    model = torch.nn.Linear(4, 4)

    def step(batch):
        model(batch).sum()
        raise RuntimeError("fails under the observer")

    with pytest.raises(RuntimeError, match="fails under the observer"):
        record_iteration(step, torch.randn(2, 4), model, step_index=0,
                         out_path=str(tmp_path / "rank-0.et.json.gz"), tensor_ranges=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_step_on_cuda_is_told_to_use_ctx_device_at_its_own_line(tmp_path, monkeypatch):
    """A step written for a GPU (``.cuda()``), given as MODULE:FUNCTION: the failure names the
    module's line, not torch's, and says to put it on ctx.device."""
    module = tmp_path / "my_cuda_step.py"
    module.write_text("import torch\n\n\ndef build(ctx):\n"
                      "    model = torch.nn.Linear(8, 8).cuda()\n"
                      "    return model, lambda: torch.randn(4, 8), lambda batch: None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="put modules and tensors there, not on cuda") as err:
        run_capture_job(CaptureConfig(
            workload=WorkloadConfig(model="custom", entrypoint="my_cuda_step:build",
                                    device="fake"),
            world_size=1, out_dir=str(tmp_path / "out")))
    assert f"at {module}:{_line_of(module, '.cuda()')} in build" in str(err.value)
