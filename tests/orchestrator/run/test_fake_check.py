"""``tracefleet-capture ... workload.check_fake=true``: the same step captured for real (2 gloo
ranks on Ray) and on fake at world 2, compared; a step that branches on fakeness itself is
caught, and the first op where the runs part is named."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orchestrator.config import REPO_ROOT
from orchestrator.outputs import CHECK_FAKE_JSON

# A library's "am I tracing?" branch: under fake it skips an op the real run does.
STEP = '''
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.parallel import DistributedDataParallel


def build(ctx):
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(),
                                                  nn.Linear(16, 4)).to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        out = model(batch[0])
        if not isinstance(out, FakeTensor):
            out = out.clamp(-10, 10)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, lambda: (torch.randn(8, 16, device=ctx.device),), step
'''


@pytest.mark.long
def test_check_fake_names_where_a_fakeness_branch_parts_the_runs(tmp_path):
    (tmp_path / "step.py").write_text(STEP)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.capture", "workload=custom",
         f"workload.entrypoint={tmp_path / 'step.py'}:build", "workload.device=fake",
         "workload.check_fake=true", "world_size=16", f"out_dir={out}",
         f"hydra.run.dir={tmp_path / 'hydra'}", "cluster.num_cpus=2"],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("check_fake:")]
    assert "aten::clamp: real 1, fake 0" in "\n".join(lines)
    first = next(line for line in lines if "first divergence" in line)
    assert "real node" in first and "aten::clamp" in first.split("; fake")[0]
    check = json.loads((out / CHECK_FAKE_JSON).read_text())
    assert check["equal"] is False and check["world_size"] == 2
    assert (out / "rank-15.et.json.gz").is_file()  # the fake capture itself at world 16
    # the clamp and its backward's ops are the whole difference
    diff = json.loads((out / "meta.json").read_text())["check_fake"]["histogram_diff"]
    assert diff["aten::clamp"] == [1, 0] and all(real == 1 and fake == 0
                                                 for real, fake in diff.values())


def test_check_fake_needs_the_fake_device():
    from actors.capture.workloads.config import WorkloadConfig, validate
    from actors.errors import ConfigError
    import pytest

    with pytest.raises(ConfigError, match="workload.check_fake=true .* needs workload.device="
                                          "fake"):
        validate(WorkloadConfig(model="custom", entrypoint="x.py:build", check_fake=True))
