"""The caching-allocator model's rules, each with numbers worked from
c10/cuda/CUDACachingAllocator.cpp (not from the model's own output)."""

import pytest

from pipemem.allocator import (
    AllocatorConfig,
    AllocatorOOM,
    CachingAllocator,
    allocation_size,
    round_size,
    simulate,
)
from pipemem.errors import UserError

KiB, MiB = 1 << 10, 1 << 20
DEFAULT = AllocatorConfig()


def test_round_size_512_and_power2_divisions():
    assert round_size(1, DEFAULT) == 512
    assert round_size(512, DEFAULT) == 512
    assert round_size(513, DEFAULT) == 1024
    four = AllocatorConfig.parse("roundup_power2_divisions:4")
    # 1200 MiB lies between 1024 and 2048 MiB: steps of 256 MiB -> 1280 MiB
    assert round_size(1200 * MiB, four) == 1280 * MiB
    assert round_size(1024 * MiB, four) == 1024 * MiB  # a power of two stays
    assert round_size(1025, four) == 1536  # 1024..2048 B in steps of 256 B
    assert round_size(1000, four) == 1024  # not above 512*4: plain 512 rounding


def test_allocation_sizes():
    assert allocation_size(512) == 2 * MiB  # small pool segment
    assert allocation_size(1 * MiB) == 2 * MiB
    assert allocation_size(1 * MiB + 512) == 20 * MiB  # large, below 10 MiB
    assert allocation_size(10 * MiB) == 10 * MiB  # 10 MiB and up: rounded to 2 MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def _events(a):
    return list(a.segment_events)


def test_one_mib_plus_one_makes_a_20_mib_segment_and_splits_it():
    a = CachingAllocator(DEFAULT)
    h = a.malloc(MiB + 1)
    assert _events(a) == [("segment_alloc", 20 * MiB)]
    assert a.block_size(h) == MiB + 512
    # the rest (20 MiB - 1 MiB - 512) is split off and serves a 10 MiB request
    a.malloc(10 * MiB)
    assert _events(a) == [("segment_alloc", 20 * MiB)]
    assert a.reserved_bytes == 20 * MiB


def test_large_remainder_of_one_mib_or_less_is_not_split():
    a = CachingAllocator(DEFAULT)
    h = a.malloc(19 * MiB)  # 20 MiB segment, 1 MiB left: not > kSmallSize, not split
    assert a.block_size(h) == 20 * MiB
    assert a.allocated_bytes == 20 * MiB


def test_small_pool_splits_down_to_512():
    a = CachingAllocator(DEFAULT)
    hs = [a.malloc(512 * KiB) for _ in range(4)]  # four fill one 2 MiB segment exactly
    assert _events(a) == [("segment_alloc", 2 * MiB)]
    assert sum(a.block_size(h) for h in hs) == 2 * MiB
    a.malloc(512 * KiB)
    assert _events(a) == [("segment_alloc", 2 * MiB)] * 2


def test_best_fit_and_stream_separation():
    a = CachingAllocator(DEFAULT)
    big = a.malloc(40 * MiB)
    small = a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    h = a.malloc(12 * MiB)  # best fit: the 12 MiB segment, not the 40 MiB one
    assert a.block_size(h) == 12 * MiB
    a.malloc(12 * MiB, stream=7)  # another stream never takes stream 0's cached 40 MiB
    assert _events(a)[-1] == ("segment_alloc", 12 * MiB)


def test_max_split_size_rules():
    cfg = AllocatorConfig.parse("max_split_size_mb:100")
    a = CachingAllocator(cfg)
    h = a.malloc(200 * MiB)
    a.free(h)
    a.malloc(50 * MiB)  # below max_split: never handed an oversize block
    assert _events(a)[-1] == ("segment_alloc", 50 * MiB)
    a2 = CachingAllocator(cfg)
    h = a2.malloc(200 * MiB)
    a2.free(h)
    h2 = a2.malloc(185 * MiB)  # oversize block within 20 MiB of the request: taken whole
    assert a2.block_size(h2) == 200 * MiB and len(a2.segment_events) == 1
    a2.free(h2)
    a2.malloc(150 * MiB)  # 200 >= 150 + 20: not taken
    assert _events(a2)[-1] == ("segment_alloc", 150 * MiB)


