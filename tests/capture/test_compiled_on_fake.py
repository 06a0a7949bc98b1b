"""torch.compile (inductor) on workload.device=fake: inductor's own plan of buffers recorded
(actors/capture/fake/compiled_on_fake.py), no kernel compiled, nothing of the compiler in the
trace."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from actors.errors import ConfigError
from actors.replay.config import AllocationConfig, ReplayConfig
from actors.replay.session import replay_rank
from actors.trace import load_trace
from tests.support.fake_vs_real import as_entrypoint, capture_fake

WIDTH, BATCH = 256, 512
NUM_SIN = 6  # sin(h) * 1.5 after the first linear: eager keeps each sin's input for backward


class PointwiseChain(nn.Module):
    """A linear, a chain of pointwise ops, a linear: the chain's intermediates are what
    inductor fuses away and its partitioner recomputes instead of saving."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.up(x)
        for _ in range(NUM_SIN):
            h = torch.sin(h) * 1.5
        return self.down(h)


def chain_step(compiled: bool, changing_arg: bool = False):
    def build(ctx):
        torch.manual_seed(0)
        net = PointwiseChain().to(ctx.device)
        run = torch.compile(net) if compiled else net
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        calls = [0]

        def step(batch):
            (x,) = batch
            if changing_arg:  # a Python number that changes every call: a guard that fails
                calls[0] += 1
                with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                    out = torch.compile(lambda t, k: net(t) * k)(x, calls[0])
            else:
                out = run(x)
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return net, lambda: (torch.randn(BATCH, WIDTH, device=ctx.device),), step
    return build


def _capture(tmp_path, name: str, build) -> Path:
    return capture_fake(as_entrypoint(build, name), tmp_path / name)


def _accounted_peak(path: Path) -> int:
    """The faithful dry run's accounted peak on meta (what tracefleet-predict reads)."""
    report = replay_rank(path, ReplayConfig(mode="compute", device="meta", iters=1,
                                            warmup_iters=1, measure_memory=False,
                                            allocation=AllocationConfig(mode="faithful")))
    assert report["status"] == "ok", report["error"]
    return report["accounted_peak_bytes"]


def test_a_compiled_step_records_inductors_buffers_and_nothing_of_the_compiler(tmp_path):
    eager = load_trace(_capture(tmp_path, "eager_chain", chain_step(False)))
    compiled = load_trace(_capture(tmp_path, "compiled_chain", chain_step(True)))
    names = Counter(op.name for op in compiled.ops)
    # the wrapper's buffers, made through the fake mode and recorded
    assert names["aten::empty_strided"] >= 3
    # the fused pointwise chain leaves no op; eager ran every one of them, forward and back
    assert names["aten::sin"] == 0 and Counter(op.name for op in eager.ops)["aten::sin"] \
        == NUM_SIN
    # nothing the compiler ran on its own fake tensors: every op of the compiled trace is one
    # of the wrapper's calls, the optimizer's, the loss's or the autograd engine's
    assert len(compiled.ops) < len(eager.ops)


def test_inductors_plan_holds_less_than_the_eager_step(tmp_path):
    """Eager keeps every sin's input and the last linear's input for backward (NUM_SIN + 1
    activations of the batch's size); inductor's partitioner saves the first linear's output
    and the last one's input, and recomputes the chain in backward: NUM_SIN - 1 fewer."""
    eager = _capture(tmp_path, "eager_peak", chain_step(False))
    compiled = _capture(tmp_path, "compiled_peak", chain_step(True))
    activation = BATCH * WIDTH * 4
    eager_peak, compiled_peak = _accounted_peak(eager), _accounted_peak(compiled)
    assert eager_peak - compiled_peak >= (NUM_SIN - 1) * activation, (eager_peak, compiled_peak)


def _table_step(num_table: int):
    """A compiled step whose one input only a generated kernel reads: a buffer of
    ``num_table`` floats, made before the iteration and summed into the loss."""
    def build(ctx):
        torch.manual_seed(0)
        net = nn.Linear(WIDTH, WIDTH).to(ctx.device)
        net.register_buffer("table", torch.ones(num_table, device=ctx.device))
        run = torch.compile(lambda x: (net(x) * 2).sum() + net.table.sum())
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def step(batch):
            run(batch[0]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return net, lambda: (torch.randn(BATCH, WIDTH, device=ctx.device),), step
    return build


def test_a_tensor_only_a_generated_kernel_reads_is_in_the_trace(tmp_path):
    """The state of torchao's compiled low-bit optimizer step is such a tensor: without a read
    recorded as the graph is called, its bytes were missing from the prediction."""
    small = _accounted_peak(_capture(tmp_path, "table_small", _table_step(1024)))
    large = _accounted_peak(_capture(tmp_path, "table_large", _table_step(1024 * 1024)))
    assert large - small >= (1024 * 1024 - 1024) * 4, (small, large)


def test_a_step_that_compiles_every_iteration_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"torch.compile compiled again in the recorded "
                                          r"iteration.*mark it dynamic"):
        _capture(tmp_path, "recompiles", chain_step(True, changing_arg=True))


