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

from actors.capture.fake.marker_ops import marker_op, storage_views, write
from actors.capture.fake.meta_storage import frees_paused
from actors.trace.conventions import WRAPPER_STORAGE_OP


def mark() -> None:
    """Write the null pointer's storage id as one WRAPPER_STORAGE_OP (call while recording)."""
    with frees_paused():  # the view's own storage is nothing the run freed
        write(marker_op(WRAPPER_STORAGE_OP, "Tensor null"), *storage_views([0]))
