"""A model of PyTorch's CUDA caching allocator, rule by rule as c10/cuda/CUDACachingAllocator.cpp
does it (torch 2.6; the rules below hold unchanged from 2.1 to 2.11 unless said: later versions
move the same code into a device-generic `CachingDeviceAllocatorImpl` and the settings into
`AcceleratorAllocatorConfig`, with the same malloc order, split rule, oversize rules, release
order, garbage collection and expandable-segment mapping).

Sizes and pools
  * round_size: a request below kMinBlockSize (512 B) becomes 512 B; otherwise it is rounded up
    to a multiple of 512 B, or, when roundup_power2_divisions gives d > 1 for its interval and
    the size exceeds 512*d, up to the next 1/d step between two powers of two
    (`roundup_power2_next_division`; a power of two stays as it is).
  * get_pool: a rounded size <= kSmallSize (1 MiB) goes to the small pool, else the large pool.
  * get_allocation_size (a new cudaMalloc segment): kSmallBuffer (2 MiB) for the small pool;
    kLargeBuffer (20 MiB) for a size below kMinLargeAlloc (10 MiB); else the size rounded up
    to kRoundLarge (2 MiB).
Reuse
  * get_free_block: best fit over the pool's free blocks ordered by (stream, size, address)
    (BlockComparatorSize; a search key of address 0, `lower_bound`):
    the smallest block of the request's stream that is at least the size, the lowest address
    among equal sizes. A block of max_split_size or more is not handed to a request below
    max_split_size; a request of max_split_size or more takes an oversize block only when it
    is less than max_non_split_rounding (default kLargeBuffer, 20 MiB) larger.
  * should_split: in the small pool (or any pool with expandable segments) the rest is split
    off when it is >= 512 B; in the large pool when it is > kSmallSize (1 MiB) and the request
    is below max_split_size. Otherwise the whole block is handed out.
  * free_block merges the freed block with a free neighbour on each side (previous first) of
    the same segment that has no outstanding stream uses, and returns it to its pool.
A new segment (malloc's order)
  1. get_free_block; 2. garbage_collect_cached_blocks when garbage_collection_threshold is
  set and a per-process memory fraction caps the allocator: while reserved is above
  threshold x cap, release in passes the whole cached large segments whose age
  (get_free_block calls since they were cached) is at least the mean age; 3. alloc_block
  (cudaMalloc of the allocation size; fails above the fraction's cap or the device's
  capacity); 4. on failure
  release_available_cached_blocks: with max_split_size set, release the smallest cached
  oversize segment of the stream that is at least max(size, max_split_size), or else the
  largest ones downwards until that much is released, and retry; 5. release_cached_blocks
  (what empty_cache does): wait for every outstanding stream event, release every whole
  cached segment, large pool first, each pool in (stream, size, address) order, and retry;
  6. OOM (`oom` trace event): the decision is taken after the cache was released.
Expandable segments (`expandable_segments:True`, 2.1+)
  * One virtual address range per (stream, pool) (created when no unmapped range of the
    stream has room), mapped in pages of kSmallBuffer (2 MiB, small pool) or kLargeBuffer
    (20 MiB, large pool). A request that finds no free block maps the pages it needs at the
    lowest unmapped address of the stream's range, joined to a free mapped block just before
    it (`try_allocate_expandable_block`, `map_block`: one `segment_map` event of the mapped
    pages). For best fit a free block followed by unmapped space counts with that space.
  * release_cached_blocks unmaps the whole pages inside each free block (`segment_unmap`).
Frees across streams
  * `record_stream(h, s)` marks a use on another stream; `free` of such a block is requested
    (it stops counting as allocated: `free_requested`) but the block returns to the pool
    only when its events complete (`free_completed`). When the GPU gets there is not the
    allocator's to know (process_events polls the events at each malloc): the caller says it
    with `complete_frees()` or `free_completed(h)` (a trace records where it happened), and
    release_cached_blocks synchronizes and completes them all.

Reserved (`torch.cuda.memory_reserved`) is the bytes of segments plus mapped pages;
allocated (`memory_allocated`) the rounded sizes of blocks handed out and not yet freed.
Addresses are the model's own (the driver picks them in CUDA); they only break ties between
free blocks of equal size, and a caller may supply them (`address_source`).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from .config import SIZE_MAX, AllocatorConfig

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20

LARGE, SMALL = 0, 1

# A free block's place in its pool's order (stream, size, address) as one int, so that the
# sorted lists compare machine-sized ints, not tuples: addresses below 2**62, sizes below 2**50.
_SZ, _ST = 62, 112
_PTR = (1 << _SZ) - 1
_UST, _UPTR = 64, (1 << 64) - 1  # unmapped ranges: (stream, address)


def _key(stream: int, size: int, ptr: int) -> int:
    return (stream << _ST) + (size << _SZ) + ptr


# The two steps every path of the model takes, as plain functions over one pool's free list
# (`free`: address -> block, `keys`: its sorted `_key`s) so that the inlined loops call them
# without a method lookup. `gc_base`: the pool's get_free_block count (garbage collection ages).


def _best_fit(free: dict, keys: list, stream: int, size: int, mss: int, nsr: int):
    """get_free_block without expandable segments: the smallest cached block of `stream` of at
    least `size` bytes, taken out of the free list, or None (none, or an oversize one that
    max_split_size keeps from this request)."""
    i = bisect_left(keys, (stream << _ST) + (size << _SZ))
    if i < len(keys):
        k = keys[i]
        if (k >> _ST) == stream:
            b = free[k & _PTR]
            if not ((size < mss and b.size >= mss) or (size >= mss and b.size >= size + nsr)):
                del keys[i]
                del free[k & _PTR]
                return b
    return None


def _free_block(block, free: dict, keys: list, gc_base: int) -> None:
    """free_block: merge `block` with each free neighbour (previous first) and put it in the
    free list. A neighbour is free, without outstanding events and mapped alike exactly when it
    sits in the free list."""
    prev = block.prev
    if prev is not None and prev.ptr in free:
        del keys[bisect_left(keys, (prev.stream << _ST) + (prev.size << _SZ) + prev.ptr)]
        del free[prev.ptr]
        block.ptr = prev.ptr
        block.size += prev.size
        block.prev = prev = prev.prev
        if prev is not None:
            prev.next = block
    nxt = block.next
    if nxt is not None and nxt.ptr in free:
        del keys[bisect_left(keys, (nxt.stream << _ST) + (nxt.size << _SZ) + nxt.ptr)]
        del free[nxt.ptr]
        block.size += nxt.size
        block.next = nxt = nxt.next
        if nxt is not None:
            nxt.prev = block
    insort(keys, (block.stream << _ST) + (block.size << _SZ) + block.ptr)
    free[block.ptr] = block
    block.gc_base = gc_base


def _split(block, size: int, free: dict, keys: list, gc_base: int):
    """Cut the first `size` bytes of `block` into a new block, returned; the rest stays `block`
    and goes to the free list."""
    ptr, stream = block.ptr, block.stream
    new = _Block(ptr, size, stream, block.pool, block.seg)
    prev = new.prev = block.prev
    if prev is not None:
        prev.next = new
    new.next = block
    block.prev = new
    block.ptr = ptr = ptr + size
    block.size -= size
    insort(keys, (stream << _ST) + (block.size << _SZ) + ptr)
    free[ptr] = block
    block.gc_base = gc_base
    return new


@dataclass(frozen=True)
class Period:
    """A repeating stretch of an event stream (CachingAllocator.run_periodic): events
    [start, start + count * length) are `count` windows of `length` events, each the one before
    with the same sizes and streams and every key k moved to k + shift, except the keys in
    `fixed`, which stay (keys that windows never name, e.g. a rank's static state). The caller
    guarantees it (pipemem.alloc_stream checks it on the arrays it builds), and that no key of
    `fixed` is ever a moved key (k + shift for a key k of a window)."""

    start: int
    length: int
    count: int
    shift: int
    fixed: frozenset = frozenset()


# run_periodic compares the states before the first 64 windows only, and builds at most 16 whole
# states (when the cheap fingerprint matches but the holders differ, each costs a pass over the blocks)
_PERIOD_LOOK, _PERIOD_BUILDS = 64, 16


class AllocatorOOM(Exception):
    """The modelled allocator could not satisfy a request within the capacity, after releasing
    its cache (what torch raises as torch.OutOfMemoryError)."""

    def __init__(self, size: int, reserved: int, allocated: int, capacity: int | None):
        self.size, self.reserved, self.allocated, self.capacity = size, reserved, allocated, capacity
        super().__init__(
            f"out of memory allocating {size} B: {reserved} B reserved, {allocated} B "
            f"allocated, capacity {capacity} B"
        )


def round_size(size: int, config: AllocatorConfig) -> int:
    """The block size a request of `size` bytes takes (round_size)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    div = config.divisions_for(size)
    if div > 1 and size > K_MIN_BLOCK * div:
        return _next_division(size, div)
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def _next_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division: the next multiple of (power-of-two floor / divisions)."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def allocation_size(size: int) -> int:
    """The cudaMalloc size of a new segment for a rounded request (get_allocation_size)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class _Block:
    __slots__ = (
        "ptr",
        "size",
        "stream",
        "pool",
        "allocated",
        "prev",
        "next",
        "requested",
        "events",
        "uses",
        "seg",
        "mapped",
        "gc_base",
    )

    def __init__(self, ptr, size, stream, pool, seg=None, mapped=True):
        self.ptr, self.size, self.stream, self.pool = ptr, size, stream, pool
        self.allocated = False
        self.prev = self.next = None
        self.requested = 0
        self.events = 0  # outstanding stream events (a requested, not completed, free)
        self.uses = None  # streams recorded with record_stream
        self.seg = seg  # the _Expandable range, or None for a cudaMalloc segment
        self.mapped = mapped
        self.gc_base = 0

    def is_split(self):
        return self.prev is not None or self.next is not None


class _Expandable:
    __slots__ = ("base", "size", "page", "stream", "pool")

    def __init__(self, base, size, page, stream, pool):
        self.base, self.size, self.page, self.stream, self.pool = base, size, page, stream, pool


class CachingAllocator:
    """One device's caching allocator. `malloc` returns an int handle; `free` gives it back.

    capacity_bytes: the device memory the allocator may take (None: unlimited); a cudaMalloc
    or page mapping beyond it fails, which starts the release-and-retry and, failing that,
    raises AllocatorOOM. memory_fraction (or the config's per_process_memory_fraction): the
    cap of torch.cuda.set_per_process_memory_fraction, as a fraction of capacity_bytes."""

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        capacity_bytes: int | None = None,
        memory_fraction: float | None = None,
        address_source=None,
    ):
        self.config = config if config is not None else AllocatorConfig()
        self.capacity = capacity_bytes
        frac = memory_fraction if memory_fraction is not None else self.config.per_process_memory_fraction
        self._allowed = int(frac * capacity_bytes) if (frac is not None and capacity_bytes) else None
        self._gc = self._allowed is not None and self.config.garbage_collection_threshold > 0
        self._mss = self.config.max_split_size
        self._nsr = self.config.max_non_split_rounding_size
        self._expandable = self.config.expandable_segments
        self._plain_rounding = not any(d > 1 for d in self.config.roundup_power2_divisions)
        # free mapped blocks per pool: sorted int keys of (stream, size, ptr) (`_key`) and ptr -> block
        self._keys = ([], [])
        self._free = ({}, {})
        # unmapped ranges of expandable segments per pool: sorted keys of (stream, ptr) and ptr -> block
        self._ukeys = ([], [])
        self._unmapped = ({}, {})
        self._gc_calls = [0, 0]
        self._live: dict[int, _Block] = {}
        self._pending: dict[int, _Block] = {}  # freed, waiting for stream events
        self._segments: dict[int, list] = {}  # cudaMalloc segments: ptr -> [size, stream, pool]
        self._seg_starts: list[int] = []  # their addresses, sorted
        self._ranges: list[_Expandable] = []
        self._next_handle = 1
        self._next_addr = 1 << 56  # above any real device address
        self._address_source = address_source
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.allocated_at_peak_reserved = 0
        self.segment_events: list[tuple[str, int]] = []
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.windows_skipped = 0  # run_periodic: windows of the period not replayed

    # -- public API -----------------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate `nbytes` on `stream`; returns a handle for free()."""
        size = (
            (-(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK if nbytes >= K_MIN_BLOCK else K_MIN_BLOCK)
            if self._plain_rounding
            else round_size(nbytes, self.config)
        )
        pool = SMALL if size <= K_SMALL_SIZE else LARGE
        block = self._get_free_block(size, stream, pool)
        if block is None:
            block = self._new_block(size, stream, pool)
        block = self._hand_out(block, size, nbytes)
        if (
            self.reserved_bytes == self.peak_reserved_bytes
            and self.allocated_bytes > self.allocated_at_peak_reserved
        ):
            self.allocated_at_peak_reserved = self.allocated_bytes  # the most allocated at the peak level
        h = self._next_handle
        self._next_handle = h + 1
        self._live[h] = block
        return h

    def free(self, handle: int) -> None:
        """Free a handle. A block used on other streams (record_stream) waits for them: its
        bytes leave `allocated` now and return to the pool at complete_frees()."""
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated_bytes -= block.size
        if block.uses:
            block.events = len(block.uses)
            block.uses = None
            self._pending[handle] = block
        else:
            self._free_block(block)

    def free_requested(self, handle: int) -> None:
        """The first half of a free whose completion comes later (free_completed)."""
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated_bytes -= block.size
        block.events = max(block.events, 1)
        block.uses = None
        self._pending[handle] = block

    def free_completed(self, handle: int) -> None:
        """The block of a requested free returns to its pool."""
        block = self._pending.pop(handle)
        block.events = 0
        self._free_block(block)

    def record_stream(self, handle: int, stream: int) -> None:
        block = self._live[handle]
        if stream != block.stream:
            if block.uses is None:
                block.uses = set()
            block.uses.add(stream)

    def complete_frees(self) -> None:
        """Every outstanding cross-stream free completes (the streams caught up)."""
        for h in list(self._pending):
            self.free_completed(h)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release_cached_blocks."""
        self._release_cached()

    def reset_peaks(self) -> None:
        self.peak_reserved_bytes = self.reserved_bytes
        self.peak_allocated_bytes = self.allocated_bytes
        self.allocated_at_peak_reserved = self.allocated_bytes

    def block_size(self, handle: int) -> int:
        return self._live[handle].size

    def is_live(self, handle: int) -> bool:
        """Allocated and not freed."""
        return handle in self._live

    def is_pending(self, handle: int) -> bool:
        """Freed, waiting for its stream events (free_requested, not yet free_completed)."""
        return handle in self._pending

    def cache_summary(self) -> dict:
        """Where the reserved-but-unallocated bytes sit now: the cached free blocks per pool
        (bytes, count, the largest) and the blocks waiting for other streams."""
        out = {}
        for name, pool in (("large", LARGE), ("small", SMALL)):
            sizes = [b.size for b in self._free[pool].values()]
            out[name] = {
                "free_bytes": sum(sizes),
                "free_blocks": len(sizes),
                "largest_free_block": max(sizes, default=0),
            }
        out["pending_free_bytes"] = sum(b.size for b in self._pending.values())
        out["reserved_bytes"] = self.reserved_bytes
        out["allocated_bytes"] = self.allocated_bytes
        return out

    def segments(self) -> list[dict]:
        """The current segments (cudaMalloc'd ones and the mapped parts of expandable ranges):
        address, size, stream, pool, and the bytes allocated in them."""
        out = []
        for ptr, (size, stream, pool) in sorted(self._segments.items()):
            out.append(
                {
                    "address": ptr,
                    "size": size,
                    "stream": stream,
                    "pool": "small" if pool == SMALL else "large",
                    "expandable": False,
                    "allocated": 0,
                }
            )
        for r in self._ranges:
            mapped = self._mapped_runs(r)
            for ptr, size in mapped:
                out.append(
                    {
                        "address": ptr,
                        "size": size,
                        "stream": r.stream,
                        "pool": "small" if r.pool == SMALL else "large",
                        "expandable": True,
                        "allocated": 0,
                    }
                )
        starts = [s["address"] for s in out]
        order = sorted(range(len(out)), key=lambda k: starts[k])
        out = [out[k] for k in order]
        starts = [s["address"] for s in out]
        for b in list(self._live.values()) + list(self._pending.values()):
            k = bisect_left(starts, b.ptr + 1) - 1
            if k >= 0 and starts[k] <= b.ptr < starts[k] + out[k]["size"]:
                out[k]["allocated"] += b.size
        return out

    def adopt_segment(self, address: int, size: int, stream: int, live: list) -> list[int]:
        """Put a cudaMalloc segment that existed before the model started (a trace that begins
        mid-run) into the state: `live` lists (address, block_size, requested) of the blocks
        allocated in it, in address order; the gaps between them are cached free blocks.
        Returns a handle per live block. Counts toward reserved without a segment event."""
        pool = SMALL if size == K_SMALL_BUFFER else LARGE
        self._segments[address] = [size, stream, pool]
        insort(self._seg_starts, address)
        self.reserved_bytes += size
        return self._chain(_with_gaps(live, address, address + size), stream, pool, None)

    def adopt_expandable(self, stream: int, small: bool, runs: list) -> list[int]:
        """Put an expandable range that was mapped before the model started into the state:
        `runs` lists (address, size, live) of its mapped stretches in address order, `live`
        as for adopt_segment. The range starts at the first run; what lies between and after
        the runs is unmapped address space. Returns a handle per live block."""
        pool = SMALL if small else LARGE
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        base = runs[0][0]
        space = (self.capacity + self.capacity // 8) if self.capacity else 1 << 40
        space = max(-(-space // page) * page, runs[-1][0] + runs[-1][1] - base)
        rng = _Expandable(base, space, page, stream, pool)
        self._ranges.append(rng)
        pieces, at = [], base
        for addr, size, live in runs:
            if addr > at:
                pieces.append((at, addr - at, None))  # unmapped
            pieces += _with_gaps(live, addr, addr + size)
            at = addr + size
            self.reserved_bytes += size
        if at < base + space:
            pieces.append((at, base + space - at, None))
        return self._chain(pieces, stream, pool, rng)

    def _chain(self, pieces, stream, pool, rng):
        """Link (address, size, state) pieces into one segment's block list: state False a
        cached free block, None unmapped space, an int the requested size of a live block."""
        prev, handles, made = None, [], []
        for ptr, bsize, state in pieces:
            b = _Block(ptr, bsize, stream, pool, rng, mapped=state is not None)
            b.prev = prev
            if prev is not None:
                prev.next = b
            prev = b
            made.append((b, state))
            if state is not None and state is not False:
                b.allocated = True
                b.requested = state
                self.allocated_bytes += bsize
                h = self._next_handle
                self._next_handle += 1
                self._live[h] = b
                handles.append(h)
        for b, state in made:
            if state is None:
                self._insert_unmapped(b)
            elif state is False:
                self._insert(b)
        self.reset_peaks()
        return handles

    # -- the steps of malloc --------------------------------------------------------------

    def run_stream(self, events) -> int | None:
        """malloc/free for a whole stream of `(size, stream, id)` events (size <= 0 frees `id`),
        the same steps as calling malloc and free one by one, with the common path (a cached
        block found, split, freed and merged) inlined. Returns the index of the event that ran
        out of memory, or None."""
        if self._expandable or self._gc:
            return self._run_stream_calls(events)
        return self._run_inline(events, {})

    def _run_inline(self, events, live: dict, first: int = 0) -> int | None:
        """run_stream's inlined loop over `events` from the state `live` (the caller's key ->
        allocated block), which it updates; `first`: the index of events[0] in the whole stream
        (for the index it returns on OOM)."""
        keys_by_pool, free_by_pool = self._keys, self._free
        # no garbage collection here: the pools' get_free_block counts stay 0, the blocks' gc_base too
        best_fit, free_block, split = _best_fit, _free_block, _split
        mss, nsr, plain, cfg = self._mss, self._nsr, self._plain_rounding, self.config
        # the counters live in locals for the loop, written back at its end and around the
        # rare calls that read or move them (_new_block)
        allocated, peak_alloc = self.allocated_bytes, self.peak_allocated_bytes
        reserved, peak_res, at_peak = (
            self.reserved_bytes,
            self.peak_reserved_bytes,
            self.allocated_at_peak_reserved,
        )
        n = first - 1
        try:
            for n, (nbytes, stream, key) in enumerate(events, first):  # noqa: B007 (the except returns n)
                if nbytes <= 0:
                    # free (nothing recorded on other streams here) + free_block
                    block = live.pop(key)
                    block.allocated = False
                    allocated -= block.size
                    pool = block.pool
                    free_block(block, free_by_pool[pool], keys_by_pool[pool], 0)
                    continue
                if plain:
                    size = -(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK if nbytes >= K_MIN_BLOCK else K_MIN_BLOCK
                else:
                    size = round_size(nbytes, cfg)
                pool = SMALL if size <= K_SMALL_SIZE else LARGE
                keys, free = keys_by_pool[pool], free_by_pool[pool]
                block = best_fit(free, keys, stream, size, mss, nsr)
                if block is None:
                    self.allocated_bytes, self.allocated_at_peak_reserved = allocated, at_peak
                    block = self._new_block(size, stream, pool)
                    reserved, peak_res = self.reserved_bytes, self.peak_reserved_bytes
                    at_peak = self.allocated_at_peak_reserved
                rest = block.size - size
                if (rest >= K_MIN_BLOCK) if pool == SMALL else (rest > K_SMALL_SIZE and size < mss):
                    block = split(block, size, free, keys, 0)
                block.allocated = True
                block.requested = nbytes
                allocated += block.size
                if allocated > peak_alloc:
                    peak_alloc = allocated
                if reserved == peak_res and allocated > at_peak:
                    at_peak = allocated
                live[key] = block
        except AllocatorOOM:
            at_peak = self.allocated_at_peak_reserved
            return n
        finally:
            self.allocated_bytes, self.peak_allocated_bytes = allocated, peak_alloc
            self.allocated_at_peak_reserved = at_peak
        return None

    def run_periodic(self, events, period: "Period") -> int | None:
        """run_stream for a stream whose middle repeats (`Period`: identical microbatches of a
        pipeline's steady phase), giving the same state, peaks and segment events as run_stream,
        without replaying the repetitions once the allocator has settled.

        Why it is exact. Call W_u the u-th window of the period and S_u the allocator's state
        before it (its segments, every block's address, size, stream and pool, which caller key
        holds each allocated block, the reserved and allocated bytes, the next segment address).
        The caller promises W_{u+1} = R(W_u) (`Period`): the same sizes and streams, each key
        moved by R (key + shift, but the `fixed` keys, which stay). Every rule of the allocator
        reads keys only to find the block a free names, so renaming the keys of a state and of
        the events it meets changes nothing else: f(R(S), R(W)) = R(f(S, W)), through the same
        reserved and allocated bytes at every event. After window t, if S_t = R(S_{t-1})
        (`_canonical`: the same blocks at the same addresses, each key moved by R), then
        S_{t+1} = f(S_t, W_t) = f(R(S_{t-1}), R(W_{t-1})) = R(f(S_{t-1}, W_{t-1})) = R(S_t), and so
        on to the last window: each later window walks the reserved and allocated bytes of window
        t-1, already counted in the peaks (and, since reserved is the same before and after it,
        it makes no segment: without a capacity nothing is ever released). So the state after
        the last window is R^(count - t)(S_t): the keys of S_t moved, nothing else, and the rest
        of the stream runs from there. R must be one-to-one on the keys it meets: the caller
        promises no fixed key is a moved key (`Period`).

        Only for the inlined path (no expandable segments, no garbage collection) and without a
        capacity (no release, no OOM); otherwise the whole stream is replayed."""
        if self._expandable or self._gc or self.capacity is not None or self._allowed is not None:
            return self.run_stream(events[:])
        start, length, count, shift = period.start, period.length, period.count, period.shift
        fixed = period.fixed
        live: dict = {}
        self._run_inline(events[:start], live)
        seen: dict = {}  # hash of a state -> [(window, state)]
        built = 0
        t = 0
        while t < count:
            if t <= _PERIOD_LOOK and built < _PERIOD_BUILDS:
                # a necessary condition first, in C: the same bytes and the same free blocks at
                # the same addresses; the whole state is built only for states that meet it
                key = hash((self.reserved_bytes, self.allocated_bytes, *map(tuple, self._keys)))
                earlier = seen.setdefault(key, [])
                now = self._canonical(live, fixed, t * shift) if earlier else None
                built += now is not None
                for u, then in earlier:
                    if then is not None and then == now:
                        # S_t = R^k(S_u), k = t - u: whole runs of k windows repeat (see above)
                        k = t - u
                        skip = (count - t) // k * k
                        if skip:
                            live = {(h if h in fixed else h + skip * shift): b for h, b in live.items()}
                            t += skip
                            self.windows_skipped = skip
                        break
                earlier.append((t, now))
                if t >= count:
                    break
            at = start + t * length
            self._run_inline(events[at : at + length], live, at)
            t += 1
        end = start + count * length
        return self._run_inline(events[end:], live, end)

    def _canonical(self, live: dict, fixed, offset: int) -> tuple:
        """The state as far as later events can tell (run_periodic): reserved and allocated
        bytes, the next segment address, the segments, and every block (address -> size,
        stream, pool, and the key holding it, moved keys less `offset`; None when free)."""
        blocks = {}
        for k, b in live.items():
            blocks[b.ptr] = (b.size, b.stream, b.pool, ("f", k) if k in fixed else k - offset)
        for pool in (LARGE, SMALL):
            for ptr, b in self._free[pool].items():
                blocks[ptr] = (b.size, b.stream, b.pool, None)
        return (
            self.reserved_bytes,
            self.allocated_bytes,
            self._next_addr,
            tuple(self._segments),
            frozenset(blocks.items()),
        )

    def _run_stream_calls(self, events):
        handles = {}
        n = -1
        try:
            for n, (nbytes, stream, key) in enumerate(events):  # noqa: B007 (n: the except returns it)
                if nbytes > 0:
                    handles[key] = self.malloc(nbytes, stream)
                else:
                    self.free(handles.pop(key))
        except AllocatorOOM:
            return n
        return None

    def would_reuse(self, nbytes: int, stream: int = 0) -> bool:
        """Whether a request of `nbytes` on `stream` would be served from the cache now
        (get_free_block succeeds), without changing anything."""
        size = round_size(nbytes, self.config)
        pool = SMALL if size <= K_SMALL_SIZE else LARGE
        return self._get_free_block(size, stream, pool, take=False) is not None

    def _get_free_block(self, size, stream, pool, take=True):
        if self._gc and take:
            self._gc_calls[pool] += 1
        keys = self._keys[pool]
        i = bisect_left(keys, (stream << _ST) + (size << _SZ))
        if i == len(keys) or (keys[i] >> _ST) != stream:
            return None
        block = self._free[pool][keys[i] & _PTR]
        if block.seg is not None:
            if self._expandable:
                # a free block followed by unmapped space counts as the size it can grow to
                n = len(keys)
                while block.seg is not None and i + 1 < n and (keys[i + 1] >> _ST) == stream:
                    nxt = self._free[pool][keys[i + 1] & _PTR]
                    if _grow_size(nxt) < _grow_size(block):
                        i += 1
                        block = nxt
                    else:
                        break
            else:
                i += 1
                while (
                    i < len(keys)
                    and (keys[i] >> _ST) == stream
                    and self._free[pool][keys[i] & _PTR].seg is not None
                ):
                    i += 1
                if i == len(keys) or (keys[i] >> _ST) != stream:
                    return None
                block = self._free[pool][keys[i] & _PTR]
        mss = self._mss
        if size < mss and block.size >= mss:
            return None
        if size >= mss and block.size >= size + self._nsr:
            return None
        if take:
            del keys[i]
            del self._free[pool][block.ptr]
        return block

    def _new_block(self, size, stream, pool):
        if self._gc:
            self._garbage_collect()
        alloc = allocation_size(size)
        if alloc >= 1 << 48:
            raise ValueError(f"a request of {size} B is beyond any device (256 TiB or more)")
        block = self._alloc_block(size, alloc, stream, pool)
        if block is None and self._release_available(size, stream, pool):
            block = self._alloc_block(size, alloc, stream, pool)
        if block is None:
            self._release_cached()
            self.num_alloc_retries += 1
            block = self._alloc_block(size, alloc, stream, pool)
        if block is None:
            self.num_ooms += 1
            raise AllocatorOOM(size, self.reserved_bytes, self.allocated_bytes, self.capacity)
        return block

    def _hand_out(self, block, size, requested):
        rest = block.size - size
        if block.pool == SMALL or self._expandable:
            split = rest >= K_MIN_BLOCK
        else:
            split = rest > K_SMALL_SIZE and size < self._mss
        if split:
            pool = block.pool
            block = _split(block, size, self._free[pool], self._keys[pool], self._gc_calls[pool])
        block.allocated = True
        block.requested = requested
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return block

    def _alloc_block(self, size, alloc, stream, pool):
        if self._allowed is not None and self.reserved_bytes + alloc > self._allowed:
            return None
        if self._expandable:
            return self._alloc_expandable(size, stream, pool)
        if self.capacity is not None and self.reserved_bytes + alloc > self.capacity:
            return None
        ptr = self._address(alloc)
        block = _Block(ptr, alloc, stream, pool)
        self._segments[ptr] = [alloc, stream, pool]
        insort(self._seg_starts, ptr)
        self._grow(alloc, "segment_alloc")
        return block

    def _address(self, size):
        if self._address_source is not None:
            ptr = self._address_source(size)
            if ptr is not None and 0 <= ptr and ptr + size <= _PTR and self._free_range(ptr, size):
                return ptr
        ptr = self._next_addr
        # keep every range on its own 2 MiB-aligned stretch, as cudaMalloc's are
        self._next_addr += -(-size // K_SMALL_BUFFER) * K_SMALL_BUFFER + K_SMALL_BUFFER
        return ptr

    def _free_range(self, ptr, size):
        """Whether [ptr, ptr + size) overlaps no segment and no expandable range."""
        starts = self._seg_starts
        k = bisect_left(starts, ptr + size)
        if k > 0 and starts[k - 1] + self._segments[starts[k - 1]][0] > ptr:
            return False
        return all(r.base >= ptr + size or r.base + r.size <= ptr for r in self._ranges)

    def _grow(self, nbytes, action):
        self.reserved_bytes += nbytes
        self.segment_events.append((action, nbytes))
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
            self.allocated_at_peak_reserved = self.allocated_bytes

    # -- the pools -------------------------------------------------------------------------

    def _insert(self, block):
        pool = block.pool
        insort(self._keys[pool], _key(block.stream, block.size, block.ptr))
        self._free[pool][block.ptr] = block
        block.gc_base = self._gc_calls[pool]

    def _remove(self, block):
        pool = block.pool
        if block.mapped:
            keys = self._keys[pool]
            del keys[bisect_left(keys, _key(block.stream, block.size, block.ptr))]
            del self._free[pool][block.ptr]
        else:
            keys = self._ukeys[pool]
            del keys[bisect_left(keys, (block.stream << _UST) + block.ptr)]
            del self._unmapped[pool][block.ptr]

    def _insert_unmapped(self, block):
        insort(self._ukeys[block.pool], (block.stream << _UST) + block.ptr)
        self._unmapped[block.pool][block.ptr] = block

    def _try_merge(self, dst, src):
        """try_merge_blocks: absorb `src` (a neighbour) into `dst` when it is free, has no
        outstanding events and is mapped alike; returns the bytes absorbed."""
        if src is None or src.allocated or src.events or src.uses or dst.mapped != src.mapped:
            return 0
        if src.events == 0 and (src.ptr in self._free[src.pool] or src.ptr in self._unmapped[src.pool]):
            self._remove(src)
        else:
            return 0  # a block still pending (freed, events outstanding) is not in a pool
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _free_block(self, block):
        pool = block.pool
        _free_block(block, self._free[pool], self._keys[pool], self._gc_calls[pool])

    # -- releasing -------------------------------------------------------------------------

    def _release_block(self, block):
        self._remove(block)
        size = self._segments.pop(block.ptr)[0]
        del self._seg_starts[bisect_left(self._seg_starts, block.ptr)]
        self.reserved_bytes -= size
        self.segment_events.append(("segment_free", size))

    def _release_cached(self):
        self.complete_frees()
        for pool in (LARGE, SMALL):
            to_unmap = []
            for key in list(self._keys[pool]):
                block = self._free[pool].get(key & _PTR)
                if block is None:
                    continue
                if block.seg is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if block.prev is None and block.next is None and not block.mapped:
                    self._remove(block)
                    self._ranges.remove(block.seg)

    def _release_available(self, size, stream, pool):
        """release_available_cached_blocks: only with max_split_size set."""
        mss = self._mss
        if mss == SIZE_MAX:
            return False
        target = max(size, mss)
        keys, free = self._keys[pool], self._free[pool]
        i = bisect_left(keys, (stream << _ST) + (target << _SZ))
        if i == len(keys) or (keys[i] >> _ST) != stream or free[keys[i] & _PTR].seg is not None:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < target and free[keys[i] & _PTR].size >= mss and (keys[i] >> _ST) == stream:
                block = free[keys[i] & _PTR]
                first = i == 0
                if not first:
                    i -= 1
                if block.seg is None and not block.is_split():
                    released += block.size
                    self._release_block(block)
                if first:
                    break
            return released >= target
        block = free[keys[i] & _PTR]
        if block.is_split():
            return False
        self._release_block(block)
        return True

    def _garbage_collect(self):
        """garbage_collect_cached_blocks: above threshold x cap, release the older whole
        cached large segments (age: get_free_block calls since cached) until under it."""
        threshold = int(self.config.garbage_collection_threshold * self._allowed)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        free = self._free[LARGE]
        now = self._gc_calls[LARGE]
        candidates = [free[k & _PTR] for k in self._keys[LARGE]]
        candidates = [b for b in candidates if not b.is_split()]
        total_age = sum(now - b.gc_base for b in candidates)
        count = len(candidates)
        if count == 0:
            return
        self.complete_frees()
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for key in list(self._keys[LARGE]):
                block = free.get(key & _PTR)
                if block is None or block.is_split() or block.seg is not None:
                    continue
                age = now - block.gc_base
                if age >= threshold_age:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # -- expandable segments ---------------------------------------------------------------

    def _alloc_expandable(self, size, stream, pool):
        cand = self._find_expandable(size, stream, pool)
        if not cand.mapped and not self._map_block(cand, min(cand.size, size)):
            return None
        while cand.size < size:
            nxt = cand.next
            if not self._map_block(nxt, min(size - cand.size, nxt.size)):
                return None
            cand = nxt
        self._remove(cand)
        return cand

    def _find_expandable(self, size, stream, pool):
        keys, unmapped = self._ukeys[pool], self._unmapped[pool]
        i = bisect_left(keys, stream << _UST)
        while i < len(keys) and (keys[i] >> _UST) == stream:
            c = unmapped[keys[i] & _UPTR]
            if _allocatable(c.prev):
                c = c.prev
            got, b = 0, c
            while got < size and (b is not None and (not b.allocated and not b.events and not b.uses)):
                got += b.size
                b = b.next
            if got >= size:
                return c
            i += 1
        page = K_SMALL_BUFFER if pool == SMALL else K_LARGE_BUFFER
        # 1 1/8 of the device's memory of address space (unlimited capacity: 1 TiB)
        space = (self.capacity + self.capacity // 8) if self.capacity else 1 << 40
        space = -(-space // page) * page
        base = self._address(space)
        rng = _Expandable(base, space, page, stream, pool)
        self._ranges.append(rng)
        block = _Block(base, space, stream, pool, seg=rng, mapped=False)
        self._insert_unmapped(block)
        return block

    def _map_block(self, block, size):
        rng = block.seg
        page = rng.page
        begin = (block.ptr - rng.base) // page
        end = -(-(block.ptr + size - rng.base) // page)
        nbytes = (end - begin) * page
        if self.capacity is not None and self.reserved_bytes + nbytes > self.capacity:
            return False
        self._remove(block)
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(
                block.ptr + nbytes, block.size - nbytes, block.stream, block.pool, rng, mapped=False
            )
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            self._insert_unmapped(rest)
            block.size = nbytes
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert(block)
        self._grow(nbytes, "segment_map")
        return True

    def _unmap_block(self, block):
        rng = block.seg
        page = rng.page
        begin = -(-(block.ptr - rng.base) // page)
        end = (block.ptr + block.size - rng.base) // page
        if begin >= end:
            return
        self._remove(block)
        start = rng.base + begin * page
        nbytes = (end - begin) * page
        before = start - block.ptr
        if before > 0:
            b = _Block(block.ptr, before, block.stream, block.pool, rng)
            b.prev, b.next = block.prev, block
            if block.prev is not None:
                block.prev.next = b
            block.prev = b
            self._insert(b)
        after = block.size - before - nbytes
        if after > 0:
            a = _Block(start + nbytes, after, block.stream, block.pool, rng)
            a.prev, a.next = block, block.next
            if block.next is not None:
                block.next.prev = a
            block.next = a
            self._insert(a)
        block.ptr, block.size, block.mapped = start, nbytes, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_unmapped(block)
        self.reserved_bytes -= nbytes
        self.segment_events.append(("segment_unmap", nbytes))

    def _mapped_runs(self, rng):
        """The mapped stretches of an expandable range, as (address, size)."""
        blocks = [b for b in list(self._live.values()) + list(self._pending.values()) if b.seg is rng]
        blocks += [b for b in self._free[rng.pool].values() if b.seg is rng]
        blocks.sort(key=lambda b: b.ptr)
        runs = []
        for b in blocks:
            if runs and runs[-1][0] + runs[-1][1] == b.ptr:
                runs[-1][1] += b.size
            else:
                runs.append([b.ptr, b.size])
        return [tuple(r) for r in runs]


def _allocatable(b):
    return b is not None and not b.allocated and not b.events and not b.uses


def _grow_size(b):
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)


def _with_gaps(live: list, start: int, end: int) -> list:
    """The (address, size, state) pieces of [start, end): each live (address, block_size,
    requested) block, and a cached free block (state False) in each gap between them."""
    pieces, at = [], start
    for ptr, bsize, req in live:
        if ptr > at:
            pieces.append((at, ptr - at, False))
        pieces.append((ptr, bsize, req))
        at = ptr + bsize
    if at < end:
        pieces.append((at, end - at, False))
    return pieces


class PartAllocator(CachingAllocator):
    """The allocator replaying one (pool, stream) part (no capacity, no garbage collection, no
    expandable segments): `_run_inline` is CachingAllocator's loop for that case, with the
    request already rounded (`round_size`), the pool and stream fixed (every free-list key has
    the part's stream: the stream check of the search is always true), and only the reserved
    bytes counted (allocated bytes, requested sizes and the blocks' `allocated` flags are not
    kept: nothing here reads them, and the state that `run_periodic` compares is still every
    block with its holder). A block here is either held by a key or in the free list (nothing
    waits for other streams, nothing is unmapped)."""

    def __init__(self, config: AllocatorConfig, pool: int, stream: int):
        super().__init__(config)
        self._pool, self._stream = pool, stream

    def _run_inline(self, events, live: dict, first: int = 0) -> None:
        pool, stream = self._pool, self._stream
        keys, free = self._keys[pool], self._free[pool]
        mss, nsr = self._mss, self._nsr
        small = pool == SMALL
        new_block, best_fit, free_block, split = self._new_block, _best_fit, _free_block, _split
        for size, key in events:
            if not size:
                free_block(live.pop(key), free, keys, 0)
                continue
            block = best_fit(free, keys, stream, size, mss, nsr)
            if block is None:
                block = new_block(size, stream, pool)
            rest = block.size - size
            if (rest >= K_MIN_BLOCK) if small else (rest > K_SMALL_SIZE and size < mss):
                block = split(block, size, free, keys, 0)
            live[key] = block
        return None
