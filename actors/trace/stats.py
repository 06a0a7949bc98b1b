"""Summary figures of one loaded trace, as plain JSON-ready data (what `tracefleet-inspect` shows).

Parameter-like storages. A trace does not say which tensors are parameters, so they are
inferred per storage generation (``suid``). One counts when it

1. exists before the trace starts: it is first seen as an op input (no op in the trace made it);
2. has a floating dtype;
3. is first used read-only (an op whose schema does not mark that argument as written: the
   forward pass reads the weights), and
4. is later updated: in place (``Tensor(a!)``) by an op other than a copy (the optimizer
   step), or by a copy (``copy_``, ``_foreach_copy_``) from a *master*: a floating storage
   that existed before the trace and is itself updated in place by a non-copy op, directly
   or through a dtype conversion (``_to_copy``, ``to``, ``clone``). That second case is mixed
   precision (bf16/fp16 weights refreshed from the fp32 masters the optimizer steps) and
   ZeRO's partitions refreshed from their fp32 copies. Other copies are not updates: DDP
   syncs buffers by copying from a broadcast buffer made in the trace, and weights are
   loaded by copies from tensors nothing updates.

Gradients (accumulated or zeroed first) and optimizer state (``exp_avg.lerp_``, momentum
``mul_``) fail 3, and so do the fp32 masters (the optimizer writes them first); activations
and inputs fail 1; buffers, frozen weights and a trace without an optimizer step fail 4.
Collectives are not uses here: a ``c10d::*`` schema does not mark the tensors it writes.
Parameters that share one flat buffer count as one storage. On the public traces this gives
exactly ResNet-50's 161 tensors (DDP, SGD) and GPT-2 large's 436 tensors / 774,030,080
elements (Adam); on the demo DDP GPT every one of its 536,064 parameters; on the demo
DeepSpeed ZeRO-3 traces the flat fp32 partition each rank holds (refreshed by ``copy_`` from
the optimizer's fp32 group after the step).
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

from actors.errors import ReplayError
from actors.trace.dtypes import itemsize_of
from actors.trace.liveness import compute_liveness
from actors.trace.model import Arg, TensorArg, Trace
from actors.trace.op_schema import parse_schema

_FLOAT_PREFIXES = ("float", "bfloat")
# Copies refresh a tensor from another: an update only when the source is a master.
_COPIES = ("aten::copy_", "aten::_foreach_copy_")
_CONVERSIONS = ("aten::_to_copy", "aten::to", "aten::clone")


def trace_stats(trace: Trace, top: int = 10) -> dict:
    """Figures of one trace: sizes, op histogram (``top`` names), collectives per group and
    kind, process groups, parameter-like storages and the liveness lower bound of memory."""
    live = compute_liveness(trace.ops, trace.num_storages)
    params = param_like_storages(trace, live.storage_external)
    names = Counter(op.name for op in trace.ops)
    return {
        "path": trace.path,
        "rank": trace.rank,
        "schema": trace.schema,
        "num_nodes": trace.num_nodes,
        "num_ops": len(trace.ops),
        "num_dropped_ops": trace.meta.get("num_dropped_ops", 0),
        "num_orphan_ops": trace.meta.get("num_orphan_ops", 0),
        "num_wrapper_ops": trace.meta.get("num_wrapper_ops", 0),
        "steps": [s.name for s in trace.steps],
        "num_op_names": len(names),
        "op_histogram": [{"name": n, "count": c} for n, c in names.most_common(top)],
        "collectives": collective_table(trace),
        "num_waits": sum(1 for op in trace.collectives if op.collective.kind == "wait"),
        "process_groups": [{"name": g.name, "desc": g.desc, "backend": g.backend,
                            "ranks": list(g.ranks), "group_size": g.group_size}
                           for g in trace.process_groups],
        "num_tensors": trace.num_tensors,
        "num_storages": trace.num_storages,
        "params": {"num_storages": len(params),
                   "bytes": sum(live.storage_bytes[s] for s in params)},
        "memory": {"lower_bound_bytes": live.lower_bound_bytes,
                   "external_bytes": live.external_bytes()},
    }


def collective_table(trace: Trace) -> list[dict]:
    """Calls per (process group, kind) with message bytes sent (in) and received (out).

    ``pg`` is None where the trace does not name the group (gloo ``c10d::*`` ops). Waits
    carry no message and are left out.
    """
    rows: dict[tuple, dict] = {}
    for op in trace.collectives:
        c = op.collective
        if c.kind == "wait":
            continue
        row = rows.get((c.pg_name, c.kind))
        if row is None:
            row = rows[(c.pg_name, c.kind)] = {"pg": c.pg_name, "kind": c.kind, "count": 0,
                                               "in_bytes": 0, "out_bytes": 0}
        size = itemsize_of(c.dtype)
        row["count"] += 1
        row["in_bytes"] += c.in_nelems * size
        row["out_bytes"] += c.out_nelems * size
    return sorted(rows.values(), key=lambda r: (r["pg"] is None, r["pg"] or "", r["kind"]))


def param_like_storages(trace: Trace, external: list[bool]) -> list[int]:
    """The suids that look like parameters (see the module docstring), in suid order."""
    # per suid: 0 unseen, 1 read so far, 2 read then written (a parameter), -1 ruled out
    state = [0] * trace.num_storages
    updated: set[int] = set()  # floating suids written in place by a non-copy op
    copies: list[tuple[int, int]] = []  # (destination suid, source suid) of every copy
    converted: dict[int, int] = {}  # output suid -> input suid of a dtype conversion
    for op in trace.ops:
        if op.collective is not None:
            continue
        written = _written_args(op.schema)
        is_copy = op.name in _COPIES
        if is_copy:
            copies.extend(_copy_pairs(op))
        elif op.name in _CONVERSIONS:
            _record_conversion(op, converted)
        for pos, arg in enumerate(op.inputs):
            writes = pos < len(written) and written[pos]
            for t in _tensors(arg):
                s = t.suid
                if s < 0:
                    continue
                if writes and not is_copy and _is_float(t):
                    updated.add(s)
                if state[s] < 0 or state[s] == 2:
                    continue
                if state[s] == 0:
                    state[s] = 1 if external[s] and not writes and _is_float(t) else -1
                elif writes and not is_copy:
                    state[s] = 2
    masters = {s for s in updated if external[s]}
    for dst, src in copies:
        for _ in range(4):  # a conversion chain is short; bounded against cycles
            if src in masters or src not in converted:
                break
            src = converted[src]
        if state[dst] == 1 and src in masters:
            state[dst] = 2
    return [s for s, v in enumerate(state) if v == 2]


def _is_float(t: TensorArg) -> bool:
    return (t.dtype or "").startswith(_FLOAT_PREFIXES)


def _copy_pairs(op) -> list[tuple[int, int]]:
    """(destination, source) suids of a copy op: ``copy_(self, src)`` or the pairwise lists of
    ``_foreach_copy_(self[], src[])``."""
    if len(op.inputs) < 2:
        return []
    dst, src = _tensors(op.inputs[0]), _tensors(op.inputs[1])
    return [(d.suid, s.suid) for d, s in zip(dst, src) if d.suid >= 0 and s.suid >= 0]


def _record_conversion(op, converted: dict[int, int]) -> None:
    ins, outs = op.input_tensors(), op.output_tensors()
    if ins and len(outs) == 1 and ins[0].suid >= 0 and outs[0].suid >= 0:
        converted[outs[0].suid] = ins[0].suid


def _tensors(arg):
    if type(arg) is TensorArg:
        return (arg,)
    if type(arg) is Arg and arg.kind == "tensor_list":
        return [t for t in arg.value if t is not None]
    return ()


@lru_cache(maxsize=8192)
def _written_args(schema: str) -> tuple[bool, ...]:
    """Per argument of ``schema``: does the op write it (``Tensor(a!)``)? () if unknown."""
    if not schema:
        return ()
    try:
        return tuple(a.is_write for a in parse_schema(schema).args)
    except ReplayError:
        return ()
