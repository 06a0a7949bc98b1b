"""FSDP2 keeps each reduce-scatter's input past its last use (pure data).

FSDP2's post-backward reduce-scatters a module's gradients from a flat input it made
(``fsdp::chunk_cat``) and keeps that input in its reduce-scatter state until the next
module's post-backward begins (so an asynchronous reduce-scatter never reads freed memory):
it lives through the whole backward of the next module, though no op uses it after the
reduce-scatter. The trace shows only that last use; this moves its end to the op before
the next ``FSDP::post_backward_reduce`` range.
"""
from __future__ import annotations

from actors.trace.liveness import Liveness
from actors.trace.model import Op

REDUCE_RANGE = "FSDP::post_backward_reduce"


def hold_reduce_scatter_inputs(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, each FSDP2 reduce-scatter input that dies at its reduce-scatter
    to the op before the next post-backward range; returns how many storages moved."""
    calls = [op for op in ops if op.collective is not None
             and op.collective.kind == "reduce_scatter_tensor"
             and op.module.startswith(REDUCE_RANGE)]
    moved = 0
    for cur, nxt in zip(calls, calls[1:]):
        start = nxt.index
        while start > cur.index + 1 and ops[start - 1].module == nxt.module:
            start -= 1
        end = start - 1
        if end <= cur.index:
            continue
        for t in cur.input_tensors():
            s = t.suid
            if s >= 0 and live.storage_last[s] == cur.index and s in live.free_after[cur.index]:
                live.free_after[cur.index].remove(s)
                live.free_after[end].append(s)
                live.storage_last[s] = end
                moved += 1
    return moved
