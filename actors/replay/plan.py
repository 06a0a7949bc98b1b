"""Compile a trace's ops once into executable steps: resolved overloads and argument templates.

The op loop then only fills tensor slots from the registry and calls the overload, which
keeps the per-op host overhead close to calling the ops directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.replay import index_safety, resolve
from actors.trace.model import Arg, Op, TensorArg

_TYPE_CONVERTERS = {
    "ScalarType": resolve.to_dtype,
    "Layout": resolve.to_layout,
    "MemoryFormat": resolve.to_memory_format,
}


@dataclass
class Step:
    """One op ready to run. ``kind`` is 'compute', 'collective' or 'skip'."""

    op: Op
    kind: str
    reason: str = ""  # why skipped
    fn: object = None  # the torch OpOverload
    template: list = None  # argument values with tensors left as None
    tensor_slots: tuple = ()  # (position, TensorArg) to fill from the registry
    list_slots: tuple = ()  # (position, tuple[TensorArg | None]) for Tensor[] / Tensor?[] args
    num_positional: int = 0
    kwarg_names: tuple = ()
    schema_args: tuple = ()  # the recorded schema's args (OpSchema.args)
    new_bytes: int = 0  # bytes of storages first used by this op (the OOM check's request)
    guards: tuple = ()  # (position, lo, hi): index inputs computed in-trace, clamped before use


def _convert(value_arg: Arg, schema_type: str, device: torch.device):
    kind = value_arg.kind
    if kind == "none":
        return None
    if kind == "device":
        return device  # device remapping: whatever the trace recorded becomes the rank's device
    base = schema_type.rstrip("?")
    conv = _TYPE_CONVERTERS.get(base)
    if conv is not None and isinstance(value_arg.value, int):
        return conv(value_arg.value)
    if base == "Device":
        return device
    if base == "Generator":
        return None
    if kind == "tuple" or kind in ("int_list", "float_list", "bool_list", "list"):
        return list(value_arg.value)
    return value_arg.value


def compile_step(op: Op, device: torch.device, mode: str) -> Step:
    """Resolve one op and build its argument template."""
    if op.collective is not None:
        return Step(op, "collective") if mode != "compute" else Step(op, "skip", "out of scope")
    if mode == "comms":
        return Step(op, "skip", "out of scope")
    resolved = resolve.resolve_op(op.name, op.schema)
    if isinstance(resolved, resolve.Unresolved):
        return Step(op, "skip", resolved.reason)
    schema_args = resolved.schema.args
    if len(op.inputs) > len(schema_args):
        return Step(op, "skip", f"{len(op.inputs)} recorded args for {len(schema_args)} in schema")
    template, slots, list_slots = [], [], []
    for pos, value in enumerate(op.inputs):
        if type(value) is TensorArg:
            template.append(None)
            slots.append((pos, value))
        elif value.kind == "tensor_list":
            template.append(None)
            list_slots.append((pos, value.value))
        elif value.kind == "object":
            return Step(op, "skip", "takes an opaque script object")
        else:
            template.append(_convert(value, schema_args[pos].type, device))
    return Step(op, "compute", fn=resolved.overload, template=template, tensor_slots=tuple(slots),
                list_slots=tuple(list_slots), num_positional=resolved.num_positional,
                kwarg_names=tuple(resolved.kwarg_names), schema_args=tuple(schema_args))


def index_ranges(steps: list[Step]) -> dict[int, tuple[int, int, bool]]:
    """Per integer storage generation: (lo, hi, monotonic) every index op reading it accepts."""
    ranges: dict[int, tuple[int, int, bool]] = {}

    def narrow(suid, bounds, monotonic):
        old = ranges.get(suid)
        if old is not None:
            bounds = (max(old[0], bounds[0]), min(old[1], bounds[1]))
            monotonic = monotonic or old[2]
        # conflicting consumers: the lower bound is the one value they all accept
        ranges[suid] = (bounds[0], max(bounds[0], bounds[1]), monotonic)

    for step in steps:
        if step.kind != "compute":
            continue
        op = step.op
        shapes = [a.shape if type(a) is TensorArg else None for a in op.inputs]
        values = [None if type(a) is TensorArg else a.value for a in op.inputs]
        out_shapes = [a.shape if type(a) is TensorArg else None for a in op.outputs]
        recorded = op.tensor_ranges or {}
        for pos, t in step.tensor_slots:
            if t.dtype in _INT_DTYPES:
                bounds = index_safety.safe_int_bounds(op.name, step.schema_args, pos, shapes,
                                                      recorded.get(pos), values,
                                                      output_shapes=out_shapes)
                if bounds is not None:
                    narrow(t.suid, bounds,
                           index_safety.is_monotonic_input(op.name, step.schema_args, pos))
        for pos, tensors in step.list_slots:  # e.g. aten::index's Tensor?[] indices
            for j, t in enumerate(tensors):
                if t is not None and t.dtype in _INT_DTYPES:
                    bounds = index_safety.safe_int_bounds(op.name, step.schema_args, pos, shapes,
                                                          None, values, element=j,
                                                          output_shapes=out_shapes)
                    if bounds is not None:
                        narrow(t.suid, bounds, False)
    return ranges


_INT_DTYPES = {"int64", "int32", "int16", "int8", "uint8"}


def add_guards(steps: list[Step], ranges: dict, external: list[bool]) -> None:
    """Index inputs the replay computes itself (e.g. offsets from a cumsum over synthetic
    lengths) are not filled by us, so clamp them into bounds before the op reads them."""
    for step in steps:
        if step.kind == "compute":
            step.guards = tuple((pos, *ranges[t.suid][:2]) for pos, t in step.tensor_slots
                                if t.suid in ranges and not external[t.suid])
