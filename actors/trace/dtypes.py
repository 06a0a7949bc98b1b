"""dtype names as the trace records them, without importing torch (the trace model is pure data)."""

# Element type inside ``Tensor(...)`` in ET type strings -> torch dtype name.
ET_TYPE_TO_DTYPE = {
    "float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
    "long int": "int64", "long": "int64", "int": "int32", "short int": "int16", "short": "int16",
    "signed char": "int8", "unsigned char": "uint8", "bool": "bool",
    "c10::complex<float>": "complex64", "c10::complex<double>": "complex128",
    "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2",
}

_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
             "float8_e4m3fn": 1, "float8_e5m2": 1}
_INTEGRAL = {"int64", "int32", "int16", "int8", "uint8", "bool"}


def itemsize_of(name: str | None) -> int:
    """Bytes per element of a dtype name (1 for unknown names)."""
    return _ITEMSIZE.get(name, 1)


def is_integral(name: str | None) -> bool:
    return name in _INTEGRAL
