"""Parse a node's recorded ``inputs``/``outputs`` into typed `Arg` / `TensorArg` values."""
from __future__ import annotations

import math
from functools import lru_cache

import orjson

from actors.errors import TraceError
from actors.trace.dtypes import ET_TYPE_TO_DTYPE
from actors.trace.model import Arg, TensorArg

_SCALAR_KINDS = {"Int": "int", "Double": "float", "Bool": "bool", "String": "str", "None": "none",
                 "Device": "device", "Object": "object", "Layout": "int", "ScalarType": "int",
                 "MemoryFormat": "int", "Scalar": "float", "SymInt": "int", "Generator": "object"}
_LIST_KINDS = {"Int": "int_list", "SymInt": "int_list", "Double": "float_list",
               "Bool": "bool_list"}
_SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "Infinity": math.inf,
                   "-Infinity": -math.inf, "NaN": math.nan}


@lru_cache(maxsize=8192)
def classify(type_str: str) -> tuple[str, str | None]:
    """Map an ET type string to (kind, dtype name for tensors)."""
    if type_str.startswith("Tensor"):
        inner = type_str[7:-1] if type_str.startswith("Tensor(") else ""
        return "tensor", ET_TYPE_TO_DTYPE.get(inner)
    if type_str.startswith("GenericList["):
        inner = type_str[12:-1]
        if not inner:
            return "list", None
        if "Tensor" in inner:
            return "tensor_list", None
        first = inner.split(",", 1)[0]
        return _LIST_KINDS.get(first, "list"), None
    if type_str.startswith("Tuple["):
        return "tuple", None
    if type_str.startswith("Optional["):
        return classify(type_str[9:-1])
    return _SCALAR_KINDS.get(type_str, "unknown"), None


def _inner_dtypes(type_str: str) -> list:
    """dtype names of each ``Tensor(x)`` inside a (possibly nested) list type, in order."""
    out, i = [], 0
    while True:
        i = type_str.find("Tensor(", i)
        if i < 0:
            return out
        j = type_str.index(")", i)
        out.append(ET_TYPE_TO_DTYPE.get(type_str[i + 7:j]))
        i = j