def test_a_backend_that_needs_values_is_refused_naming_it(tmp_path):
    def reads_values(gm, inputs):
        raise RuntimeError("this backend needs real tensors")

    def build(ctx):
        net = nn.Linear(8, 8).to(ctx.device)
        run = torch.compile(net, backend=reads_values)
        return net, lambda: (torch.randn(4, 8, device=ctx.device),), \
            lambda b: run(b[0]).sum().backward()

    with pytest.raises(ConfigError, match=r"workload.device=fake: torch.compile raised "
                                          r"\w+ on fake tensors \(.*this backend needs real "
                                          r"tensors.*capture the step with"):
        _capture(tmp_path, "bad_backend", build)


def test_a_real_capture_still_compiles_kernels_after_a_fake_one(tmp_path):
    """The fake capture's swaps are undone: a compiled function then runs real kernels."""
    _capture(tmp_path, "fake_first", chain_step(True))
    x = torch.randn(4, WIDTH)
    net = PointwiseChain()
    assert torch.allclose(torch.compile(net)(x), net(x), atol=1e-5)


@pytest.mark.parametrize("ac", ["none", "selective_op", "full"])
def test_workload_compile_compiles_every_block_of_the_built_in_model(tmp_path, ac):
    """workload.compile=true: each block compiled in place (module names kept), FSDP2 over it;
    inductor's buffers in the trace and the fused ops gone, with or without AC (the built-in
    attention used to break the graph on fake, which left a checkpointed block eager; full AC's
    recompute replays attention under inductor's run_with_rng_state, a higher-order op whose
    fake rule torch keys by FakeTensorMode's exact type and whose RNG state is a real tensor)."""
    from actors.capture.fake_rank import record_meta_rank
    from actors.capture.request import CaptureRequest
    from actors.capture.workloads.config import WorkloadConfig

    def capture(compiled: bool):
        cfg = CaptureRequest(WorkloadConfig(
            model="llama", parallel="fsdp2", precision="bf16_mixed", vocab=256, d_model=64,
            n_layers=2, n_heads=4, seq_len=32, batch_size=2, device="fake",
            activation_checkpointing=ac, compile=compiled))
        out = tmp_path / f"compiled-{compiled}"
        out.mkdir()
        return load_trace(record_meta_rank(cfg, str(out), 0, 2)[1])

    eager, compiled = capture(False), capture(True)
    ops = Counter(op.name for op in compiled.ops)
    assert ops["aten::empty_strided"] > 10 and ops["c10d::_allgather_base_"] \
        == Counter(op.name for op in eager.ops)["c10d::_allgather_base_"]
    # the blocks' RMSNorms fused away: only the final norm, outside the blocks, runs eagerly
    assert ops["aten::rsqrt"] == 1 < Counter(op.name for op in eager.ops)["aten::rsqrt"]


def test_workload_compile_is_refused_where_it_is_not_built():
    from actors.capture.workloads.config import WorkloadConfig, validate

    with pytest.raises(ConfigError, match=r"workload.compile=true with workload.parallel=zero3.*"
                                          r"a custom step compiles itself"):
        validate(WorkloadConfig(model="llama", parallel="zero3", compile=True))


def _compiled_update_step(ctx):
    """SGD with momentum whose update is one compiled function: the weights and the momentum
    buffers are written only by its generated kernels."""
    torch.manual_seed(0)
    net = nn.Linear(WIDTH, WIDTH).to(ctx.device)
    momentum = [torch.zeros_like(p) for p in net.parameters()]

    @torch.compile
    def update(params, grads, bufs):
        for p, g, b in zip(params, grads, bufs):
            b.mul_(0.9).add_(g)
            p.add_(b, alpha=-1e-3)

    def step(batch):
        net(batch[0]).square().mean().backward()
        with torch.no_grad():
            update(list(net.parameters()), [p.grad for p in net.parameters()], momentum)
        net.zero_grad(set_to_none=True)

    return net, lambda: (torch.randn(BATCH, WIDTH, device=ctx.device),), step


def test_the_weights_a_compiled_update_writes_are_the_traces_parameters(tmp_path):
    """The trace tells parameters by their update in place after a read in forward; a compiled
    update leaves no op, so each input the graph writes is written by a recorded ``mul_``: the
    weight and bias count as parameters, the momentum buffers (first used by the write) not."""
    from actors.trace.stats import trace_stats

    path = _capture(tmp_path, "compiled_update", _compiled_update_step)
    params = trace_stats(load_trace(path))["params"]
    assert params == {"num_storages": 2, "bytes": (WIDTH * WIDTH + WIDTH) * 4}
