"""The peak reserved bytes of a stream, replayed one pool and stream at a time.

`peak_reserved_bytes(signed, streams, handles, config, period)` gives the same number as
`simulate(...).peak_reserved_bytes` on the whole stream (tests/test_allocator_pools.py holds it
to that on many plans and settings), by replaying each (pool, stream) part of the stream through
its own allocator and adding their final reserved bytes.

Why it is exact (no capacity, no garbage collection, no expandable segments: otherwise the whole
stream is replayed). A request of rounded size s goes to the small pool when s <= 1 MiB, else to
the large one (`round_size`); the free of a block returns it to the pool and stream it came from.
Everything a malloc or a free reads or changes belongs to its (pool, stream): the free list it
searches is the pool's, keyed by (stream, size, address), and the search takes only blocks of
its stream; a split or a merge touches the block's neighbours in its own segment, and a segment
is made for one (pool, stream) and holds only its blocks. What the parts share: the reserved and
allocated counters (read, without a capacity or a garbage-collection threshold, by nothing that
decides anything) and the address of the next segment. Replayed alone, a part's segments get
other addresses, but in the same order (addresses only grow, each segment above the last) and
with the same blocks at the same offsets inside them; addresses decide only the order of free
blocks of equal size (the same order) and nothing else (merges follow the segment's block list,
and segments are never adjacent: `_address` leaves a gap). So each part makes, alone, the same
segments as in the whole replay. Without a capacity nothing is ever released, so each part's
reserved bytes only grow: the whole stream's reserved bytes at any moment are the sum of the
parts', also only growing, and its peak is the sum of the parts' final reserved bytes.

Why bother: a part often settles into a repeating state where the whole does not. Megatron's last
stage keeps each microbatch's loss (a small block) to the end, so the small pool, and with it
the whole allocator, never repeats, while the large pool does; each part gets the stream's
repeating stretch (`Period`, cut to the part's events) and `run_periodic` skips what repeats.
"""

from __future__ import annotations

import numpy as np

from .config import AllocatorConfig
from .model import K_SMALL_SIZE, LARGE, SMALL, CachingAllocator, PartAllocator, Period, round_size


class _Part:
    """(signed bytes, stream, handle) arrays sliced into event tuples (what run_stream reads)."""

    def __init__(self, signed, streams, handles):
        self.signed, self.streams, self.handles = signed, streams, handles

    def __len__(self) -> int:
        return int(self.signed.size)

    def __getitem__(self, sl: slice) -> list[tuple[int, int, int]]:
        return list(zip(self.signed[sl].tolist(), self.streams[sl].tolist(), self.handles[sl].tolist()))


class _RoundedPart:
    """One part's events as `PartAllocator` reads them: (rounded size, handle) for an
    allocation, (0, handle) for a free."""

    def __init__(self, rounded, handles):
        self.rounded, self.handles = rounded, handles

    def __len__(self) -> int:
        return int(self.rounded.size)

    def __getitem__(self, sl: slice) -> list[tuple[int, int]]:
        return list(zip(self.rounded[sl].tolist(), self.handles[sl].tolist()))


def _rounded(signed, config: AllocatorConfig) -> np.ndarray:
    """Each allocation's rounded size (`round_size`), 0 for a free."""
    out = np.zeros(signed.size, np.int64)
    alloc = signed > 0
    sizes, inverse = np.unique(signed[alloc], return_inverse=True)
    rounded = np.fromiter((round_size(int(x), config) for x in sizes), np.int64, sizes.size)
    out[alloc] = rounded[inverse]
    return out


def peak_reserved_bytes(
    signed: np.ndarray,
    streams: np.ndarray,
    handles: np.ndarray,
    config: AllocatorConfig | str | None = None,
    period: Period | None = None,
) -> int:
    """The peak reserved bytes of the events (signed bytes: > 0 allocates under the handle,
    <= 0 frees it; their allocator streams), replayed from an empty allocator without a capacity;
    `period` as for `simulate`. See the module docstring."""
    parts = replay_parts(signed, streams, handles, config, period)
    if len(parts) == 1:
        return parts[0].peak_reserved_bytes
    for a in parts:
        if a.peak_reserved_bytes != a.reserved_bytes:  # never (nothing is released): say so loudly
            raise AssertionError("a pool's reserved bytes fell without a capacity")
    return sum(a.reserved_bytes for a in parts)


def replay_parts(
    signed, streams, handles, config: AllocatorConfig | str | None = None, period: Period | None = None
) -> list[CachingAllocator]:
    """The allocators after replaying each (pool, stream) part of the events, or a one-element
    list: the whole stream replayed in one allocator (expandable segments, or a stream whose
    frees this split cannot place)."""
    if not isinstance(config, AllocatorConfig):
        config = AllocatorConfig.parse(config)
    signed = np.asarray(signed, np.int64)
    streams = np.asarray(streams, np.int64)
    handles = np.asarray(handles, np.int64)
    groups = (
        None if config.expandable_segments or signed.size == 0 else _groups(signed, streams, handles, config)
    )
    if groups is not None and period is not None and period.count > 1:
        # every window must hold the same events of each part (the windows repeat their sizes
        # and streams; checked here for the parts, which the frees take from their allocations)
        part = np.empty(signed.size, np.int64)
        for k, idx in enumerate(groups):
            part[idx] = k
        w = part[period.start : period.start + period.count * period.length].reshape(period.count, -1)
        if not (w == w[0]).all():
            groups = None
    out = []
    for idx in groups or [np.arange(signed.size)]:
        part_period = None
        if period is not None:
            start = int(np.searchsorted(idx, period.start))
            length = int(np.searchsorted(idx, period.start + period.length)) - start
            if length > 0:
                part_period = Period(start, length, period.count, period.shift, period.fixed)
        if groups is None:
            a = CachingAllocator(config)
            part = _Part(signed[idx], streams[idx], handles[idx])
        else:
            rounded = _rounded(signed[idx], config)
            first = int(np.flatnonzero(rounded)[0])
            pool = SMALL if rounded[first] <= K_SMALL_SIZE else LARGE
            a = PartAllocator(config, pool, int(streams[idx][first]))
            part = _RoundedPart(rounded, handles[idx])
        if part_period is None:
            a.run_stream(part[:])
        else:
            a.run_periodic(part, part_period)
        out.append(a)
    return out


def _groups(signed, streams, handles, config) -> list[np.ndarray] | None:
    """The event indices of each (pool, stream) part, or None: replay the stream whole."""
    alloc = signed > 0
    # the pool of each allocation, from its rounded size (few distinct sizes)
    sizes = np.unique(signed[alloc])
    is_small = np.fromiter((round_size(int(s), config) <= K_SMALL_SIZE for s in sizes), bool, sizes.size)
    # the part of each allocation: its pool and its stream
    group = (alloc & np.isin(signed, sizes[is_small])).astype(np.int64) + 2 * (streams - streams.min())
    # a free's part is its allocation's (the block goes back where it came from, whatever stream
    # the free names): the event before it among its handle's, in time order, must be that
    # allocation (else the stream is not one this split understands: replay it whole)
    order = np.lexsort((np.arange(signed.size), handles))
    h, a = handles[order], alloc[order]
    frees = np.flatnonzero(~a)
    if frees.size and (frees[0] == 0 or not (a[frees - 1].all() and (h[frees - 1] == h[frees]).all())):
        return None
    g = group[order]
    g[frees] = g[frees - 1]
    group[order] = g
    return [np.flatnonzero(group == k) for k in np.unique(group).tolist()]
