"""Replay a pipeline schedule per rank (layer 6 of DESIGN.md's flow): the one place that
turns jobs and a schedule into memory over time.

Each rank walks its actions in order with every job's {net, peak} from liveness:
    peak = max(peak, current + job.peak);  current += job.net
starting from the rank's static bytes; the optimizer step, when given, runs after the last
action. Actions are the compute jobs (F, B, I, W) and the memory actions a runtime lowering
adds (pipemem.runtime: receive buffers, frees of what the runtime held), whose bytes are the
stage's boundary sizes. Durations (a TimeModel, or the jobs' `seconds`) add the makespan and
the bubbles.

Built for size and for many plans: every rank's walk is one vectorised pass (numpy gathers
each action's {net, peak} from a per-(kind, stage) table through index arrays cached on the
schedule, then cumulative sums), integer bytes throughout; per-action timelines are made
only when asked for (`RankReplay.timeline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import UserError
from .jobs import JobMemory, StageJobs, StaticBytes
from .schedules.actions import ALL_KINDS, KINDS, MEMORY_KINDS, Action, Schedule, paused_gc
from .schedules.check import Simulation, TimeModel, simulate

_KIND_INDEX = {k: i for i, k in enumerate(ALL_KINDS)}


@dataclass
class RankReplay:
    pp_rank: int
    static_bytes: int
    peak_allocated_bytes: int  # static + highest (current + job.peak)
    peak_at: str  # action at the peak ('F3@s1', or 'optimizer')
    peak_action_index: int  # index in the rank's list (len(actions) for the optimizer)
    max_inflight: int  # most (chunk, microbatch) forwards held at once (F +1, B/I -1)
    activation_hwm_bytes: int  # max of `current` after an action (above static)
    final_bytes: int  # static + current after the last action (and optimizer)
    _actions: list = field(repr=False, default_factory=list)
    _net: object = field(repr=False, default=None)  # per action net bytes (numpy view)
    _peak: object = field(repr=False, default=None)  # per action peak bytes
    optimizer: tuple | None = field(repr=False, default=None)  # (before, during, after)

    @property
    def timeline(self) -> list[tuple[str, int, int, int]]:
        """(action, bytes before, bytes at its peak, bytes after), static included. Made on
        demand from the replay's per-action arrays."""
        out = []
        if self._actions:
            net = np.asarray(self._net)
            after = self.static_bytes + np.cumsum(net)
            before = after - net
            during = before + np.asarray(self._peak)
            out = [
                (str(a), b, d, e)
                for a, b, d, e in zip(self._actions, before.tolist(), during.tolist(), after.tolist())
            ]
        if self.optimizer is not None:
            out.append(("optimizer",) + tuple(int(x) for x in self.optimizer))
        return out

    def point(self, i: int) -> tuple[str, int, int, int] | None:
        """The timeline's i-th point (the optimizer's at len(actions)), without making the
        timeline: a report reads the point at the peak of every rank, and a schedule of 10^5
        actions per rank would otherwise build every rank's whole timeline for one point."""
        n = len(self._actions)
        if i >= n:
            return (
                ("optimizer",) + tuple(int(x) for x in self.optimizer) if self.optimizer is not None else None
            )
        net = np.asarray(self._net)
        before = self.static_bytes + int(net[:i].sum())
        return (str(self._actions[i]), before, before + int(np.asarray(self._peak)[i]), before + int(net[i]))

    def stages_backward_before(self, i: int) -> set[int]:
        """Stages that ran a backward (B, or W: the split backward's end) before action i."""
        return {a[1] for a in self._actions[:i] if a[0] in ("B", "W")}

    def to_dict(self, timeline: bool = False) -> dict:
        d = {
            "pp_rank": self.pp_rank,
            "static_bytes": self.static_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_at": self.peak_at,
            "peak_action_index": self.peak_action_index,
            "max_inflight": self.max_inflight,
            "activation_hwm_bytes": self.activation_hwm_bytes,
            "final_bytes": self.final_bytes,
        }
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
        d = {
            "schedule": self.schedule.name,
            "pp": self.schedule.pp,
            "vpp": self.schedule.vpp,
            "microbatches": self.schedule.microbatches,
            "ranks": [r.to_dict(timeline) for r in self.ranks],
            "max_peak_allocated_bytes": self.max_peak_allocated_bytes,
        }
        if self.simulation:
            d.update(
                makespan=self.makespan,
                bubble_ratio=self.bubble_ratio,
                stage_bubble_ratio=self.stage_bubble_ratio,
            )
        return d


