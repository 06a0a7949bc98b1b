"""Which ranks have byte-identical traces: one signature, and in compute mode one replay, each.

A meta capture writes rank 0's trace for every rank (as hard links: actors/capture/
meta_world.py), and data-parallel ranks often record the same program, so a 1,024-rank folder
may hold one distinct trace. Grouping is cheapest first, reading bytes only when it must:

1. by file identity, ``(device, inode)`` (plus the member for archive members): hard links
   of one file are one trace without reading a byte;
2. the remaining files by size and a hash of their first ``HEAD_BYTES`` (traces of
   different ranks usually differ in the header: pid, timestamps);
3. only files still colliding by a streamed blake2b over all their stored bytes.

The stored bytes are compared (gzip included): two files that inflate to the same JSON but
were compressed differently count as different, which costs a replay, never correctness.
"""
from __future__ import annotations

import hashlib
import os

from actors.errors import TraceError
from actors.trace.source import TraceSource

HEAD_BYTES = 64 << 10  # hashed first: cheap, and tells most different traces apart
_CHUNK_BYTES = 1 << 20  # streaming block of the full hash (never a whole file in memory)


def identical_groups(sources: dict[int, TraceSource]) -> dict[int, list[int]]:
    """``{representative rank: [ranks with byte-identical traces, representative first]}``
    (the representative is the group's lowest rank; every rank is in exactly one group)."""
    by_identity: dict[tuple, list[int]] = {}
    for rank in sorted(sources):
        by_identity.setdefault(_identity(sources[rank]), []).append(rank)
    # ranks of one identity share everything below; compare one rank per identity
    by_head: dict[tuple, list[list[int]]] = {}
    for ranks in by_identity.values():
        src = sources[ranks[0]]
        by_head.setdefault(_digest(src, HEAD_BYTES), []).append(ranks)
    groups: dict[int, list[int]] = {}
    for clusters in by_head.values():
        if len(clusters) > 1:  # same size and head: decide on every byte
            by_full: dict[tuple, list[int]] = {}
            for ranks in clusters:
                by_full.setdefault(_digest(sources[ranks[0]], None), []).extend(ranks)
            clusters = list(by_full.values())
        for ranks in clusters:
            ranks = sorted(ranks)
            groups[ranks[0]] = ranks
    return dict(sorted(groups.items()))


def representatives(groups: dict[int, list[int]]) -> dict[int, int]:
    """``{rank: its group's representative}`` for every rank of ``groups``."""
    return {rank: rep for rep, ranks in groups.items() for rank in ranks}


def _identity(src: TraceSource) -> tuple:
    try:
        st = os.stat(src.path)
    except OSError as e:
        raise TraceError(src, f"cannot read file: {e.strerror or e}") from None
    return (st.st_dev, st.st_ino, src.member)


def _digest(src: TraceSource, limit: int | None) -> tuple:
    """``(size, blake2b)`` of the first ``limit`` stored bytes (None: all, streamed)."""
    h = hashlib.blake2b(digest_size=16)
    if src.member is not None:  # an archive member: its bytes come through the size limit
        data = src.read_raw()
        h.update(data if limit is None else data[:limit])
        return (len(data), h.digest())
    try:
        with open(src.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            remaining = size if limit is None else min(limit, size)
            while remaining > 0:
                block = f.read(min(_CHUNK_BYTES, remaining))
                if not block:  # the file shrank under us: hash what is there
                    break
                h.update(block)
                remaining -= len(block)
    except OSError as e:
        raise TraceError(src, f"cannot read file: {e.strerror or e}") from None
    return (size, h.digest())
