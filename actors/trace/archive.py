"""Trace bytes out of gzip files and tar archives, never expanding past a stated limit.

**The rank of a file or archive member** is the integer right before its ``.json`` suffix
(``.et.json``, ``.json.gz`` and ``.et.json.gz`` included), preceded by ``rank``, ``-``,
``_`` or ``.``: ``rank-3.et.json.gz``, ``rank3.json``, ``dlrm_eg_3.json``, ``foo_rank_3.json``
and ``trace.3.json`` are rank 3; ``resnet_et.json`` and ``gpt2.json`` carry no rank.

**Bounded reads.** A file larger than the limit is refused from its size, before a byte of
it is read; a gzip stream is inflated in chunks and refused as soon as it passes the limit,
holding at most `HOLD_BYTES` meanwhile (past that it is only counted, and inflated again once
it proved to fit: a gzip bomb costs a bounded buffer, not the limit in memory); a tar member
is refused from its header's size before a byte of it is read. The profiler trace and
``meta.json`` beside a trace are read the same way.
"""
from __future__ import annotations

import io
import os
import re
import tarfile
import zlib
from pathlib import PurePosixPath

from actors.errors import TraceError

DEFAULT_MAX_DECOMPRESSED_BYTES = 4 << 30
# gzip output held while its size is unknown: 256 MiB covers a 70B-class meta trace (183 MB
# of JSON) in one pass; a larger stream is counted to its end first, then inflated again
HOLD_BYTES = 256 << 20
_CHUNK_BYTES = 1 << 20  # inflated output per step
_INPUT_BYTES = 1 << 16  # compressed input fed per step
_RANK_IN_NAME = re.compile(r"(?:rank|[-_.])(\d+)(?:\.et)?\.json(?:\.gz)?$")
_TRACE_NAME = re.compile(r"\.json(?:\.gz)?$")
_LIMIT_KEY = "trace.max_decompressed_bytes"


def rank_from_name(name) -> int | None:
    """The rank a file or member name carries (see the module doc), None without one."""
    m = _RANK_IN_NAME.search(PurePosixPath(str(name)).name)
    return int(m.group(1)) if m else None


def is_trace_name(name) -> bool:
    """``*.json`` or ``*.json.gz``, not a hidden file (``._x.json`` is macOS metadata)."""
    base = PurePosixPath(str(name)).name
    return bool(_TRACE_NAME.search(base)) and not base.startswith(".")


def is_gzip(data: bytes) -> bool:
    return data[:2] == b"\x1f\x8b"


def is_tar_bytes(data: bytes) -> bool:
    """POSIX/GNU tar: the ``ustar`` magic of the first header."""
    return len(data) > 262 and data[257:262] == b"ustar"


_RAISE_LIMIT = (f"if the trace is genuine, raise the limit: {_LIMIT_KEY}=16GiB (tracefleet) or "
                "--max-decompressed-bytes 16GiB (tracefleet-inspect)")


def _too_big(where, limit: int, advice: str = _RAISE_LIMIT) -> TraceError:
    return TraceError(where, f"expands past the limit of {limit:,} bytes; {advice}")


