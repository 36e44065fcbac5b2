"""PyTorch's CUDA caching allocator, modelled: what a stream of allocations and frees reserves.

* `config.py`: `AllocatorConfig`, PYTORCH_CUDA_ALLOC_CONF parsed as PyTorch parses it.
* `model.py`: `CachingAllocator` (the rules, cited there) and `AllocatorOOM`.
* `simulate`: one call for a whole stream of events (what per-rank estimates use).
* `snapshot.py`: a `torch.cuda.memory._dump_snapshot` file, read safely, and its replay.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import AllocatorConfig
from .model import AllocatorOOM, CachingAllocator, Period, allocation_size, round_size

__all__ = [
    "AllocatorConfig",
    "CachingAllocator",
    "AllocatorOOM",
    "Period",
    "SimResult",
    "simulate",
    "round_size",
    "allocation_size",
]


@dataclass
class SimResult:
    """What one stream of events did to the allocator."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    final_reserved_bytes: int
    final_allocated_bytes: int
    allocated_at_peak_reserved: int
    segment_events: list
    oom_at: int | None = None  # index of the event that ran out of memory, if any
    windows_skipped: int = 0  # windows of a `period` not replayed (the state had repeated)


def simulate(
    events,
    config: AllocatorConfig | str | None = None,
    capacity_bytes: int | None = None,
    period: Period | None = None,
) -> SimResult:
    """Replay `events` through a fresh allocator.

    Each event is a tuple `(size, stream, id)`: size > 0 allocates `size` bytes on `stream`
    under the caller's `id`; size <= 0 frees the allocation `id` (so `(0, 0, id)` or
    `(-size, stream, id)` both free). A free of an id never allocated is an error (KeyError).
    With capacity_bytes, the first request that runs out of memory after release-and-retry
    stops the replay: `oom_at` is its index. `period`: the stretch of `events` that repeats
    (`Period`); the result is the same, without replaying the repetitions once the allocator's
    state repeats (`CachingAllocator.run_periodic`; `events` then needs only slicing)."""
    if not isinstance(config, AllocatorConfig):
        config = AllocatorConfig.parse(config)
    a = CachingAllocator(config, capacity_bytes=capacity_bytes)
    oom_at = a.run_stream(events) if period is None else a.run_periodic(events, period)
    return SimResult(
        a.peak_reserved_bytes,
        a.peak_allocated_bytes,
        a.reserved_bytes,
        a.allocated_bytes,
        a.allocated_at_peak_reserved,
        a.segment_events,
        oom_at,
        a.windows_skipped,
    )
