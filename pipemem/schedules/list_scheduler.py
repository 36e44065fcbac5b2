"""List scheduling of pipeline actions under a per-rank memory limit (the greedy pass the
memory-limited zero-bubble scheduler searches over, and the builder of ZB-H2).

Event-driven, in time order: an idle rank runs, among the actions whose inputs have arrived,
an input-grad backward (I, or B when not split) first (the critical path), else a forward
that fits, else a pending weight-grad W. A forward that brings a new microbatch onto the rank
must leave room for that microbatch's later chunks on this rank, those of every microbatch
already there, and the largest backward peak, so admitted microbatches can always finish.
Memory is tracked in integers (`job_numbers` scales microbatch-unit Fractions).
"""

from __future__ import annotations

import heapq
import math
from fractions import Fraction

from ..errors import UserError
from ..jobs import StageJobs
from .actions import Action
from .check import TimeModel


def job_numbers(jobs: dict[int, StageJobs], num_stages: int):
    """Per stage: (F net, F peak), (I net, I peak), (W net, W peak), (B net, B peak), and the
    factor they were multiplied by: Fractions (microbatch units) become integers, which keeps
    the greedy's arithmetic fast and exact; compare limits times that factor."""
    out = _raw_job_numbers(jobs, num_stages)
    fracs = [v for n in out for pair in n if pair for v in pair if isinstance(v, Fraction)]
    if not fracs:
        return out, 1
    scale = 1
    for v in fracs:
        scale = scale * v.denominator // math.gcd(scale, v.denominator)
    conv = [tuple(None if pair is None else tuple(int(v * scale) for v in pair) for pair in n) for n in out]
    return conv, scale


def _raw_job_numbers(jobs: dict[int, StageJobs], num_stages: int):
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


def stage_times(jobs, times: TimeModel | None, num_stages: int) -> tuple[list, list, list, list, float]:
    if times is None:
        sj = [jobs[s] for s in range(num_stages)]
        if all(j.F.seconds > 0 and (j.I is None or j.I.seconds > 0) for j in sj):
            times = TimeModel(
                F=[j.F.seconds for j in sj],
                I=[(j.I.seconds if j.I else j.B.seconds) for j in sj],
                W=[(j.W.seconds if j.W else 0.0) for j in sj],
                B=[j.B.seconds for j in sj],
            )
        else:
            times = TimeModel()
    tf, tb, ti, tw = times.per_stage(num_stages)
    return tf, tb, ti, tw, float(times.comm)


def list_schedule(
    pp, m, stage_rank, nums, tms, limits, split=True, admit_scale=1.0, w_first=None, alternate=False
):
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
    reserve = [0] * pp  # later-chunk forward memory owed to microbatches already on the rank
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
            later_f[s] = sum(nums[q][0][0] for q in st[n + 1 :])
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
    last_fb = ["F"] * pp  # last forward or backward each rank ran (Ws skipped)

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
            if cur[r] + nums[s][2][1] <= lim:  # oldest first; a W frees memory but may peak above
                pend_w[r].pop(0)
                choice = ("W", s, i)
        if choice is None:
            if future is None:
                wake_at[r] = inf  # sleep until a neighbour's notify
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


_KIND_SLOT = {"F": 0, "I": 1, "W": 2, "B": 3}


def activation_peaks(ranks: list[list[Action]], nums) -> list:
    """Per rank, the most memory held while its actions run, from zero, on the job numbers
    (`job_numbers`): before each action the running sum of the nets, plus that action's peak.
    The same walk as pipemem.replay's without static bytes (which the scheduler's jobs leave
    out), kept here so the schedules package needs nothing above it."""
    slot = _KIND_SLOT
    out = []
    for acts in ranks:
        cur, best = 0, None
        for kind, stage, _ in acts:
            net, peak = nums[stage][slot[kind]]
            if best is None or cur + peak > best:
                best = cur + peak
            cur += net
        out.append(0 if best is None else best)
    return out
