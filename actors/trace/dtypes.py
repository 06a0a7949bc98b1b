"""Dtype names as an Execution Trace spells them, mapped to torch dtype *names* (no torch import).

The trace loader must stay torch-free, so everything here is plain data keyed by the names
``torch.<name>`` carries (``"float32"``, ``"int64"``, ...); ``actors.replay.ops.resolve`` turns a
name into a ``torch.dtype``. Three spellings occur in traces:

* ``Tensor(<c++ type>)`` in ``inputs.types``: the demangled C++ element type, which depends
  on the compiler that built torch (GCC writes ``long int``, clang ``long``);
* an ``int`` ScalarType code for ``ScalarType`` arguments (``dtype=6`` is float32);
* the c10 ScalarType name (``"Float"``) in the ``dtype`` attr of ``record_param_comms``.
"""
from __future__ import annotations

# Index = c10::ScalarType code (torch/headeronly/core/ScalarType.h, torch 2.13).
DTYPE_BY_CODE: tuple[str, ...] = (
    "uint8", "int8", "int16", "int32", "int64",                      # 0-4
    "float16", "float32", "float64",                                 # 5-7
    "complex32", "complex64", "complex128", "bool",                  # 8-11
    "qint8", "quint8", "qint32", "bfloat16", "quint4x2", "quint2x4",  # 12-17
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",              # 18-22
    "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",  # 23-26
    "uint16", "uint32", "uint64",                                    # 27-29
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",   # 30-36
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",          # 37-43
    "float8_e8m0fnu", "float4_e2m1fn_x2",                            # 44-45
)

# c10 ScalarType names (record_param_comms "dtype" attr) -> dtype name.
C10_NAME_TO_DTYPE: dict[str, str] = {
    "Byte": "uint8", "Char": "int8", "Short": "int16", "Int": "int32", "Long": "int64",
    "Half": "float16", "Float": "float32", "Double": "float64",
    "ComplexHalf": "complex32", "ComplexFloat": "complex64", "ComplexDouble": "complex128",
    "Bool": "bool", "QInt8": "qint8", "QUInt8": "quint8", "QInt32": "qint32",
    "BFloat16": "bfloat16", "QUInt4x2": "quint4x2", "QUInt2x4": "quint2x4",
    "Bits1x8": "bits1x8", "Bits2x4": "bits2x4", "Bits4x2": "bits4x2", "Bits8": "bits8",
    "Bits16": "bits16", "Float8_e5m2": "float8_e5m2", "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2fnuz": "float8_e5m2fnuz", "Float8_e4m3fnuz": "float8_e4m3fnuz",
    "UInt16": "uint16", "UInt32": "uint32", "UInt64": "uint64",
    "Float8_e8m0fnu": "float8_e8m0fnu", "Float4_e2m1fn_x2": "float4_e2m1fn_x2",
}

# The C++ element type inside ``Tensor(...)``. GCC spellings were captured from torch 2.13's
# ExecutionTraceObserver; clang spellings (``long``, ``unsigned short``) appear in older
# public traces.
ET_TYPE_TO_DTYPE: dict[str, str] = {
    "float": "float32", "double": "float64",
    "c10::Half": "float16", "c10::BFloat16": "bfloat16",
    "signed char": "int8", "unsigned char": "uint8",
    "short int": "int16", "short": "int16",
    "int": "int32",
    "long int": "int64", "long": "int64", "long long int": "int64", "long long": "int64",
    "short unsigned int": "uint16", "unsigned short": "uint16",
    "unsigned int": "uint32",
    "long unsigned int": "uint64", "unsigned long": "uint64",
    "long long unsigned int": "uint64", "unsigned long long": "uint64",
    "bool": "bool",
    "c10::complex<c10::Half>": "complex32", "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128",
    "c10::Float8_e5m2": "float8_e5m2", "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2fnuz": "float8_e5m2fnuz", "c10::Float8_e4m3fnuz": "float8_e4m3fnuz",
    "c10::Float8_e8m0fnu": "float8_e8m0fnu", "c10::Float4_e2m1fn_x2": "float4_e2m1fn_x2",
    "c10::qint8": "qint8", "c10::quint8": "quint8", "c10::qint32": "qint32",
    "c10::quint4x2": "quint4x2", "c10::quint2x4": "quint2x4",
    "c10::bits1x8": "bits1x8", "c10::bits2x4": "bits2x4", "c10::bits4x2": "bits4x2",
    "c10::bits8": "bits8", "c10::bits16": "bits16",
}

_ITEMSIZE: dict[str, int] = {name: 1 for name in DTYPE_BY_CODE}  # the 1-byte majority
_ITEMSIZE.update({
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "bits16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4, "qint32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
})

_INTEGRAL = frozenset({"uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"})

# Undefined tensors: the observer writes the dtype of a tensor without storage this way.
_UNDEFINED = "nullptr (uninitialized)"


def itemsize_of(name: str | None) -> int:
    """Bytes per element of dtype ``name``; 0 when the dtype is None or unknown."""
    return _ITEMSIZE.get(name, 0)


def is_integral(name: str | None, include_bool: bool = False) -> bool:
    """True for integer dtypes (``bool`` only with ``include_bool``)."""
    return name in _INTEGRAL or (include_bool and name == "bool")


def dtype_from_et_type(type_str: str) -> str | None:
    """``"Tensor(long int)"`` or ``"long int"`` -> ``"int64"``; None if undefined or unknown."""
    inner = type_str
    if inner.startswith("Tensor(") and inner.endswith(")"):
        inner = inner[7:-1]
    if inner == _UNDEFINED:
        return None
    return ET_TYPE_TO_DTYPE.get(inner)


def dtype_name(value: int | str | None) -> str | None:
    """Normalize any recorded dtype spelling to a dtype name; None if None or unrecognized.

    Accepts a ScalarType code, a dtype name (``"float32"``, ``"torch.float32"``), a c10 name
    (``"Float"``) or an ET element type (``"long int"``, ``"Tensor(float)"``).
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return DTYPE_BY_CODE[value] if 0 <= value < len(DTYPE_BY_CODE) else None
    name = value[6:] if value.startswith("torch.") else value
    if name in _ITEMSIZE:
        return name
    return C10_NAME_TO_DTYPE.get(name) or dtype_from_et_type(name)