def read_file(path, limit: int, advice: str = _RAISE_LIMIT) -> bytes:
    """A file's bytes; TraceError naming it when it cannot be read or holds more than
    ``limit`` bytes (read at most ``limit + 1``: a file growing meanwhile is caught too)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > limit:  # refused unread
                raise _too_big(path, limit, advice)
            data = f.read(limit + 1)
    except OSError as e:
        raise TraceError(path, f"cannot read file: {e.strerror or e}") from None
    if len(data) > limit:
        raise _too_big(path, limit, advice)
    return data


def gunzip(data: bytes, limit: int, where, advice: str = _RAISE_LIMIT) -> bytes:
    """Inflate a gzip stream (all members) in chunks; TraceError past ``limit`` bytes.

    At most ``min(limit, HOLD_BYTES)`` of output is held while the size is unknown; a stream
    longer than that is counted to its end without keeping it (refused the moment it passes
    ``limit``) and inflated again, now known to fit (see the module docstring)."""
    try:
        out = _inflate(data, limit, min(limit, HOLD_BYTES), where, advice)
        if out is None:  # longer than what is held, yet within the limit: inflate it again
            out = _inflate(data, limit, limit, where, advice)
    except (EOFError, zlib.error) as e:
        raise TraceError(where, f"truncated or corrupt compressed file (gzip: {e})") from None
    return b"".join(out)


def _inflate(data: bytes, limit: int, hold: int, where, advice: str) -> list[bytes] | None:
    """The inflated chunks of the gzip members of ``data``, or None when more than ``hold``
    bytes came out (the rest is then only counted); TraceError past ``limit``. The input is
    fed in small slices, so no call copies what remains of it; chunks, not one growing buffer,
    so nothing is copied while they accumulate."""
    out: list[bytes] | None = []
    total, pos, view = 0, 0, memoryview(data)
    stream = zlib.decompressobj(wbits=31)  # one gzip member
    while True:
        piece = view[pos:pos + _INPUT_BYTES]
        pos += len(piece)
        while True:  # until this piece is used up and nothing more comes out of it
            chunk = stream.decompress(piece, _CHUNK_BYTES)
            piece = stream.unconsumed_tail
            total += len(chunk)
            if total > limit:
                raise _too_big(where, limit, advice)
            if out is not None:
                if total > hold:
                    out = None  # too long to hold while unproven: count the rest
                elif chunk:
                    out.append(chunk)
            if stream.eof or not (piece or chunk):
                break
        if stream.eof:
            pos -= len(stream.unused_data)  # where the next member (or padding) starts
            if view[pos:pos + 2].tobytes() == b"\x1f\x8b":
                stream = zlib.decompressobj(wbits=31)
            elif not view[pos:].tobytes().strip(b"\0"):  # gzip allows trailing NUL padding
                return out
            else:
                raise zlib.error("trailing garbage after the last gzip member")
        elif pos >= len(data):
            raise EOFError("the data ends inside a gzip member")


def _open_tar(path, data: bytes | None):
    # "r|*" streams: members are visited once, in order, and skipped without being kept.
    if data is not None:
        return tarfile.open(fileobj=io.BytesIO(data), mode="r|*")
    return tarfile.open(path, mode="r|*")


def trace_members(path, limit: int, data: bytes | None = None) -> list[str]:
    """Names of the regular ``*.json[.gz]`` members of a tar archive (``data``: its bytes).

    Walks the archive without keeping it; a member whose header says it is larger than
    ``limit`` is refused here, before anything reads it.
    """
    names = []
    try:
        with _open_tar(path, data) as tar:
            for member in tar:
                if member.isfile() and is_trace_name(member.name):
                    if member.size > limit:
                        raise _too_big(f"{path}:{member.name}", limit)
                    names.append(member.name)
    except (OSError, EOFError, zlib.error, tarfile.TarError) as e:
        raise TraceError(path, f"truncated or corrupt tar archive ({e})") from None
    return names


def read_member(path, member: str, limit: int, data: bytes | None = None) -> bytes:
    """The bytes of one tar member, as stored (still gzip if it is a ``.json.gz``).

    Streams the archive up to the member; refuses it from its header if larger than ``limit``.
    """
    where = f"{path}:{member}"
    try:
        with _open_tar(path, data) as tar:
            for info in tar:
                if info.name != member:
                    continue
                if not info.isfile():
                    raise TraceError(where, "is not a regular file in the archive")
                if info.size > limit:
                    raise _too_big(where, limit)
                return tar.extractfile(info).read()
    except (OSError, EOFError, zlib.error, tarfile.TarError) as e:
        raise TraceError(where, f"truncated or corrupt tar archive ({e})") from None
    raise TraceError(where, "no such member in the archive")


def single_member(path, data: bytes, limit: int) -> bytes:
    """The one trace member of an (already inflated) tar archive; TraceError otherwise."""
    names = trace_members(path, limit, data)
    if len(names) != 1:
        raise TraceError(path, f"tar archive holds {len(names)} trace files "
                               f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}); "
                               "a rank trace is one of them: pass the archive as trace.dir "
                               "(or to tracefleet-inspect) to read every rank")
    return read_member(path, names[0], limit, data)
