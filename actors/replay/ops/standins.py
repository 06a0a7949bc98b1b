"""Meta-device stand-ins for ops that need concrete values.

On ``meta`` a tensor has a shape but no data, so an op whose result is a value
(``aten::item``) or whose output shape depends on values (``nonzero``, ``masked_select``,
``unique``, a boolean-mask ``index``, ``repeat_interleave`` without ``output_size``) cannot
run. Its outputs are known from the trace: the replay returns the recorded scalar (or the
input's recorded ``tensor_range``, or 0) and meta tensors of the recorded shapes, so later ops
see what the original saw. The step is marked ``standin`` and counted apart.

Ops known to need values are stood in when the plan is compiled (`lookup`); any other op that
fails on meta for lack of values gets a stand-in when it raises (`fallback`). Other errors
keep failing with their reason.

Functional collectives (``_c10d_functional::*``: tensor and context parallel) make their
output inside the op, unlike c10d's, which write into a buffer an earlier op made. A meta dry
run (``replay.mode=compute``) replays no collective, so without a stand-in their outputs would
be held only from the first op that reads them: each call returns meta tensors of the recorded
shapes (a ``wait_tensor`` or an in-place call returns its input), held from the call as in the
original.
"""
from __future__ import annotations

import torch

from actors.replay.ops import resolve
from actors.replay.ops.recorded import Outputs, binding, schema_of
from actors.trace.collectives import FUNCTIONAL as FUNCTIONAL_COLLECTIVES, FUNCTIONAL_WAITS
from actors.trace.model import Arg, Op

# ops whose result needs the input's values: a scalar, or an output shape set by the data
VALUE_DEPENDENT = frozenset({
    "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal",
    "aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select",
    "aten::_unique", "aten::_unique2", "aten::unique_dim",
    "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount",
    "aten::_pack_padded_sequence",
})
# what the meta kernels raise when a result needs values (torch 2.13 wording)
_NEEDS_VALUES = (
    "cannot be called on meta tensors",  # Tensor.item(), and ops that call it
    "data-independent implementation does not exist",  # nonzero, boolean-mask indexing
    "without output_size",  # repeat_interleave
    "data-dependent",
)


def lookup(op: Op, device: torch.device) -> resolve.ResolvedOp | None:
    """A stand-in binding for a VALUE_DEPENDENT op or a functional collective on meta; None
    otherwise."""
    if device.type != "meta":
        return None
    if op.name in FUNCTIONAL_COLLECTIVES:
        return _collective_binding(op)
    if op.name not in VALUE_DEPENDENT:
        return None
    return _binding(op, f"{op.name} needs values: outputs from the trace")


def stands_in_for_collective(op: Op, device: torch.device, mode: str) -> bool:
    """Whether a meta dry run (compute mode) runs collective ``op`` as a stand-in."""
    return mode == "compute" and device.type == "meta" and op.name in FUNCTIONAL_COLLECTIVES


def _collective_binding(op: Op) -> resolve.ResolvedOp | None:
    schema = schema_of(op)
    if isinstance(schema, str):
        return None
    reason = "a collective on meta: outputs from the trace"
    if op.name.endswith("_") or op.name in FUNCTIONAL_WAITS:  # returns its input

        def aliasing(first, *args, **kwargs):
            return first
        return binding(schema, aliasing, standin=reason)
    return binding(schema, _returning_recorded(op), standin=reason)


def fallback(step, error: BaseException):
    """A callable returning the recorded outputs when ``step`` failed on meta because its
    result needs values (then the step is a stand-in); None for any other error."""
    message = str(error)
    if step.op is None or not any(text in message for text in _NEEDS_VALUES):
        return None
    return _returning_recorded(step.op)


def _binding(op: Op, reason: str) -> resolve.ResolvedOp | None:
    schema = schema_of(op)
    return None if isinstance(schema, str) else binding(schema, _returning_recorded(op),
                                                        standin=reason)


def _returning_recorded(op: Op):
    """A callable ignoring its arguments and returning what ``op`` returned in the trace."""
    if _returns_scalar(op):
        value = _recorded_scalar(op)

        def scalar_standin(*args, **kwargs):
            return value
        return scalar_standin
    outputs = Outputs(op, torch.device("meta"))

    def standin(*args, **kwargs):
        return outputs()
    return standin


_SCALAR_TYPES = frozenset({"Scalar", "int", "float", "bool", "SymInt", "SymFloat", "SymBool"})


def _returns_scalar(op: Op) -> bool:
    schema = schema_of(op)
    if isinstance(schema, str):
        return len(op.outputs) == 1 and type(op.outputs[0]) is Arg and \
            op.outputs[0].kind in ("int", "float", "bool")
    return len(schema.returns) == 1 and schema.returns[0].type in _SCALAR_TYPES


def _recorded_scalar(op: Op):
    """The scalar an op like ``item`` returned: as recorded, else the low end of its input's
    recorded range, else 0."""
    value = op.outputs[0].value if op.outputs and type(op.outputs[0]) is Arg else None
    if isinstance(value, (int, float, bool)):
        return value
    low = (op.tensor_ranges or {}).get(0)
    return low[0] if low else 0