class ArgParser:
    """Turns one side of a node into a tuple of args; reports malformed values precisely."""

    def __init__(self, path):
        self.path = path

    def parse_side(self, side, node_id) -> tuple:
        values, shapes, types, strides = side
        if not (type(values) is list and type(shapes) is list and type(types) is list):
            raise TraceError(self.path, "an input or output side's values, shapes and types must "
                                        f"be lists (got {_kinds(values, shapes, types)})", node_id)
        if not (len(values) == len(types) == len(shapes)):
            raise TraceError(self.path, f"values/shapes/types have different lengths "
                                        f"({len(values)}/{len(shapes)}/{len(types)})", node_id)
        if type(strides) is not list:
            strides = None
        out = []
        for i, (value, type_str) in enumerate(zip(values, types)):
            if type(type_str) is not str:
                raise TraceError(self.path, f"type #{i} is {preview(type_str, 40)}; expected a type "
                                            "string such as 'Tensor(float)' or 'Int'", node_id)
            kind, dtype = classify(type_str)
            stride = strides[i] if strides is not None and i < len(strides) else None
            if kind == "tensor":
                out.append(self._tensor(value, shapes[i], stride, dtype, node_id))
            elif kind == "tensor_list":
                out.append(Arg("tensor_list", self._tensor_list(value, shapes[i], stride, type_str,
                                                                node_id), type_str))
            elif kind == "float":
                out.append(Arg(kind, _SPECIAL_FLOATS.get(value, value) if isinstance(value, str)
                               else value, type_str))
            elif kind == "float_list":
                out.append(Arg(kind, [_SPECIAL_FLOATS.get(v, v) if isinstance(v, str) else v
                                      for v in value], type_str))
            elif kind == "none" or value == "<None>":
                out.append(Arg("none", None, type_str))
            else:
                out.append(Arg(kind, value, type_str))
        return tuple(out)

    def _tensor(self, value, shape, stride, dtype, node_id):
        if value == "<None>" or value is None:
            return Arg("none", None, "Tensor")
        if not isinstance(value, list) or len(value) != 6:
            raise TraceError(self.path, f"tensor value {preview(value)} must have 6 entries "
                                        "[tensor_id, storage_id, offset, numel, itemsize, device]",
                             node_id)
        tensor_id, storage_id, offset, numel, itemsize, device = value
        if storage_id == 0 and device == "" and numel == 0:
            return Arg("none", None, "Tensor")  # an undefined tensor
        if not (type(tensor_id) is int and type(storage_id) is int and type(offset) is int
                and type(numel) is int and type(itemsize) is int and type(device) is str
                and min(tensor_id, storage_id, offset, numel) >= 0 and itemsize >= 1):
            raise TraceError(self.path, f"tensor value {preview(value, 80)} must be [tensor_id, "
                                        "storage_id, offset, numel, itemsize, device]: four "
                                        "integers >= 0, an item size >= 1 and a device string",
                             node_id)
        sizes = tuple(shape) if type(shape) is list else None
        if sizes is None or not _sizes(sizes):
            raise TraceError(self.path, f"tensor shape {preview(shape)} must be a list of sizes "
                                        ">= 0", node_id)
        if dtype is None:
            dtype = _dtype_from_itemsize(itemsize)
        return TensorArg(tensor_id, storage_id, offset, numel, itemsize, device, sizes,
                         tuple(stride) if type(stride) is list and len(stride) == len(sizes) and all(
                             type(s) is int for s in stride) else None, dtype)

    def _tensor_list(self, value, shapes, strides, type_str, node_id):
        """Flatten a (possibly nested) list of tensor tuples, keeping shapes/strides aligned."""
        dtypes = _inner_dtypes(type_str)
        out = []
        if isinstance(value, list):
            for j, item in enumerate(value):
                self._walk(item, shapes[j] if isinstance(shapes, list) and j < len(shapes) else [],
                           strides[j] if isinstance(strides, list) and j < len(strides) else None,
                           1, dtypes, out, node_id)
        return tuple(out)

    def _walk(self, v, s, st, depth, dtypes, out, node_id) -> None:
        """Append the tensors of list item ``v`` to ``out`` (a method, not a recursive closure:
        that is a reference cycle per list, left for the cyclic GC the loader pauses)."""
        if isinstance(v, list) and v and isinstance(v[0], list):
            if depth > _MAX_LIST_DEPTH:
                raise TraceError(self.path, f"a tensor list nests deeper than {_MAX_LIST_DEPTH} "
                                            "levels; expected lists of tensor values", node_id)
            for j, item in enumerate(v):
                self._walk(item, s[j] if isinstance(s, list) and j < len(s) else [],
                           st[j] if isinstance(st, list) and j < len(st) else None, depth + 1,
                           dtypes, out, node_id)
        elif v == "<None>" or v is None:
            out.append(None)  # keeps positions (e.g. aten::index's Tensor?[] indices)
        elif v == []:
            return
        else:
            dtype = dtypes[min(len(out), len(dtypes) - 1)] if dtypes else None
            t = self._tensor(v, s, st, dtype, node_id)
            out.append(t if type(t) is TensorArg else None)


_BY_ITEMSIZE = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}
_MAX_LIST_DEPTH = 8  # real traces nest tensor lists two deep (a list of lists of tensors)


def _sizes(shape: tuple) -> bool:
    """A tuple of ints >= 0 (cached: traces repeat a few shapes many times)."""
    try:
        return _sizes_cached(shape)
    except TypeError:  # unhashable: a list inside
        return False


@lru_cache(maxsize=1 << 16)
def _sizes_cached(shape: tuple) -> bool:
    return all(type(d) is int and d >= 0 for d in shape)


def preview(value, limit: int = 60) -> str:
    """A JSON value as the file shows it, cut to ``limit`` characters, for messages (str() of
    a list nested deeper than Python's recursion limit raises)."""
    try:
        text = orjson.dumps(value).decode()
    except TypeError:  # orjson writes 254 levels at most
        text = f"<{type(value).__name__} nested too deep to show>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _kinds(*values) -> str:
    return "/".join(type(v).__name__ for v in values)


def _dtype_from_itemsize(itemsize) -> str:
    """Schemas before 1.0.2 may lack the element type: fall back on the element size."""
    return _BY_ITEMSIZE.get(itemsize, "uint8")
