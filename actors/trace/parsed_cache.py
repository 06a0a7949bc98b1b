"""A loaded trace kept on disk, so the next load of the same file is a read, not a parse.

Loading a large trace takes tens of seconds (a 700 MB pipeline stage: ~20 s), and a sweep,
a fit search or a second ``tracefleet-predict`` loads the same files again. After a load of a
file of at least `MIN_CACHED_BYTES` of JSON, its `Trace` is written to ``parsed_cache_dir``
(``trace.parsed_cache_dir``) under a key of the file (real path, archive member, size, mtime,
inode), the rank asked for, and the loader's own source code, so an edited file or a changed
loader is a miss, never a stale answer. A hit decodes the file back into the same objects.

The format is JSON lines (orjson) of the model's objects, each tagged with its class from a
fixed list (`_SLOTTED`, `_DATACLASSES`) and their fields: the trace without its ops, then one
line per op, so a read holds one op's text at a time. Nothing read back is executed, and a file
that is not one of ours (or is cut) is a miss that the load overwrites. The folder is kept under
`MAX_CACHE_BYTES`, least recently used files first out.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path

import orjson

from actors.trace.model import Arg, Collective, Op, ProcessGroupInfo, Step, TensorArg, Trace
from actors.trace.source import TraceSource, json_bytes_estimate

log = logging.getLogger(__name__)

DEFAULT_DIR = "~/.cache/tracefleet/parsed"  # trace.parsed_cache_dir's default
MIN_CACHED_BYTES = 32 << 20  # smaller traces load in well under a second: not worth a file
MAX_CACHE_BYTES = 16 << 30  # the folder's size kept below this
_MAGIC = b"tracefleet-parsed-trace 2\n"
_NUM_OPS = "_parsed_cache_num_ops"  # in the first line's meta: how many op lines follow
_OPS_PER_WRITE = 4096
_SLOTTED = {cls.__name__: cls for cls in (TensorArg, Arg, Op, Collective)}
_DATACLASSES = {cls.__name__: cls for cls in (ProcessGroupInfo, Step, Trace)}
_SLOTS = {name: cls.__slots__ for name, cls in _SLOTTED.items()}
_FIELDS = {name: tuple(f.name for f in fields(cls)) for name, cls in _DATACLASSES.items()}


class _NotCacheable(Exception):
    """A value the format does not hold (the trace is then not written)."""


def cached_load(source: TraceSource, rank: int | None, load) -> object:
    """``load()`` (the loader's `Trace`), or the one a previous load of the same file wrote to
    ``source.parsed_cache_dir``; writes it there after a load."""
    key = _key(source, rank)
    if key is None:
        return load()
    path = Path(os.path.expanduser(source.parsed_cache_dir)) / f"{key}.json"
    trace = _read(path, key)
    if trace is not None:
        try:
            os.utime(path)  # recently used: the last to go
        except OSError:  # a folder shared read-only: still a hit
            pass
        return trace
    trace = load()
    _write(path, key, trace)
    return trace


def _key(source: TraceSource, rank: int | None) -> str | None:
    """The cache key of ``source`` (None: not cached)."""
    if not source.parsed_cache_dir:
        return None
    try:
        st = os.stat(source.path)
        if json_bytes_estimate([source]) < MIN_CACHED_BYTES:
            return None
    except OSError:
        return None  # the loader names what is wrong with the file
    text = "\0".join(map(str, (os.path.realpath(source.path), source.member, st.st_size,
                               st.st_mtime_ns, st.st_ino, rank, _loader_digest())))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@lru_cache(maxsize=1)
def _loader_digest() -> str:
    """A digest of the trace package's source code: a changed loader never reads old files."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _read(path: Path, key: str) -> Trace | None:
    try:
        with open(path, "rb") as f:
            if f.readline() != _MAGIC or f.readline().strip() != key.encode():
                return None
            trace = _dec(orjson.loads(f.readline()))
            if not isinstance(trace, Trace) or trace.ops != []:
                return None
            num_ops = trace.meta.pop(_NUM_OPS)
            trace.ops.extend(_dec(orjson.loads(line)) for line in f)
        if len(trace.ops) != num_ops or not all(type(op) is Op for op in trace.ops):
            raise ValueError(f"{len(trace.ops)} ops read of {num_ops}")
        return trace
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError,
            AttributeError, RecursionError) as e:
        log.warning("parsed-trace cache: %s is unreadable (%s); loading the trace again", path, e)
        return None


def _write(path: Path, key: str, trace: Trace) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".writing-")
        with os.fdopen(fd, "wb") as f:
            head = replace(trace, ops=[], meta={**trace.meta, _NUM_OPS: len(trace.ops)})
            f.write(_MAGIC + key.encode() + b"\n" + orjson.dumps(_enc(head)) + b"\n")
            for start in range(0, len(trace.ops), _OPS_PER_WRITE):
                f.write(b"".join(orjson.dumps(_enc(op)) + b"\n"
                                 for op in trace.ops[start:start + _OPS_PER_WRITE]))
        os.replace(tmp, path)  # whole or absent: a reader never sees half a file
        tmp = None
        _evict(path.parent, keep=path)
    except (_NotCacheable, TypeError, orjson.JSONEncodeError) as e:
        log.info("parsed-trace cache: %s not cached (%s)", trace.path, e)
    except OSError as e:
        log.warning("parsed-trace cache: cannot write %s (%s); loads stay uncached", path, e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _evict(folder: Path, keep: Path) -> None:
    """Remove the least recently used files until the folder is under `MAX_CACHE_BYTES`."""
    entries = []
    for p in folder.glob("*.json"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= MAX_CACHE_BYTES:
            break
        if p != keep:
            p.unlink(missing_ok=True)
            total -= size


def _enc(v):
    """``v`` as JSON values: containers and model objects tagged (see the module docstring)."""
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if math.isfinite(v) else {"f": repr(v)}
    if t is tuple:
        return {"T": [_enc(x) for x in v]}
    if t is list:
        return {"L": [_enc(x) for x in v]}
    if t is dict:
        return {"D": [[_enc(k), _enc(x)] for k, x in v.items()]}
    if t is frozenset:
        return {"F": [_enc(x) for x in v]}
    name = t.__name__
    if _SLOTTED.get(name) is t:
        return {"o": [name, [_enc(getattr(v, s)) for s in _SLOTS[name]]]}
    if _DATACLASSES.get(name) is t:
        return {"d": [name, [_enc(getattr(v, f)) for f in _FIELDS[name]]]}
    raise _NotCacheable(f"a {name} value")


def _dec(v):
    if type(v) is not dict:
        return v
    (tag, body), = v.items()
    if tag == "o":
        name, values = body
        obj = object.__new__(_SLOTTED[name])
        for slot, x in zip(_SLOTS[name], values, strict=True):
            setattr(obj, slot, _dec(x))
        return obj
    if tag == "T":
        return tuple(map(_dec, body))
    if tag == "L":
        return list(map(_dec, body))
    if tag == "D":
        return {_dec(k): _dec(x) for k, x in body}
    if tag == "F":
        return frozenset(map(_dec, body))
    if tag == "d":
        name, values = body
        return _DATACLASSES[name](**dict(zip(_FIELDS[name], map(_dec, values), strict=True)))
    if tag == "f":
        return float(body)
    raise ValueError(f"unknown tag {tag!r}")
