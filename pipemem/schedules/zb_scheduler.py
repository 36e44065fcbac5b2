"""A memory-limited zero-bubble scheduler.

Given p ranks, m microbatches, v chunks per rank, each stage's jobs {net, peak, seconds} and a
per-rank memory limit, build a valid schedule with a short makespan whose replayed activation
memory never exceeds the limit (in the jobs' units, above static memory).

Heuristic plus search:
1. Greedy list scheduling (event-driven, in time order): an idle rank runs, among the actions
   whose inputs have arrived, an input-grad backward (I, or B when not split) first (the critical
   path), else a forward that fits, else a pending weight-grad W (which fills bubbles and frees
   memory). A forward that brings a new microbatch onto the rank must leave room for that
   microbatch's later chunks on this rank, those of every microbatch already there, and the
   largest backward peak, so admitted microbatches can always finish (no memory deadlock).
2. Search: the greedy runs under several policies (effective limits, W before F above a memory
   threshold) and the named schedules for the same placement are candidates too; the fastest
   that fits wins (ties: lower peak).
When nothing fits, `smallest_feasible_limit` binary-searches the limit.
"""

from __future__ import annotations

import heapq
import math
from fractions import Fraction

from ..errors import UserError
from ..jobs import StageJobs
from .actions import Action, Schedule, loop_stage_map, v_stage_map
from .check import TimeModel, simulate
from .unit_jobs import DEFAULT_W_RATIO, unit_jobs


def _job_nums(jobs: dict[int, StageJobs], num_stages: int):
    """Per stage: (F net, F peak), (I net, I peak), (W net, W peak), (B net, B peak), and the
    factor they were multiplied by: Fractions (microbatch units) become integers, which keeps
    the greedy's arithmetic fast and exact; compare limits times that factor."""
    out = _raw_job_nums(jobs, num_stages)
    fracs = [v for n in out for pair in n if pair for v in pair if isinstance(v, Fraction)]
    if not fracs:
        return out, 1
    scale = 1
    for v in fracs:
        scale = scale * v.denominator // math.gcd(scale, v.denominator)
    conv = [tuple(None if pair is None else tuple(int(v * scale) for v in pair) for pair in n) for n in out]
    return conv, scale


def _raw_job_nums(jobs: dict[int, StageJobs], num_stages: int):
    out = []
    for s in range(num_stages):
        sj = jobs.get(s)
        if sj is None:
            raise UserError(f"memory-limited schedule: no jobs for virtual stage {s}")
        f = (sj.F.net_bytes, sj.F.peak_bytes)
        b = (sj.B.net_bytes, sj.B.peak_bytes)
        i = (sj.I.net_bytes, sj.I.peak_bytes) if sj.I else None
        w = (sj.W.net_bytes, sj.W.peak_bytes) if sj.W else None
        out.append((f, i, w, b))
    return out


def _times(jobs, times: TimeModel | None, num_stages: int) -> tuple[list, list, list, list, float]:
    if times is None:
        sj = [jobs[s] for s in range(num_stages)]
        if all(j.F.seconds > 0 and (j.I is None or j.I.seconds > 0) for j in sj):
            times = TimeModel(F=[j.F.seconds for j in sj], I=[(j.I.seconds if j.I else j.B.seconds) for j in sj],
                              W=[(j.W.seconds if j.W else 0.0) for j in sj], B=[j.B.seconds for j in sj])
        else:
            times = TimeModel()
    tf, tb, ti, tw = times.per_stage(num_stages)
    return tf, tb, ti, tw, float(times.comm)


