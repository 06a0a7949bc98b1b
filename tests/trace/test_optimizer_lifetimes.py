"""Gradients live through the optimizer step (actors/trace/optimizer_lifetimes.py): on the fake
trace of examples/ddp_step.py (AdamW's per-parameter loop), each gradient's last read is its
own parameter's update; the rule holds every one to the step's last op."""
from __future__ import annotations

from actors.trace import load_trace
from actors.trace.conventions import trace_file_name
from actors.trace.liveness import compute_liveness
from actors.trace.optimizer_lifetimes import STEP_RANGE, hold_gradients_through_step
from tests.capture.test_capture_fake import DDP_EXAMPLE, fake_capture


def test_gradients_are_held_to_the_end_of_the_step(tmp_path):
    fake_capture(tmp_path, 2, DDP_EXAMPLE)
    trace = load_trace(tmp_path / trace_file_name(0))
    live = compute_liveness(trace.ops, trace.num_storages)
    step = [op.index for op in trace.ops if op.module.startswith(STEP_RANGE)]
    first, last = step[0], step[-1]
    assert step == list(range(first, last + 1))  # one run of ops
    grads = {t.suid for i in step for t in trace.ops[i].input_tensors()
             if t.suid >= 0 and not live.storage_external[t.suid]
             and live.storage_first[t.suid] < first}
    assert len(grads) == 6  # 3 Linears' weights and biases (DDP copied them back into .grad)
    assert min(live.storage_last[s] for s in grads) < last  # freed inside the step before
    assert hold_gradients_through_step(trace.ops, live) == len(grads)
    assert {live.storage_last[s] for s in grads} == {last}
    assert all(s in live.free_after[last] for s in grads)
