"""The fast paths of the schedule simulation and the interleaved generators against the plain
reference versions they replaced: same actions, and the same floats bit for bit (makespan,
bubbles, busy, every start and end), deadlock messages included."""

from __future__ import annotations

import random
from collections import deque

import pytest

from pipemem.errors import UserError
from pipemem.schedules import SCHEDULE_NAMES, SPECS, Schedule, get_schedule
from pipemem.schedules import generators as gen
from pipemem.schedules.actions import Action
from pipemem.schedules.check import Simulation, TimeModel, _deadlock_message, check_schedule, simulate

# every generated (not searched) schedule name
_GENERATORS = tuple(n for spec in SPECS if not spec.searched for n in spec.names)


# ---------------------------------------------------------------- references (the earlier code)


def _reference_simulate(schedule: Schedule, times: TimeModel | None) -> Simulation:
    """The event-driven simulation as first written: index per rank, flat s*M+i slots, a dict of
    waiters."""
    times = times or TimeModel()
    pp, S, M = schedule.pp, schedule.num_stages, schedule.microbatches
    tf, tb, ti, tw = times.per_stage(S)
    comm = float(times.comm)
    stage_rank = schedule.stage_rank
    hop_prev = [comm if s and stage_rank[s - 1] != stage_rank[s] else 0.0 for s in range(S)]
    hop_next = [comm if s + 1 < S and stage_rank[s + 1] != stage_rank[s] else 0.0 for s in range(S)]
    n = S * M
    fin = [-1.0] * (2 * n)
    ranks = schedule.ranks
    ptr = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    starts = [[0.0] * len(a) for a in ranks]
    ends = [[0.0] * len(a) for a in ranks]
    waiting: dict[int, list[int]] = {}
    ready = deque(range(pp))
    last = S - 1
    while ready:
        r = ready.popleft()
        acts = ranks[r]
        j = ptr[r]
        t_rank = clock[r]
        spent = 0.0
        while j < len(acts):
            kind, s, i = acts[j]
            k = s * M + i
            if kind == "F":
                key = k
                t0 = t_rank
                if s:
                    d = fin[k - M]
                    if d < 0:
                        waiting.setdefault(k - M, []).append(r)
                        break
                    d += hop_prev[s]
                    if d > t0:
                        t0 = d
                dur = tf[s]
            elif kind == "W":
                key = -1
                d = fin[n + k]
                if d < 0:
                    waiting.setdefault(n + k, []).append(r)
                    break
                t0 = d if d > t_rank else t_rank
                dur = tw[s]
            else:
                key = n + k
                d = fin[k]
                if d < 0:
                    waiting.setdefault(k, []).append(r)
                    break
                t0 = d if d > t_rank else t_rank
                if s != last:
                    d = fin[key + M]
                    if d < 0:
                        waiting.setdefault(key + M, []).append(r)
                        break
                    d += hop_next[s]
                    if d > t0:
                        t0 = d
                dur = tb[s] if kind == "B" else ti[s]
            t_rank = t0 + dur
            starts[r][j] = t0
            ends[r][j] = t_rank
            spent += dur
            j += 1
            if key >= 0:
                fin[key] = t_rank
                ready.extend(waiting.pop(key, ()))
        busy[r] += spent
        ptr[r] = j
        clock[r] = t_rank
    stuck = [r for r in range(pp) if ptr[r] < len(ranks[r])]
    if stuck:
        raise UserError(_deadlock_message(schedule, stuck, ptr))
    makespan = max(clock) if pp else 0.0
    bubble = 1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    spans = [(ends[r][-1] - starts[r][0]) if ranks[r] else 0.0 for r in range(pp)]
    cost = max(spans) if spans else 0.0
    stage_bubble = (cost - max(busy)) / cost if cost > 0 else 0.0
    return Simulation(makespan, bubble, stage_bubble, busy, starts, ends)


def _reference_interleaved_rank(pp, m, vpp, r, warmup, group, zero_bubble=False, deferred_w=0):
    total = m * vpp
    warmup = min(warmup, total)
    bkind = "I" if zero_bubble else "B"

    def in_order(kind, reverse_chunks):
        seen = [0] * vpp
        out = []
        for b, k0 in enumerate(range(0, total, group)):
            c = b % vpp
            if reverse_chunks:
                c = vpp - 1 - c
            n = min(group, total - k0)
            out += [Action(kind, c * pp + r, i) for i in range(seen[c], seen[c] + n)]
            seen[c] += n
        return out

    fwd, bwd = in_order("F", False), in_order(bkind, True)
    acts = fwd[:warmup]
    if not zero_bubble:
        for k in range(total - warmup):
            acts += [fwd[warmup + k], bwd[k]]
        return acts + bwd[total - warmup :]
    wts = [Action("W", a[1], a[2]) for a in bwd]
    nw = 0
    for k in range(total):
        if k < total - warmup:
            acts.append(fwd[warmup + k])
        acts.append(bwd[k])
        if k >= deferred_w:
            acts.append(wts[nw])
            nw += 1
    return acts + wts[nw:]