def _greedy(pp, m, stage_rank, nums, tms, limits, split=True, admit_scale=1.0, w_first=None, alternate=False):
    """One greedy pass. Returns per-rank action lists, or None when the policy deadlocks.
    `alternate`: after a backward, a ready forward goes before the next backward (the 1F1B
    rhythm; Ws between them do not count); otherwise backwards always go first."""
    tf, tb, ti, tw, comm = tms
    S = len(stage_rank)
    rank_stages = [[s for s in range(S) if stage_rank[s] == r] for r in range(pp)]
    fin_f = [[None] * m for _ in range(S)]
    fin_g = [[None] * m for _ in range(S)]
    next_f = [0] * S
    next_b = [0] * S
    cur = [0] * pp
    reserve = [0] * pp             # later-chunk forward memory owed to microbatches already on the rank
    pend_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    acts: list[list[Action]] = [[] for _ in range(pp)]
    todo = [len(st) * m * (3 if split else 2) for st in rank_stages]
    # memory a new microbatch will still need on rank r after its first forward there, and the
    # headroom any single job of the rank needs above its start (its peak, or F's peak above net)
    later_f = [0] * S
    bpeak = [0] * pp
    for r in range(pp):
        st = rank_stages[r]
        for n, s in enumerate(st):
            later_f[s] = sum(nums[q][0][0] for q in st[n + 1:])
        for s in st:
            f, i, w, b = nums[s]
            cand = [b[1], f[1] - f[0]] + ([i[1], w[1]] if split else [])
            bpeak[r] = max(bpeak[r], max(0, *cand))
    # a microbatch enters a rank at the rank's first (lowest) stage
    enters = [s == rank_stages[stage_rank[s]][0] for s in range(S)]
    inf = float("inf")
    # a rank is woken at its wake_at time: when its running action ends, when an input it
    # saw coming arrives, or when a neighbour finishes something it may consume
    wake_at = [0.0] * pp
    busy_until = [0.0] * pp
    heap = [(0.0, r) for r in range(pp)]
    last_fb = ["F"] * pp            # last forward or backward each rank ran (Ws skipped)

    def notify(q, when):
        if todo[q]:
            when = max(when, busy_until[q])
            if when < wake_at[q]:
                wake_at[q] = when
                heapq.heappush(heap, (when, q))

    while heap:
        t, r = heapq.heappop(heap)
        if t != wake_at[r] or not todo[r]:
            continue
        lim = limits[r]
        choice = None
        future = None
        # 1. backward (input grad), oldest microbatch, later stage first
        best = None
        for s in rank_stages[r]:
            i = next_b[s]
            if i >= m:
                continue
            d = fin_f[s][i]
            if d is None:
                continue
            if s + 1 < S:
                g = fin_g[s + 1][i]
                if g is None:
                    continue
                if stage_rank[s + 1] != r:
                    g += comm
                d = max(d, g)
            bn = nums[s][1] if split else nums[s][3]
            if cur[r] + bn[1] > lim:
                continue
            if d <= t:
                if best is None or (i, -s) < best[0]:
                    best = ((i, -s), s, i)
            elif future is None or d < future:
                future = d
        if best is not None:
            choice = ("I" if split else "B", best[1], best[2])
        wait_w = bool(pend_w[r]) and w_first is not None and cur[r] >= w_first * lim
        if (choice is None or (alternate and last_fb[r] != "F")) and not wait_w:
            bestf = None
            for s in rank_stages[r]:
                i = next_f[s]
                if i >= m:
                    continue
                if s:
                    d = fin_f[s - 1][i]
                    if d is None:
                        continue
                    if stage_rank[s - 1] != r:
                        d += comm
                else:
                    d = 0.0
                fn, fp = nums[s][0]
                if enters[s]:
                    need = cur[r] + fn + later_f[s] + reserve[r] + bpeak[r]
                    if cur[r] + fp > lim * admit_scale or need > lim * admit_scale:
                        continue
                elif cur[r] + fp > lim:
                    continue
                if d <= t:
                    key = (-s, i)
                    if bestf is None or key < bestf[0]:
                        bestf = (key, s, i)
                elif future is None or d < future:
                    future = d
            if bestf is not None:
                choice = ("F", bestf[1], bestf[2])
            elif best is not None:
                choice = ("I" if split else "B", best[1], best[2])
        if choice is None and pend_w[r]:
            s, i = pend_w[r][0]
            if cur[r] + nums[s][2][1] <= lim:     # oldest first; a W frees memory but may peak above
                pend_w[r].pop(0)
                choice = ("W", s, i)
        if choice is None:
            if future is None:
                wake_at[r] = inf           # sleep until a neighbour's notify
            else:
                wake_at[r] = future
                heapq.heappush(heap, (future, r))
            continue
        kind, s, i = choice
        if kind != "W":
            last_fb[r] = kind
        if kind == "F":
            dur = tf[s]
            net, pk = nums[s][0]
            fin_f[s][i] = t + dur
            next_f[s] += 1
            if enters[s]:
                reserve[r] += later_f[s]
            else:
                reserve[r] -= net
        elif kind == "W":
            dur = tw[s]
            net, pk = nums[s][2]
        else:
            dur = ti[s] if kind == "I" else tb[s]
            net, pk = nums[s][1] if kind == "I" else nums[s][3]
            fin_g[s][i] = t + dur
            next_b[s] += 1
            if kind == "I":
                pend_w[r].append((s, i))
        if cur[r] + pk > lim:
            return None
        cur[r] += net
        acts[r].append(Action(kind, s, i))
        todo[r] -= 1
        end = t + dur
        busy_until[r] = wake_at[r] = end
        heapq.heappush(heap, (end, r))
        if kind == "F":
            if s + 1 < S and stage_rank[s + 1] != r:
                notify(stage_rank[s + 1], end + comm)
        elif kind != "W" and s and stage_rank[s - 1] != r:
            notify(stage_rank[s - 1], end + comm)
    if any(todo):
        return None
    return acts


def _peaks(ranks, stage_rank, nums):
    out = []
    for acts in ranks:
        cur = 0
        peak = 0
        for kind, s, _ in acts:
            f, i, w, b = nums[s]
            net, pk = f if kind == "F" else i if kind == "I" else w if kind == "W" else b
            if cur + pk > peak:
                peak = cur + pk
            cur += net
        out.append(peak)
    return out


def _named_candidates(pp, m, vpp, placement, split):
    from . import generators as g
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
    nums, scale = _job_nums(jobs, S)
    if split and any(n[1] is None or n[2] is None for n in nums):
        split = False
    tms = _times(jobs, times, S)
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
        ranks = _greedy(pp, microbatches, stage_rank, nums, tms, limits, split, admit, wf, alt)
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
    nums, scale = _job_nums(jobs, S)
    if split and any(n[1] is None or n[2] is None for n in nums):
        split = False
    tms = _times(jobs, times, S)
    free = _greedy(pp, microbatches, stage_rank, nums, tms, [float("inf")] * pp, split)
    hi = max(_peaks(free, stage_rank, nums))
    lo = 0

    def ok(lim):
        return _greedy(pp, microbatches, stage_rank, nums, tms, [lim] * pp, split) is not None

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
