"""A GPU target's optimizer left to torch's default runs the multi-tensor foreach kernels on
fake (actors/capture/fake/optimizer_default.py), as torch picks them for CUDA tensors, and the
trace's step then holds what a foreach step holds: checked against a real foreach step's CPU
allocator counter."""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from actors.capture.fake.cuda_dispatch import OPTIMIZER, cuda_kernels
from actors.capture.workloads.build import WorkloadConfig
from actors.gpu_arch import GpuArch
from tests.support.fake_vs_real import as_entrypoint
from tests.support.step_peaks import measured_peak, predicted_peak

WIDTH, NUM_LAYERS = 512, 4


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model_and_optimizer(**optimizer_kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(NUM_LAYERS)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **optimizer_kwargs)


def _step(model, optimizer, batch):
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _step_ops(arch, **optimizer_kwargs) -> tuple[Counter, object]:
    """The aten ops of a second AdamW step on fake (the first creates the state)."""
    with FakeTensorMode():
        model, optimizer = _model_and_optimizer(**optimizer_kwargs)
        batch = torch.randn(8, WIDTH)
        with cuda_kernels(arch) as log:
            _step(model, optimizer, batch)
            model(batch).square().mean().backward()
            with OpNames() as names:
                optimizer.step()
    return names.ops, log


def test_a_gpu_targets_default_adamw_steps_with_foreach_kernels():
    gpu, log = _step_ops(GpuArch.sm90)
    assert gpu["_foreach_sqrt"] == 1 and gpu["_foreach_lerp_"] == 1
    assert gpu["sqrt"] == 0  # no parameter stepped on its own
    (record,) = [r for r in log.summary() if r["op"] == OPTIMIZER]
    assert (record["kernel"], record["cpu_kernel"], record["num_calls"]) == \
        ("foreach", "for-loop", 2)
    assert record["detail"] == f"{2 * NUM_LAYERS} tensors"
    cpu, none = _step_ops(None)  # a CPU target: the CPU's for-loop, one parameter at a time
    assert none is None and cpu["_foreach_sqrt"] == 0 and cpu["sqrt"] == 2 * NUM_LAYERS
    # the user's own choice stands; real tensors keep the CPU's choice
    chosen, log = _step_ops(GpuArch.sm90, foreach=False)
    assert chosen["_foreach_sqrt"] == 0 and not log.summary()
    model, optimizer = _model_and_optimizer()
    with cuda_kernels(GpuArch.sm90) as log, OpNames() as names:
        _step(model, optimizer, torch.randn(8, WIDTH))
    assert names.ops["_foreach_sqrt"] == 0 and not log.summary()
    from torch.optim import adam, optimizer as optim_base
    assert adam._default_to_fused_or_foreach is optim_base._default_to_fused_or_foreach


def build_default_adamw(ctx):
    model, optimizer = _model_and_optimizer()
    return model, lambda: torch.randn(8, WIDTH), lambda batch: _step(model, optimizer, batch)


def test_the_foreach_step_is_predicted_as_a_real_one_measures(tmp_path):
    """The step is the peak here (4 x 1 MiB of weights, a batch of 8): the sm90 trace's
    faithful dry run against a real foreach step. The CPU target's trace holds less: foreach's
    list of square roots (a copy of every parameter, alive for the whole update) where the
    for-loop holds one parameter's two temporaries (its root, then the root's quotient)."""
    def real_foreach_step():
        model, optimizer = _model_and_optimizer(foreach=True)
        return lambda: _step(model, optimizer, torch.randn(8, WIDTH))

    measured = measured_peak(real_foreach_step)
    spec = as_entrypoint(build_default_adamw, "default_adamw")
    gpu = predicted_peak(spec, tmp_path / "sm90", "sm90")
    cpu = predicted_peak(spec, tmp_path / "cpu")
    print({"predicted": gpu, "measured": measured, "ratio": round(gpu / measured, 4)})
    assert 0.99 <= gpu / measured <= 1.01, (gpu, measured)
    weights = NUM_LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    one_loop_temporaries = 2 * WIDTH * WIDTH * 4
    assert abs((gpu - cpu) - (weights - one_loop_temporaries)) <= 0.01 * weights, \
        (gpu - cpu, weights, one_loop_temporaries)


def test_the_built_in_recipes_step_adamw_fused_on_a_gpu_target():
    """torchtitan's optimizer.implementation default: fused on a GPU target; on a CPU target
    torch's own default."""
    from actors.capture.workloads.optimizers import make_optimizer

    params = list(nn.Linear(4, 4).parameters())
    gpu = make_optimizer(WorkloadConfig(device="fake", gpu_kernels="sm90"), params)
    cpu = make_optimizer(WorkloadConfig(device="fake"), params)
    assert gpu.defaults["fused"] is True and cpu.defaults["fused"] is None
