"""FSDP2 holds some storages past their last use in the trace (pure data).

The trace shows when an op last reads a storage; FSDP2 frees two kinds later, in Python state
the trace does not record:

* the reduce-scatter input: post-backward reduce-scatters a module's gradients from a flat
  input it made (``fsdp::chunk_cat``) and keeps that input in its reduce-scatter state until
  the next module's post-backward begins (so an asynchronous reduce-scatter never reads freed
  memory): its end moves to the op before the next ``FSDP::post_backward_reduce`` range;
* the unsharded parameters: ``fsdp::split_with_sizes_copy`` (``FSDP::all_gather_copy_out``)
  copies the gathered block into one storage per parameter, and FSDP2 frees those storages
  only when it reshards the module (``storage.resize_(0)``, not an op): after the module's
  forward (``reshard_after_forward``) or in its post-backward, just before the module's
  ``FSDP::post_backward_reduce`` range, not at each parameter's last matmul. Measured on a
  2-rank Llama (d256, bf16 gathered blocks of 1.6 MiB, full AC): the first weights the
  backward uses were freed up to a block's backward early, 0.9 MiB of the gap at the peak;
* a forward all-gather's flat output: in forward FSDP2 keeps it (``all_gather_state``, so the
  copy-out overlaps the next all-gather) until the next module's copy-out begins, or the
  root's post-forward for the last one (a gathered block, 1.6 MiB there, through each forward).
"""
from __future__ import annotations

import bisect

from actors.trace.autograd_lifetimes import is_backward_node
from actors.trace.liveness import Liveness
from actors.trace.model import Op

REDUCE_RANGE = "FSDP::post_backward_reduce"
GATHER_RANGE = "FSDP::all_gather"
COPY_OUT_RANGE = "FSDP::all_gather_copy_out"


def _range_start(ops: list[Op], index: int) -> int:
    """The first op of the run of ops sharing op ``index``'s range."""
    start = index
    while start > 0 and ops[start - 1].module == ops[index].module:
        start -= 1
    return start


def hold_reduce_scatter_inputs(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, each FSDP2 reduce-scatter input that dies at its reduce-scatter
    to the op before the next post-backward range; returns how many storages moved."""
    calls = [op for op in ops if op.collective is not None
             and op.collective.kind == "reduce_scatter_tensor"
             and op.module.startswith(REDUCE_RANGE)]
    moved = 0
    for cur, nxt in zip(calls, calls[1:]):
        end = _range_start(ops, nxt.index) - 1
        if end <= cur.index:
            continue
        for t in cur.input_tensors():
            s = t.suid
            if s >= 0 and live.storage_last[s] == cur.index:
                moved += live.hold_until(s, end)
    return moved


class _ModuleIndex:
    """The op indices of each module range (``op.module``), built in one pass so each copy-out's
    reshard is found by bisection instead of a scan of the ops after it (160 copy-outs over
    37k ops on llama3_70b)."""

    def __init__(self, ops: list[Op]):
        self.ops = ops
        self.by_module: dict[str, list[int]] = {}
        for op in ops:
            self.by_module.setdefault(op.module, []).append(op.index)

    def first_after(self, module: str, index: int) -> int | None:
        """The first op after ``index`` in range ``module``, None when there is none."""
        found = self.by_module.get(module, ())
        k = bisect.bisect_right(found, index)
        return found[k] if k < len(found) else None

    def last_inside(self, module: str, lo: int, hi: int) -> int:
        """The last op in ``[lo, hi)`` inside module ``module`` or its submodules (``lo`` when
        there is none)."""
        inside = (f"## module:{module} ##", f"## module:{module}.")
        last = lo
        for name, found in self.by_module.items():
            if name.startswith(inside):
                k = bisect.bisect_left(found, hi) - 1
                if k >= 0 and found[k] >= lo:
                    last = max(last, found[k])
        return last


def _reshard_index(index: _ModuleIndex, copy_out: int, suffix: str, module: str) -> int:
    """The last op before FSDP2 reshards the parameters gathered at op ``copy_out``: before
    the module's post-backward reduce when no other gather of the module comes first (a
    backward gather, or a forward one kept through backward), else its forward's last op."""
    reduce_at = index.first_after(REDUCE_RANGE + suffix, copy_out)
    next_gather = index.first_after(GATHER_RANGE + suffix, copy_out)
    if reduce_at is not None and (next_gather is None or reduce_at < next_gather):
        return _range_start(index.ops, reduce_at) - 1
    stop = next_gather if next_gather is not None else len(index.ops)
    return index.last_inside(module, copy_out, stop)


def hold_unsharded_parameters(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, each FSDP2 unsharded parameter storage (an ``out`` of
    ``fsdp::split_with_sizes_copy``) to its module's reshard; returns how many moved."""
    moved = 0
    copy_outs = _copy_outs(ops)
    index = _ModuleIndex(ops) if copy_outs else None
    for op in copy_outs:
        suffix = op.module[len(COPY_OUT_RANGE):]  # " (layers.2)"; "" for the root
        module = suffix.strip()[1:-1] or "<root>"
        end = _reshard_index(index, op.index, suffix, module)
        for t in op.input_tensors()[1:]:  # the first is the gathered flat buffer
            if t.suid >= 0:
                moved += live.hold_until(t.suid, end)
    return moved


def _copy_outs(ops: list[Op]) -> list[Op]:
    return [op for op in ops
            if op.name == "fsdp::split_with_sizes_copy" and op.module.startswith(COPY_OUT_RANGE)]


def hold_forward_all_gather_outputs(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, each forward all-gather's flat output (the first argument of
    ``fsdp::split_with_sizes_copy``) to the op before the next copy-out range, the last one to
    the root module's last forward op; returns how many storages moved."""
    backward_start = next((op.index for op in ops if is_backward_node(op.module)), len(ops))
    forward = [op for op in _copy_outs(ops) if op.index < backward_start]
    # the root's post-forward: after the last op inside a module range (a loss computed
    # outside the model runs after it)
    root_end = max((op.index for op in ops[:backward_start] if op.module.startswith("## module:")),
                   default=backward_start - 1)
    moved = 0
    for cur, nxt in zip(forward, [*forward[1:], None]):
        end = _range_start(ops, nxt.index) - 1 if nxt is not None else root_end
        flat = cur.input_tensors()[0].suid
        if flat >= 0:
            moved += live.hold_until(flat, end)
    return moved
