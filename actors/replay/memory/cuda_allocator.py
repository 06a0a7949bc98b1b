"""A model of PyTorch's CUDA caching allocator: which segments a stream of allocations and
frees reserves, hence ``max_memory_reserved``, the figure a CUDA OOM is decided by.

Pure Python (no torch, no GPU), one device. The rules (PyTorch's
``c10/cuda/CUDACachingAllocator.cpp``, re-implemented from their behaviour):

* sizes are rounded (cuda_alloc_conf.round_size); requests up to 1 MiB use the small pool,
  larger ones the large pool; each pool caches its free blocks;
* a request takes the best-fitting free block of its pool (smallest size, then lowest address);
  with ``max_split_size`` set, a request below it never takes a block at or above it, and a
  request at or above it only takes a block smaller than request + 20 MiB;
* a taken block is split when the rest is worth keeping: small pool (or expandable segments)
  rest >= 512 B; large pool request < max_split_size and rest > 1 MiB;
* no fitting block: reserve a new segment (cuda_alloc_conf.segment_size); when the capacity
  refuses it, release cached oversize blocks (with max_split_size set) and try again, then
  release every cached whole segment and try once more (``num_alloc_retries`` counts this
  step); still refused: an out-of-memory;
* a freed block stays reserved, merged with its free neighbours in the segment;
* every stream has its own pools: a block freed by one stream's allocation is cached for that
  stream only (PyTorch's pools key free blocks by stream), so memory a side stream (FSDP2's
  all-gather copy-in and reduce-scatter streams) cached is not reused by the compute stream.

Free blocks live in one sorted list of integer keys per pool, ``size << 64 | address``, so a
best fit is one ``bisect``. Expandable segments are in cuda_expandable.py.
"""
from __future__ import annotations

from bisect import bisect_left, insort

from actors.replay.memory.cuda_alloc_conf import (LARGE_BUFFER, SMALL_SIZE, AllocatorSettings,
                                           MIN_BLOCK, round_size, segment_size)
from actors.replay.memory.cuda_expandable import ExpandableSegments

ADDR_BITS = 64  # addresses are counters below 2**64: keys order by size, then address


class Block:
    """A range of a segment: allocated, cached free, or (expandable) not mapped."""

    __slots__ = ("addr", "size", "pool", "allocated", "mapped", "prev", "next", "gc_base")

    def __init__(self, addr: int, size: int, pool: "Pool", prev=None, next=None):
        self.addr, self.size, self.pool = addr, size, pool  # the pool it is cached in when free
        self.allocated = False
        self.mapped = True
        self.prev, self.next = prev, next
        self.gc_base = 0  # the pool's lookup count when the block was cached (its age base)


class Pool:
    """The cached free blocks of one stream's small or large pool."""

    __slots__ = ("small", "stream", "keys", "blocks", "num_lookups", "unmapped")

    def __init__(self, small: bool, stream: int = 0):
        self.small, self.stream = small, stream
        self.keys: list[int] = []  # sorted size << ADDR_BITS | addr of every cached free block
        self.blocks: dict[int, Block] = {}  # key -> block
        self.num_lookups = 0  # best-fit searches so far: the garbage collector's clock
        self.unmapped: list[Block] = []  # expandable segments' unmapped ranges, by address

    def insert(self, block: Block) -> None:
        key = block.size << ADDR_BITS | block.addr
        insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.num_lookups

    def remove(self, block: Block) -> None:
        key = block.size << ADDR_BITS | block.addr
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]


