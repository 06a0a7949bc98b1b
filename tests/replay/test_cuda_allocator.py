"""The caching allocator model on hand-worked sequences, one rule each (cuda_allocator.py)."""
from __future__ import annotations

import pytest

from actors.errors import ConfigError
from actors.replay.memory.cuda_alloc_conf import (AllocatorSettings, parse_alloc_conf, round_size,
                                           segment_size)
from actors.replay.memory.cuda_allocator import ADDR_BITS, CachingAllocatorModel

MiB = 1 << 20


def model(capacity_mib=None, **settings) -> CachingAllocatorModel:
    cap = None if capacity_mib is None else capacity_mib * MiB
    return CachingAllocatorModel(AllocatorSettings(**settings), cap)


def cached_sizes(m, small=False) -> list[int]:
    pool = m.small_pool if small else m.large_pool
    return sorted(k >> ADDR_BITS for k in pool.keys)


def test_sizes_round_up_to_512_bytes():
    m = model()
    a, b = m.malloc(1), m.malloc(513)
    assert (a.size, b.size) == (512, 1024)
    assert m.allocated_bytes == 1536
    assert m.reserved_bytes == 2 * MiB  # one small segment
    assert cached_sizes(m, small=True) == [2 * MiB - 1536]
    for n in (1, 511, 512, 513, 1025, 10**6):  # the fast path rounds alike (small pool: split)
        assert model().malloc(n).size == round_size(n, [0] * 16) == max(512, -(-n // 512) * 512)


def test_one_mib_is_small_one_byte_more_is_large():
    m = model()
    m.malloc(MiB)
    assert m.reserved_bytes == 2 * MiB
    m.malloc(MiB + 1)
    assert m.reserved_bytes == 2 * MiB + 20 * MiB
    assert cached_sizes(m) == [20 * MiB - (MiB + 512)]


def test_segment_sizes():
    assert segment_size(512) == 2 * MiB
    assert segment_size(3 * MiB) == 20 * MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB + 512) == 12 * MiB


def test_second_3mib_request_comes_from_the_first_20mib_segment():
    m = model()
    a = m.malloc(3 * MiB)
    b = m.malloc(3 * MiB)
    assert m.reserved_bytes == 20 * MiB and m.num_segment_allocs == 1
    assert b.addr == a.addr + 3 * MiB
    assert m.allocated_bytes == 6 * MiB
    assert cached_sizes(m) == [14 * MiB]


def test_best_fit_takes_the_smallest_fitting_block_then_the_lowest_address():
    m = model()
    big, mid, mid2 = m.malloc(16 * MiB), m.malloc(12 * MiB), m.malloc(12 * MiB)
    for block in (big, mid2, mid):
        m.free(block)
    got = m.malloc(11 * MiB)
    assert got.addr == mid.addr  # 12 MiB beats 16 MiB; of the two 12 MiB, the lower address
    assert m.reserved_bytes == 40 * MiB  # served from the cache: no new segment


def test_large_split_needs_more_than_1mib_left():
    m = model()
    whole = m.malloc(19 * MiB)  # 20 MiB segment, 1 MiB left: not split
    assert whole.size == 20 * MiB and m.allocated_bytes == 20 * MiB
    m.free(whole)
    part = m.malloc(18 * MiB + 512 * 1024)  # 1.5 MiB left: split
    assert part.size == 18 * MiB + 512 * 1024
    assert cached_sizes(m) == [MiB + 512 * 1024]


def test_small_split_keeps_a_512_byte_rest():
    m = model()
    m.malloc(MiB)
    m.malloc(MiB - 512)  # leaves exactly 512 B: split off and cached
    assert cached_sizes(m, small=True) == [512]
    last = m.malloc(512)
    assert last.size == 512 and m.reserved_bytes == 2 * MiB


def test_free_merges_with_free_neighbours():
    m = model()
    a, b, c = m.malloc(3 * MiB), m.malloc(3 * MiB), m.malloc(3 * MiB)
    m.free(a)
    m.free(c)  # merges with the 11 MiB tail
    assert cached_sizes(m) == [3 * MiB, 14 * MiB]
    m.free(b)  # joins both sides: the whole segment again
    assert cached_sizes(m) == [20 * MiB]
    assert m.allocated_bytes == 0 and m.reserved_bytes == 20 * MiB  # freed, still reserved


def test_max_split_size_keeps_oversize_blocks_whole_and_for_oversize_requests():
    m = model(max_split_size_bytes=32 * MiB)
    m.free(m.malloc(40 * MiB))
    m.malloc(10 * MiB)  # below max_split: may not take the cached 40 MiB block
    assert m.reserved_bytes == 50 * MiB
    big = m.malloc(36 * MiB)  # at or above: takes it (40 < 36 + 20), unsplit
    assert big.size == 40 * MiB and m.reserved_bytes == 50 * MiB
    m.free(big)
    m.malloc(18 * MiB)  # below max_split again: an 18 MiB segment of its own
    assert m.reserved_bytes == 68 * MiB
    unlimited = model()
    unlimited.free(unlimited.malloc(40 * MiB))
    part = unlimited.malloc(10 * MiB)  # without max_split: split out of the cached block
    assert part.size == 10 * MiB and unlimited.reserved_bytes == 40 * MiB


def test_oversize_request_skips_a_block_20mib_bigger():
    m = model(max_split_size_bytes=32 * MiB)
    m.free(m.malloc(130 * MiB))
    m.malloc(100 * MiB)  # 130 >= 100 + 20: a new segment
    assert m.reserved_bytes == 230 * MiB


def test_release_and_retry_at_capacity_is_counted():
    m = model(capacity_mib=40)
    m.free(m.malloc(12 * MiB))  # 12 MiB cached
    m.malloc(30 * MiB)  # 12 + 30 > 40: release the cache, retry
    assert m.num_alloc_retries == 1 and m.num_ooms == 0
    assert m.reserved_bytes == 30 * MiB and m.reserved_peak_bytes == 30 * MiB


def test_oversize_segments_are_released_first_without_a_retry():
    m = model(capacity_mib=120, max_split_size_bytes=32 * MiB)
    m.free(m.malloc(90 * MiB))  # too big to serve 60 MiB (90 >= 60 + 20)
    m.free(m.malloc(12 * MiB))
    m.malloc(60 * MiB)  # 102 + 60 > 120: the cached 90 MiB oversize segment goes first
    assert m.num_alloc_retries == 0
    assert m.reserved_bytes == 72 * MiB and cached_sizes(m) == [12 * MiB]


def test_oom_is_counted_and_the_stream_goes_on():
    m = model(capacity_mib=40)
    m.malloc(30 * MiB)
    m.malloc(12 * MiB)
    assert m.num_ooms == 1 and m.num_alloc_retries == 1
    assert m.first_oom["request_bytes"] == 12 * MiB and m.first_oom["reserved_bytes"] == 30 * MiB
    assert m.reserved_peak_bytes == 42 * MiB  # what the stream needed


def test_garbage_collection_releases_old_segments_before_reserving():
    def run(**settings):
        m = model(capacity_mib=100, **settings)
        blocks = [m.malloc(n * MiB) for n in (12, 14, 16)]
        for b in blocks:
            m.free(b)
        m.malloc(30 * MiB)  # 42 cached + 30 = 72: below capacity
        m.malloc(40 * MiB)  # 72 + 40 > 100
        return m
    plain, collected = run(), run(garbage_collection_threshold=0.5)
    assert plain.num_alloc_retries == 1
    assert collected.num_alloc_retries == 0  # above 50 MiB the old segments went first
    assert collected.reserved_bytes == plain.reserved_bytes == 70 * MiB


def test_expandable_segments_grow_in_pages_and_reuse_freed_space():
    m = model(expandable_segments=True)
    m.free(m.malloc(30 * MiB))  # two 20 MiB pages mapped
    assert m.reserved_bytes == 40 * MiB
    m.malloc(50 * MiB)  # the 40 MiB free block grows by one page
    assert m.reserved_bytes == 60 * MiB
    fixed = model()
    fixed.free(fixed.malloc(30 * MiB))
    fixed.malloc(50 * MiB)
    assert fixed.reserved_bytes == 80 * MiB  # a second segment


def test_expandable_segments_unmap_free_pages_on_release():
    m = model(expandable_segments=True)
    a, b = m.malloc(30 * MiB), m.malloc(MiB)  # large pool 40 MiB, small pool 2 MiB
    m.free(a)
    m.release_cached()
    assert m.reserved_bytes == 2 * MiB  # the large pages went, the small one is in use
    m.free(b)
    m.release_cached()
    assert m.reserved_bytes == 0 and not m.small_pool.unmapped and not m.large_pool.unmapped


def test_expandable_segments_retry_unmaps_free_pages_then_maps():
    m = model(capacity_mib=80, expandable_segments=True)
    a = m.malloc(30 * MiB)  # pages [0, 40) mapped
    m.malloc(5 * MiB)  # [30, 35); [35, 40) stays free before the unmapped rest
    m.free(a)
    m.malloc(50 * MiB)  # 5 free + 45 more: 60 MiB of pages, 100 > 80: unmap [0, 20), retry
    assert m.num_alloc_retries == 1 and m.num_ooms == 0
    assert m.reserved_bytes == 80 * MiB


def test_roundup_power2_divisions():
    divisions = parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions
    assert round_size(1200 * MiB, divisions) == 1280 * MiB  # 1 GiB + 1/4 steps of 256 MiB
    assert round_size(1024 * MiB, divisions) == 1024 * MiB
    assert round_size(600, divisions) == 1024  # small: plain 512 B rounding
    listed = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]").roundup_power2_divisions
    assert listed[:9] == [1] * 9 and listed[9] == 2 and listed[10:] == [8] * 6


