"""A memory-limited zero-bubble scheduler.

Given p ranks, m microbatches, v chunks per rank, each stage's jobs {net, peak, seconds} and a
per-rank memory limit, build a valid schedule with a short makespan whose replayed activation
memory never exceeds the limit (in the jobs' units, above static memory).

Heuristic plus search:
1. Greedy list scheduling (list_scheduler.py).
2. Search: the greedy runs under several policies (effective limits, W before F above a memory
   threshold) and the named schedules for the same placement are candidates too; the fastest
   that fits wins (ties: lower peak).
When nothing fits, `smallest_feasible_limit` binary-searches the limit. Every candidate's
memory is checked by walking its actions over the integer jobs (`list_scheduler.activation_peaks`,
the walk pipemem.replay does, without static bytes): the schedules package imports nothing
above it.

Registered here (SPECS): ZBAuto (`auto`) and Paddle's ZBVPP.
"""

from __future__ import annotations

from fractions import Fraction

from ..errors import UserError
from ..jobs import StageJobs
from . import generators
from .actions import Schedule, stage_rank_map
from .check import TimeModel, simulate
from .list_scheduler import activation_peaks, job_numbers, list_schedule, stage_times
from .spec import ScheduleSpec
from .unit_jobs import DEFAULT_W_RATIO, unit_jobs


def _peaks(ranks, stage_rank, nums) -> list:
    """Per-rank activation peak of candidate action lists on the integer jobs."""
    return activation_peaks(ranks, nums)


def _named_candidates(pp, m, vpp, placement, split, named=None):
    """The named orders for this placement the search also tries (`ScheduleSpec.candidate`, in
    that order): one chunk per rank, V-shaped with two, or looped with several; with fused
    backwards only (`split` False) those that do not split them. `named`: the specs to take
    them from (schedules.registry passes every registered one; default the built-ins)."""
    if vpp == 1:
        group = [s for s in (named or generators.SPECS) if s.chunks == "one"]
    elif placement == "v" and vpp == 2:
        group = [s for s in (named or generators.SPECS) if s.chunks == "two" and s.placement == "v"]
    else:
        group = [s for s in (named or generators.SPECS) if s.chunks == "several"]
    group = sorted(
        (s for s in group if s.candidate is not None and (split or not s.split_backward)),
        key=lambda s: s.candidate,
    )
    out = []
    for spec in group:
        try:
            out.append(spec.build(pp, m, vpp))
        except UserError:
            pass
    return out


