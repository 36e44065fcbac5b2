"""Is a schedule valid, and how long does it take?

`check_schedule` verifies that every (stage, microbatch) runs F once and its backward once (B, or
I and W), each on the rank its stage lives on, and then runs `simulate`: an as-soon-as-possible
execution of every rank's list in order, in which
  F(s, i) waits for F(s-1, i); B/I(s, i) waits for F(s, i) and for B/I(s+1, i); W(s, i) for I(s, i).
A rank whose next action waits for something no rank will ever run deadlocks the pipeline; the
error names the first such action. The same simulation with per-stage durations (a TimeModel)
gives the makespan and the bubbles.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import length_hint

from ..errors import UserError
from .actions import Schedule, paused_gc


@dataclass
class TimeModel:
    """Durations per virtual stage (seconds or any unit). Scalars apply to every stage.
    B defaults to I + W; comm is added when a dependency crosses ranks."""

    F: float | list[float] = 1.0
    B: float | list[float] | None = None
    I: float | list[float] = 1.0
    W: float | list[float] = 1.0
    comm: float = 0.0

    def per_stage(self, num_stages: int) -> tuple[list[float], list[float], list[float], list[float]]:
        def expand(v, name):
            if isinstance(v, (int, float)):
                return [float(v)] * num_stages
            if len(v) != num_stages:
                raise UserError(
                    f"time model: {name} has {len(v)} stage times, the schedule has {num_stages} stages"
                )
            return [float(x) for x in v]

        tf, ti, tw = expand(self.F, "F"), expand(self.I, "I"), expand(self.W, "W")
        tb = [a + b for a, b in zip(ti, tw)] if self.B is None else expand(self.B, "B")
        return tf, tb, ti, tw


@dataclass
class Simulation:
    makespan: float
    bubble_ratio: float  # 1 - busy / (pp * makespan): idle share of all ranks over the whole step
    stage_bubble_ratio: (
        float  # Qi et al.: (longest rank span - its work) / span, span from a rank's first start
    )
    busy: list[float]  # per rank
    start: list[list[float]] | None  # per rank, per action (None from simulate(timeline=False))
    end: list[list[float]] | None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("makespan", "bubble_ratio", "stage_bubble_ratio", "busy")}


def _structure(schedule: Schedule) -> None:
    """Each action on its stage's rank, in range, and every (stage, microbatch) exactly covered."""
    pp, S, M = schedule.pp, schedule.num_stages, schedule.microbatches
    name = schedule.name
    if len(schedule.ranks) != pp:
        raise UserError(f"schedule {name}: {len(schedule.ranks)} rank lists for --pp {pp}")
    stage_rank = schedule.stage_rank
    seen = {k: bytearray(S * M) for k in "FBIW"}
    for r, acts in enumerate(schedule.ranks):
        for n, (kind, s, i) in enumerate(acts):
            arr = seen.get(kind)
            if arr is None or not (0 <= s < S) or not (0 <= i < M) or stage_rank[s] != r:
                _bad_action(schedule, r, n)
            k = s * M + i
            if arr[k]:
                raise UserError(f"schedule {name}: rank {r} action #{n} {acts[n]}: runs a second time")
            arr[k] = 1
    n = S * M
    ones = int.from_bytes(b"\x01" * n, "little")
    sf, sb, si, sw = (int.from_bytes(seen[k], "little") for k in "FBIW")
    ok = sf & ((sb & (ones ^ si) & (ones ^ sw)) | ((ones ^ sb) & si & sw))
    if ok == ones:
        return
    sf, sb, si, sw = seen["F"], seen["B"], seen["I"], seen["W"]
    for k in range(n):
        s, i = divmod(k, M)
        where = f"schedule {name}: stage {s} microbatch {i} (rank {stage_rank[s]})"
        if not sf[k]:
            raise UserError(f"{where} never runs F")
        if sb[k] and (si[k] or sw[k]):
            raise UserError(f"{where} runs both B and {'I' if si[k] else 'W'} (its backward twice)")
        if not sb[k] and not (si[k] and sw[k]):
            raise UserError(f"{where} never runs " + ("W" if si[k] else "I" if sw[k] else "B (or I and W)"))


