"""Resolve a trace op to its ``torch.ops`` overload; convert recorded enum codes to torch values.

``resolve_op(name, schema)`` returns a :class:`ResolvedOp` or an :class:`Unresolved` whose
``kind`` says why it is not replayed here: ``COLLECTIVE`` (the collective replay owns it),
``SKIPPED`` (replaying it alone is meaningless or unsafe) or ``UNRESOLVED`` (this torch has no
matching overload). Lookups are ``getattr`` chains on ``torch.ops``; nothing is evaluated.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache

import torch

from actors.errors import ReplayError
from actors.trace.op_schema import OpSchema, parse_schema
from actors.trace.dtypes import dtype_name

COLLECTIVE = "collective"
SKIPPED = "skip"
UNRESOLVED = "unresolved"

# Collectives: their data movement needs the peers, so the collective replay handles them.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd",
                                    "c10d_functional", "_dtensor", "symm_mem"})
_COLLECTIVE_PREFIXES = ("record_param_comms", "nccl:", "gloo:", "mpi:", "ucc:", "xccl:")
# Not work of their own: profiler bookkeeping, and autograd ranges whose children are the ops.
# (Ops taking a Generator as state, such as dropout or random_, replay fine.)
_SKIP_NAMESPACES = {
    "profiler": "profiler bookkeeping (record_function enter/exit), not work",
    "autograd": "autograd engine range; its child ops carry the work",
}
_SKIP_OPS = {
    # Data-dependent asserts: they fail on the synthetic data the replay feeds them.
    "aten::_assert_async": "data-dependent assert",
    "aten::_assert_scalar": "data-dependent assert",
    "aten::_functional_assert_async": "data-dependent assert",
    "aten::_functional_assert_scalar": "data-dependent assert",
    # Needs the recorded CUDA stream object, which a trace cannot carry.
    "aten::record_stream": "needs the recorded stream object",
}
# Argument types that a trace records only as an opaque placeholder.
_OPAQUE_TYPES = frozenset({"Storage", "Stream", "Capsule", "Any", "AnyClassType"})


@dataclass(frozen=True, slots=True)
class Unresolved:
    """Why an op is not replayed by the op loop; ``kind`` is COLLECTIVE, SKIPPED or UNRESOLVED."""

    name: str
    kind: str
    reason: str


@dataclass(frozen=True, slots=True)
class ResolvedOp:
    """A callable overload plus how the trace's positional value list maps onto its call."""

    overload: object  # torch._ops.OpOverload, or a callable taking the recorded arguments
    schema: OpSchema  # as recorded in the trace
    num_positional: int  # leading recorded values passed positionally
    kwarg_names: tuple[str, ...]  # names of the recorded values after those, in order
    translated_from: str = ""  # the recorded op's name when ``overload`` runs an equivalent
    standin: str = ""  # why ``overload`` returns stand-ins from the trace instead of computing

    def split_args(self, values) -> tuple[tuple, dict]:
        """Split recorded values (all schema args in order, trailing ones may be missing)."""
        if len(values) > self.num_positional + len(self.kwarg_names):
            raise ReplayError(f"{self.overload}: {len(values)} recorded values for "
                              f"{len(self.schema.args)} schema arguments")
        k = self.num_positional
        return tuple(values[:k]), dict(zip(self.kwarg_names, values[k:]))


def skip_reason(name: str, schema: str = "") -> Unresolved | None:
    """The COLLECTIVE/SKIPPED verdict for an op by name alone; None if it may be replayed."""
    qualified = schema[:schema.find("(")].partition(".")[0] if "(" in schema else name
    namespace = qualified.partition("::")[0] if "::" in qualified else ""
    if name.startswith(_COLLECTIVE_PREFIXES) or namespace in _COLLECTIVE_NAMESPACES:
        return Unresolved(name, COLLECTIVE, f"{qualified} is a collective")
    if namespace in _SKIP_NAMESPACES:
        return Unresolved(name, SKIPPED, _SKIP_NAMESPACES[namespace])
    if qualified in _SKIP_OPS:
        return Unresolved(name, SKIPPED, f"{qualified}: {_SKIP_OPS[qualified]}")
    return None


@lru_cache(maxsize=8192)
def resolve_op(name: str, schema: str) -> ResolvedOp | Unresolved:
    """Resolve a trace op (node name and op_schema string) to its torch overload."""
    skipped = skip_reason(name, schema)
    if skipped is not None:
        return skipped
    if not schema:
        namespace, _, op = name.partition("::")
        if not (namespace.isidentifier() and op.isidentifier()):
            return Unresolved(name, SKIPPED, "not an operator (a record_function range)")
        return _resolve_unschema(namespace, op, name)
    try:
        parsed = parse_schema(schema)
    except ReplayError as e:
        return Unresolved(name, UNRESOLVED, str(e))
    for arg in parsed.args:
        if (arg.type in _OPAQUE_TYPES or arg.type.startswith("__torch__.")) and \
                not arg.type.endswith("?"):
            return Unresolved(name, SKIPPED, f"argument {arg.name!r} of type {arg.type} "
                                             "cannot be rebuilt from a trace")
    overload, why = _lookup(parsed.namespace, parsed.name, parsed.overload)
    if overload is None:
        return Unresolved(name, UNRESOLVED, why)
    return _bind(name, parsed, overload)


