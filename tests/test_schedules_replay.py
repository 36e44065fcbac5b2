"""Replay rule, timeline, optimizer step, time model and the validity check."""

from __future__ import annotations

import pytest

from pipemem.errors import UserError
from pipemem.jobs import JobMemory, StageJobs, StaticBytes
from pipemem.replay import replay
from pipemem.schedules import Action, Schedule, get_schedule
from pipemem.schedules.check import TimeModel, check_schedule, simulate


def _jobs(n):
    return {s: StageJobs(s, F=JobMemory(10, 15), B=JobMemory(-10, 5)) for s in range(n)}


def test_replay_rule_by_hand():
    """2 ranks, 1F1B, m=2: rank 0 runs F0 F1 B0 B1, rank 1 runs F0 B0 F1 B1.
    rank 0 from 100: F0 115/110, F1 125/120, B0 125/110, B1 115/100 -> peak 125 first at F1.
    rank 1 from 200: F0 215/210, B0 215/200, F1 215/210, B1 215/200 -> peak 215 at F0."""
    res = replay(get_schedule("1F1B", 2, 2), _jobs(2), [100, StaticBytes(params=150, grads=50)])
    r0, r1 = res.ranks
    assert (r0.peak_allocated_bytes, r0.peak_at, r0.peak_action_index) == (125, "F1@s0", 1)
    assert r0.timeline == [
        ("F0@s0", 100, 115, 110),
        ("F1@s0", 110, 125, 120),
        ("B0@s0", 120, 125, 110),
        ("B1@s0", 110, 115, 100),
    ]
    assert (r0.activation_hwm_bytes, r0.max_inflight, r0.final_bytes) == (20, 2, 100)
    assert (r1.peak_allocated_bytes, r1.peak_at, r1.static_bytes) == (215, "F0@s1", 200)
    assert r1.max_inflight == 1
    assert res.max_peak_allocated_bytes == 215 and res.peak_rank == 1


def test_optimizer_runs_after_the_last_action():
    opt = [JobMemory(0, 40), JobMemory(30, 35)]
    res = replay(get_schedule("1F1B", 2, 2), _jobs(2), [100, 200], optimizer_jobs=opt)
    r0, r1 = res.ranks
    assert (r0.peak_allocated_bytes, r0.peak_at, r0.peak_action_index) == (140, "optimizer", 4)
    assert r0.timeline[-1] == ("optimizer", 100, 140, 100)
    assert (r1.peak_allocated_bytes, r1.peak_at, r1.final_bytes) == (235, "optimizer", 230)


def test_split_backward_needs_i_and_w_jobs():
    with pytest.raises(UserError, match="no I job"):
        replay(get_schedule("ZBH1", 2, 4), _jobs(2), [0, 0])


def test_jobs_for_every_stage():
    with pytest.raises(UserError, match="stage 1"):
        replay(get_schedule("1F1B", 2, 2), {0: _jobs(1)[0]}, [0, 0])


@pytest.mark.parametrize("name", ["1F1B", "GPipe"])
@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (8, 3), (4, 32)])
def test_classic_bubble_formula(name, pp, m):
    """T_B = 2 T_F: makespan (m + p - 1)(T_F + T_B), bubble (p - 1) / (m + p - 1)."""
    sim = simulate(get_schedule(name, pp, m), TimeModel(F=1, B=2))
    assert sim.makespan == pytest.approx((m + pp - 1) * 3)
    assert sim.bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1))


def test_times_from_job_seconds_and_comm():
    jobs = {s: StageJobs(s, F=JobMemory(1, 1, 2.0), B=JobMemory(-1, 0, 4.0)) for s in range(2)}
    res = replay(get_schedule("1F1B", 2, 1), jobs, [0, 0])
    assert res.makespan == pytest.approx(12.0)  # F, F, B, B in a chain
    sim = simulate(get_schedule("1F1B", 2, 1), TimeModel(F=2, B=4, comm=0.5))
    assert sim.makespan == pytest.approx(13.0)  # two hops