def _bad_action(schedule: Schedule, r: int, n: int):
    a = schedule.ranks[r][n]
    kind, s, i = a
    S, M = schedule.num_stages, schedule.microbatches
    where = f"schedule {schedule.name}: rank {r} action #{n} {a}"
    if kind not in ("F", "B", "I", "W"):
        raise UserError(f"{where}: unknown kind {kind!r} (use F, B, I or W)")
    if not (0 <= s < S):
        raise UserError(f"{where}: stage {s} out of range 0..{S - 1} (pp {schedule.pp} x vpp {schedule.vpp})")
    if not (0 <= i < M):
        raise UserError(f"{where}: microbatch {i} out of range 0..{M - 1}")
    raise UserError(f"{where}: stage {s} is placed on rank {schedule.stage_rank[s]}, not rank {r}")


def simulate(schedule: Schedule, times: TimeModel | None = None, timeline: bool = True) -> Simulation:
    """Run every rank's list in order, each action as soon as its inputs and its rank are ready.
    Raises UserError on a deadlock (an order that violates the data dependencies).
    `timeline=False` skips the per-action start and end times (Simulation.start/end are None),
    for callers that read only the makespan, the bubbles and `busy`."""
    with paused_gc():
        return _simulate(schedule, times, timeline)


def _simulate(schedule: Schedule, times: TimeModel | None, timeline: bool = True) -> Simulation:
    # Event-driven: a rank runs its list until an action needs an input not made yet, then
    # parks on that input and is woken (FIFO) when it is made. This loop is the hot path of
    # `pipemem schedule` and of the planner (10^5-10^6 actions), so it is kept flat: each rank
    # walks an iterator of its own list, finish times live in per-stage rows indexed by
    # microbatch (no s*M+i index arithmetic, whose large ints are allocated), and nothing is
    # stored per action unless the timeline is asked for. The arithmetic (the order of the
    # additions and comparisons, and the order of the wake-ups, which decides how `busy` is
    # summed) is the reference's: tests/test_schedules_equivalence.py compares bit for bit.
    times = times or TimeModel()
    pp, S, M = schedule.pp, schedule.num_stages, schedule.microbatches
    tf, tb, ti, tw = times.per_stage(S)
    comm = float(times.comm)
    stage_rank = schedule.stage_rank
    # hop cost into stage s from s-1 (forward) and from s+1 (backward)
    hop_prev = [comm if s and stage_rank[s - 1] != stage_rank[s] else 0.0 for s in range(S)]
    hop_next = [comm if s + 1 < S and stage_rank[s + 1] != stage_rank[s] else 0.0 for s in range(S)]
    # finish time (-1.0: not yet; tested with `< 0.0`, a float-float compare) of the forward
    # (fwd[s][i]) and of the input grad, B or I (bwd[s][i]), of stage s, microbatch i; nothing
    # waits for a W, so it is not kept
    fwd = [[-1.0] * M for _ in range(S)]
    bwd = [[-1.0] * M for _ in range(S)]
    # the ranks parked on each of them (None: none), in the order they parked
    fwd_parked: list[list] = [[None] * M for _ in range(S)]
    bwd_parked: list[list] = [[None] * M for _ in range(S)]
    ranks = schedule.ranks
    # each rank's place in its list: an iterator, stepped back onto the action it parks on
    iters = [iter(a) for a in ranks]
    clock = [0.0] * pp
    busy = [0.0] * pp
    # per rank, the (starts, ends) being recorded, or None; without a timeline only a rank's
    # first segment is recorded: the span bubble needs its first start
    record = [([], []) for _ in range(pp)]
    starts, ends = [rec[0] for rec in record], [rec[1] for rec in record]
    ready = deque(range(pp))
    last = S - 1
    while ready:
        r = ready.popleft()
        todo = iters[r]
        t_rank = clock[r]
        rec = record[r]
        st, en = rec if rec is not None else (None, None)
        spent = 0.0
        for kind, s, i in todo:
            if kind == "F":
                t0 = t_rank
                if s:
                    d = fwd[s - 1][i]
                    if d < 0.0:
                        wait = fwd_parked[s - 1]
                        break
                    d += hop_prev[s]
                    if d > t0:
                        t0 = d
                dur = tf[s]
                made, parked = fwd[s], fwd_parked[s]
            elif kind == "W":
                d = bwd[s][i]
                if d < 0.0:
                    wait = bwd_parked[s]
                    break
                t0 = d if d > t_rank else t_rank
                dur = tw[s]
                made = None
            else:  # B or I
                d = fwd[s][i]
                if d < 0.0:
                    wait = fwd_parked[s]
                    break
                t0 = d if d > t_rank else t_rank
                if s != last:
                    d = bwd[s + 1][i]
                    if d < 0.0:
                        wait = bwd_parked[s + 1]
                        break
                    d += hop_next[s]
                    if d > t0:
                        t0 = d
                dur = tb[s] if kind == "B" else ti[s]
                made, parked = bwd[s], bwd_parked[s]
            t_rank = t0 + dur
            spent += dur
            if st is not None:
                st.append(t0)
                en.append(t_rank)
            if made is not None:
                made[i] = t_rank
                woken = parked[i]
                if woken is not None:
                    ready.extend(woken)
        else:
            kind = None  # the rank ran to its end
        if kind is not None:  # park on the missing input
            todo.__setstate__(len(ranks[r]) - length_hint(todo) - 1)  # run this action when woken
            w = wait[i]
            if w is None:
                wait[i] = [r]
            else:
                w.append(r)
        if not timeline and rec is not None and st:
            record[r] = None
        busy[r] += spent
        clock[r] = t_rank
    ptr = [len(ranks[r]) - length_hint(iters[r]) for r in range(pp)]  # each rank's next action
    stuck = [r for r in range(pp) if ptr[r] < len(ranks[r])]
    if stuck:
        raise UserError(_deadlock_message(schedule, stuck, ptr))
    makespan = max(clock) if pp else 0.0
    total = sum(busy)
    bubble = 1.0 - total / (pp * makespan) if makespan > 0 else 0.0
    # a rank's span: from its first start to its last end (its clock)
    spans = [(clock[r] - starts[r][0]) if ranks[r] else 0.0 for r in range(pp)]
    cost = max(spans) if spans else 0.0
    stage_bubble = (cost - max(busy)) / cost if cost > 0 else 0.0
    if not timeline:
        starts = ends = None
    return Simulation(makespan, bubble, stage_bubble, busy, starts, ends)