def test_oom_is_decided_after_the_cache_is_released():
    a = CachingAllocator(DEFAULT, capacity_bytes=100 * MiB)
    h = a.malloc(60 * MiB)
    a.free(h)  # 60 MiB cached
    a.malloc(80 * MiB)  # 60 + 80 > 100: release the cache, then it fits
    assert _events(a) == [
        ("segment_alloc", 60 * MiB),
        ("segment_free", 60 * MiB),
        ("segment_alloc", 80 * MiB),
    ]
    with pytest.raises(AllocatorOOM):
        a.malloc(40 * MiB)
    assert a.reserved_bytes == 80 * MiB


def test_release_available_frees_oversize_first():
    cfg = AllocatorConfig.parse("max_split_size_mb:40")
    a = CachingAllocator(cfg, capacity_bytes=150 * MiB)
    h1, h2 = a.malloc(100 * MiB), a.malloc(10 * MiB)
    a.free(h1)
    a.free(h2)  # cached: one oversize 100 MiB segment, one of 10 MiB
    a.malloc(60 * MiB)  # 100 >= 60 + 20: not reused; 110 + 60 > 150: cudaMalloc fails
    # release_available_cached_blocks frees the one oversize block >= 60 MiB, the 10 MiB stays
    assert _events(a)[2:] == [("segment_free", 100 * MiB), ("segment_alloc", 60 * MiB)]
    assert a.reserved_bytes == 70 * MiB


def test_release_available_that_falls_short_releases_everything():
    cfg = AllocatorConfig.parse("max_split_size_mb:40")
    a = CachingAllocator(cfg, capacity_bytes=200 * MiB)
    h1, h2 = a.malloc(50 * MiB), a.malloc(10 * MiB)
    a.free(h1)
    a.free(h2)
    a.malloc(180 * MiB)
    # the oversize 50 MiB is released but is less than 180 MiB: release_cached_blocks frees the rest
    assert _events(a)[2:] == [
        ("segment_free", 50 * MiB),
        ("segment_free", 10 * MiB),
        ("segment_alloc", 180 * MiB),
    ]


def test_expandable_segments_map_pages():
    a = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    hs = [a.malloc(3 * MiB) for _ in range(10)]  # 30 MiB in 20 MiB pages
    assert _events(a) == [("segment_map", 20 * MiB), ("segment_map", 20 * MiB)]
    a.malloc(100)  # small pool: its own range, 2 MiB pages
    assert _events(a)[-1] == ("segment_map", 2 * MiB)
    for h in hs:
        a.free(h)
    a.empty_cache()
    assert ("segment_unmap", 40 * MiB) in _events(a)
    assert a.reserved_bytes == 2 * MiB


def test_cross_stream_free_waits():
    a = CachingAllocator(DEFAULT)
    h = a.malloc(12 * MiB)
    a.record_stream(h, 5)
    a.free(h)
    assert a.allocated_bytes == 0
    a.malloc(12 * MiB)  # the block is not back yet: a new segment
    assert len(a.segment_events) == 2
    a.complete_frees()
    a.malloc(12 * MiB)
    assert len(a.segment_events) == 2


def test_simulate_matches_step_by_step():
    ev = [(MiB + 1, 0, "a"), (10 * MiB, 0, "b"), (0, 0, "a"), (30 * MiB, 0, "c"), (0, 0, "b")]
    r = simulate(ev, "")
    assert r.peak_reserved_bytes == 50 * MiB
    assert r.segment_events == [("segment_alloc", 20 * MiB), ("segment_alloc", 30 * MiB)]


