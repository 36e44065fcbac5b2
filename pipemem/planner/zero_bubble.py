"""The smallest GPU memory under which the memory-limited scheduler reaches zero bubble for a
plan, on the plan's real stage jobs.

Paddle's ZB-VPP pass takes its limit as a hand-set multiple of 1F1B's memory
(`memory_limit_times`); here the limit is searched for. For a plan (its tp/pp/vpp/recompute...
as `pipemem plan` lists it) the stage jobs {net, peak} of every F, I (input-grad) and W
(weight-grad) job come from `pipemem.stages.build_stage_jobs` (what `pipemem estimate`
replays) and their durations from the planner's FLOPs model (cost.stage_flops). A candidate
memory M gives rank r the activation limit M - static_r; the scheduler
(`pipemem.schedules.zb_scheduler.memory_limited_schedule`, its greedy list scheduler without
the wider policy search, so each run takes milliseconds to a second) builds the fastest
schedule it can under those limits. Bisection over M (to `resolution` bytes) finds the smallest M whose
schedule has zero bubble in Qi et al.'s sense: every rank busy from its first action to its
last (`Simulation.stage_bubble_ratio` == 0). Where the stages are too unbalanced for that (the
head on the last stage), the target is the least stage bubble the scheduler reaches with
unlimited memory, and the answer says so.

The schedule found is checked the one way every number is: exported as CSV (PyTorch
pipelining's format, schedules/csv_io.py) and estimated with `pipemem estimate --schedule
csv:FILE`, whose peak is the one reported.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from ..errors import UserError

ZERO = 1e-9


@dataclass
class ZeroBubble:
    flags: str  # the plan, scheduled by the memory-limited scheduler (needs the CSV)
    memory_bytes: int  # the smallest memory M found (static + activation limit, per rank)
    zero_bubble: bool  # the schedule at M has zero stage bubble
    stage_bubble: float  # its stage bubble (Qi et al.)
    bubble: float  # idle share of all ranks over the makespan (the planner's bubble)
    makespan_ratio: float  # its makespan / the plan's own schedule's makespan
    peak_bytes: int  # pipemem estimate of the plan with that schedule
    fits: bool  # pipemem estimate's verdict is FITS (and the --reserve is left)
    schedule: object  # pipemem.schedules.Schedule
    csv_text: str
    probes: int  # scheduler runs of the bisection

    def to_dict(self) -> dict:
        same = ("flags", "memory_bytes", "zero_bubble", "stage_bubble", "bubble", "makespan_ratio")
        return {
            **{k: getattr(self, k) for k in same},
            "max_peak_allocated_bytes": self.peak_bytes,
            "fits": self.fits,
            "scheduler_runs": self.probes,
            "schedule_notes": self.schedule.notes,
        }


def smallest_zero_bubble_memory(
    search, result, resolution: int = 1 << 20, csv_path: str | None = None
) -> ZeroBubble:
    """For `result` (a PlanResult of `search`, a PlanSearch) with pp > 1: see module docstring."""
    from ..plan import ParallelPlan, validate_plan
    from ..runtime import fold_per_action
    from ..schedules.check import TimeModel, simulate
    from ..schedules.csv_io import to_csv_text
    from ..schedules.zb_scheduler import memory_limited_schedule
    from ..stages import build_stage_jobs
    from .cost import schedule_for, stage_flops

    kw = dict(result.kwargs)
    plan = validate_plan(
        search.arch,
        ParallelPlan(**{k: v for k, v in kw.items() if k != "schedule"}, schedule=kw.get("schedule")),
    )
    if plan.pp == 1:
        raise UserError("--zero-bubble needs a pipeline plan (pp > 1)")
    own = schedule_for(kw.get("schedule"), plan.pp, plan.microbatches, plan.vpp)
    placement = "v" if own.placement == "v" else "loop"
    stage_plan = build_stage_jobs(search.arch, plan)
    static = stage_plan.static_per_rank(own)  # placement: the schedule's
    statics = [st.total for st in static]
    jobs = fold_per_action(stage_plan.stages)  # the scheduler needs self-contained jobs
    d = stage_flops(search.arch, plan.pp_layout, plan.seq_len, plan.recompute, plan.recompute_layers)
    times = TimeModel(F=[x[0] for x in d], I=[x[1] for x in d], W=[x[2] for x in d])
    own_makespan = simulate(own, times).makespan
    probes = 0

    def run(memory):
        nonlocal probes
        probes += 1
        limits = None if memory is None else [memory - s for s in statics]
        if limits is not None and min(limits) < 0:
            return None
        try:
            sched = memory_limited_schedule(
                plan.pp,
                plan.microbatches,
                jobs=jobs,
                times=times,
                memory_limit=limits,
                vpp=plan.vpp,
                placement=placement,
                name="ZBAuto",
                search=False,
            )
        except UserError:
            return None
        return sched, simulate(sched, times)

    free = run(None)
    if free is None:
        raise UserError("the memory-limited scheduler found no schedule for this plan")
    target = max(free[1].stage_bubble_ratio, 0.0) + ZERO

    def peak_of(sched) -> int:
        """Highest static + activation bytes of the schedule on the jobs (what the limit bounds)."""
        from ..replay import replay

        rep = replay(sched, jobs, static, simulate_time=False)
        return max(r.peak_allocated_bytes for r in rep.ranks)

    hi = peak_of(free[0])
    best = (hi, free)
    lo = max(statics)
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        got = run(mid)
        if got is not None and got[1].stage_bubble_ratio <= target:
            hi = peak_of(got[0])  # the schedule may use less than the limit it was given
            best = (hi, got)
        else:
            lo = mid
    memory, (sched, sim) = best
    text = to_csv_text(sched)
    path = csv_path
    tmp = None
    if path is None:
        fd, tmp = tempfile.mkstemp(suffix=".csv", prefix="pipemem-zb-")
        os.close(fd)
        path = tmp
    try:
        with open(path, "w") as f:
            f.write(text)
        call = dict(kw, schedule=f"csv:{path}")
        from ..estimate import estimate

        est = estimate(search.config, model_name=search.model, **search.gpu_opts, **call)
    except OSError as e:
        raise UserError(f"--schedule-csv {path}: cannot write ({e.strerror})") from None
    finally:
        if tmp is not None:
            os.unlink(tmp)
    from .search import flags_string

    peak = est.max_peak_allocated_bytes
    flags = flags_string(search.model_flag, search.target, dict(kw, schedule=f"csv:{csv_path or 'FILE.csv'}"))
    return ZeroBubble(
        flags=flags,
        memory_bytes=memory,
        zero_bubble=sim.stage_bubble_ratio <= ZERO,
        stage_bubble=sim.stage_bubble_ratio,
        bubble=sim.bubble_ratio,
        makespan_ratio=sim.makespan / own_makespan if own_makespan else 1.0,
        peak_bytes=peak,
        fits=bool(est.fits) and est.max_device_peak_bytes <= search.target.budget_bytes,
        schedule=sched,
        csv_text=text,
        probes=probes,
    )
