"""The run's own frees, written into a fake capture's trace.

A trace shows when each storage is used, not when the run let go of it: a tensor the user's
code still references (the ``ModelOutput`` a Hugging Face model returns keeps the logits, 2 MiB
on a small Llama, alive through the whole backward) outlives its last use, and a replay that
frees at the last use predicts less than the run held. On the fake device every storage comes
from the unique meta allocator, which learns each free (actors/capture/fake/meta_storage.py).
While :func:`recording` is on, the fake mode (actors/capture/fake/fake_mode.py) calls
:func:`emit` before each op: the storages freed since the last call are written as one
``tracefleet::freed`` op (actors/trace/conventions.py: FREED_OP) whose input lists a
zero-size view of each, so the observer names them by their storage ids, and, per storage,
whether it was made during the recorded step (the allocator's addresses only grow): a storage
an op made and the observer never saw as its output (the op raised: checkpoint's early stop
ends a recompute inside its last op) is then not read as alive before the step. The op runs
below the Python dispatch keys and does nothing; the trace's loader turns it into recorded
frees.
"""
from __future__ import annotations

from contextlib import contextmanager

from actors.capture.fake import meta_storage, wrapper_marker
from actors.capture.fake.marker_ops import marker_op, storage_views, write
from actors.trace.conventions import FREED_OP

_step_start = [0]  # the first address of the recorded step (see recording)
_held: list[int] = []  # freed before the running op began its own work: written by emit


def _freed_op():
    """``tracefleet::freed(Tensor[] storages, int[] made_in_step) -> ()``."""
    return marker_op(FREED_OP, "Tensor[] storages, int[] made_in_step")


def emit() -> None:
    """Write the storages freed since the last call as one ``tracefleet::freed`` op."""
    if not meta_storage.num_freed() and not _held:
        return
    addresses = _held + meta_storage.take_freed()
    _held.clear()
    made = [int(a >= _step_start[0]) for a in addresses]
    # the views' own (empty) storages die right here: not frees of the run
    with meta_storage.frees_paused():
        write(_freed_op(), storage_views(addresses), made)


def op_begins() -> int:
    """Before an op's own work: :func:`emit`; the first address that work can make."""
    emit()
    return meta_storage.next_address()


def op_ends(start: int) -> None:
    """After the op's own work (begun at ``start``): forget the storages it made and let go of
    inside it (a fake tensor cache miss's temporaries, a decomposition's intermediates). No op
    of the trace saw them, and whether they exist depends on what the process ran before (a
    cache hit makes none): the trace would depend on it too."""
    if meta_storage.num_freed():
        _held.extend(a for a in meta_storage.take_freed() if a < start)


@contextmanager
def recording(mode):
    """Within the block, ``mode`` (a CaptureFakeMode) writes the run's frees before each op;
    those pending when the block ends are written at its end (inside the step's range)."""
    _freed_op()  # defined before the observer starts
    _step_start[0] = meta_storage.next_address()
    _held.clear()
    with meta_storage.record_frees():
        mode.emit_frees = True
        try:
            wrapper_marker.mark()
            yield
            emit()
        finally:
            mode.emit_frees = False
