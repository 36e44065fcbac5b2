"""The steady-state shortcut of the allocator replay (`CachingAllocator.run_periodic`): a rank's
stream replayed with its repeating stretch (`alloc_stream.find_period`) gives the same
`SimResult` as the whole stream replayed event by event, to the byte, on many plans; and it does
skip windows where the allocator's state repeats."""

from __future__ import annotations

import numpy as np
import pytest

import pipemem
from pipemem import alloc_stream as A
from pipemem.allocator import Period, simulate
from pipemem.estimate import schedule_of
from pipemem.runtime import lower
from pipemem.stages import build_stage_jobs

MiB = 1 << 20

PLANS = [
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=128)),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=64, recompute="full")),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, vpp=2, microbatches=32)),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=2, vpp=4, microbatches=24, dist_opt=True, dp=2)),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=32, dp=2, convention="torchtitan")),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=32, dp=2, convention="torchtitan", fsdp=True)),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=16, convention="hf", grads="set-to-none")),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=16, schedule="ZBVZeroBubble")),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=16, schedule="ZB1P")),
    ("llama3.2-3b", dict(gpu="h100-80g", tp=2, pp=4, microbatches=48, seq_len=2048, micro_batch=2)),
    ("mixtral-8x7b", dict(pp=4, microbatches=16, ep=2, dp=2, layers=8, convention="megatron")),
]


def _inputs(model, kw):
    e = pipemem.estimate(model, **kw)
    sp = build_stage_jobs(e.arch, e.plan)
    sched = schedule_of(e.plan)
    low = lower(sched, e.runtime)
    first_mb = {s: m for s, m in sp.first_backward_overrides(sched)}
    for r in e.ranks:
        yield A.rank_stream_period(sp, low, r.pp_rank, r.static, r.source[2], sp.stages, first_mb)


def _same(a, b) -> bool:
    return (
        a.peak_reserved_bytes,
        a.peak_allocated_bytes,
        a.final_reserved_bytes,
        a.final_allocated_bytes,
        a.allocated_at_peak_reserved,
        a.segment_events,
        a.oom_at,
    ) == (
        b.peak_reserved_bytes,
        b.peak_allocated_bytes,
        b.final_reserved_bytes,
        b.final_allocated_bytes,
        b.allocated_at_peak_reserved,
        b.segment_events,
        b.oom_at,
    )


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:64,roundup_power2_divisions:4"])
def test_shortcut_equals_full_replay(conf):
    periods = skipped = 0
    for model, kw in PLANS:
        for ev, inp, period in _inputs(model, kw):
            # the input is the stream the allocator always saw (handles renamed, nothing else)
            assert np.array_equal(inp.signed, (ev.sign * ev.size)[ev.stream != A.OUTSIDE])
            full = simulate(ev.as_tuples(), conf)
            assert _same(simulate(inp[:], conf), full)
            if period is None:
                continue
            periods += 1
            short = simulate(inp, conf, period=period)
            assert _same(short, full), (model, kw)
            skipped += short.windows_skipped > 0
    assert periods >= 30 and skipped >= 5  # the shortcut is found and taken, not vacuous


def test_expandable_segments_replay_the_whole_stream():
    model, kw = PLANS[0]
    for ev, inp, period in _inputs(model, kw):
        conf = "expandable_segments:True"
        r = simulate(inp, conf, period=period)
        assert r.windows_skipped == 0 and _same(r, simulate(ev.as_tuples(), conf))


def _synthetic(windows: int, drift: bool):
    """Static state, then `windows` microbatches that each keep one activation for the next
    (a rotating pair) and free a temporary; `drift`: each window also keeps a small block to
    the end (the state never repeats)."""
    ev = [(100 * MiB, 0, -1), (30 * MiB, 0, -2)]
    start = len(ev)
    for w in range(windows):
        h = 10 * w
        ev += [(25 * MiB, 0, h), (7 * MiB, 0, h + 1), (0, 0, h + 1)]
        if w:
            ev.append((0, 0, h - 10))
        if drift:
            ev.append((4096, 0, h + 2))
    length = (len(ev) - start - (3 + drift)) // (windows - 1) if windows > 1 else 0
    return ev, start + 3 + drift, length


@pytest.mark.parametrize("drift", [False, True])
def test_synthetic_periods(drift):
    ev, start, length = _synthetic(200, drift)
    count = (len(ev) - start) // length
    period = Period(start, length, count, 10, frozenset({-1, -2}))
    full = simulate(ev, "")
    short = simulate(ev, "", period=period)
    assert _same(short, full)
    assert (short.windows_skipped > 100) == (not drift)