def test_alloc_conf_string():
    s = parse_alloc_conf("max_split_size_mb:128, expandable_segments:True,"
                         "garbage_collection_threshold:0.6,release_lock_on_cudamalloc:True")
    assert s.max_split_size_bytes == 128 * MiB and s.expandable_segments
    assert s.garbage_collection_threshold == 0.6
    for bad in ("max_split_size_mb:20", "expandable_segments:yes", "bogus:1",
                "garbage_collection_threshold:1.5", "backend:cudaMallocAsync",
                "roundup_power2_divisions:3", "max_split_size_mb"):
        with pytest.raises(ConfigError, match="PYTORCH_CUDA_ALLOC_CONF"):
            parse_alloc_conf(bad)


def _check_segments(m, live) -> None:
    """Every segment's blocks tile it, no two free neighbours are left unmerged, and the
    sums agree with the statistics."""
    seen, allocated, mapped = set(), 0, 0
    starts = [*live, *(b for p in (m.small_pool, m.large_pool)
                       for b in (*p.blocks.values(), *p.unmapped))]
    for block in starts:
        while block.prev is not None:
            block = block.prev
        if id(block) in seen:
            continue
        seen.add(id(block))
        while block is not None:
            nxt = block.next
            if nxt is not None:
                assert block.addr + block.size == nxt.addr
                assert block.allocated or nxt.allocated or block.mapped != nxt.mapped
            mapped += block.size if block.mapped else 0
            allocated += block.size if block.allocated else 0
            block = nxt
    assert mapped == m.reserved_bytes and allocated == m.allocated_bytes