def memory_limited_schedule(
    pp: int,
    microbatches: int,
    jobs: dict[int, StageJobs] | None = None,
    times: TimeModel | None = None,
    memory_limit=None,
    vpp: int = 1,
    placement: str | None = None,
    w_ratio=DEFAULT_W_RATIO,
    split: bool = True,
    name: str = "ZBAuto",
    search: bool = True,
    named: tuple[ScheduleSpec, ...] | None = None,
) -> Schedule:
    """Fastest schedule found whose per-rank activation memory stays within `memory_limit`
    (a number, or one per rank, in the jobs' units; None = unlimited). Without `jobs`, unit jobs
    (microbatch units, w = `w_ratio`) are used. Raises UserError with the smallest feasible
    limit when nothing fits."""
    if pp < 1 or microbatches < 1 or vpp < 1:
        raise UserError("memory-limited schedule: --pp, --microbatches and --vpp must be at least 1")
    placement = placement or _default_placement(vpp)
    if placement not in ("v", "loop"):
        raise UserError(f"memory-limited schedule: placement {placement!r}: use 'loop' or 'v'")
    if placement == "v" and vpp % 2:
        raise UserError("memory-limited schedule: V placement needs an even --vpp (2)")
    stage_rank, jobs, nums, scale, split, tms = _problem(pp, vpp, placement, jobs, times, w_ratio, split)
    if memory_limit is None:
        limits = [float("inf")] * pp
    elif isinstance(memory_limit, (list, tuple)):
        if len(memory_limit) != pp:
            raise UserError(f"--memory-limit: {len(memory_limit)} limits for {pp} ranks")
        limits = list(memory_limit)
    else:
        limits = [memory_limit] * pp
    limits = [lim if lim == float("inf") else lim * scale for lim in limits]
    # (admission scale, W-first threshold, 1F1B alternation)
    policies = [(1.0, None, True), (1.0, None, False)]
    if search:
        policies += [
            (a, wf, alt)
            for alt in (True, False)
            for a, wf in (
                (1.0, 0.9),
                (1.0, 0.75),
                (0.9, None),
                (0.8, None),
                (0.67, None),
                (0.5, None),
                (0.8, 0.8),
            )
        ]
    tm = TimeModel(F=tms[0], B=tms[1], I=tms[2], W=tms[3], comm=tms[4])
    best = None
    for admit, wf, alt in policies:
        if admit < 1.0 and limits[0] == float("inf"):
            continue
        ranks = list_schedule(pp, microbatches, stage_rank, nums, tms, limits, split, admit, wf, alt)
        if ranks is None:
            continue
        best = _better(best, ranks, "greedy", stage_rank, nums, limits, tm, pp, vpp, microbatches, placement)
    if search:
        for cand in _named_candidates(pp, microbatches, vpp, placement, split, named):
            if cand.stage_rank != stage_rank:
                continue
            best = _better(
                best, cand.ranks, cand.name, stage_rank, nums, limits, tm, pp, vpp, microbatches, placement
            )
    if best is None:
        lo = smallest_feasible_limit(pp, microbatches, jobs, times, vpp=vpp, placement=placement, split=split)
        raise UserError(
            f"no schedule fits --memory-limit {_fmt(memory_limit)} (pp {pp}, microbatches "
            f"{microbatches}, vpp {vpp}); the smallest limit that fits is {_fmt(lo)}"
        )
    _, ranks, origin = best
    notes = f"memory limit {_fmt(memory_limit)}; best of greedy policies and named schedules: {origin}"
    return Schedule(
        name, pp, vpp, microbatches, ranks, stage_rank=stage_rank, placement=placement, notes=notes
    )


def _problem(pp, vpp, placement, jobs, times, w_ratio, split):
    """What the scheduler and the limit search start from: each stage's rank, the jobs (unit
    jobs of `w_ratio` when None), their integer numbers and scale (`job_numbers`), whether the
    backwards split (not when a job lacks B or W) and the stage times."""
    S = pp * vpp
    if jobs is None:
        jobs = unit_jobs(S, vpp, w_ratio)
    nums, scale = job_numbers(jobs, S)
    split = split and not any(n[1] is None or n[2] is None for n in nums)
    return stage_rank_map(placement, pp, vpp), jobs, nums, scale, split, stage_times(jobs, times, S)


def _default_placement(vpp: int) -> str:
    """The scheduler's placement when none is given: V with two chunks per rank, else looped."""
    return "v" if vpp == 2 else "loop"


def _fmt(x) -> str:
    if x is None:
        return "none"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    return f"{f:.4g}" if f != int(f) else str(int(f))


def _better(best, ranks, origin, stage_rank, nums, limits, tm, pp, vpp, m, placement):
    peaks = _peaks(ranks, stage_rank, nums)
    if any(pk > lim for pk, lim in zip(peaks, limits)):
        return best
    sched = Schedule(origin, pp, vpp, m, ranks, stage_rank=stage_rank, placement=placement)
    try:
        sim = simulate(sched, tm)
    except UserError:
        return best
    spans = [(e[-1] - st[0]) if e else 0.0 for st, e in zip(sim.start, sim.end)]
    key = (sim.makespan, max(spans), max(peaks))
    if best is None or key < best[0]:
        return (key, ranks, origin)
    return best


