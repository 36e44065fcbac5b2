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
                raise UserError(f"time model: {name} has {len(v)} stage times, the schedule has {num_stages} stages")
            return [float(x) for x in v]
        tf, ti, tw = expand(self.F, "F"), expand(self.I, "I"), expand(self.W, "W")
        tb = [a + b for a, b in zip(ti, tw)] if self.B is None else expand(self.B, "B")
        return tf, tb, ti, tw


@dataclass
class Simulation:
    makespan: float
    bubble_ratio: float           # 1 - busy / (pp * makespan): idle share of all ranks over the whole step
    stage_bubble_ratio: float     # Qi et al.: (longest rank span - its work) / span, span from a rank's first start
    busy: list[float]             # per rank
    start: list[list[float]]      # per rank, per action
    end: list[list[float]]

    def to_dict(self) -> dict:
        return {"makespan": self.makespan, "bubble_ratio": self.bubble_ratio,
                "stage_bubble_ratio": self.stage_bubble_ratio, "busy": self.busy}


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


def simulate(schedule: Schedule, times: TimeModel | None = None) -> Simulation:
    """Run every rank's list in order, each action as soon as its inputs and its rank are ready.
    Raises UserError on a deadlock (an order that violates the data dependencies)."""
    with paused_gc():
        return _simulate(schedule, times)


def _simulate(schedule: Schedule, times: TimeModel | None) -> Simulation:
    times = times or TimeModel()
    pp, S, M = schedule.pp, schedule.num_stages, schedule.microbatches
    tf, tb, ti, tw = times.per_stage(S)
    comm = float(times.comm)
    stage_rank = schedule.stage_rank
    # hop cost into stage s from s-1 (forward) and from s+1 (backward)
    hop_prev = [comm if s and stage_rank[s - 1] != stage_rank[s] else 0.0 for s in range(S)]
    hop_next = [comm if s + 1 < S and stage_rank[s + 1] != stage_rank[s] else 0.0 for s in range(S)]
    n = S * M
    # finish times: [0, n) forward of (s, i) at s*M+i; [n, 2n) its input grad (B or I)
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
        t0 = t_rank = clock[r]
        st, en = starts[r], ends[r]
        na = len(acts)
        spent = 0.0
        while j < na:
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
            else:                                   # B or I
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
            st[j] = t0
            en[j] = t_rank
            spent += dur
            j += 1
            if key >= 0:
                fin[key] = t_rank
                if waiting:
                    woken = waiting.pop(key, None)
                    if woken:
                        ready.extend(woken)
        busy[r] += spent
        ptr[r] = j
        clock[r] = t_rank
    stuck = [r for r in range(pp) if ptr[r] < len(ranks[r])]
    if stuck:
        raise UserError(_deadlock_message(schedule, stuck, ptr))
    makespan = max(clock) if pp else 0.0
    total = sum(busy)
    bubble = 1.0 - total / (pp * makespan) if makespan > 0 else 0.0
    spans = [(ends[r][-1] - starts[r][0]) if ranks[r] else 0.0 for r in range(pp)]
    cost = max(spans) if spans else 0.0
    stage_bubble = (cost - max(busy)) / cost if cost > 0 else 0.0
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
        return [where[(nk, ns, i)] for nk, ns in need
                if (nk, ns, i) in where and where[(nk, ns, i)][1] >= ptr[where[(nk, ns, i)][0]]]

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
        text = f"B of stage {s + 1} must come before B of stage {s}" if s + 1 < schedule.num_stages else \
            "F must come before B"
    blockers = []
    for nk, ns in need:
        pos = where.get((nk, ns, i))
        if pos is not None and pos[1] >= ptr[pos[0]]:
            blockers.append(f"{nk}{i}@s{ns} (rank {pos[0]} action #{pos[1]})")
    others = ", ".join(f"rank {q} at #{ptr[q]} {schedule.ranks[q][ptr[q]]}" for q in stuck[1:4])
    return (f"schedule {schedule.name}: rank {r} action #{ptr[r]} {a} can never start: it waits for "
            f"{' and '.join(blockers) or 'an action that never runs'} ({text}); the pipeline deadlocks"
            + (f"; also stuck: {others}" if others else ""))


def check_schedule(schedule: Schedule, times: TimeModel | None = None) -> Simulation:
    """Raise UserError naming the first violation; return the simulation of a valid schedule."""
    _structure(schedule)
    return simulate(schedule, times)
