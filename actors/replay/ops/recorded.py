"""An op's recorded values, for code that runs something other than the recorded op.

Device translations (`translate`) and meta stand-ins (`standins`) must return exactly what the
recorded op returned: one entry per recorded output, tensors of the recorded shapes and dtypes.
`Outputs` builds that tuple from whatever was computed plus the trace for the rest.
"""
from __future__ import annotations

import torch

from actors.errors import ReplayError
from actors.replay.ops import resolve
from actors.trace.model import Arg, Op, TensorArg
from actors.trace.op_schema import OpSchema, parse_schema


def schema_of(op: Op) -> OpSchema | str:
    """The recorded schema (the live one for traces that recorded none), or why there is none."""
    if op.schema:
        try:
            return parse_schema(op.schema)
        except ReplayError as e:
            return str(e)
    live = resolve.resolve_op(op.name, "")
    return live.schema if isinstance(live, resolve.ResolvedOp) else "no op_schema recorded"


def binding(schema: OpSchema, fn, translated_from: str = "", standin: str = ""):
    """A ResolvedOp calling ``fn`` with the recorded arguments split like ``schema``."""
    kwarg_names = tuple(a.name for a in schema.args if a.kwarg_only)
    return resolve.ResolvedOp(fn, schema, len(schema.args) - len(kwarg_names), kwarg_names,
                              translated_from=translated_from, standin=standin)


def input_arg(op: Op, schema: OpSchema, name: str) -> TensorArg | Arg | None:
    """The recorded value of the schema argument ``name`` (None when the trace omits it)."""
    for pos, arg in enumerate(schema.args):
        if arg.name == name:
            return op.inputs[pos] if pos < len(op.inputs) else None
    return None


def recorded_value(arg: TensorArg | Arg | None):
    """A recorded non-tensor value (None for a missing or undefined argument)."""
    return None if arg is None or type(arg) is TensorArg else arg.value


def standin_tensor(arg: TensorArg, device: torch.device) -> torch.Tensor:
    """A zero tensor of the recorded shape and dtype: an output nothing here computes (cudnn's
    reserve space, philox seeds, a value-dependent result on meta). Zeros are a safe index."""
    return torch.zeros(arg.shape, dtype=resolve.torch_dtype(arg.dtype), device=device)


def fit(x: torch.Tensor, arg: TensorArg) -> torch.Tensor:
    """``x`` in the recorded output's shape when the equivalent lays the same values out
    differently: a reshape when the sizes agree (cudnn's (B, H, L, 1) logsumexp), else the
    overlap copied into zeros (the efficient kernel pads its logsumexp to 32 rows)."""
    if x.shape == arg.shape:
        return x
    if x.numel() == arg.numel:
        return x.reshape(arg.shape)
    out = x.new_zeros(arg.shape)
    if x.dim() != out.dim():
        return out
    region = tuple(slice(0, min(a, b)) for a, b in zip(x.shape, arg.shape))
    out[region] = x[region]
    return out


class Outputs:
    """Assembles an op's return value: computed entries where given, the rest from the trace
    (stand-in tensors of the recorded shape, recorded scalars, None for undefined tensors)."""

    def __init__(self, op: Op, device: torch.device):
        self.recorded = op.outputs
        self.device = device

    def __call__(self, computed: dict[int, object] | None = None):
        """The op's return value: a single value for one output, else a tuple."""
        computed = computed or {}
        values = tuple(self._entry(i, arg, computed) for i, arg in enumerate(self.recorded))
        if len(values) == 1:
            return values[0]
        return values if values else None

    def _entry(self, i: int, arg, computed: dict):
        if type(arg) is TensorArg:
            return computed[i] if i in computed else standin_tensor(arg, self.device)
        if arg.kind == "tensor_list":
            return [None if t is None else standin_tensor(t, self.device) for t in arg.value]
        return None if arg.kind == "none" else arg.value
