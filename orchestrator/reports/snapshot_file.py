"""Reading a memory snapshot (``torch.cuda.memory._dump_snapshot``'s pickle, or one tracefleet
predicted) without trusting it.

A pickle can name any importable callable and have it called. The unpickler here resolves no
name at all (``find_class`` and ``persistent_load`` refuse), so only what pickle builds by
itself can come out: containers, strings, numbers, booleans and None. What came out is then
walked: a set or bytes (which no snapshot holds) is refused too, and the shape is checked
(``segments`` and ``device_traces`` lists of dicts, each event an ``action`` with a ``size``).
Every refusal is a SnapshotError naming the file and what was found.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

from orchestrator.errors import SnapshotError

MAX_SNAPSHOT_BYTES = 8 << 30  # a recorded history of millions of events stays below this
_PLAIN = (dict, list, tuple, str, int, float, bool, type(None))
_ALLOWED = "dicts, lists, tuples, strings, numbers, booleans and None"


class _PlainUnpickler(pickle.Unpickler):
    """Builds containers and scalars only: any global (class, function) is refused unread."""

    def __init__(self, data: bytes, path: str):
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module, name):
        raise SnapshotError(self._path, f"refused: the pickle asks for {module}.{name}; a "
                                        f"memory snapshot holds only {_ALLOWED}")

    def persistent_load(self, pid):
        raise SnapshotError(self._path, "refused: the pickle asks for a persistent object; a "
                                        f"memory snapshot holds only {_ALLOWED}")


def loads_snapshot(data: bytes, path="<bytes>") -> dict:
    """The snapshot in ``data`` (see the module docstring); a bare list of segments (older
    ``_snapshot`` output) comes back as ``{"segments": it, "device_traces": []}``."""
    path = str(path)
    try:
        obj = _PlainUnpickler(data, path).load()
    except SnapshotError:
        raise
    except RecursionError:
        raise SnapshotError(path, "refused: nested too deeply for a memory snapshot") from None
    except Exception as e:  # UnpicklingError, EOFError, ValueError, ... : not a whole pickle
        raise SnapshotError(path, f"not a readable pickle ({type(e).__name__}: {e})") from None
    _check_plain(obj, path)
    if isinstance(obj, list):
        obj = {"segments": obj, "device_traces": []}
    _check_shape(obj, path)
    return obj


def read_snapshot(path, max_bytes: int = MAX_SNAPSHOT_BYTES) -> dict:
    """``loads_snapshot`` of the file at ``path`` (refused past ``max_bytes``)."""
    p = Path(path)
    if not p.is_file():
        raise SnapshotError(p, "no such file (expected a pickle from "
                               "torch.cuda.memory._dump_snapshot or tracefleet-predict)")
    size = p.stat().st_size
    if size > max_bytes:
        raise SnapshotError(p, f"{size} B is larger than the {max_bytes} B a snapshot is read to")
    return loads_snapshot(p.read_bytes(), p)


def _check_plain(obj, path: str) -> None:
    """Refuse any value but plain containers and scalars (walked without recursion)."""
    todo, seen = [obj], set()
    while todo:
        value = todo.pop()
        if not isinstance(value, _PLAIN):
            raise SnapshotError(path, f"refused: holds a {type(value).__name__}; a memory "
                                      f"snapshot holds only {_ALLOWED}")
        if isinstance(value, (dict, list, tuple)):
            if id(value) in seen:  # a shared frame list: checked once
                continue
            seen.add(id(value))
        if isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)):
            todo.extend(value)


def _check_shape(snap, path: str) -> None:
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list) or \
            not isinstance(snap.get("device_traces", []), list):
        raise SnapshotError(path, "not a memory snapshot: expected a dict with 'segments' and "
                                  "'device_traces' lists (torch.cuda.memory._snapshot())")
    snap.setdefault("device_traces", [])
    for i, seg in enumerate(snap["segments"]):
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks"), list) or \
                not isinstance(seg.get("total_size"), int):
            raise SnapshotError(path, f"segment {i}: expected a dict with 'total_size' and "
                                      "'blocks'")
    for d, trace in enumerate(snap["device_traces"]):
        if not isinstance(trace, list):
            raise SnapshotError(path, f"device_traces[{d}]: expected a list of events")
        for k, event in enumerate(trace):
            if not isinstance(event, dict) or not isinstance(event.get("action"), str) or \
                    not isinstance(event.get("size", 0), int) or \
                    not isinstance(event.get("addr", 0), int):
                raise SnapshotError(path, f"device_traces[{d}][{k}]: expected an event dict "
                                          "with a string 'action' and integer 'size' / 'addr'")
