"""Expandable segments (``expandable_segments:True``) for the caching allocator model.

Instead of one segment per cudaMalloc, each pool reserves one address range (1 1/8 of the
device's memory, as PyTorch does) and maps physical pages into it as it grows: 2 MiB pages
for the small pool, 20 MiB for the large one. Reserved memory is what is mapped. A request no
cached block serves maps pages right after the free block before the first unmapped range
(or into the first unmapped range with enough room); freed blocks stay mapped until the cache
is released (``empty_cache``, or the retry before an out-of-memory), which unmaps every whole
page inside a free block.

A mixin of CachingAllocatorModel (cuda_allocator.py): it uses the model's pools, blocks and
statistics.
"""
from __future__ import annotations

from bisect import insort

from actors.replay.memory.cuda_alloc_conf import LARGE_BUFFER, SMALL_BUFFER


def _by_addr(block) -> int:
    return block.addr


class ExpandableSegments:
    """Growing, mapping and unmapping of the pools' expandable segments."""

    def _prefer_expandable(self, pool, i: int) -> int:
        """Best fit counts a free block followed by unmapped space as big as it could grow:
        among the fitting blocks, move on while the next one could grow less."""
        keys, blocks = pool.keys, pool.blocks

        def reach(b) -> int:
            nxt = b.next
            return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

        current = blocks[keys[i]]
        while i + 1 < len(keys):
            candidate = blocks[keys[i + 1]]
            if reach(candidate) >= reach(current):
                break
            i, current = i + 1, candidate
        return i

    def _grow(self, pool, size: int, force: bool):
        """Map pages so that a free block of at least ``size`` exists; returns it taken out
        of the pool, or None when the capacity refuses the pages."""
        block = self._room_for(pool, size)
        if not block.mapped:
            block = self._map(pool, block, min(block.size, size), force)
            if block is None:
                return None
        while block.size < size:  # a free block followed by unmapped pages
            block = self._map(pool, block.next, min(size - block.size, block.next.size), force)
            if block is None:
                return None
        pool.remove(block)
        return block

    def _room_for(self, pool, size: int):
        """The first unmapped range (with the free block before it) that has ``size`` bytes
        of free or unmapped space; a new segment when none has."""
        for block in pool.unmapped:
            start = block
            if block.prev is not None and not block.prev.allocated:
                start = block.prev
            room, b = 0, start
            while b is not None and not b.allocated and room < size:
                room += b.size
                b = b.next
            if room >= size:
                return start
        space = -(-(self.device_bytes * 9 // 8) // LARGE_BUFFER) * LARGE_BUFFER
        base = -(-self.next_addr // LARGE_BUFFER) * LARGE_BUFFER  # page-aligned in both pools
        self.next_addr = base + space
        block = self._new_block(base, space, pool)
        block.mapped = False
        insort(pool.unmapped, block, key=_by_addr)
        return block

    def _map(self, pool, block, nbytes: int, force: bool):
        """Map whole pages at the start of unmapped ``block`` covering ``nbytes``; the mapped
        part joins its free neighbours in the pool. None if the capacity refuses."""
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        nbytes = min(-(-nbytes // page) * page, block.size)
        if not force and self.capacity_bytes is not None and \
                self.reserved_bytes + nbytes > self.capacity_bytes:
            return None
        pool.unmapped.remove(block)
        if nbytes < block.size:
            rest = self._new_block(block.addr + nbytes, block.size - nbytes, pool,
                                   block, block.next)
            rest.mapped = False
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = nbytes
            insort(pool.unmapped, rest, key=_by_addr)
        block.mapped = True
        self._add_reserved(nbytes)
        self.num_segment_allocs += 1
        self._merge(pool, block)
        pool.insert(block)
        return block

    def _unmap(self, pool, block) -> None:
        """Unmap the whole pages inside cached free ``block``; a segment left with nothing
        mapped is given back."""
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        end = block.addr + block.size
        begin, stop = -(-block.addr // page) * page, end // page * page
        if stop <= begin:
            return
        pool.remove(block)
        if begin > block.addr:  # the partial page in front stays mapped and free
            before = self._new_block(block.addr, begin - block.addr, pool, block.prev, block)
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.insert(before)
        if stop < end:
            after = self._new_block(stop, end - stop, pool, block, block.next)
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.addr, block.size, block.mapped = begin, stop - begin, False
        self.reserved_bytes -= block.size
        self.num_segment_frees += 1
        self._merge(pool, block)
        if block.prev is None and block.next is None:
            return  # nothing of the segment is left: its address range is given back
        insort(pool.unmapped, block, key=_by_addr)
