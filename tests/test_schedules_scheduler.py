"""The memory-limited zero-bubble scheduler."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipemem.errors import UserError
from pipemem.jobs import JobMemory, StageJobs
from pipemem.replay import replay
from pipemem.schedules import get_schedule
from pipemem.schedules.check import TimeModel, check_schedule
from pipemem.schedules.unit_jobs import unit_jobs
from pipemem.schedules.zb_scheduler import memory_limited_schedule, smallest_feasible_limit

EQUAL = TimeModel(F=1, I=1, W=1)


@st.composite
def problems(draw):
    pp = draw(st.integers(1, 5))
    vpp = draw(st.sampled_from([1, 2]))
    m = draw(st.integers(1, 8))
    jobs = {}
    for s in range(pp * vpp):
        f = draw(st.integers(1, 60))
        fpk = f + draw(st.integers(0, 20))
        w = draw(st.integers(0, f))  # kept from I until W
        ipk = draw(st.integers(0, 10))
        jobs[s] = StageJobs(
            s,
            F=JobMemory(f, fpk, draw(st.floats(0.5, 3))),
            B=JobMemory(-f, ipk, draw(st.floats(0.5, 5))),
            I=JobMemory(w - f, ipk, draw(st.floats(0.5, 3))),
            W=JobMemory(-w, draw(st.integers(0, 5)), draw(st.floats(0.2, 3))),
        )
    limit = draw(st.integers(1, 400))
    return pp, vpp, m, jobs, limit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_never_exceeds_the_limit(problem):
    pp, vpp, m, jobs, limit = problem
    try:
        sched = memory_limited_schedule(pp, m, jobs, None, limit, vpp=vpp)
    except UserError as e:
        assert "smallest limit that fits is" in str(e)
        smallest = smallest_feasible_limit(pp, m, jobs, None, vpp=vpp)
        assert smallest > limit
        sched = memory_limited_schedule(pp, m, jobs, None, smallest, vpp=vpp)  # and that one fits
        limit = smallest
    check_schedule(sched)
    res = replay(sched, jobs, None)
    assert all(r.peak_allocated_bytes <= limit for r in res.ranks)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (6, 12), (8, 24)])
@pytest.mark.parametrize("w", [Fraction(1, 2), Fraction(32, 34)])
def test_limit_p_is_at_least_as_fast_as_zb_h1(pp, m, w):
    jobs = unit_jobs(pp, 1, w)
    auto = replay(memory_limited_schedule(pp, m, jobs, EQUAL, pp), jobs, None, times=EQUAL)
    assert auto.max_peak_allocated_bytes <= pp
    for name in ("ZBH1", "ZB1P"):
        zbh1 = replay(get_schedule(name, pp, m), jobs, None, times=EQUAL)
        assert auto.bubble_ratio <= zbh1.bubble_ratio + 1e-12
        assert auto.stage_bubble_ratio <= zbh1.stage_bubble_ratio + 1e-12


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 16), (8, 24)])
def test_greedy_alone_matches_zb_h1_at_limit_p(pp, m):
    """Without the named candidates (search=False) the list scheduler itself is as fast as ZB-H1."""
    jobs = unit_jobs(pp, 1, Fraction(32, 34))
    auto = replay(memory_limited_schedule(pp, m, jobs, EQUAL, pp, search=False), jobs, None, times=EQUAL)
    zb1p = replay(get_schedule("ZB1P", pp, m), jobs, None, times=EQUAL)
    assert auto.max_peak_allocated_bytes <= pp
    assert auto.makespan <= zb1p.makespan


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 12), (4, 24), (8, 24), (8, 48)])
def test_limit_2p_reaches_zero_bubble_with_equal_times(pp, m):
    """Qi et al. 2024: with 2p·M_B and T_F = T_B = T_W the pipeline has (near) zero bubble: every
    rank busy from its first action to its last (bubble as in the paper: longest rank span)."""
    jobs = unit_jobs(pp, 1, Fraction(32, 34))
    res = replay(memory_limited_schedule(pp, m, jobs, EQUAL, 2 * pp), jobs, None, times=EQUAL)
    assert res.max_peak_allocated_bytes <= 2 * pp
    assert res.stage_bubble_ratio <= 0.01
    # and the whole step is as short as any schedule can be: the last rank starts after p-1 forwards
    assert res.makespan == pytest.approx(3 * m + pp - 1)


def test_infeasible_limit_reports_the_smallest_that_fits():
    jobs = unit_jobs(4, 1, Fraction(1, 2))
    smallest = smallest_feasible_limit(4, 8, jobs, EQUAL)
    assert 0 < smallest <= 1  # one microbatch at a time always works
    with pytest.raises(UserError, match="smallest limit that fits is"):
        memory_limited_schedule(4, 8, jobs, EQUAL, smallest / 2)
    sched = memory_limited_schedule(4, 8, jobs, EQUAL, smallest)
    assert replay(sched, jobs, None).max_peak_allocated_bytes <= smallest


def test_more_memory_never_slower():
    jobs = unit_jobs(4, 1, Fraction(32, 34))
    spans = [
        replay(memory_limited_schedule(4, 16, jobs, EQUAL, lim), jobs, None, times=EQUAL).makespan
        for lim in (1, 2, 3, 4, 6, 8)
    ]
    assert spans == sorted(spans, reverse=True)


def test_v_placement_fits_and_is_valid():
    jobs = unit_jobs(8, 2, Fraction(32, 34))
    sched = memory_limited_schedule(4, 8, jobs, EQUAL, 2, vpp=2)
    assert sched.placement == "v"
    check_schedule(sched)
    assert replay(sched, jobs, None).max_peak_allocated_bytes <= 2


def test_named_auto_and_zbvpp():
    assert get_schedule("auto", 4, 8, memory_limit=3).name == "ZBAuto"
    s = get_schedule("ZBVPP", 4, 8, 2)
    check_schedule(s)
    assert replay(s, unit_jobs(8, 2), None).max_peak_allocated_bytes <= 4
    with pytest.raises(UserError, match="auto"):
        get_schedule("1F1B", 4, 8, memory_limit=3)