def smallest_feasible_limit(
    pp: int,
    microbatches: int,
    jobs: dict[int, StageJobs] | None = None,
    times: TimeModel | None = None,
    vpp: int = 1,
    placement: str | None = None,
    w_ratio=DEFAULT_W_RATIO,
    split: bool = True,
    rel_tol: float = 1e-3,
):
    """Smallest per-rank limit (same for every rank) under which the greedy finds a schedule,
    by binary search between the memory of one microbatch at a time and the unlimited peak."""
    placement = placement or _default_placement(vpp)
    stage_rank, jobs, nums, scale, split, tms = _problem(pp, vpp, placement, jobs, times, w_ratio, split)
    free = list_schedule(pp, microbatches, stage_rank, nums, tms, [float("inf")] * pp, split)
    hi = max(_peaks(free, stage_rank, nums))
    lo = 0

    def ok(lim):
        return list_schedule(pp, microbatches, stage_rank, nums, tms, [lim] * pp, split) is not None

    exact = all(isinstance(v, int) for n in nums for pair in n if pair for v in pair)
    if exact:
        lo, hi = int(lo), int(hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        return hi if scale == 1 else Fraction(hi, scale)
    lo, hi = float(lo), float(hi)
    while hi - lo > rel_tol * max(abs(hi), 1e-12):
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    # snap to a nearby simple value when the jobs are in microbatch units
    for den in (1, 2, 3, 4, 6, 8, 12, 16, 34):
        cand = round(hi * den) / den
        if lo < cand <= hi + 1e-12 and ok(cand):
            return cand
    return hi


# ---------------------------------------------------------------- registration (schedules.registry)


def zb_auto(
    pp: int,
    m: int,
    vpp: int = 1,
    name: str = "ZBAuto",
    memory_limit=None,
    w_ratio=None,
    times: TimeModel | None = None,
    named=None,
    placement=None,
) -> Schedule:
    """The memory-limited zero-bubble search (`auto`): any chunks per rank, V placement at two
    unless `placement` says otherwise. Unit jobs (microbatch units, w = `w_ratio`), timed by
    `times` when given (`pipemem schedule --times`), else by the unit jobs' own durations."""
    w = DEFAULT_W_RATIO if w_ratio is None else w_ratio
    if times is None:
        return memory_limited_schedule(
            pp, m, memory_limit=memory_limit, vpp=vpp, placement=placement, w_ratio=w, name=name, named=named
        )
    jobs = unit_jobs(pp * vpp, vpp, Fraction(w).limit_denominator(10**6), (times.F, times.I, times.W))
    return memory_limited_schedule(
        pp, m, jobs, times, memory_limit, vpp=vpp, placement=placement, name=name, named=named
    )


def zb_vpp(pp: int, m: int, vpp: int = 2, name: str = "ZBVPP", memory_limit=None, **search) -> Schedule:
    """Paddle's ZBVPP: the search (`zb_auto`'s other settings) on V placement, two chunks per
    rank, with ZB-V's memory (p microbatches) unless a limit is given."""
    if vpp != 2:
        raise UserError(f"ZBVPP runs 2 chunks per rank: pass --vpp 2 (got {vpp})")
    limit = pp if memory_limit is None else memory_limit
    return zb_auto(pp, m, 2, name, limit, placement="v", **search)


def _auto_placement(pp: int, vpp: int) -> list[int]:
    return stage_rank_map(_default_placement(vpp), pp, vpp)


SPECS = (
    ScheduleSpec(
        "ZBVPP",
        zb_vpp,
        placement="v",
        chunks="two",
        searched=True,
        split_backward=True,
        paddle="ZBVPP",
        paper="Paddle's memory-limited zero-bubble V",
    ),
    ScheduleSpec(
        "ZBAuto",
        zb_auto,
        placement=_auto_placement,
        chunks="any",
        searched=True,
        split_backward=True,
        aliases=("auto", "memorylimited"),
        shown="auto",
        paper="memory-limited zero-bubble search (`--memory-limit`)",
    ),
)