def _sched(ranks, pp=2, m=1, vpp=1):
    return Schedule("test", pp, vpp, m, ranks)


A = Action


def test_check_names_duplicates_and_missing():
    with pytest.raises(UserError, match=r"F0@s0: runs a second time"):
        check_schedule(_sched([[A("F", 0, 0), A("F", 0, 0), A("B", 0, 0)], [A("F", 1, 0), A("B", 1, 0)]]))
    with pytest.raises(UserError, match=r"stage 1 microbatch 0 .* never runs B"):
        check_schedule(_sched([[A("F", 0, 0), A("B", 0, 0)], [A("F", 1, 0)]]))
    with pytest.raises(UserError, match=r"never runs W"):
        check_schedule(_sched([[A("F", 0, 0), A("B", 0, 0)], [A("F", 1, 0), A("I", 1, 0)]]))
    with pytest.raises(UserError, match="placed on rank 0"):
        check_schedule(_sched([[A("F", 0, 0), A("B", 0, 0)], [A("F", 0, 0)]]))


def test_check_names_the_first_dependency_violation():
    # rank 1 wants B of stage 1 before its own F: F must come before B
    bad = _sched([[A("F", 0, 0), A("B", 0, 0)], [A("B", 1, 0), A("F", 1, 0)]])
    with pytest.raises(UserError, match=r"rank 1 action #0 B0@s1 .*F0@s1.*deadlocks"):
        check_schedule(bad)
    # W before I on one rank
    bad = _sched([[A("F", 0, 0), A("B", 0, 0)], [A("F", 1, 0), A("W", 1, 0), A("I", 1, 0)]])
    with pytest.raises(UserError, match="I must come before W"):
        check_schedule(bad)
    # B of stage 0 before B of stage 1 can arrive, while stage 1 waits on microbatch 1 first
    bad = _sched(
        [
            [A("F", 0, 0), A("F", 0, 1), A("B", 0, 1), A("B", 0, 0)],
            [A("F", 1, 0), A("F", 1, 1), A("B", 1, 0), A("B", 1, 1)],
        ],
        m=2,
    )
    check_schedule(bad)  # valid: rank 0 waits, no deadlock
    bad = _sched(
        [
            [A("F", 0, 1), A("F", 0, 0), A("B", 0, 0), A("B", 0, 1)],
            [A("F", 1, 0), A("B", 1, 0), A("F", 1, 1), A("B", 1, 1)],
        ],
        m=2,
    )
    check_schedule(bad)
    crossed = _sched(
        [
            [A("F", 0, 0), A("B", 0, 0), A("F", 0, 1), A("B", 0, 1)],
            [A("F", 1, 1), A("B", 1, 1), A("F", 1, 0), A("B", 1, 0)],
        ],
        m=2,
    )
    with pytest.raises(UserError, match=r"rank 0 action #1 B0@s0 .*B0@s1 \(rank 1 action #3\)"):
        check_schedule(crossed)


def test_jobs_for_one_microbatch_replace_the_stage_jobs():
    """Microbatch 1 of stage 0 keeps 30 instead of 10: rank 0 (F0 F1 B0 B1 from 0) reaches
    10 + 30 + its F peak above net (5) = 45 at F1."""
    jobs = _jobs(2)
    jobs[(0, 1)] = StageJobs(0, F=JobMemory(30, 35), B=JobMemory(-30, 0))
    res = replay(get_schedule("1F1B", 2, 2), jobs, [0, 0])
    r0 = res.ranks[0]
    assert (r0.peak_allocated_bytes, r0.peak_at) == (45, "F1@s0")
    assert r0.timeline == [
        ("F0@s0", 0, 15, 10),
        ("F1@s0", 10, 45, 40),
        ("B0@s0", 40, 45, 30),
        ("B1@s0", 30, 30, 0),
    ]