@pytest.mark.parametrize(
    "text,word",
    [
        ("foo:1", "foo"),
        ("max_split_size_mb:10", "max_split_size_mb"),
        ("expandable_segments:yes", "expandable_segments"),
        ("garbage_collection_threshold:1.5", "garbage"),
        ("roundup_power2_divisions:3", "roundup"),
        ("max_split_size_mb", "max_split_size_mb"),
    ],
)
def test_bad_alloc_conf(text, word):
    with pytest.raises(UserError) as e:
        AllocatorConfig.parse(text)
    assert "--alloc-conf" in str(e.value) and word in str(e.value) and "\n" not in str(e.value)


def test_divisions_list():
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    # first value fills below it; '>' fills from the last named interval on (as PyTorch does)
    assert cfg.roundup_power2_divisions[:8] == (1,) * 8
    assert cfg.roundup_power2_divisions[9] == 2
    assert cfg.roundup_power2_divisions[10:] == (8,) * 6


def test_garbage_collection_releases_old_cached_segments():
    cfg = AllocatorConfig.parse("garbage_collection_threshold:0.5")
    a = CachingAllocator(cfg, capacity_bytes=100 * MiB, memory_fraction=1.0)
    h1, h2 = a.malloc(30 * MiB), a.malloc(30 * MiB)
    a.free(h1)
    a.free(h2)  # 60 MiB cached, above 0.5 x 100 MiB
    a.malloc(40 * MiB)  # no cached block fits: collect, then cudaMalloc
    # both cached blocks are as old as the average (one get_free_block call): both released
    assert _events(a)[2:] == [("segment_free", 30 * MiB)] * 2 + [("segment_alloc", 40 * MiB)]
    b = CachingAllocator(cfg, capacity_bytes=100 * MiB)  # no memory fraction: no collection
    h1, h2 = b.malloc(30 * MiB), b.malloc(30 * MiB)
    b.free(h1)
    b.free(h2)
    b.malloc(40 * MiB)
    assert _events(b)[2:] == [("segment_alloc", 40 * MiB)]


def _check_invariants(a):
    live = list(a._live.values()) + list(a._pending.values())
    assert a.allocated_bytes == sum(b.size for b in a._live.values())
    segs = a.segments()
    assert a.reserved_bytes == sum(s["size"] for s in segs)
    for pool in (0, 1):
        assert len(a._keys[pool]) == len(a._free[pool])
        for b in a._free[pool].values():
            for n in (b.prev, b.next):  # two free mapped neighbours are always merged
                assert (
                    n is None
                    or n.allocated
                    or n.events
                    or not n.mapped
                    or n in live
                    or n.ptr not in a._free[pool]
                )
            if b.next is not None:
                assert b.ptr + b.size == b.next.ptr


@pytest.mark.parametrize(
    "conf",
    [
        "",
        "expandable_segments:True",
        "max_split_size_mb:64",
        "roundup_power2_divisions:4",
        "expandable_segments:True,max_split_size_mb:64",
    ],
)
def test_random_streams_keep_the_books(conf):
    import random

    rnd = random.Random(7)
    a = CachingAllocator(AllocatorConfig.parse(conf), capacity_bytes=2 << 30)
    live = []
    for step in range(3000):
        if live and rnd.random() < 0.48:
            h = live.pop(rnd.randrange(len(live)))
            if rnd.random() < 0.1:
                a.record_stream(h, 9)
            a.free(h)
        else:
            size = rnd.choice([1, 700, 64 * KiB, 1 * MiB, MiB + 1, 5 * MiB, 12 * MiB, 70 * MiB, 300 * MiB])
            try:
                live.append(a.malloc(size + rnd.randrange(4096), rnd.choice([0, 0, 0, 3])))
            except AllocatorOOM:
                pass
        if step % 500 == 0:
            a.complete_frees()
        if step % 1000 == 999:
            a.empty_cache()
        if step % 97 == 0:
            _check_invariants(a)
    assert a.peak_reserved_bytes <= 2 << 30
    for h in live:
        a.free(h)
    a.empty_cache()
    assert a.reserved_bytes == 0 and a.allocated_bytes == 0


