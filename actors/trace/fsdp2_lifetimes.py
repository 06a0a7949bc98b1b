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


def _reshard_index(ops: list[Op], copy_out: int, suffix: str, module: str) -> int:
    """The last op before FSDP2 reshards the parameters gathered at op ``copy_out``: before
    the module's post-backward reduce when no other gather of the module comes first (a
    backward gather, or a forward one kept through backward), else its forward's last op."""
    reduce_at = next_gather = None
    for op in ops[copy_out + 1:]:
        if op.module == REDUCE_RANGE + suffix:
            reduce_at = op.index
            break
        if op.module == GATHER_RANGE + suffix:
            next_gather = op.index
            break
    if reduce_at is not None:
        return _range_start(ops, reduce_at) - 1
    stop = next_gather if next_gather is not None else len(ops)
    inside = (f"## module:{module} ##", f"## module:{module}.")
    return max((op.index for op in ops[copy_out:stop] if op.module.startswith(inside)),
               default=copy_out)


def hold_unsharded_parameters(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, each FSDP2 unsharded parameter storage (an ``out`` of
    ``fsdp::split_with_sizes_copy``) to its module's reshard; returns how many moved."""
    moved = 0
    for op in _copy_outs(ops):
        suffix = op.module[len(COPY_OUT_RANGE):]  # " (layers.2)"; "" for the root
        module = suffix.strip()[1:-1] or "<root>"
        end = _reshard_index(ops, op.index, suffix, module)
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