class CachingAllocatorModel(ExpandableSegments):
    """Segments, blocks and statistics of one device's caching allocator.

    ``capacity_bytes``: what segments may reserve in total (None: unlimited);
    ``device_bytes``: the device's memory (sizes an expandable segment's address space).
    """

    _new_block = Block  # for the expandable-segments mixin

    def __init__(self, settings: AllocatorSettings | None = None,
                 capacity_bytes: int | None = None, device_bytes: int | None = None):
        self.settings = s = settings or AllocatorSettings()
        self.capacity_bytes = capacity_bytes
        self.device_bytes = device_bytes or capacity_bytes or 1 << 46
        self.max_split = s.max_split_size_bytes or 1 << 62
        self.divisions = s.roundup_power2_divisions
        self.plain_rounding = not any(n > 1 for n in self.divisions)  # the common fast path
        self.expandable = s.expandable_segments
        self.small_pool, self.large_pool = Pool(True), Pool(False)  # the compute stream's (0)
        self.pools = {(0, True): self.small_pool, (0, False): self.large_pool}  # (stream, small)
        self.next_addr = LARGE_BUFFER  # address counter: never 0, page-aligned segment bases
        self.allocated_bytes = self.allocated_peak_bytes = 0
        self.reserved_bytes = self.reserved_peak_bytes = 0
        self.num_alloc_retries = self.num_ooms = 0
        self.num_segment_allocs = self.num_segment_frees = 0
        self.num_allocs = 0
        self.first_oom: dict | None = None  # the first request the capacity refused

    # --- allocation ---------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        """Serve a request of ``nbytes`` on ``stream`` (0: the compute stream); an out-of-memory
        is counted (``num_ooms``, and the first one in ``first_oom``) and the segment reserved
        beyond the capacity, so the stream goes on and the peak shows how much was needed."""
        if self.plain_rounding:
            size = (nbytes + MIN_BLOCK - 1) & -MIN_BLOCK if nbytes > MIN_BLOCK else MIN_BLOCK
        else:
            size = round_size(nbytes, self.divisions)
        small = size <= SMALL_SIZE
        pool = self.pools.get((stream, small)) or self.pools.setdefault((stream, small),
                                                                        Pool(small, stream))
        self.num_allocs += 1
        block = self._best_fit(pool, size)
        if block is None:
            if self.settings.garbage_collection_threshold:
                self._collect_garbage()
            block = self._reserve(pool, size)
            if block is None and self._release_oversize(pool, size):
                block = self._reserve(pool, size)
            if block is None:
                self.release_cached()
                self.num_alloc_retries += 1
                block = self._reserve(pool, size)
            if block is None:
                self.num_ooms += 1
                if self.first_oom is None:
                    self.first_oom = {"request_bytes": nbytes, "allocation_index": self.num_allocs,
                                      "reserved_bytes": self.reserved_bytes,
                                      "allocated_bytes": self.allocated_bytes}
                block = self._reserve(pool, size, force=True)
        return self._take(pool, block, size)

    def _best_fit(self, pool: Pool, size: int) -> Block | None:
        """The cached block a request of ``size`` takes (removed from the pool), or None."""
        keys = pool.keys
        pool.num_lookups += 1
        i = bisect_left(keys, size << ADDR_BITS)
        if i == len(keys):
            return None
        if self.expandable:
            i = self._prefer_expandable(pool, i)
        key = keys[i]
        found = key >> ADDR_BITS
        oversize = self.max_split
        if size < oversize <= found or (size >= oversize and found >= size + LARGE_BUFFER):
            return None  # an oversize block is kept for oversize requests of about its size
        block = pool.blocks.pop(key)
        del keys[i]
        return block

    def _reserve(self, pool: Pool, size: int, force: bool = False) -> Block | None:
        """A new segment (or newly mapped pages) for ``size``; None if the capacity refuses."""
        if self.expandable:
            return self._grow(pool, size, force)
        seg = segment_size(size)
        if not force and self.capacity_bytes is not None and \
                self.reserved_bytes + seg > self.capacity_bytes:
            return None
        block = Block(self.next_addr, seg, pool)
        self.next_addr += seg
        self._add_reserved(seg)
        self.num_segment_allocs += 1
        return block

    def _add_reserved(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.reserved_peak_bytes:
            self.reserved_peak_bytes = self.reserved_bytes

    def _take(self, pool: Pool, block: Block, size: int) -> Block:
        """Split ``block`` when the rest is worth caching; mark it allocated."""
        rest = block.size - size
        if pool.small or self.expandable:
            split = rest >= MIN_BLOCK
        else:
            split = size < self.max_split and rest > SMALL_SIZE
        if split:
            tail = Block(block.addr + size, rest, pool, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            pool.insert(tail)
        block.allocated = True
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.allocated_peak_bytes:
            self.allocated_peak_bytes = self.allocated_bytes
        return block

    # --- free ---------------------------------------------------------------------------
    def free(self, block: Block) -> None:
        """Return ``block`` to its pool, merged with its free neighbours (still reserved)."""
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = block.pool
        self._merge(pool, block)
        pool.insert(block)

    def _merge(self, pool: Pool, block: Block) -> None:
        """Absorb the free neighbours of ``block`` in the same mapping state."""
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated and prev.mapped == block.mapped:
            self._detach(pool, prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated and nxt.mapped == block.mapped:
            self._detach(pool, nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block

    def _detach(self, pool: Pool, block: Block) -> None:
        """Take a free block out of the pool's cache or its unmapped list."""
        if block.mapped:
            pool.remove(block)
        else:
            pool.unmapped.remove(block)

    # --- giving memory back ---------------------------------------------------------------
    def _release_segment(self, pool: Pool, block: Block) -> None:
        """Give a cached whole segment back to the device."""
        pool.remove(block)
        self.reserved_bytes -= block.size
        self.num_segment_frees += 1

    def _release_oversize(self, pool: Pool, size: int) -> bool:
        """With max_split_size set: release the smallest cached oversize segment that covers
        the request, else the largest ones until they add up to it."""
        if self.settings.max_split_size_bytes is None:
            return False
        need = max(size, self.max_split)
        keys = pool.keys
        i = bisect_left(keys, need << ADDR_BITS)
        if i < len(keys):
            block = pool.blocks[keys[i]]
            if block.prev is None and block.next is None:
                self._release_segment(pool, block)
                return True
            return False
        released = 0
        for key in reversed(keys[:i]):
            if released >= need or key >> ADDR_BITS < self.max_split:
                break
            block = pool.blocks[key]
            if block.prev is None and block.next is None:
                self._release_segment(pool, block)
                released += block.size
        return released >= need

    def release_cached(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached whole segment (and unmap the
        free pages of expandable segments)."""
        for pool in self.pools.values():
            for block in list(pool.blocks.values()):
                if self.expandable:
                    self._unmap(pool, block)
                elif block.prev is None and block.next is None:
                    self._release_segment(pool, block)

    def _collect_garbage(self) -> None:
        """Above threshold x capacity reserved, release cached whole large segments unused
        for at least the average age (in best-fit searches), until enough is back."""
        if self.capacity_bytes is None or self.expandable:  # PyTorch skips expandable blocks
            return
        limit = int(self.settings.garbage_collection_threshold * self.capacity_bytes)
        if self.reserved_bytes <= limit:
            return
        target, reclaimed = self.reserved_bytes - limit, 0
        ages = {b: pool.num_lookups - b.gc_base for pool in self.pools.values() if not pool.small
                for b in pool.blocks.values() if b.prev is None and b.next is None and b.mapped}
        while ages and reclaimed < target:
            threshold = sum(ages.values()) / len(ages)
            old = [b for b, age in ages.items() if age >= threshold]
            for block in old:
                del ages[block]
                reclaimed += block.size
                self._release_segment(block.pool, block)

    def stats(self) -> dict:
        """The figures PyTorch's ``memory_stats()`` names alike."""
        return {"predicted_reserved_peak_bytes": self.reserved_peak_bytes,
                "predicted_allocated_peak_bytes": self.allocated_peak_bytes,
                "num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
                "reserved_bytes": self.reserved_bytes, "allocated_bytes": self.allocated_bytes,
                "num_segment_allocs": self.num_segment_allocs,
                "num_segment_frees": self.num_segment_frees, "num_allocs": self.num_allocs,
                "first_oom": self.first_oom}
