"""Autograd holds some storages past their last use in the trace (pure data).

* A backward node keeps its inputs until it returns: the engine moves the incoming gradient
  into the node and the node unpacks its saved tensors, and both are released only after the
  node's ``apply`` (``release_variables``), not after the op that last reads them. A
  ``MulBackward0`` computing both gradients holds its saved ``a`` while it makes ``grad * a``'s
  partner: with a 1.5 MiB SwiGLU activation this was 1.5 MiB of the FSDP2 full-AC gap.
* Non-reentrant activation checkpointing keeps the checkpointed call's inputs (the arguments
  its recompute needs) in the checkpoint frame, which every saved-tensor holder of the block
  references: they live until the block's backward has run, not until the recompute's last
  read of them (the block input, 0.5 MiB on the bench's Llama).

A node's ops are the run of top-level ops inside its ``<Name>Backward<N>`` (or
``AccumulateGrad``) range. A recompute runs inside the node that first unpacked a saved
tensor, and its ops directly in the block's body carry that node's range too: a node's own
ops are told apart by reading a gradient (a storage the backward made from the loss's).
"""
from __future__ import annotations

import re

from actors.trace.liveness import Liveness
from actors.trace.model import Op

_NODE_RANGE = re.compile(r"(Backward\d*|AccumulateGrad)$")
_MODULE_RANGE = re.compile(r"^## module:(.+) ##$")


def is_backward_node(module: str) -> bool:
    """Whether a range name is an autograd node's (``MmBackward0``, ``...::AccumulateGrad``)."""
    return bool(_NODE_RANGE.search(module))


def _gradient_ops(ops: list[Op]) -> list[bool]:
    """Per op: whether it is a backward node's own computation (inside a node range, reading a
    gradient or no tensor at all). Gradients start at the first node op's outputs and flow
    through every op that reads one."""
    grads: set[int] = set()
    own = [False] * len(ops)
    started = False
    for op in ops:
        node = is_backward_node(op.module)
        ins = [t.suid for t in op.input_tensors() if t.suid >= 0]
        reads_grad = any(s in grads for s in ins)
        if node and not started:
            started = reads_grad = True
        if started and (reads_grad or (node and not ins)):
            own[op.index] = node
            grads.update(t.suid for t in op.output_tensors() if t.suid >= 0)
    return own


def hold_node_inputs(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, each storage a backward node's own op reads last to the node's last
    op, when it existed before the node began; returns how many storages moved."""
    own = _gradient_ops(ops)
    moved = 0
    i = 0
    while i < len(ops):
        if not is_backward_node(ops[i].module):
            i += 1
            continue
        end = i
        while end + 1 < len(ops) and ops[end + 1].module == ops[i].module:
            end += 1
        node_ops = [op for op in ops[i:end + 1] if own[op.index]]
        if node_ops:
            begin = node_ops[0].index
            for op in node_ops:
                for t in op.input_tensors():
                    s = t.suid
                    if s >= 0 and live.storage_last[s] == op.index \
                            and live.storage_first[s] < begin:
                        moved += live.hold_until(s, end)
        i = end + 1
    return moved


def _block_of(modules: list[str]) -> str:
    """The checkpointed block: the longest dotted prefix shared by the recomputed modules."""
    parts = [m.split(".") for m in modules]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


def _recomputes(ops: list[Op], own: list[bool], backward_start: int) -> list[tuple[int, int]]:
    """``(first, last)`` op index of every recompute: backward ops inside module ranges, with
    the ops up to the next node op of the backward's own (a block body's ops carry no module)."""
    spans: list[list[int]] = []
    for op in ops[backward_start:]:
        if own[op.index]:
            if spans and spans[-1][1] < 0:
                spans[-1][1] = op.index - 1  # the recompute ends before the node's own ops
        elif _MODULE_RANGE.match(op.module):
            if not spans or spans[-1][1] >= 0:
                spans.append([op.index, -1])
    return [(a, b if b >= 0 else len(ops) - 1) for a, b in spans]


def _backward_end(ops: list[Op], own: list[bool], after: int, stop: int) -> int:
    """Where the block's backward ends: at the first op after ``after`` (and before ``stop``,
    the next recompute) in a range that is neither a node's nor a module's (FSDP2's
    post-backward reduce-scatter runs there, after the block's last node)."""
    for op in ops[after + 1:stop]:
        if op.module and not own[op.index] and not is_backward_node(op.module) \
                and not _MODULE_RANGE.match(op.module):
            return op.index
    return stop


def hold_checkpoint_inputs(ops: list[Op], live: Liveness) -> int:
    """Extend, in ``live``, the inputs of every recomputed (checkpointed) block to the block's
    last backward node op (see :func:`_backward_end`); returns how many storages moved.

    A recompute's inputs are the storages it reads last that existed before the block's
    forward began (the block: the modules the recompute runs, their common dotted prefix).
    """
    own = _gradient_ops(ops)
    node_ops = [op.index for op in ops if own[op.index]]
    if not node_ops:
        return 0
    spans = _recomputes(ops, own, node_ops[0])
    moved = 0
    for k, (first, last) in enumerate(spans):
        modules = [m.group(1) for op in ops[first:last + 1]
                   if (m := _MODULE_RANGE.match(op.module))]
        block = _block_of(modules)
        inside = (f"## module:{block} ##", f"## module:{block}.")
        forward_start = next((op.index for op in ops[:node_ops[0]]
                              if op.module.startswith(inside)), None)
        stop = _backward_end(ops, own, last, spans[k + 1][0] if k + 1 < len(spans) else len(ops))
        end = max((j for j in node_ops if last < j < stop), default=None)
        if not block or forward_start is None or end is None:
            continue
        for op in ops[first:last + 1]:
            for t in op.input_tensors():
                s = t.suid
                if (s >= 0 and live.storage_first[s] < forward_start
                        and live.storage_last[s] == op.index):
                    moved += live.hold_until(s, end)
    return moved
