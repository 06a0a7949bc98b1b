"""Reading a memory snapshot (``torch.cuda.memory._dump_snapshot``'s pickle, or one tracefleet
predicted) without trusting it.

A pickle can name any importable callable and have it called. The unpickler here resolves no
name at all (``find_class`` and ``persistent_load`` refuse), so only what pickle builds by
itself can come out: containers, strings, numbers, booleans and None. What came out is then
walked: a set or bytes (which no snapshot holds) is refused too, and every field the comparison
reads is checked before it is used (``segments`` and ``device_traces`` lists of dicts, byte
counts integers in int64's range, frames lists of dicts with string file names). Every refusal
is a SnapshotError naming the file, the field and what was found.
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
    """Every field the comparison reads, typed and in range; a refusal names the field
    (``device_traces[0][3].size: 10**400 is not a byte count``)."""
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list) or \
            not isinstance(snap.get("device_traces", []), list):
        raise SnapshotError(path, "not a memory snapshot: expected a dict with 'segments' and "
                                  "'device_traces' lists (torch.cuda.memory._snapshot())")
    snap.setdefault("device_traces", [])
    for i, seg in enumerate(snap["segments"]):
        where = f"segments[{i}]"
        _fields(seg, where, path, total_size=_bytes, device=_index, blocks=list)
        if "total_size" not in seg or "blocks" not in seg:
            raise SnapshotError(path, f"{where}: expected a dict with 'total_size' and 'blocks'")
        for k, block in enumerate(seg["blocks"]):
            _fields(block, f"{where}.blocks[{k}]", path, size=_bytes, requested_size=_bytes,
                    state=str, frames=list)
            _frames(block, f"{where}.blocks[{k}]", path)
    for d, trace in enumerate(snap["device_traces"]):
        if not isinstance(trace, list):
            raise SnapshotError(path, f"device_traces[{d}]: expected a list of events")
        for k, event in enumerate(trace):
            where = f"device_traces[{d}][{k}]"
            _fields(event, where, path, action=str, size=_bytes, addr=_address, frames=list)
            if "action" not in event:
                raise SnapshotError(path, f"{where}: expected an event with an 'action'")
            if event["action"] in _SIZED and "size" not in event:
                raise SnapshotError(path, f"{where}: a {event['action']!r} event without its "
                                          "'size'")
            _frames(event, where, path)


# Events whose size the comparison adds up (torch writes a size on every event).
_SIZED = {"alloc", "free_completed", "segment_alloc", "segment_free", "segment_map",
          "segment_unmap"}
_MAX_BYTES = 1 << 63  # an int64 byte count, as the allocator keeps it
_MAX_ADDRESS = 1 << 64
_MAX_DEVICE = 1 << 16


def _bytes(value) -> str | None:
    ok = type(value) is int and 0 <= value < _MAX_BYTES
    return None if ok else "is not a byte count (an integer in [0, 2**63))"


def _address(value) -> str | None:
    ok = type(value) is int and 0 <= value < _MAX_ADDRESS
    return None if ok else "is not an address (an integer in [0, 2**64))"


def _index(value) -> str | None:
    ok = type(value) is int and 0 <= value < _MAX_DEVICE
    return None if ok else "is not a device index (an integer >= 0)"


def _fields(obj, where: str, path: str, **kinds) -> None:
    """``obj`` is a dict whose fields named in ``kinds`` (when present) are of that type, or
    pass that check (a function returning what is wrong, or None)."""
    if not isinstance(obj, dict):
        raise SnapshotError(path, f"{where}: expected a dict, found a {type(obj).__name__}")
    for name, kind in kinds.items():
        if name not in obj:
            continue
        value = obj[name]
        if isinstance(kind, type):
            if not isinstance(value, kind):
                raise SnapshotError(path, f"{where}.{name}: expected a {kind.__name__}, found "
                                          f"a {type(value).__name__}")
        elif (wrong := kind(value)) is not None:
            raise SnapshotError(path, f"{where}.{name}: {_shown(value)} {wrong}")


def _frames(obj: dict, where: str, path: str) -> None:
    for f, frame in enumerate(obj.get("frames") or ()):
        _fields(frame, f"{where}.frames[{f}]", path, filename=str, name=str, line=int)


def _shown(value) -> str:
    """A value for a message, cut short (a 10**400 or a long string stays one line)."""
    if type(value) is int and value.bit_length() > 64:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else \
        f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."