def _resolve_unschema(namespace: str, op: str, name: str) -> ResolvedOp | Unresolved:
    """Old traces may lack op_schema: accept the op only when one overload is not an out=
    variant (a trace records those by their own schema)."""
    packet, why = _lookup(namespace, op, None)
    if packet is None:
        return Unresolved(name, UNRESOLVED, why)
    names = [n for n in packet.overloads() if n != "out" and not n.endswith("_out")]
    if len(names) != 1:
        return Unresolved(name, UNRESOLVED, f"no op_schema recorded and {name} has "
                                            f"{len(names)} candidate overloads")
    overload = getattr(packet, names[0])
    return _bind(name, parse_schema(str(overload._schema)), overload)


# Op namespaces torch itself defines in Python modules that a replaying process may not have
# imported (a trace of FSDP2 records fsdp::all_gather_copy_in, fsdp::split_with_sizes_copy,
# fsdp::chunk_cat): imported on the first miss. tracefleet_kernel:: ops stand for a GPU's
# generated kernel in a GPU target's capture (actors/trace/kernel_ops.py).
_unimported_op_libraries = {"fsdp": "torch.distributed.fsdp",
                            "tracefleet_kernel": "actors.trace.kernel_ops"}


def _lookup(namespace: str, op: str, overload: str | None):
    """(object, "") or (None, reason). ``overload`` None returns the packet."""
    if not namespace:
        return None, f"{op}: no namespace in the op name"
    if namespace in _unimported_op_libraries:  # once per process: importing again is a no-op
        importlib.import_module(_unimported_op_libraries.pop(namespace))
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        if not _namespace_known(namespace):
            return None, (f"unknown op namespace {namespace!r} (load the library that "
                          "registers it)")
        return None, f"{namespace}::{op} is not registered in this torch"
    if overload is None:
        return packet, ""
    try:
        return getattr(packet, overload or "default"), ""
    except AttributeError:
        return None, (f"{namespace}::{op} has no overload {overload or 'default'!r} "
                      f"(available: {', '.join(packet.overloads())})")


def _namespace_known(namespace: str) -> bool:
    prefix = namespace + "::"
    return any(n.startswith(prefix) for n in torch._C._dispatch_get_all_op_names())


def _bind(name: str, parsed: OpSchema, overload) -> ResolvedOp | Unresolved:
    """Check the recorded schema against the live one and build the value split.

    Schemas drift across torch versions; the recorded values still bind when the recorded
    positional args are a prefix of the live positional args, every recorded kwarg is a
    live kwarg, and every live arg the trace lacks has a default.
    """
    live = overload._schema.arguments
    live_by_name = {a.name: a for a in live}
    live_positional = [a.name for a in live if not a.kwarg_only]
    names = [a.name for a in parsed.args]
    num_positional = sum(1 for n in names if n in live_positional)
    missing = [n for n in names if n not in live_by_name]
    absent = [a.name for a in live if a.name not in names and not a.has_default_value()]
    if parsed.is_vararg or missing or absent or \
            names[:num_positional] != live_positional[:num_positional] or \
            any(not live_by_name[n].kwarg_only for n in names[num_positional:]):
        return Unresolved(name, UNRESOLVED,
                          f"recorded schema has {len(names)} args {names}, this torch's "
                          f"{overload} has {len(live)}: {overload._schema}")
    return ResolvedOp(overload, parsed, num_positional, tuple(names[num_positional:]))


def torch_dtype_or_none(name: str | None) -> torch.dtype | None:
    """The torch.dtype for a dtype name such as "float32"; None if missing or unknown."""
    value = getattr(torch, name, None) if name else None
    return value if isinstance(value, torch.dtype) else None


def torch_dtype(name: str) -> torch.dtype:
    """The torch.dtype for a dtype name such as "float32"."""
    dtype = torch_dtype_or_none(name)
    if dtype is None:
        raise ReplayError(f"dtype {name!r} is not available in torch {torch.__version__}")
    return dtype


def to_dtype(value: int | str | None) -> torch.dtype | None:
    """A recorded dtype (ScalarType code such as 6, or any name spelling) as a torch.dtype."""
    if value is None:
        return None
    name = dtype_name(value)
    if name is None:
        raise ReplayError(f"unknown dtype {value!r} recorded in the trace")
    return torch_dtype(name)


# c10::Layout and c10::MemoryFormat enumerations, in code order.
_LAYOUTS = (torch.strided, torch.sparse_coo, torch.sparse_csr, torch._mkldnn,
            torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc, torch.jagged)
_MEMORY_FORMATS = (torch.contiguous_format, torch.preserve_format, torch.channels_last,
                   torch.channels_last_3d)


def to_layout(code: int | None) -> torch.layout | None:
    """A recorded Layout code (0 = strided) as a torch.layout."""
    return None if code is None else _enum(_LAYOUTS, code, "layout")


def to_memory_format(code: int | None) -> torch.memory_format | None:
    """A recorded MemoryFormat code (0 = contiguous, 2 = channels_last) as a torch.memory_format."""
    return None if code is None else _enum(_MEMORY_FORMATS, code, "memory format")


def _enum(table, code, what):
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < len(table):
        raise ReplayError(f"unknown {what} code {code!r} recorded in the trace")
    return table[code]


def to_device(recorded, replay_device: str | torch.device) -> torch.device:
    """Remap any recorded device (``"cuda:1"``, ``"cpu"``, None) to the rank's replay device.

    Every tensor of a rank lives on one device in the replay, so the recorded device only
    tells that an argument is a device; its value is deliberately ignored.
    """
    return torch.device(replay_device)
