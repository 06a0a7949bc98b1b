"""The environment variables a user's code read during a capture.

A user's step is often sized or switched by environment variables (``EXAMPLE_DIM``,
``USE_COMPILE``, a recipe's flags), which no workload field shows: a capture cache keyed on the
settings alone would hand back a capture made with other values. While
:func:`environment_reads` is on, every read of ``os.environ`` (``os.environ[...]``,
``os.environ.get``, ``os.getenv``, ``in``) whose nearest caller outside the standard library is
the user's code (not torch, another installed package or tracefleet itself) records the
variable's name; meta.json keeps each one's value at capture (``environment``, null for unset)
and the capture cache reuses a capture only where they are unchanged
(orchestrator/studies/study_traces.py).
"""
from __future__ import annotations

import os
import sys
import sysconfig
import threading
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

# Frames from these folders are not the user's: the standard library (os, collections.abc),
# installed packages, tracefleet's own code.
_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                 for k in ("stdlib", "platstdlib")})
_NOT_USERS = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                    for k in ("purelib", "platlib")}) + tuple(
    str(Path(__file__).resolve().parents[2] / name) + os.sep
    for name in ("actors", "orchestrator", "tracefleet"))
_LOCK = threading.Lock()


def _users_read() -> bool:
    """Whether the nearest caller outside the standard library is the user's code."""
    frame = sys._getframe(2)  # the caller of __getitem__
    while frame is not None:
        name = frame.f_code.co_filename
        # os and collections.abc are frozen modules ("<frozen os>")
        if not name.startswith("<frozen "):
            path = os.path.realpath(name)
            if path.startswith(_NOT_USERS):  # first: a venv's site-packages is in its stdlib
                return False
            if not path.startswith(_STDLIB):
                return True
        frame = frame.f_back
    return False


_ACTIVE: list[set] = []  # the sets of the environment_reads blocks now open (nested: all)
_PATCH: list = []  # os.environ's patched read while any block is open


def _getitem(original):
    def getitem(self, key):
        if _ACTIVE and self is os.environ and isinstance(key, str) and _users_read():
            note_reads((key,))
        return original(self, key)
    return getitem


@contextmanager
def environment_reads():
    """Within the block, the names of the variables the user's code reads are added to the
    yielded set (blocks nest: an inner block's reads are the outer ones' too)."""
    names: set[str] = set()
    with _LOCK:
        if not _ACTIVE:
            _PATCH.append(mock.patch.object(os._Environ, "__getitem__",
                                            _getitem(os._Environ.__getitem__)))
            _PATCH[0].start()
        _ACTIVE.append(names)
    try:
        yield names
    finally:
        with _LOCK:
            _ACTIVE.remove(names)
            if not _ACTIVE:
                _PATCH.pop().stop()


def note_reads(names) -> None:
    """Count ``names`` as read in every open block: reads made before and kept (a module's
    import-time reads, when the module is loaded once and used again)."""
    with _LOCK:
        for active in _ACTIVE:
            active.update(names)


def environment_of(names) -> dict[str, str | None]:
    """``{name: its value now, None where unset}`` for ``names``, sorted by name."""
    return {name: os.environ.get(name) for name in sorted(names)}
