"""Gradients live through the optimizer step, not to its last read of them (pure data).

A parameter's ``.grad`` is freed by ``zero_grad`` (or the next backward's overwrite), never by
the optimizer op that last reads it: ``torch.optim``'s per-parameter loop reads a gradient for
the last time in that parameter's update, while the parameter keeps it through the updates
of all the others. Measured on examples/ddp_step.py (4 x 512-wide Linears, AdamW, 2 gloo
ranks): the real peak is the first weight's ``sqrt`` / ``div`` temporaries with every gradient
alive; freed at their last read, the dry run lacked that weight's 1 MiB gradient (0.955).

The step is the run of top-level ops in an ``Optimizer.step#<Name>.step`` range (torch.optim
opens it); a storage it reads that the iteration made before the step (a gradient, or a
clipping temporary the step reads) is held to the run's last op. Storages that existed before
the iteration (parameters, optimizer state, DDP's buckets and the gradients viewing them) are
held by the faithful policy anyway.
"""
from __future__ import annotations

from actors.trace.liveness import Liveness
from actors.trace.model import Op

STEP_RANGE = "Optimizer.step#"


def hold_gradients_through_step(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, each storage made in the iteration before an optimizer step and
    read by it to the step's last op; returns how many storages moved."""
    moved = 0
    i = 0
    while i < len(ops):
        if not ops[i].module.startswith(STEP_RANGE):
            i += 1
            continue
        start, name = i, ops[i].module
        while i < len(ops) and ops[i].module == name:
            i += 1
        end = ops[i - 1].index
        for op in ops[start:i]:
            for t in op.input_tensors():
                s = t.suid
                if s >= 0 and not live.storage_external[s] \
                        and 0 <= live.storage_first[s] < ops[start].index:
                    moved += live.hold_until(s, end)
    return moved
