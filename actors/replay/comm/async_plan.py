"""When each collective of a trace runs async and where it completes (pure: no torch).

* A ``wait`` (NCCL traces' ``record_param_comms`` waits, functional ``wait_tensor``)
  completes the latest earlier call of the same ``seq``: that call runs ``async_op=True``.
* A call the trace records as async with no wait to pair it (gloo traces record the
  ``c10d::*`` call's ``async_op`` flag, not the Python ``work.wait()``) runs async and
  completes right before the first later op that reads or writes one of its buffers, which
  is when the original had to have waited for it: its communication overlaps what runs in
  between, as it did in the original. Ops that only make views of a buffer (DeepSpeed narrows
  its gathered flat buffer into parameters right after issuing the all-gather) read nothing
  and do not count. A call nothing uses completes at the end of the iteration.
* Every other call is synchronous.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from actors.trace.model import Op
from actors.trace.op_schema import is_view_op


@dataclass
class AsyncPlan:
    """The plan of one rank's collectives (op indices throughout)."""

    waited: dict[int, int] = field(default_factory=dict)  # wait op -> the call it completes
    calls: set[int] = field(default_factory=set)  # calls that run async_op=True
    complete_before: dict[int, list[int]] = field(default_factory=dict)  # op -> unpaired calls due


def plan_async(ops: Sequence[Op]) -> AsyncPlan:
    """The async plan of ``ops`` (see the module docstring)."""
    plan = AsyncPlan()
    last_call: dict = {}
    for op in ops:
        c = op.collective
        if c is None:
            continue
        if c.kind == "wait":
            call = last_call.pop(c.wait_seq, None) if c.wait_seq is not None else None
            if call is not None:
                plan.waited[op.index] = call
                plan.calls.add(call)
        elif c.seq is not None:
            last_call[c.seq] = op.index
    unpaired = {op.index for op in ops if op.collective is not None
                and op.collective.kind != "wait" and op.collective.async_op
                and op.index not in plan.calls}
    watching: dict[int, set[int]] = {}  # suid -> unpaired calls in flight on it
    for op in ops:
        suids = {t.suid for t in op.input_tensors() + op.output_tensors()}
        if op.collective is None and is_view_op(op.schema):
            continue
        due = set().union(*(watching.pop(s, ()) for s in suids & watching.keys()))
        if due:
            plan.complete_before[op.index] = sorted(due)
            for calls in watching.values():
                calls -= due
        if op.index in unpaired:
            plan.calls.add(op.index)
            for s in suids:
                watching.setdefault(s, set()).add(op.index)
    return plan
