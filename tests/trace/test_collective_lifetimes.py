"""A functional collective's inputs live until the run waits (actors/trace/collective_lifetimes.py):
on the fake trace of a step whose all-gather input is a temporary the Python code drops at
once, the wait follows the call and the recorded free is at the call; the rule holds the input
to the op before the gathered result's first use, where eager code waits."""
from __future__ import annotations

import textwrap

from actors.trace import load_trace
from actors.trace.collective_lifetimes import hold_collective_inputs
from actors.trace.conventions import trace_file_name
from actors.trace.liveness import compute_liveness
from actors.trace.recorded_frees import hold_recorded_frees
from tests.capture.test_capture_fake import fake_capture

STEP = textwrap.dedent('''
    import torch
    import torch.distributed._functional_collectives as funcol

    def build(ctx):
        with torch.device(ctx.device):
            model = torch.nn.Linear(64, 64)
        group = ctx.mesh.get_group()
        opt = torch.optim.SGD(model.parameters())

        def step(x):
            h = model(x)
            gathered = funcol.all_gather_single(h * 2, 0, group)  # the doubled h: gather only
            busy = torch.tanh(h).exp()  # work while the gather is in flight
            (gathered.sum() + busy.sum()).backward()
            opt.step()
            opt.zero_grad()
        return model, lambda: torch.ones(8, 64, device=ctx.device), step
''')


def test_all_gather_input_is_held_to_the_wait(tmp_path):
    (tmp_path / "step.py").write_text(STEP)
    fake_capture(tmp_path / "out", 2, str(tmp_path / "step.py") + ":build")
    trace = load_trace(tmp_path / "out" / trace_file_name(0))
    ops = trace.ops
    call = next(op for op in ops if op.name == "_c10d_functional::all_gather_into_tensor")
    wait = ops[call.index + 1]
    assert wait.name == "_c10d_functional::wait_tensor"  # fake: the wait follows the call
    gathered = {t.suid for t in wait.output_tensors()}
    first_use = next(op.index for op in ops[wait.index + 1:]
                     if gathered & {t.suid for t in op.input_tensors()})
    assert ops[first_use - 1].name == "aten::exp"  # the work in between ran first
    doubled = call.input_tensors()[0].suid
    live = compute_liveness(ops, trace.num_storages)
    hold_recorded_frees(trace.recorded_frees, live)
    assert live.storage_last[doubled] < first_use - 1  # Python let go of it at the call
    assert hold_collective_inputs(ops, live) >= 1
    assert live.storage_last[doubled] == first_use - 1
    assert doubled in live.free_after[first_use - 1]