@pytest.mark.parametrize("settings", [{}, {"max_split_size_bytes": 24 * MiB},
                                      {"expandable_segments": True},
                                      {"garbage_collection_threshold": 0.5}])
def test_random_streams_keep_the_invariants(settings):
    import random
    rng = random.Random(7)
    m = model(capacity_mib=400, **settings)
    live = []
    for step in range(3000):
        if live and rng.random() < 0.45:
            m.free(live.pop(rng.randrange(len(live))))
        else:
            n = rng.choice((rng.randrange(1, MiB), rng.randrange(MiB, 12 * MiB),
                            rng.randrange(12 * MiB, 60 * MiB)))
            live.append(m.malloc(n))
        assert m.allocated_bytes <= m.reserved_bytes or m.num_ooms
        if step % 500 == 0:
            _check_segments(m, live)
    for block in live:
        m.free(block)
    _check_segments(m, [])
    m.release_cached()
    assert m.allocated_bytes == 0 and m.reserved_bytes == 0


def test_a_block_cached_by_one_stream_serves_only_that_stream():
    """PyTorch's pools key free blocks by stream: what FSDP2's reduce-scatter stream freed is
    not reused by the compute stream (a new segment), but is by its own stream."""
    m = model()
    side = m.malloc(100 * MiB, stream=2)
    m.free(side)
    assert m.reserved_bytes == 100 * MiB
    compute = m.malloc(60 * MiB)  # stream 0: cannot take the side stream's cached 100 MiB
    assert m.reserved_bytes == 160 * MiB and compute.pool is m.large_pool
    again = m.malloc(60 * MiB, stream=2)  # its own stream's cache: split, no new segment
    assert m.reserved_bytes == 160 * MiB and again.addr == side.addr
    assert again.pool is m.pools[(2, False)] and cached_sizes(m) == []
    m.free(again)
    m.free(compute)
    m.release_cached()  # empty_cache releases every stream's cached segments
    assert m.reserved_bytes == 0
