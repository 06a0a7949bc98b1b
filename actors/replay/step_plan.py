"""Compile a trace's ops once into executable steps: resolved overloads and argument templates.

The op loop then only fills tensor slots from the registry and calls the overload, which
keeps the per-op host overhead close to calling the ops directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from operator import itemgetter

import torch
from torch._prims_common import dtype_to_type  # type promotion's category of a dtype

from actors.replay.memory.tensor_store import FLOAT_FILL
from actors.replay.ops import index_safety, resolve, standins, translate
from actors.trace.host_scalars import HOST_SCALAR
from actors.trace.model import Arg, Op, TensorArg

_TYPE_CONVERTERS = {
    "ScalarType": resolve.to_dtype,
    "Layout": resolve.to_layout,
    "MemoryFormat": resolve.to_memory_format,
}


@dataclass
class Step:
    """One entry of the op loop. ``kind``: 'compute', 'collective', 'skip', 'failed' or 'hook'
    (a callable an extension runs between ops; ``op`` is then None)."""

    op: Op | None
    kind: str
    reason: str = ""  # why skipped or failed
    # the overload's C++ callable (skips OpOverload.__call__'s frame); a collective: the
    # callable of the extension that replays it (ReplayExtension.runs); a hook: the hook
    fn: object = None
    template: list = None  # positional argument values, tensors left as None
    kwargs: dict = None  # constant keyword arguments (recorded values equal to defaults dropped)
    tensor_slots: tuple = ()  # (position, TensorArg) to fill from the registry
    list_slots: tuple = ()  # (position, tuple[TensorArg | None]) for Tensor[] / Tensor?[] args
    kw_tensor_slots: tuple = ()  # (name, TensorArg | tuple) tensors passed by keyword
    single_out: TensorArg | None = None  # the fast path: exactly one tensor output
    out_dtype: object = None  # torch dtype expected of single_out
    schema_args: tuple = ()  # the recorded schema's args (OpSchema.args)
    guards: tuple = ()  # (position, lo, hi): index inputs computed in-trace, clamped before use
    # Storage generations the op reads or writes (extension-owned ones left out) and their
    # accounted bytes: an upper bound of what the op can need, the loop's cheap memory guard.
    touch: tuple = ()
    touch_bytes: int = 0
    translated_from: str = ""  # the recorded op name when fn runs a device equivalent
    standin: str = ""  # why the outputs are stand-ins (shapes from the trace), not computed
    time_ns: int = 0  # time in this op over the measured iterations (replay.per_op_timing)
    at: int = -1  # a hook: the index of the op it runs next to
    # The op loop's fast path, set by `set_fast_path` for plain single-output ops:
    # (fn, getter, kwargs, out uid, out suid, out accounted bytes if the op makes the
    #  storage else 0, held-bytes limit); the call is fn(*getter(registry), **kwargs).
    fast: tuple | None = None


_LITERALS = {"None": None, "True": True, "False": False, "[]": []}


def _is_default(value, default: str | None) -> bool:
    """Whether a recorded value equals the schema default (then it need not be passed)."""
    if default is None:
        return False
    if default in _LITERALS:
        lit = _LITERALS[default]
    else:
        try:
            lit = float(default) if any(c in default for c in ".eE") else int(default)
        except ValueError:
            return False
    if isinstance(lit, bool) or isinstance(value, bool) or lit is None:
        return value is lit
    return type(value) in (int, float) and type(lit) in (int, float) and value == lit \
        or value == lit == []


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
    if op.collective is not None and not standins.stands_in_for_collective(op, device, mode):
        return Step(op, "collective") if mode != "compute" else Step(op, "skip", "out of scope")
    if mode == "comms":
        return Step(op, "skip", "out of scope")
    # An op that cannot run on this device runs as an equivalent (a GPU-only kernel on cpu or
    # meta) or, on meta, returns its recorded outputs when computing them needs values.
    resolved = translate.lookup(op, device) or standins.lookup(op, device) or \
        resolve.resolve_op(op.name, op.schema)
    if isinstance(resolved, resolve.Unresolved):
        return Step(op, "skip", resolved.reason)
    schema_args = resolved.schema.args
    if len(op.inputs) > len(schema_args):
        return Step(op, "skip", f"{len(op.inputs)} recorded args for {len(schema_args)} in schema")
    n = resolved.num_positional
    template, slots, list_slots, kwargs, kw_slots = [], [], [], {}, []
    for pos, value in enumerate(op.inputs):
        sarg = schema_args[pos]
        if type(value) is not TensorArg and value.kind == "object":
            if sarg.type.rstrip("?") != "Generator":
                return Step(op, "skip", f"takes an opaque script object ({sarg.type})")
            value = Arg("none", None)  # the default generator stands in for the recorded one
        if type(value) is Arg and value.kind == HOST_SCALAR:
            scalar = _host_scalar(op, value.value)
            if pos >= n:
                kwargs[sarg.name] = scalar
            else:
                template.append(scalar)
            continue
        is_tensor = type(value) is TensorArg or value.kind == "tensor_list"
        if pos >= n:  # keyword-only
            if is_tensor:
                kw_slots.append((sarg.name, value if type(value) is TensorArg else value.value))
            else:
                converted = _convert(value, sarg.type, device)
                if not _is_default(converted, sarg.default):
                    kwargs[sarg.name] = converted
            continue
        if type(value) is TensorArg and pos > 0 and _wrapped_number(op, value, sarg.type):
            # a number the loader could not tell (it landed on a freed 0-dim tensor's storage
            # of its dtype): pass a number, as the caller did (see _host_scalar)
            template.append(1.0)
        elif type(value) is TensorArg:
            template.append(None)
            slots.append((pos, value))
        elif value.kind == "tensor_list":
            template.append(None)
            list_slots.append((pos, value.value))
        else:
            template.append(_convert(value, sarg.type, device))
    outs = op.outputs
    single = outs[0] if len(outs) == 1 and type(outs[0]) is TensorArg else None
    return Step(op, "compute", fn=getattr(resolved.overload, "_op", resolved.overload),
                template=template, kwargs=kwargs or None, tensor_slots=tuple(slots),
                list_slots=tuple(list_slots), kw_tensor_slots=tuple(kw_slots),
                single_out=single, out_dtype=resolve.torch_dtype_or_none(single.dtype) if single else None,
                schema_args=tuple(schema_args), translated_from=resolved.translated_from,
                standin=resolved.standin)


def _host_scalar(op: Op, dtype_name: str) -> torch.Tensor:
    """A Python number the op was called with (actors/trace/host_scalars.py), as a 0-dim CPU
    tensor, which kernels on every device take. It gets the dtype of the op's result where
    both are of one kind (floats, integers): a wrapped number does not promote the result
    (DeepSpeed's ``loss * scale`` stays float32), a float64 tensor would."""
    dtype = resolve.torch_dtype_or_none(dtype_name)
    outs = op.outputs
    if dtype is not None and len(outs) == 1 and type(outs[0]) is TensorArg:
        out = resolve.torch_dtype_or_none(outs[0].dtype)
        if out is not None and dtype_to_type(out) is dtype_to_type(dtype):
            dtype = out
    dtype = dtype or torch.float64
    # the value a materialized tensor gets (0.0625), 1 for integers: never a zero divisor
    return torch.full((), FLOAT_FILL if dtype.is_floating_point or dtype.is_complex else 1,
                      dtype=dtype)


def _wrapped_number(op: Op, value: TensorArg, schema_type: str) -> bool:
    """A 0-dim float64 input next to 0-dim lower-precision floats whose op still returned a
    lower-precision float: only a wrapped Python number leaves the result unpromoted."""
    outs = op.outputs
    if not (value.shape == () and value.dtype == "float64" and schema_type == "Tensor"
            and len(outs) == 1 and type(outs[0]) is TensorArg
            and outs[0].dtype in ("float32", "float16", "bfloat16")):
        return False
    others = [t for t in op.input_tensors() if t is not value]
    return bool(others) and all(t.shape == () and t.dtype == outs[0].dtype for t in others)


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


def set_touch(steps: list[Step], storage_bytes: list[int], owned: set[int]) -> None:
    """Each op's distinct storages (minus extension-owned ones) and their accounted bytes."""
    for step in steps:
        if step.kind in ("compute", "collective"):
            op = step.op
            suids = {t.suid for t in op.input_tensors() + op.output_tensors() if t.suid >= 0}
            step.touch = tuple(sorted(suids - owned))
            step.touch_bytes = sum(storage_bytes[s] for s in step.touch)


def set_fast_path(steps: list[Step], liveness, guard: float, present: set[int],
                  gather, constant) -> None:
    """Flatten plain compute steps (tensor positionals, one tensor out, no guards) into the
    tuple the op loop unpacks, sparing it a dozen attribute lookups per op.

    An op's positional arguments are ``getter(registry)``. When its tensors are required
    (``Tensor``, not ``Tensor?``) and registered before the op runs (a persistent or
    extension-owned storage in ``present``, or a tensor an earlier op made or used in the same
    iteration), ``getter`` is an ``operator.itemgetter`` over the registry, where
    ``constant(value)`` has put the op's constant arguments too: one C call builds the whole
    argument tuple. A tensor a flush dropped then arrives as None, which a required argument
    refuses with an error the loop catches (it re-materializes and retries). Otherwise
    ``getter`` is ``gather(template, slots)``, which materializes what is missing.

    The output's accounted bytes are set only when the op makes a fresh storage: a view or
    in-place output lives on a storage its input already holds. ``limit`` is the bytes held
    above which the op might not fit the guard (flush threshold or capacity).
    """
    first, external = liveness.storage_first, liveness.storage_external
    seen: set[int] = set()  # uids registered earlier in an iteration
    for step in steps:
        if step.kind != "compute":
            continue
        single, slots = step.single_out, step.tensor_slots
        if single is not None and not (step.list_slots or step.kw_tensor_slots or step.guards):
            required = not any(step.schema_args[pos].type.endswith("?") for pos, _ in slots)
            if required and all(t.uid in seen or t.suid in present for _, t in slots):
                by_pos = {pos: t.uid for pos, t in slots}
                index = [by_pos[i] if i in by_pos else constant(v)
                         for i, v in enumerate(step.template)]
                # itemgetter of one index returns the item itself: a slice keeps a sequence
                getter = itemgetter(*index) if len(index) > 1 else \
                    itemgetter(slice(index[0], index[0] + 1) if index else slice(0, 0))
            else:
                getter = partial(gather, step.template, slots)
            # first used here, and as an output only (an in-place op on an input-first storage
            # writes a storage already held); an extension-owned one is its owner's to account
            fresh = first[single.suid] == step.op.index and not external[single.suid] \
                and single.suid not in present
            step.fast = (step.fn, getter, step.kwargs, single.uid, single.suid,
                         liveness.storage_bytes[single.suid] if fresh else 0,
                         guard - step.touch_bytes)
        seen.update(t.uid for t in step.op.input_tensors())
        seen.update(t.uid for t in step.op.output_tensors())
