"""Replay a pipeline schedule per rank (layer 6 of DESIGN.md's flow).

Each rank walks its actions in order with every job's {net, peak} from liveness:
    peak = max(peak, current + job.peak);  current += job.net
starting from the rank's static bytes; the optimizer step, when given, runs after the last
action. Durations (a TimeModel, or the jobs' `seconds`) add the makespan and the bubbles.
Built for size: p=64, v=2, m=1024 is 262,144 actions; the loop touches tuples and lists only,
and the timeline's action strings are made when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UserError
from .jobs import JobMemory, StageJobs, StaticBytes
from .schedules.actions import Action, Schedule, paused_gc
from .schedules.check import Simulation, TimeModel, simulate


@dataclass
class RankReplay:
    pp_rank: int
    static_bytes: int
    peak_allocated_bytes: int          # static + highest (current + job.peak)
    peak_at: str                       # action at the peak ('F3@s1', or 'optimizer')
    peak_action_index: int             # index in the rank's list (len(actions) for the optimizer)
    max_inflight: int                  # most (chunk, microbatch) forwards held at once (F +1, B/I -1)
    activation_hwm_bytes: int          # max of `current` after an action (above static)
    final_bytes: int                   # static + current after the last action (and optimizer)
    _actions: list = field(repr=False, default_factory=list)
    _table: dict = field(repr=False, default_factory=dict)
    optimizer: tuple | None = field(repr=False, default=None)   # (before, during, after)
    _override: dict = field(repr=False, default_factory=dict)   # Action -> (net, peak)

    @property
    def timeline(self) -> list[tuple[str, int, int, int]]:
        """(action, bytes before, bytes at its peak, bytes after), static included. Rebuilt on
        demand by walking the actions again, so a replay keeps no per-action lists."""
        out = []
        cur = self.static_bytes
        table, override = self._table, self._override
        for a in self._actions:
            net, pk = override.get(a) or table[a[0]][a[1]]
            out.append((str(a), cur, cur + pk, cur + net))
            cur += net
        if self.optimizer is not None:
            out.append(("optimizer",) + tuple(self.optimizer))
        return out

    def to_dict(self, timeline: bool = False) -> dict:
        d = {"pp_rank": self.pp_rank, "static_bytes": self.static_bytes,
             "peak_allocated_bytes": self.peak_allocated_bytes, "peak_at": self.peak_at,
             "peak_action_index": self.peak_action_index, "max_inflight": self.max_inflight,
             "activation_hwm_bytes": self.activation_hwm_bytes, "final_bytes": self.final_bytes}
        if timeline:
            d["timeline"] = [list(t) for t in self.timeline]
        return d


@dataclass
class ReplayResult:
    schedule: Schedule
    ranks: list[RankReplay]
    simulation: Simulation | None = None

    @property
    def max_peak_allocated_bytes(self):
        return max(r.peak_allocated_bytes for r in self.ranks)

    @property
    def peak_rank(self) -> int:
        return max(self.ranks, key=lambda r: r.peak_allocated_bytes).pp_rank

    @property
    def makespan(self) -> float | None:
        return self.simulation.makespan if self.simulation else None

    @property
    def bubble_ratio(self) -> float | None:
        return self.simulation.bubble_ratio if self.simulation else None

    @property
    def stage_bubble_ratio(self) -> float | None:
        return self.simulation.stage_bubble_ratio if self.simulation else None

    def to_dict(self, timeline: bool = False) -> dict:
        d = {"schedule": self.schedule.name, "pp": self.schedule.pp, "vpp": self.schedule.vpp,
             "microbatches": self.schedule.microbatches,
             "ranks": [r.to_dict(timeline) for r in self.ranks],
             "max_peak_allocated_bytes": self.max_peak_allocated_bytes}
        if self.simulation:
            d.update(makespan=self.makespan, bubble_ratio=self.bubble_ratio,
                     stage_bubble_ratio=self.stage_bubble_ratio)
        return d


def _static_total(x) -> int:
    return x.total if isinstance(x, StaticBytes) else x


def _job_table(schedule: Schedule, jobs) -> dict[str, list]:
    """kind -> per stage (net, peak), or None where the stage has no such job."""
    table = {k: [None] * schedule.num_stages for k in "FBIW"}
    for s in range(schedule.num_stages):
        sj = jobs.get(s)
        if sj is None:
            raise UserError(f"replay: no jobs for virtual stage {s} (schedule {schedule.name} has "
                            f"{schedule.num_stages} stages: pp {schedule.pp} x vpp {schedule.vpp})")
        for kind in "FBIW":
            j = getattr(sj, kind, None)
            if j is None and kind == "B" and sj.I is not None and sj.W is not None:
                j = JobMemory(sj.I.net_bytes + sj.W.net_bytes,
                              max(sj.I.peak_bytes, sj.I.net_bytes + sj.W.peak_bytes),
                              sj.I.seconds + sj.W.seconds)
            if j is not None:
                table[kind][s] = (j.net_bytes, j.peak_bytes)
    return table


def _missing_job(schedule: Schedule, rank: int, table) -> UserError:
    for a in schedule.ranks[rank]:
        if a[0] not in table:
            return UserError(f"replay: rank {rank} runs {a}: unknown kind {a[0]!r}")
        if table[a[0]][a[1]] is None:
            return UserError(f"replay: rank {rank} runs {a} but stage {a[1]} has no {a[0]} job "
                             f"(build split-backward jobs for schedules with I/W)")
    return UserError(f"replay: rank {rank}: malformed actions")


def _times_from_jobs(schedule: Schedule, jobs) -> TimeModel | None:
    sj = [jobs[s] for s in range(schedule.num_stages)]
    tf = [j.F.seconds for j in sj]
    ti = [(j.I.seconds if j.I else 0.0) for j in sj]
    tw = [(j.W.seconds if j.W else 0.0) for j in sj]
    tb = [(j.B.seconds if j.B else a + b) for j, a, b in zip(sj, ti, tw)]
    if min(tf) <= 0 or min(tb) <= 0:
        return None
    return TimeModel(F=tf, B=tb, I=ti, W=tw)


def _overrides(jobs) -> dict:
    """Jobs given for one (stage, microbatch): Action -> (net, peak) for each kind they have."""
    out = {}
    for key, sj in jobs.items():
        if isinstance(key, tuple):
            stage, mb = key
            for kind in "FBIW":
                j = getattr(sj, kind, None)
                if j is not None:
                    out[Action(kind, stage, mb)] = (j.net_bytes, j.peak_bytes)
    return out


def replay(schedule: Schedule, jobs: dict[int | tuple[int, int], StageJobs], static_bytes: list | None = None,
           optimizer_jobs: list[JobMemory] | dict[int, JobMemory] | None = None,
           times: TimeModel | None = None, simulate_time: bool | None = None) -> ReplayResult:
    """Walk every rank's actions; see the module docstring. `jobs` is keyed by virtual stage,
    and may also hold keys (stage, microbatch) whose jobs replace the stage's for that
    microbatch (memory only: the time model uses the per-stage durations);
    `static_bytes[r]` (int or StaticBytes) is what rank r holds before the first action.
    The schedule is assumed valid (pipemem.schedules.check.check_schedule). Makespan and bubbles
    come from `times`, or from the jobs' `seconds` when every F and B has one (simulate_time=None),
    or are skipped (simulate_time=False)."""
    with paused_gc():
        return _replay(schedule, jobs, static_bytes, optimizer_jobs, times, simulate_time)


def _replay(schedule, jobs, static_bytes, optimizer_jobs, times, simulate_time) -> ReplayResult:
    pp = schedule.pp
    statics = [0] * pp if static_bytes is None else [_static_total(x) for x in static_bytes]
    if len(statics) != pp:
        raise UserError(f"replay: {len(statics)} static sizes for {pp} pipeline ranks")
    table = _job_table(schedule, jobs)
    override = _overrides(jobs)
    ranks = []
    for r, acts in enumerate(schedule.ranks):
        static = statics[r]
        cur = static
        peak = None
        at = -1
        hi = static
        inflight = max_inflight = 0
        try:
            for idx, a in enumerate(acts):
                kind, s, _ = a
                net, pk = (override.get(a) or table[kind][s]) if override else table[kind][s]
                during = cur + pk
                if peak is None or during > peak:
                    peak = during
                    at = idx
                cur += net
                if cur > hi:
                    hi = cur
                if kind == "F":
                    inflight += 1
                    if inflight > max_inflight:
                        max_inflight = inflight
                elif kind != "W":
                    inflight -= 1
        except (TypeError, KeyError, IndexError):
            raise _missing_job(schedule, r, table) from None
        opt = None
        if optimizer_jobs is not None:
            oj = optimizer_jobs[r]
            before = cur
            during = cur + oj.peak_bytes
            cur += oj.net_bytes
            opt = (before, during, cur)
            if peak is None or during > peak:
                peak = during
                at = len(acts)
        if peak is None:
            peak = static
        ranks.append(RankReplay(r, static, peak,
                                "optimizer" if at == len(acts) else (str(acts[at]) if at >= 0 else "-"),
                                at, max_inflight, hi - static, cur, acts, table, opt, override))
    sim = None
    if simulate_time is not False:
        tm = times or (_times_from_jobs(schedule, jobs) if simulate_time is None else TimeModel())
        if tm is None and simulate_time:
            tm = TimeModel()
        if tm is not None:
            sim = simulate(schedule, tm)
    return ReplayResult(schedule, ranks, sim)


def inflight_counts(schedule: Schedule) -> list[int]:
    """Per rank, the most (chunk, microbatch) forwards held at once (F +1, B or I -1)."""
    out = []
    for acts in schedule.ranks:
        n = best = 0
        for a in acts:
            k = a[0]
            if k == "F":
                n += 1
                if n > best:
                    best = n
            elif k != "W":
                n -= 1
        out.append(best)
    return out


__all__ = ["replay", "ReplayResult", "RankReplay", "inflight_counts", "Action"]