# ---------------------------------------------------------------- cases


def _outcome(fn, *args):
    try:
        sim = fn(*args)
    except UserError as e:
        return ("error", str(e))
    return ("ok", sim.makespan, sim.bubble_ratio, sim.stage_bubble_ratio, sim.busy, sim.start, sim.end)


def _bits(x):
    """Floats compared by their bits (repr round-trips exactly), in nested lists/tuples."""
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, (list, tuple)):
        return [_bits(v) for v in x]
    return x


def _time_models(S, rng):
    per = lambda lo, hi: [round(rng.uniform(lo, hi), 3) for _ in range(S)]  # noqa: E731
    return [
        None,
        TimeModel(F=1, I=1, W=1, comm=0.3),
        TimeModel(F=1.1, I=0.7, W=0.35, comm=0.05),
        TimeModel(F=per(0.5, 2), I=per(0.3, 1.5), W=per(0.1, 1.0), comm=0.017),
        TimeModel(F=per(0.5, 2), B=per(0.5, 3), I=per(0.3, 1.5), W=per(0.1, 1.0)),
    ]


def _schedules():
    for name in _GENERATORS:
        for pp in (1, 2, 3, 4, 5, 8):
            for m in (1, 2, 3, 4, 6, 8, 10, 12, 16):
                for vpp in (1, 2, 3):
                    try:
                        yield name, get_schedule(name, pp, m, vpp)
                    except UserError:
                        pass


SCHEDULES = list(_schedules())


def test_sweep_covers_every_generator():
    assert {name for name, _ in SCHEDULES} == set(_GENERATORS)
    assert set(_GENERATORS) <= set(SCHEDULE_NAMES)


@pytest.mark.parametrize("name", sorted(_GENERATORS))
def test_simulation_bit_identical(name):
    for nm, s in SCHEDULES:
        if nm != name:
            continue
        rng = random.Random(f"{name}-{s.pp}-{s.microbatches}-{s.vpp}")
        for tm in _time_models(s.num_stages, rng):
            ref = _outcome(_reference_simulate, s, tm)
            assert _bits(_outcome(simulate, s, tm)) == _bits(ref), (name, s, tm)
            fast = simulate(s, tm, timeline=False)
            assert fast.start is None and fast.end is None
            assert _bits(ref[1:5]) == _bits(
                [fast.makespan, fast.bubble_ratio, fast.stage_bubble_ratio, fast.busy]
            )


def test_deadlocks_and_reorders_bit_identical():
    """Orders with adjacent actions swapped: some still run (other times), some deadlock (the
    same message, which names the rank and action number where each rank stopped)."""
    rng = random.Random(7)
    seen = {"ok": 0, "error": 0}
    for _, s in SCHEDULES[::3]:
        for _ in range(3):
            ranks = [list(a) for a in s.ranks]
            r = rng.randrange(s.pp)
            if len(ranks[r]) > 1:
                j = rng.randrange(len(ranks[r]) - 1)
                ranks[r][j], ranks[r][j + 1] = ranks[r][j + 1], ranks[r][j]
            s2 = Schedule(
                s.name, s.pp, s.vpp, s.microbatches, ranks, stage_rank=s.stage_rank, placement=s.placement
            )
            tm = TimeModel(F=1.3, I=0.9, W=0.4, comm=0.11)
            ref = _outcome(_reference_simulate, s2, tm)
            assert _bits(_outcome(simulate, s2, tm)) == _bits(ref)
            assert _outcome(simulate, s2, tm, False)[0] == ref[0]
            seen[ref[0]] += 1
    assert seen["ok"] and seen["error"]


def test_check_schedule_timeline_flag():
    s = get_schedule("ZBVZeroBubble", 4, 8, 2)
    full, light = check_schedule(s), check_schedule(s, timeline=False)
    assert light.start is None and (full.makespan, full.busy) == (light.makespan, light.busy)


@pytest.mark.parametrize("zero_bubble", [False, True])
def test_interleaved_rank_same_actions(zero_bubble):
    for pp in (1, 2, 3, 4, 7):
        for m in (1, 2, 3, 5, 8, 13):
            for vpp in (1, 2, 3):
                for group in sorted({1, 2, pp, m, max(1, m // 2)}):
                    for r in range(pp):
                        for warmup in sorted(
                            {0, 1, r, 2 * (pp - 1 - r) + (vpp - 1) * group, m * vpp, m * vpp + 3}
                        ):
                            args = (pp, m, vpp, r, warmup, group, zero_bubble, r if zero_bubble else 0)
                            got = gen._interleaved_rank(*args)
                            assert got == _reference_interleaved_rank(*args), args
                            assert all(type(a) is Action for a in got)


def test_split_backward_recorded_by_generators():
    for name, s in SCHEDULES:
        known = s.cache.get("split_backward")
        if known is not None:
            assert known == any(a[0] in "IW" for acts in s.ranks for a in acts), name
