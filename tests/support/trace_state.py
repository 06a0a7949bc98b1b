"""A comparable picture of a loaded `Trace`: its classes have slots, not equality."""
from __future__ import annotations

import dataclasses


def trace_state(value):
    """``value`` (a Trace, an Op, ...) as nested plain data: every slot and field, containers
    told apart by type (a tuple read back as a list differs)."""
    if dataclasses.is_dataclass(value):
        return (type(value).__name__,
                {f.name: trace_state(getattr(value, f.name)) for f in dataclasses.fields(value)})
    slots = [s for cls in type(value).__mro__ for s in getattr(cls, "__slots__", ())]
    if slots:
        return (type(value).__name__, {s: trace_state(getattr(value, s, None)) for s in slots})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [trace_state(v) for v in value])
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, sorted(map(repr, value)))
    if isinstance(value, dict):
        return ("dict", [(repr(k), trace_state(v)) for k, v in value.items()])
    return (type(value).__name__, value)
