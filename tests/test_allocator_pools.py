"""The peak reserved bytes replayed one (pool, stream) part at a time (`allocator.pools`) equal
the whole stream's replay, to the byte, on many plans and allocator settings; and the parts do
skip repeating windows where the whole allocator never repeats."""

from __future__ import annotations

import pytest
from test_allocator_periodic import PLANS, _inputs, _synthetic

from pipemem.allocator import Period, simulate
from pipemem.allocator.pools import peak_reserved_bytes, replay_parts

MiB = 1 << 20


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:64,roundup_power2_divisions:4"])
def test_parts_equal_the_whole_replay(conf):
    split = 0
    for model, kw in [PLANS[i] for i in ((1, 5, 10) if conf else (0, 3, 6, 8))]:
        for ev, inp, period in _inputs(model, kw):
            full = simulate(ev.as_tuples(), conf).peak_reserved_bytes
            assert peak_reserved_bytes(inp.signed, inp.stream, inp.handle, conf, period) == full, (model, kw)
            assert peak_reserved_bytes(inp.signed, inp.stream, inp.handle, conf) == full, (model, kw)
            split += len(replay_parts(inp.signed, inp.stream, inp.handle, conf)) > 1
    assert split >= 6  # the split is taken, not vacuous


def test_expandable_segments_replay_whole():
    model, kw = PLANS[0]
    ev, inp, period = next(_inputs(model, kw))
    conf = "expandable_segments:True"
    parts = replay_parts(inp.signed, inp.stream, inp.handle, conf, period)
    assert len(parts) == 1
    assert parts[0].peak_reserved_bytes == simulate(ev.as_tuples(), conf).peak_reserved_bytes


def _arrays(ev):
    import numpy as np

    return (np.array([e[i] for e in ev], np.int64) for i in range(3))


def test_a_growing_small_pool_does_not_stop_the_large_pool_repeating():
    """Each window keeps a small block to the end (the whole allocator never repeats), but its
    large blocks rotate: the large pool's part skips windows; the peak is the whole replay's."""
    ev, start, length = _synthetic(200, drift=True)
    count = (len(ev) - start) // length
    period = Period(start, length, count, 10, frozenset({-1, -2}))
    whole = simulate(ev, "", period=period)
    assert whole.windows_skipped == 0
    signed, streams, handles = _arrays(ev)
    parts = replay_parts(signed, streams, handles, "", period)
    assert len(parts) == 2 and max(a.windows_skipped for a in parts) > 100
    assert peak_reserved_bytes(signed, streams, handles, "", period) == simulate(ev, "").peak_reserved_bytes


def test_a_free_without_its_allocation_is_an_error_as_in_the_whole_replay():
    ev = [(4 * MiB, 0, 1), (4096, 0, 2), (0, 0, 1), (0, 0, 1)]
    signed, streams, handles = _arrays(ev[:3])
    assert len(replay_parts(signed, streams, handles, "")) == 2  # small and large
    signed, streams, handles = _arrays(ev)
    with pytest.raises(KeyError):
        simulate(ev, "")
    with pytest.raises(KeyError):
        replay_parts(signed, streams, handles, "")  # replayed whole: the same error


def test_a_free_naming_another_stream_returns_the_block_to_its_part():
    ev = [(4 * MiB, 1, 1), (4 * MiB, 0, 2), (0, 0, 1), (6 * MiB, 1, 3), (0, 1, 2), (0, 1, 3)]
    signed, streams, handles = _arrays(ev)
    assert len(replay_parts(signed, streams, handles, "")) == 2
    assert peak_reserved_bytes(signed, streams, handles, "") == simulate(ev, "").peak_reserved_bytes
