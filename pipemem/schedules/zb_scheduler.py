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
memory is checked by replaying it (pipemem.replay); the scheduler sits after replay in the flow.
"""

from __future__ import annotations

from fractions import Fraction

from ..errors import UserError
from ..jobs import StageJobs
from ..replay import replay
from . import generators as g
from .actions import Schedule, loop_stage_map, v_stage_map
from .check import TimeModel, simulate
from .list_scheduler import job_numbers, list_schedule, scaled_jobs, stage_times
from .unit_jobs import DEFAULT_W_RATIO, unit_jobs


def _peaks(ranks, stage_rank, nums) -> list:
    """Per-rank activation peak of candidate action lists: the replay of them (pipemem.replay,
    the one walk of memory over time) on the integer jobs."""
    pp = len(ranks)
    sched = Schedule("candidate", pp, len(stage_rank) // pp, 1, ranks, stage_rank=stage_rank)
    return [r.peak_allocated_bytes for r in replay(sched, scaled_jobs(nums), None, simulate_time=False).ranks]


def _named_candidates(pp, m, vpp, placement, split):
    if vpp == 1:
        fns = [g.one_f_one_b, g.zb_h1, g.zb_1p, g.zb_h2, g.gpipe] if split else [g.one_f_one_b, g.gpipe]
    elif placement == "v" and vpp == 2:
        fns = [g.zb_v, g.v_half, g.v_min, g.dualpipe_v] if split else []
    else:
        fns = [g.interleaved_1f1b, g.interleaved_zero_bubble, g.looped_bfs] if split else \
            [g.interleaved_1f1b, g.looped_bfs]
    out = []
    for fn in fns:
        try:
            out.append(fn(pp, m, vpp))
        except UserError:
            pass
    return out


def memory_limited_schedule(pp: int, microbatches: int, jobs: dict[int, StageJobs] | None = None,
                            times: TimeModel | None = None, memory_limit=None, vpp: int = 1,
                            placement: str | None = None, w_ratio=DEFAULT_W_RATIO, split: bool = True,
                            name: str = "ZBAuto", search: bool = True) -> Schedule:
    """Fastest schedule found whose per-rank activation memory stays within `memory_limit`
    (a number, or one per rank, in the jobs' units; None = unlimited). Without `jobs`, unit jobs
    (microbatch units, w = `w_ratio`) are used. Raises UserError with the smallest feasible
    limit when nothing fits."""
    if pp < 1 or microbatches < 1 or vpp < 1:
        raise UserError("memory-limited schedule: --pp, --microbatches and --vpp must be at least 1")
    placement = placement or ("v" if vpp == 2 else "loop")
    if placement not in ("v", "loop"):
        raise UserError(f"memory-limited schedule: placement {placement!r}: use 'loop' or 'v'")
    if placement == "v" and vpp % 2:
        raise UserError("memory-limited schedule: V placement needs an even --vpp (2)")
    stage_rank = v_stage_map(pp, vpp) if placement == "v" else loop_stage_map(pp, vpp)
    S = pp * vpp
    if jobs is None:
        jobs = unit_jobs(S, vpp, w_ratio)
    nums, scale = job_numbers(jobs, S)
    if split and any(n[1] is None or n[2] is None for n in nums):
        split = False
    tms = stage_times(jobs, times, S)
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
        policies += [(a, wf, alt) for alt in (True, False)
                     for a, wf in ((1.0, 0.9), (1.0, 0.75), (0.9, None), (0.8, None), (0.67, None), (0.5, None),
                                   (0.8, 0.8))]
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
        for cand in _named_candidates(pp, microbatches, vpp, placement, split):
            if cand.stage_rank != stage_rank:
                continue
            best = _better(best, cand.ranks, cand.name, stage_rank, nums, limits, tm, pp, vpp, microbatches,
                           placement)
    if best is None:
        lo = smallest_feasible_limit(pp, microbatches, jobs, times, vpp=vpp, placement=placement, split=split)
        raise UserError(f"no schedule fits --memory-limit {_fmt(memory_limit)} (pp {pp}, microbatches "
                        f"{microbatches}, vpp {vpp}); the smallest limit that fits is {_fmt(lo)}")
    _, ranks, origin = best
    notes = f"memory limit {_fmt(memory_limit)}; best of greedy policies and named schedules: {origin}"
    return Schedule(name, pp, vpp, microbatches, ranks, stage_rank=stage_rank, placement=placement, notes=notes)


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


def smallest_feasible_limit(pp: int, microbatches: int, jobs: dict[int, StageJobs] | None = None,
                            times: TimeModel | None = None, vpp: int = 1, placement: str | None = None,
                            w_ratio=DEFAULT_W_RATIO, split: bool = True, rel_tol: float = 1e-3):
    """Smallest per-rank limit (same for every rank) under which the greedy finds a schedule,
    by binary search between the memory of one microbatch at a time and the unlimited peak."""
    placement = placement or ("v" if vpp == 2 else "loop")
    stage_rank = v_stage_map(pp, vpp) if placement == "v" else loop_stage_map(pp, vpp)
    S = pp * vpp
    if jobs is None:
        jobs = unit_jobs(S, vpp, w_ratio)
    nums, scale = job_numbers(jobs, S)
    if split and any(n[1] is None or n[2] is None for n in nums):
        split = False
    tms = stage_times(jobs, times, S)
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
