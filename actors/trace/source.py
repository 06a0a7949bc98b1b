"""Where one rank's trace is, and how a path given by the user maps to rank traces.

A `TraceSource` names a trace file, or a member of a tar archive, plus the decompression
limit; it is small and picklable, so the driver hands it to a rank actor, which reads its
member itself (``trace.transfer=path``: nothing is extracted) or gets the member's bytes
(``object_store``). ``os.fspath(source)`` is the file on disk.

`discover` turns a path into ``{rank: TraceSource}``:

* a folder: its ``*.json[.gz]`` files whose name carries a rank (rule in
  `actors.trace.archive`); other files (``meta.json``, notes) are ignored, unless the folder
  holds a single trace file, which is then the only rank;
* a ``.tar`` / ``.tar.gz`` archive: its ``*.json[.gz]`` members; each must carry a rank,
  unless the archive holds exactly one;
* any other file: one trace. A ``*.json`` / ``*.json.gz`` file is always one (read as JSON
  or gzip, even when its inflated bytes would pass for an empty tar: zeros do).

A lone trace without a rank in its name is rank 0. Two files of one rank are refused.
"""
from __future__ import annotations

import os
import stat
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path

from actors.errors import ConfigError, TraceError
from actors.trace import archive
from actors.trace.archive import DEFAULT_MAX_DECOMPRESSED_BYTES


@dataclass(frozen=True)
class TraceSource:
    """One rank's trace: ``path`` on disk, ``member`` of it when ``path`` is a tar archive."""

    path: str
    member: str | None = None
    # Refuse data that would expand past this many bytes (gzip, tar members).
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
    # Where a large trace's loaded model is kept for the next load (None: nowhere;
    # actors/trace/parsed_cache.py).
    parsed_cache_dir: str | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.member}" if self.member else self.path

    def __fspath__(self) -> str:
        return self.path

    @property
    def name(self) -> str:
        """The file or member name (what the rank is read from)."""
        return Path(self.member or self.path).name

    def read_raw(self) -> bytes:
        """The stored bytes of the file or member (still gzip-compressed if it is)."""
        if self.member is not None:
            return archive.read_member(self.path, self.member, self.max_decompressed_bytes)
        return archive.read_file(self.path, self.max_decompressed_bytes)

    def read_json_bytes(self, data: bytes | None = None) -> bytes:
        """The trace's JSON text; ``data`` are `read_raw`'s bytes when they came another way.

        gzip is inflated with the limit; a file that is itself a one-trace tar archive
        yields that trace.
        """
        limit = self.max_decompressed_bytes
        raw = self.read_raw() if data is None else data
        if archive.is_gzip(raw):
            raw = archive.gunzip(raw, limit, self)
        if self.member is None and archive.is_tar_bytes(raw):
            raw = archive.single_member(self.path, raw, limit)
            if archive.is_gzip(raw):
                raw = archive.gunzip(raw, limit, self)
        return raw


def as_source(path, max_decompressed_bytes: int | None = None) -> TraceSource:
    """``path`` as a TraceSource (a TraceSource is returned as is)."""
    if isinstance(path, TraceSource):
        return path
    return TraceSource(str(path), None, max_decompressed_bytes or DEFAULT_MAX_DECOMPRESSED_BYTES)


def discover(path, max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES,
             parsed_cache_dir: str | None = None) -> dict[int, TraceSource]:
    """``{rank: TraceSource}`` of a folder, an archive or one file (see the module doc);
    ``parsed_cache_dir``: the sources' (`TraceSource`).

    ConfigError when the path does not exist or holds no trace; TraceError for an archive
    member without a rank or two traces of one rank.
    """
    found = _discover(Path(path), max_decompressed_bytes)
    if parsed_cache_dir is None:
        return found
    return {rank: replace(s, parsed_cache_dir=parsed_cache_dir) for rank, s in found.items()}


def _discover(path: Path, limit: int) -> dict[int, TraceSource]:
    if path.is_dir():
        named = [p for p in path.iterdir() if archive.is_trace_name(p.name)]
        for p in named:  # a link to /dev/zero, a folder: refused by name, never skipped
            if not p.is_file():
                raise ConfigError(f"{p}: not a regular file ({_kind_of(p)}); a rank trace is a "
                                  "file (a link to one is read)")
        names = sorted(p.name for p in named)
        ranked = [n for n in names if archive.rank_from_name(n) is not None]
        if not ranked and len(names) == 1:
            ranked = names
        if not ranked:
            raise ConfigError(f"{path}: no rank trace files; expected names like rank-<r>.et.json[.gz] "
                              "(the rank is the integer right before .json, after 'rank', '-', '_' "
                              "or '.')")
        return _by_rank(path, [(n, TraceSource(str(path / n), None, limit)) for n in ranked])
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; expected a folder of rank traces, a .tar[.gz] "
                          "archive of them, or one trace file")
    if not _is_tar_file(path):
        return {archive.rank_from_name(path.name) or 0: TraceSource(str(path), None, limit)}
    members = archive.trace_members(path, limit)
    if not members:
        raise ConfigError(f"{path}: the archive holds no *.json or *.json.gz member")
    if len(members) > 1:
        for m in members:
            if archive.rank_from_name(m) is None:
                raise TraceError(f"{path}:{m}", f"the member's name carries no rank, and the archive "
                                                f"holds {len(members)} traces; name each rank's file "
                                                "like rank-<r>.json (the integer right before .json, "
                                                "after 'rank', '-', '_' or '.')")
    return _by_rank(path, [(m, TraceSource(str(path), m, limit)) for m in members])


def _kind_of(path: Path) -> str:
    """What a path that is not a regular file is, for a message."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        return f"a link that cannot be followed: {e.strerror or e}"
    target = f"a link to {os.path.realpath(path)}, " if path.is_symlink() else ""
    kind = "a folder" if stat.S_ISDIR(mode) else "a character device" if stat.S_ISCHR(mode) \
        else "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) \
        else "a block device" if stat.S_ISBLK(mode) else "not a file"
    return target + kind


def missing_ranks(sources: dict, world_size: int) -> list[int]:
    """The ranks of a ``world_size``-rank job with no trace in ``sources``."""
    return sorted(set(range(world_size)) - set(sources))


def _by_rank(where, named: list[tuple[str, TraceSource]]) -> dict[int, TraceSource]:
    found: dict[int, tuple[str, TraceSource]] = {}
    for name, source in named:
        rank = archive.rank_from_name(name)
        rank = 0 if rank is None else rank
        if rank in found:
            raise ConfigError(f"{where}: rank {rank} has two trace files, {found[rank][0]} and "
                              f"{name}; keep one")
        found[rank] = (name, source)
    return {rank: source for rank, (_, source) in sorted(found.items())}


def _is_tar_file(path: Path) -> bool:
    if archive.is_trace_name(path.name):  # a trace by its name (one trace in a tar is read too)
        return False
    try:
        return tarfile.is_tarfile(path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None


def json_bytes_estimate(sources) -> int:
    """About how many bytes of JSON ``sources`` hold (an archive shared by several ranks
    counted once): a gzip file's size as its trailer records it (ISIZE, modulo 4 GiB), any
    other file's size on disk. What loading costs grows with the JSON, not the stored bytes:
    a 70B meta trace is 6 MB of gzip and 180 MB of JSON."""
    total = 0
    for path in {s.path for s in sources}:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size > 18 and archive.is_gzip(f.read(2)):
                f.seek(-4, os.SEEK_END)
                size = max(size, int.from_bytes(f.read(4), "little"))
        total += size
    return total
