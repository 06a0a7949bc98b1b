"""The no-op ops a fake capture writes into its trace for the loader to read
(actors/trace/conventions.py: ``tracefleet::freed``, ``tracefleet::wrapper_storage``): one
library for their namespace, zero-size ``meta`` views that name a storage by its address, and
the call below the Python dispatch keys, so that no mode of the capture sees it."""
from __future__ import annotations

import torch

_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)
_META = torch.device("meta")
_libraries: dict[str, torch.library.Library] = {}  # namespace -> its library
_defined: set[str] = set()


def marker_op(qualified_name: str, arguments: str):
    """The op ``namespace::name(arguments) -> ()``, a no-op the observer records (defined on the
    first call)."""
    namespace, name = qualified_name.split("::")
    if qualified_name not in _defined:
        library = _libraries.get(namespace)
        if library is None:
            library = _libraries[namespace] = torch.library.Library(namespace, "DEF")
        library.define(f"{name}({arguments}) -> ()")
        library.impl(name, lambda *args: None, "CompositeExplicitAutograd")
        _defined.add(qualified_name)
    return getattr(getattr(torch.ops, namespace), name).default


def storage_views(addresses) -> list[torch.Tensor]:
    """A zero-size uint8 ``meta`` view of each storage address: the observer writes it with
    that storage's id. Made unrecorded (they are no op of the run; two per storage were a third
    of a fake trace's nodes when the run's frees were written so)."""
    views = []
    torch._C._autograd._enable_record_function(False)  # this thread only
    try:
        for address in addresses:
            storage = torch._C._construct_storage_from_data_pointer(address, _META, 0)
            views.append(torch.empty(0, dtype=torch.uint8, device=_META)
                         .set_(storage, 0, (0,), (1,)))
    finally:  # a capture records with RecordFunction on: there is no getter to restore
        torch._C._autograd._enable_record_function(True)
    return views


def write(op, *args) -> None:
    """Call the marker ``op`` below the Python dispatch keys (the capture's modes)."""
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
        op(*args)