def _deadlock_message(schedule: Schedule, stuck: list[int], ptr: list[int]) -> str:
    where = {}
    for r, acts in enumerate(schedule.ranks):
        for n, a in enumerate(acts):
            where[(a.kind, a.stage, a.microbatch)] = (r, n)

    def blockers_of(r):
        kind, s, i = schedule.ranks[r][ptr[r]]
        if kind == "F":
            need = [("F", s - 1)]
        elif kind == "W":
            need = [("I", s)]
        else:
            need = [("F", s)] + ([("B", s + 1), ("I", s + 1)] if s + 1 < schedule.num_stages else [])
        return [
            where[(nk, ns, i)]
            for nk, ns in need
            if (nk, ns, i) in where and where[(nk, ns, i)][1] >= ptr[where[(nk, ns, i)][0]]
        ]

    # the root cause first: an action that waits for a later action of its own rank
    own = [q for q in stuck if any(b[0] == q for b in blockers_of(q))]
    r = own[0] if own else stuck[0]
    stuck = [r] + [q for q in stuck if q != r]
    a = schedule.ranks[r][ptr[r]]
    kind, s, i = a
    if kind == "F":
        need = [("F", s - 1)]
        text = f"F of stage {s - 1} must come before F of stage {s}"
    elif kind == "W":
        need = [("I", s)]
        text = "I must come before W"
    else:
        need = [("F", s)] + ([("B", s + 1), ("I", s + 1)] if s + 1 < schedule.num_stages else [])
        text = (
            f"B of stage {s + 1} must come before B of stage {s}"
            if s + 1 < schedule.num_stages
            else "F must come before B"
        )
    blockers = []
    for nk, ns in need:
        pos = where.get((nk, ns, i))
        if pos is not None and pos[1] >= ptr[pos[0]]:
            blockers.append(f"{nk}{i}@s{ns} (rank {pos[0]} action #{pos[1]})")
    others = ", ".join(f"rank {q} at #{ptr[q]} {schedule.ranks[q][ptr[q]]}" for q in stuck[1:4])
    return (
        f"schedule {schedule.name}: rank {r} action #{ptr[r]} {a} can never start: it waits for "
        f"{' and '.join(blockers) or 'an action that never runs'} ({text}); the pipeline deadlocks"
        + (f"; also stuck: {others}" if others else "")
    )


def check_schedule(schedule: Schedule, times: TimeModel | None = None, timeline: bool = True) -> Simulation:
    """Raise UserError naming the first violation; return the simulation of a valid schedule
    (`timeline` as in `simulate`)."""
    _structure(schedule)
    return simulate(schedule, times, timeline)
