"""Training phases of a trace's ops: forward, backward, update (pure data).

Per ProfilerStep window: ops before the first backward op are forward, ops up to the last
backward op are backward, the rest is the update (the optimizer step). A backward op is one
recorded inside an autograd node's range (``...Backward0``, ``AccumulateGrad``). An op of an
optimizer's step (torch.optim's ``Optimizer.step#`` range) is the update wherever it runs: with
the step in backward (a parameter's post-accumulate-grad hook, torchtitan's
``optimizer.early_step_in_backward``) it runs between backward ops.
"""
from __future__ import annotations

import re

from actors.trace.model import Op, Trace
from actors.trace.optimizer_lifetimes import STEP_RANGE

_BACKWARD = re.compile(r"(Backward\d*|AccumulateGrad)$")
FWD, BWD, UPDATE = "forward", "backward", "update"


def is_backward_op(op: Op) -> bool:
    """Whether ``op`` ran inside an autograd node (the backward pass)."""
    return bool(_BACKWARD.search(op.module))


def phases(trace: Trace) -> list[str]:
    """FWD, BWD or UPDATE per op index (see the module docstring)."""
    out = [FWD] * len(trace.ops)
    windows = [(s.first, s.end) for s in trace.steps] or [(0, len(trace.ops))]
    for first, end in windows:
        bwd = [i for i in range(first, end) if is_backward_op(trace.ops[i])]
        if bwd:
            for i in range(bwd[0], end):
                out[i] = BWD if i <= bwd[-1] else UPDATE
        for i in range(first, end):
            if trace.ops[i].module.startswith(STEP_RANGE):
                out[i] = UPDATE
    return out
