"""The caching allocator model with its history kept: every allocation, free and segment event
as ``torch.cuda.memory._record_memory_history`` records them on a GPU, what each live block was
requested for, the reserved bytes per stream and the allocated bytes per category.

Used only when a replay asks for a memory snapshot or the predicted timeline (replay.
allocator_snapshot / replay.allocator_timeline): the plain model (cuda_allocator.py) keeps its
hot path. The caller (actors/replay/memory/model_recording.py) sets ``tag`` (what is running:
an op of an iteration) and ``category`` (what the storage holds) before each request.

Events are tuples, turned into torch's dicts only when the snapshot is written
(actors/replay/memory/snapshot.py): ``(action, addr, size, stream, tag)`` with the sizes torch
records (requested bytes for alloc and free, mapped bytes for segments); an alloc also carries
the storage's category, an out-of-memory is ``(OOM, 0, requested, stream, tag, device_free)``.
"""
from __future__ import annotations

from actors.replay.memory.cuda_alloc_conf import LARGE_BUFFER, SMALL_BUFFER
from actors.replay.memory.cuda_allocator import CachingAllocatorModel

# actions, in the names torch's TraceEntry gives them (index = code)
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom")
(ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP,
 OOM) = range(len(ACTIONS))
UNTAGGED = -1  # a request outside any op (before the first one: the cuBLAS workspace)
NO_CATEGORY = -1  # not one of the trace's storages (the workspace, an extension's charge)


class RecordingAllocatorModel(CachingAllocatorModel):
    """``CachingAllocatorModel`` that keeps its history (``events``, when ``record_events``),
    the live blocks' requests (``live``: address -> (requested bytes, tag, category, block)), the
    reserved bytes per stream (``stream_reserved``) and the allocated (block) bytes per
    category (``category_bytes``, ``NO_CATEGORY`` included)."""

    def __init__(self, *args, record_events: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_events = record_events
        self.events: list[tuple] = []
        self.tag = UNTAGGED
        self.category = NO_CATEGORY
        self.live: dict[int, tuple] = {}
        self.stream_reserved: dict[int, int] = {}
        self.category_bytes: dict[int, int] = {}

    def malloc(self, nbytes: int, stream: int = 0):
        block = super().malloc(nbytes, stream)
        cat = self.category
        self.live[block.addr] = (nbytes, self.tag, cat, block)
        self.category_bytes[cat] = self.category_bytes.get(cat, 0) + block.size
        if self.record_events:
            self.events.append((ALLOC, block.addr, nbytes, stream, self.tag, cat))
        return block

    def free(self, block) -> None:
        nbytes, _, cat, _ = self.live.pop(block.addr)
        self.category_bytes[cat] -= block.size
        if self.record_events:
            stream = block.pool.stream
            self.events.append((FREE_REQUESTED, block.addr, nbytes, stream, self.tag))
            self.events.append((FREE_COMPLETED, block.addr, nbytes, stream, self.tag))
        super().free(block)

    # --- segments ---------------------------------------------------------------------------
    def _reserve(self, pool, size: int, force: bool = False):
        if force:  # the OOM path: torch records the refused request, then raises
            self._note_oom(pool, size)
        block = super()._reserve(pool, size, force)
        if block is not None and not self.expandable:
            self._segment(SEGMENT_ALLOC, block.addr, block.size, pool.stream)
        return block

    def _note_oom(self, pool, size: int) -> None:
        if self.record_events:
            free = max(0, (self.capacity_bytes or 0) - self.reserved_bytes)
            self.events.append((OOM, 0, size, pool.stream, self.tag, free))

    def _release_segment(self, pool, block) -> None:
        self._segment(SEGMENT_FREE, block.addr, -block.size, pool.stream)
        super()._release_segment(pool, block)

    def _map(self, pool, block, nbytes: int, force: bool):
        addr, before = block.addr, self.reserved_bytes
        mapped = super()._map(pool, block, nbytes, force)
        if mapped is not None:
            self._segment(SEGMENT_MAP, addr, self.reserved_bytes - before, pool.stream)
        return mapped

    def _unmap(self, pool, block) -> None:
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        begin, before = -(-block.addr // page) * page, self.reserved_bytes
        super()._unmap(pool, block)
        if self.reserved_bytes != before:
            self._segment(SEGMENT_UNMAP, begin, self.reserved_bytes - before, pool.stream)

    def _segment(self, action: int, addr: int, delta: int, stream: int) -> None:
        """A segment event: ``delta`` reserved bytes more (alloc, map) or fewer (free, unmap)."""
        self.stream_reserved[stream] = self.stream_reserved.get(stream, 0) + delta
        if self.record_events:
            self.events.append((action, addr, abs(delta), stream, self.tag))
