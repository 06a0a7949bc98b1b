"""Schema versions and the per-version node layout of Execution Trace JSON.

1.0.1 keeps a node's fields flat (``parent``, ``inputs``, ``input_shapes``, ...); from 1.0.2
on, inputs/outputs are nested ``{values, shapes, types[, strides]}`` and the scalar fields
move into ``attrs``. `NodeView` hides the difference from the loader.
"""
from __future__ import annotations

import re

from actors.errors import TraceError

MIN_VERSION = (1, 0, 1)
MAX_VERSION = (1, 1)  # any 1.1.x

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def parse_version(path, schema) -> tuple[int, int, int]:
    """Return the numeric version of a schema string or raise TraceError if unsupported."""
    m = _VERSION.match(schema) if isinstance(schema, str) else None
    if m is None:
        raise TraceError(path, f"missing or malformed 'schema' field {schema!r}; expected e.g. "
                               "'1.1.1-chakra.0.0.4'")
    version = tuple(int(x) for x in m.groups())
    if version < MIN_VERSION or version[:2] > MAX_VERSION:
        raise TraceError(path, f"unsupported schema {schema!r}; tracefleet reads 1.0.1 through 1.1.x")
    return version


class NodeView:
    """Uniform read access to one raw node dict, whichever the schema."""

    __slots__ = ("raw", "flat")

    def __init__(self, raw: dict, flat: bool):
        self.raw = raw
        self.flat = flat

    def parent(self) -> int:
        return self.raw["parent"] if self.flat else self.raw["ctrl_deps"]

    def side(self, which: str):
        """(values, shapes, types, strides|None) of ``inputs`` or ``outputs``."""
        raw = self.raw
        if self.flat:
            prefix = "input" if which == "inputs" else "output"
            return raw[which], raw[f"{prefix}_shapes"], raw[f"{prefix}_types"], None
        side = raw[which]
        return side["values"], side["shapes"], side["types"], side.get("strides")

    def attrs(self) -> dict:
        if self.flat:
            return self.raw
        return {a["name"]: a["value"] for a in self.raw.get("attrs", ())}


class OpSchemaReader:
    """A node's ``op_schema`` ('' when absent), read without building its attrs dict.

    Nodes of one trace list their attrs in one order, so the position found last is tried first.
    """

    __slots__ = ("flat", "pos")

    def __init__(self, flat: bool):
        self.flat = flat
        self.pos = 0

    def __call__(self, raw: dict) -> str:
        """The op schema; TypeError when attrs are not a list of objects or it is no string."""
        if self.flat:
            return _text(raw.get("op_schema"))
        attrs = raw.get("attrs", ())
        pos = self.pos
        if pos < len(attrs) and attrs[pos]["name"] == "op_schema":
            return _text(attrs[pos]["value"])
        for pos, a in enumerate(attrs):
            if a["name"] == "op_schema":
                self.pos = pos
                return _text(a["value"])
        return ""


def _text(value) -> str:
    if value is None or type(value) is str:
        return value or ""
    raise TypeError("op_schema is not a string")
