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
from .actions import Schedule


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
        for n, a in enumerate(acts):
            kind, s, i = a
            where = f"schedule {name}: rank {r} action #{n} {a}"
            if kind not in seen:
                raise UserError(f"{where}: unknown kind {kind!r} (use F, B, I or W)")
            if not (0 <= s < S):
                raise UserError(f"{where}: stage {s} out of range 0..{S - 1} (pp {pp} x vpp {schedule.vpp})")
            if not (0 <= i < M):
                raise UserError(f"{where}: microbatch {i} out of range 0..{M - 1}")
            if stage_rank[s] != r:
                raise UserError(f"{where}: stage {s} is placed on rank {stage_rank[s]}, not rank {r}")
            k = s * M + i
            if seen[kind][k]:
                raise UserError(f"{where}: runs a second time")
            seen[kind][k] = 1
    sf, sb, si, sw = seen["F"], seen["B"], seen["I"], seen["W"]
    for s in range(S):
        for i in range(M):
            k = s * M + i
            missing = None
            if not sf[k]:
                missing = "F"
            elif sb[k] and (si[k] or sw[k]):
                missing = "no I/W next to its B (backward runs twice)"
            elif not sb[k] and not (si[k] and sw[k]):
                missing = "W" if si[k] else ("I" if sw[k] else "B (or I and W)")
            if missing:
                raise UserError(f"schedule {name}: stage {s} microbatch {i} (rank {stage_rank[s]}) "
                                f"has {missing}" if missing.startswith("no") else
                                f"schedule {name}: stage {s} microbatch {i} (rank {stage_rank[s]}) never runs "
                                f"{missing}")


def simulate(schedule: Schedule, times: TimeModel | None = None) -> Simulation:
    """Run every rank's list in order, each action as soon as its inputs and its rank are ready.
    Raises UserError on a deadlock (an order that violates the data dependencies)."""
    times = times or TimeModel()
    pp, S, M = schedule.pp, schedule.num_stages, schedule.microbatches
    tf, tb, ti, tw = times.per_stage(S)
    comm = float(times.comm)
    stage_rank = schedule.stage_rank
    n = S * M
    fin_f = [-1.0] * n          # F(s, i) finished
    fin_g = [-1.0] * n          # input grad of (s, i) finished (B or I)
    fin_w = [-1.0] * n          # weight grad of (s, i) finished (B or W)
    ranks = schedule.ranks
    ptr = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    starts = [[0.0] * len(a) for a in ranks]
    ends = [[0.0] * len(a) for a in ranks]
    waiting: dict[tuple[int, int], list[int]] = {}
    ready = deque(range(pp))
    last = S - 1
    while ready:
        r = ready.popleft()
        acts = ranks[r]
        j = ptr[r]
        t_rank = clock[r]
        st, en = starts[r], ends[r]
        na = len(acts)
        while j < na:
            kind, s, i = acts[j]
            k = s * M + i
            if kind == "F":
                t0 = t_rank
                if s:
                    d = fin_f[k - M]
                    if d < 0:
                        waiting.setdefault((0, k - M), []).append(r)
                        break
                    if stage_rank[s - 1] != r:
                        d += comm
                    if d > t0:
                        t0 = d
                dur = tf[s]
                t1 = t0 + dur
                fin_f[k] = t1
                key = (0, k)
            elif kind == "W":
                d = fin_g[k]
                if d < 0:
                    waiting.setdefault((1, k), []).append(r)
                    break
                t0 = d if d > t_rank else t_rank
                dur = tw[s]
                t1 = t0 + dur
                fin_w[k] = t1
                key = None
            else:                                   # B or I
                d = fin_f[k]
                if d < 0:
                    waiting.setdefault((0, k), []).append(r)
                    break
                t0 = d if d > t_rank else t_rank
                if s != last:
                    d = fin_g[k + M]
                    if d < 0:
                        waiting.setdefault((1, k + M), []).append(r)
                        break
                    if stage_rank[s + 1] != r:
                        d += comm
                    if d > t0:
                        t0 = d
                dur = tb[s] if kind == "B" else ti[s]
                t1 = t0 + dur
                fin_g[k] = t1
                if kind == "B":
                    fin_w[k] = t1
                key = (1, k)
            st[j] = t0
            en[j] = t1
            t_rank = t1
            busy[r] += dur
            j += 1
            if key is not None and waiting:
                woken = waiting.pop(key, None)
                if woken:
                    ready.extend(woken)
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
    M = schedule.microbatches
    where = {}
    for r, acts in enumerate(schedule.ranks):
        for n, a in enumerate(acts):
            where[(a.kind, a.stage, a.microbatch)] = (r, n)
    r = stuck[0]
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