def test_expandable_best_fit_counts_the_unmapped_space_after_a_block():
    a = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    ha = a.malloc(30 * MiB)  # maps two 20 MiB pages: A at 0, 10 MiB free after it
    a.malloc(10 * MiB)  # fills the rest exactly
    a.malloc(15 * MiB)  # maps a third page: 5 MiB free at its end, unmapped space after
    start_a = a._live[ha].ptr
    a.free(ha)  # free: A's 30 MiB (between two allocated blocks) and the 5 MiB tail
    hd = a.malloc(4 * MiB)
    # the 5 MiB tail is the smallest fit, but it can grow into the unmapped space, so for best
    # fit it counts as larger than A's 30 MiB block: the request goes to A's place
    assert a._live[hd].ptr == start_a
    assert _events(a) == [("segment_map", 40 * MiB), ("segment_map", 20 * MiB)]


def test_requests_below_512_and_small_pool_boundary():
    a = CachingAllocator(DEFAULT)
    h = a.malloc(1)
    assert a.block_size(h) == 512 and _events(a) == [("segment_alloc", 2 * MiB)]
    h2 = a.malloc(1 * MiB)  # exactly kSmallSize: still the small pool
    assert a.block_size(h2) == 1 * MiB and len(a.segment_events) == 1


@pytest.mark.parametrize(
    "conf,cap",
    [
        ("", None),
        ("", 600 * MiB),
        ("max_split_size_mb:64", 600 * MiB),
        ("roundup_power2_divisions:[64:2,>:4]", None),
        ("expandable_segments:True", 600 * MiB),
    ],
)
def test_simulate_is_the_step_by_step_allocator(conf, cap):
    import random

    rnd = random.Random(11)
    ev, live, key = [], [], 0
    for _ in range(4000):
        if live and rnd.random() < 0.47:
            ev.append((0, 0, live.pop(rnd.randrange(len(live)))))
        else:
            key += 1
            size = rnd.choice([100, 3000, 200 * KiB, MiB, 3 * MiB, 11 * MiB, 40 * MiB]) + rnd.randrange(9000)
            ev.append((size, rnd.choice([0, 0, 5]), key))
            live.append(key)
    got = simulate(ev, conf, capacity_bytes=cap)
    a = CachingAllocator(AllocatorConfig.parse(conf), capacity_bytes=cap)
    handles, oom_at = {}, None
    for n, (size, stream, k) in enumerate(ev):
        try:
            if size > 0:
                handles[k] = a.malloc(size, stream)
            else:
                a.free(handles.pop(k))
        except AllocatorOOM:
            oom_at = n
            break
    assert got.oom_at == oom_at
    assert got.segment_events == a.segment_events
    assert (
        got.peak_reserved_bytes,
        got.peak_allocated_bytes,
        got.final_reserved_bytes,
        got.final_allocated_bytes,
        got.allocated_at_peak_reserved,
    ) == (
        a.peak_reserved_bytes,
        a.peak_allocated_bytes,
        a.reserved_bytes,
        a.allocated_bytes,
        a.allocated_at_peak_reserved,
    )


def test_settings_a_snapshot_recorded():
    divs = {str(1 << i): (4 if i == 8 else 0) for i in range(16)}
    cfg = AllocatorConfig.from_snapshot_settings(
        {
            "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256,max_non_split_rounding_mb:64",
            "max_split_size": 256 * MiB,
            "expandable_segments": False,
            "garbage_collection_threshold": 0.0,
            "roundup_power2_divisions": divs,
        }
    )
    assert cfg.max_split_size == 256 * MiB
    assert cfg.max_non_split_rounding_size == 64 * MiB  # only in the text: taken from it
    assert cfg.divisions_for(300 * MiB) == 4 and cfg.divisions_for(600 * MiB) == 0
    assert AllocatorConfig.from_snapshot_settings({"max_split_size": -1}) == AllocatorConfig()
    assert AllocatorConfig.from_snapshot_settings(None) == AllocatorConfig()
