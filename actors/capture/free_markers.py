"""The run's own frees, written into a fake capture's trace.

A trace shows when each storage is used, not when the run let go of it: a tensor the user's
code still references (the ``ModelOutput`` a Hugging Face model returns keeps the logits, 2 MiB
on a small Llama, alive through the whole backward) outlives its last use, and a replay that
frees at the last use predicts less than the run held. On the fake device every storage comes
from the unique meta allocator, which learns each free (actors/capture/meta_storage.py).
While :func:`recording` is on, the fake mode (actors/capture/fake_mode.py) calls
:func:`emit` before each op: the storages freed since the last call are written as one
``tracefleet::freed`` op (actors/trace/conventions.py: FREED_OP) whose input lists a
zero-size view of each, so the observer names them by their storage ids. The op runs below
the Python dispatch keys and does nothing; the trace's loader turns it into recorded frees.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from actors.capture import meta_storage
from actors.trace.conventions import FREED_OP

_NAMESPACE, _NAME = FREED_OP.split("::")
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)
_META = torch.device("meta")
_library = None


def _freed_op():
    """``tracefleet::freed(Tensor[] storages) -> ()``: a no-op the observer records."""
    global _library
    if _library is None:
        _library = torch.library.Library(_NAMESPACE, "DEF")
        _library.define(f"{_NAME}(Tensor[] storages) -> ()")
        _library.impl(_NAME, lambda storages: None, "CompositeExplicitAutograd")
    return getattr(getattr(torch.ops, _NAMESPACE), _NAME).default


def emit() -> None:
    """Write the storages freed since the last call as one ``tracefleet::freed`` op."""
    if not meta_storage.num_freed():
        return
    addresses = meta_storage.take_freed()
    # the views' own (empty) storages die right here: not frees of the run
    with meta_storage.frees_paused():
        views = []
        for address in addresses:
            storage = torch._C._construct_storage_from_data_pointer(address, _META, 0)
            views.append(torch.empty(0, dtype=torch.uint8, device=_META)
                         .set_(storage, 0, (0,), (1,)))
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            _freed_op()(views)
        del views


@contextmanager
def recording(mode):
    """Within the block, ``mode`` (a CaptureFakeMode) writes the run's frees before each op;
    those pending when the block ends are written at its end (inside the step's range)."""
    _freed_op()
    with meta_storage.record_frees():
        mode.emit_frees = True
        try:
            yield
            emit()
        finally:
            mode.emit_frees = False
