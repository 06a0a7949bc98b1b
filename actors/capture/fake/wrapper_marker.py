"""The wrappers' storage id, written into a fake capture's trace.

The observer gives every tensor-subclass wrapper (a DTensor: it owns no memory) one storage id,
the null data pointer's. On a real device the wrapper ops run their local work under
``PythonSubclass`` frames, whose inputs tell the loader that id; on fake, an op DTensor runs
on its fast path leaves no frame (torchao's low-bit optimizer calls ``p.detach()`` on each
DTensor parameter), and the loader read the id as one storage as large as the largest wrapper,
held all step: the whole embedding's bytes on an FSDP2 job. :func:`mark` writes one
``tracefleet::wrapper_storage`` op (actors/trace/conventions.py: WRAPPER_STORAGE_OP) whose input
is a zero-size view of the null pointer, so the observer names that id; the loader then drops
the ops left on it (actors/trace/subclass_wrappers.py).
"""
from __future__ import annotations

import torch

from actors.capture.fake.meta_storage import frees_paused
from actors.trace.conventions import WRAPPER_STORAGE_OP

_NAMESPACE, _NAME = WRAPPER_STORAGE_OP.split("::")
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)
_library = None


def _marker_op():
    """``tracefleet::wrapper_storage(Tensor null) -> ()``: a no-op the observer records."""
    global _library
    if _library is None:
        _library = torch.library.Library(_NAMESPACE, "FRAGMENT")  # free_markers DEFs it
        _library.define(f"{_NAME}(Tensor null) -> ()")
        _library.impl(_NAME, lambda null: None, "CompositeExplicitAutograd")
    return getattr(getattr(torch.ops, _NAMESPACE), _NAME).default


def mark() -> None:
    """Write the null pointer's storage id as one WRAPPER_STORAGE_OP (call while recording)."""
    op = _marker_op()
    with frees_paused():  # the view's own storage is nothing the run freed
        storage = torch._C._construct_storage_from_data_pointer(0, torch.device("meta"), 0)
        null = torch.empty(0, dtype=torch.uint8, device="meta").set_(storage, 0, (0,), (1,))
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            op(null)