def _static_total(x) -> int:
    return x.total if isinstance(x, StaticBytes) else int(x)


def _codes(schedule: Schedule):
    """Per schedule (cached): all ranks' actions as one int array of kind * S + stage, and each
    rank's (start, end) in it."""
    c = schedule.cache.get("codes")
    if c is None:
        S = schedule.num_stages
        index = _KIND_INDEX
        flat: list[int] = []
        bounds = []
        for r, acts in enumerate(schedule.ranks):
            start = len(flat)
            try:
                flat.extend([index[a[0]] * S + a[1] for a in acts])
            except KeyError:
                bad = next(a for a in acts if a[0] not in index)
                raise UserError(f"replay: rank {r} runs {bad}: unknown kind {bad[0]!r}") from None
            bounds.append((start, len(flat)))
        c = (np.asarray(flat, dtype=np.int64), bounds)
        schedule.cache["codes"] = c
    return c


def _used_codes(schedule: Schedule) -> np.ndarray:
    """The distinct action codes of the schedule (cached): which (kind, stage) jobs it needs."""
    u = schedule.cache.get("used_codes")
    if u is None:
        u = schedule.cache["used_codes"] = np.unique(_codes(schedule)[0])
    return u


def _job_table(schedule: Schedule, jobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(net, peak, present) per (kind, stage) code: compute jobs from the stages' jobs, memory
    actions from their boundary bytes."""
    S = schedule.num_stages
    rows = []
    for s in range(S):
        sj = jobs.get(s)
        if sj is None:
            raise UserError(
                f"replay: no jobs for virtual stage {s} (schedule {schedule.name} has "
                f"{schedule.num_stages} stages: pp {schedule.pp} x vpp {schedule.vpp})"
            )
        rows.append(_stage_row(sj))
    net = [r[0][k] for k in range(len(ALL_KINDS)) for r in rows]  # kind-major: code = k * S + s
    peak = [r[1][k] for k in range(len(ALL_KINDS)) for r in rows]
    have = [r[2][k] for k in range(len(ALL_KINDS)) for r in rows]
    # Bytes are integers; jobs in other units (Fractions of a microbatch, floats) replay exactly
    # too, on Python numbers (slower: scale them to integers for large schedules).
    exact = all(type(v) is int for v in net) and all(type(v) is int for v in peak)
    dt = np.int64 if exact else object
    return (np.asarray(net, dtype=dt), np.asarray(peak, dtype=dt), np.asarray(have, dtype=bool))


_ROWS: dict = {}  # id(StageJobs) -> (the jobs, their row): stage jobs are shared between plans


def _stage_row(sj) -> tuple:
    """(net, peak, present) of every kind (ALL_KINDS order) for one stage's jobs."""
    hit = _ROWS.get(id(sj))
    if hit is not None and hit[0] is sj:
        return hit[1]
    net, peak, have = [], [], []
    for kind in KINDS:
        j = getattr(sj, kind, None)
        if j is None and kind == "B" and isinstance(sj, StageJobs):
            j = sj.fused_backward()
        net.append(j.net_bytes if j is not None else 0)
        peak.append(j.peak_bytes if j is not None else 0)
        have.append(j is not None)
    for attr, sign in MEMORY_KINDS.values():
        b = sign * int(getattr(sj, attr, 0) or 0)
        net.append(b)
        peak.append(max(b, 0))
        have.append(True)
    row = (net, peak, have)
    if len(_ROWS) > 100_000:
        _ROWS.clear()
    _ROWS[id(sj)] = (sj, row)
    return row


def _missing_job(schedule: Schedule, rank: int, jobs) -> UserError:
    for a in schedule.ranks[rank]:
        sj = jobs.get(a[1])
        if a[0] in KINDS and (
            sj is None
            or (getattr(sj, a[0], None) is None and not (a[0] == "B" and sj.fused_backward() is not None))
        ):
            return UserError(
                f"replay: rank {rank} runs {a} but stage {a[1]} has no {a[0]} job "
                f"(build split-backward jobs for schedules with I/W)"
            )
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
            for kind in KINDS:
                j = getattr(sj, kind, None)
                if j is not None:
                    out[Action(kind, stage, mb)] = (j.net_bytes, j.peak_bytes)
    return out


def replay(
    schedule: Schedule,
    jobs: dict[int | tuple[int, int], StageJobs],
    static_bytes: list | None = None,
    optimizer_jobs: list[JobMemory] | dict[int, JobMemory] | None = None,
    times: TimeModel | None = None,
    simulate_time: bool | None = None,
) -> ReplayResult:
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
    codes, bounds = _codes(schedule)
    net_tab, peak_tab, have = _job_table(schedule, jobs)
    if not have[_used_codes(schedule)].all():
        bad = int(np.argmin(have[codes]))
        r = next(r for r, (a, b) in enumerate(bounds) if a <= bad < b)
        raise _missing_job(schedule, r, jobs)
    net = net_tab[codes]
    peak = peak_tab[codes]
    override = _overrides(jobs)
    if override:
        for r, acts in enumerate(schedule.ranks):
            o = bounds[r][0]
            for i, a in enumerate(acts):
                v = override.get(a)
                if v is not None:
                    net[o + i], peak[o + i] = v
    cum = np.cumsum(net)
    exact = net.dtype != object
    if exact:
        # integers: the level during each action over all ranks' actions in a row; a rank's own
        # is this less what the ranks before it left (`base`): the same argmax, the same numbers
        during_all = cum - net
        during_all += peak
    inflight = _inflight_from_codes(schedule, codes, bounds)
    ranks = []
    for r, (a, b) in enumerate(bounds):
        static = statics[r]
        acts = schedule.ranks[r]
        if b > a and exact:
            base = _py(cum[a - 1]) if a else 0
            during = during_all[a:b]
            at = int(during.argmax())
            pk = static + (_py(during[at]) - base)
            cur = _py(cum[b - 1]) - base
            hi = max(0, _py(cum[a:b].max()) - base)
        elif b > a:  # Python numbers (floats: summed in the order they always were)
            base = _py(cum[a - 1]) if a else 0
            after = cum[a:b] - base
            during = after - net[a:b] + peak[a:b]
            at = int(during.argmax())
            pk = static + _py(during[at])
            cur = _py(after[-1])
            hi = max(0, _py(after.max()))
        else:
            at, pk, cur, hi = -1, None, 0, 0
        cur += static
        opt = None
        if optimizer_jobs is not None:
            oj = optimizer_jobs[r]
            before = cur
            during_opt = cur + oj.peak_bytes
            cur += oj.net_bytes
            opt = (before, during_opt, cur)
            if pk is None or during_opt > pk:
                pk, at = during_opt, len(acts)
        if pk is None:
            pk = static
        label = "optimizer" if at == len(acts) else (str(acts[at]) if at >= 0 else "-")
        ranks.append(
            RankReplay(r, static, pk, label, at, inflight[r], hi, cur, acts, net[a:b], peak[a:b], opt)
        )
    sim = None
    if simulate_time is not False:
        tm = times or (_times_from_jobs(schedule, jobs) if simulate_time is None else TimeModel())
        if tm is None and simulate_time:
            tm = TimeModel()
        if tm is not None:
            sim = simulate(_compute_only(schedule), tm)
    return ReplayResult(schedule, ranks, sim)


def _py(x):
    """A numpy scalar as a Python int (object arrays already hold Python numbers)."""
    return x.item() if hasattr(x, "item") else x


def _compute_only(schedule: Schedule) -> Schedule:
    """The schedule without memory actions (the time model runs compute actions)."""
    if all(a[0] in KINDS for acts in schedule.ranks for a in acts):
        return schedule
    ranks = [[a for a in acts if a[0] in KINDS] for acts in schedule.ranks]
    return schedule.with_ranks(ranks)


def _inflight_from_codes(schedule: Schedule, codes: np.ndarray, bounds) -> list[int]:
    """inflight_counts from the schedule's action codes (numpy; the same numbers, the same cache):
    the most forwards held at once is the highest prefix sum of F +1, B or I -1 (0 at least)."""
    out = schedule.cache.get("inflight")
    if out is None:
        k = codes // schedule.num_stages
        d = (k == _KIND_INDEX["F"]).astype(np.int64) - ((k == _KIND_INDEX["B"]) | (k == _KIND_INDEX["I"]))
        out = [max(0, int(np.cumsum(d[a:b]).max())) if b > a else 0 for a, b in bounds]
        schedule.cache["inflight"] = out
    return out


def inflight_counts(schedule: Schedule) -> list[int]:
    """Per rank, the most (chunk, microbatch) forwards held at once (F +1, B or I -1); cached."""
    out = schedule.cache.get("inflight")
    if out is not None:
        return out
    out = []
    for acts in schedule.ranks:
        n = best = 0
        for a in acts:
            k = a[0]
            if k == "F":
                n += 1
                if n > best:
                    best = n
            elif k == "B" or k == "I":
                n -= 1
        out.append(best)
    schedule.cache["inflight"] = out
    return out


__all__ = ["replay", "ReplayResult", "RankReplay", "inflight_counts", "Action"]
