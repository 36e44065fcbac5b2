"""The plan search: every plan of the space that fits, each estimated by `pipemem.estimate`.

For each proposal of `space.enumerate_bases` x schedule x micro-batch size:

1. validity: `validate_plan` (the rules of `pipemem estimate`) and the schedule generator
   (e.g. Megatron's interleaved order needs microbatches % pp == 0); invalid plans are
   counted by reason, never listed;
2. exact pruning: a rank's replayed peak is at least its static bytes (replay starts there and
   no job has a negative peak), so when the static bytes of some rank (the same
   `static_bytes` the estimate uses) plus the reserve exceed the GPU, no micro-batch size,
   recomputation or schedule of that placement can fit: the whole group is skipped unestimated;
3. recomputation: the cheapest setting that fits. No recomputation when it fits (any
   recomputation only adds work); otherwise selective, and full recomputation of the fewest
   layers per stage that fits (`--recompute-layers K`, found by bisection over K), whichever
   the cost model finds faster. Bisection relies on the peak not growing when one more layer
   per stage is recomputed (each recomputed layer keeps a subset of what it kept before:
   tests/test_planner.py checks it on random plans); every listed plan is estimated as listed,
   so this can only cost a missed lighter setting, never a wrong FITS;
4. each listed plan carries its estimate's peak, its cost (cost.py) and the flags that
   reproduce it with `pipemem estimate`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

from ..errors import UserError
from ..plan import ParallelPlan, validate_plan
from .cost import Cost, plan_cost, schedule_for
from .hardware import Speeds
from .space import Base, SpaceOptions, enumerate_bases, schedules_for

RECOMPUTE_LADDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Target:
    """Where the plans must run."""

    gpus: int
    capacity_bytes: int
    reserve_bytes: int
    speeds: Speeds
    gpu: str | None = None            # preset key, or None with gpu_memory
    gpu_memory: float | None = None   # GiB, when given instead of a preset
    gpus_per_node: int = 8

    @property
    def budget_bytes(self) -> int:
        return self.capacity_bytes - self.reserve_bytes


@dataclass
class PlanResult:
    kwargs: dict            # pipemem.estimate keyword arguments of the plan
    flags: str              # the same plan as `pipemem estimate` flags
    peak_bytes: int         # highest allocated peak over the pipeline ranks
    rank_peaks: list[int]
    headroom_bytes: int     # GPU capacity - peak (the reserve is part of it)
    schedule: str | None
    cost: Cost

    def to_dict(self) -> dict:
        kw = dict(self.kwargs)
        if kw.get("pp_layout") is not None:
            kw["pp_layout"] = list(kw["pp_layout"])
        return {"flags": self.flags, "plan": kw, "schedule": self.schedule,
                "max_peak_allocated_bytes": self.peak_bytes, "rank_peak_allocated_bytes": list(self.rank_peaks),
                "headroom_bytes": self.headroom_bytes, **self.cost.to_dict()}


@dataclass
class SearchStats:
    proposed: int = 0
    invalid: Counter = field(default_factory=Counter)   # reason -> count
    pruned_static: int = 0                              # skipped by the static-bytes bound
    no_fit: int = 0                                     # estimated, nothing of the ladder fits
    estimates: int = 0                                  # pipemem.estimate calls
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"proposed": self.proposed, "invalid": dict(self.invalid), "pruned_by_static_bound": self.pruned_static,
                "estimated_no_fit": self.no_fit, "estimate_calls": self.estimates, "seconds": self.seconds}


@dataclass
class PlanSearch:
    model: str
    model_flag: str
    arch: object
    target: Target
    fixed: dict
    plans: list[PlanResult]          # fitting plans, fastest first
    stats: SearchStats
    config: dict = field(default_factory=dict, repr=False)   # the model's HF config
    gpu_opts: dict = field(default_factory=dict)              # estimate()'s gpu / gpu_memory

    @property
    def pareto(self) -> list[PlanResult]:
        """Pipeline plans (pp > 1) no other pipeline plan beats on both peak memory and bubble,
        lowest peak first. (Plans without a pipeline have no bubble at all.)"""
        return pareto_front([p for p in self.plans if p.kwargs.get("pp", 1) > 1], lambda p: p.cost.bubble)

    @property
    def pareto_step_time(self) -> list[PlanResult]:
        """Plans no other plan beats on both peak memory and estimated step time."""
        return pareto_front(self.plans, lambda p: p.cost.step_s)


def pareto_front(plans: list[PlanResult], second) -> list[PlanResult]:
    """The plans not dominated in (peak bytes, second(plan)), lowest peak first."""
    out = []
    best = float("inf")
    for p in sorted(plans, key=lambda p: (p.peak_bytes, second(p), p.flags)):
        if second(p) < best - 1e-12:
            out.append(p)
            best = second(p)
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


FLAG_ORDER = ("seq_len", "global_batch", "micro_batch", "dp", "tp", "pp", "vpp", "pp_layout", "cp", "ep", "etp",
              "zero", "fsdp", "dist_opt", "recompute", "recompute_layers", "schedule", "convention", "dtype",
              "master_weights", "optimizer", "flash_attn", "layers")


def flags_string(model_flag: str, target: Target, kwargs: dict) -> str:
    """`pipemem estimate` flags that reproduce the plan."""
    import shlex

    parts = ["--model", shlex.quote(model_flag)]
    if target.gpu is not None:
        parts += ["--gpu", target.gpu]
    else:
        parts += ["--gpu-memory", f"{target.gpu_memory:g}"]
    for k in FLAG_ORDER:
        v = kwargs.get(k)
        if v is None:
            continue
        if isinstance(v, bool):
            if k in ("fsdp", "dist_opt"):
                if v:
                    parts.append(_flag(k))
            else:
                parts.append(_flag(k) if v else "--no-" + k.replace("_", "-"))
            continue
        if k in ("vpp", "cp", "ep") and v == 1:
            continue
        if k == "zero" and v == 0:
            continue
        if k == "recompute" and v == "none":
            continue
        if k == "pp_layout":
            v = ",".join(str(x) for x in v)
        parts += [_flag(k), str(v)]
    return " ".join(parts)


class _Progress:
    """A rich progress bar on stderr, shown only once the search has run for a second."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.t0 = time.perf_counter()
        self.done = 0
        self.bar = None

    def advance(self, fitting: int) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is None:
            if time.perf_counter() - self.t0 < 1.0:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("planning"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[fit]} fit"), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("plans", total=self.total, completed=self.done, fit=fitting)
        self.bar.update(self.task, completed=self.done, fit=fitting)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def search_plans(model, target: Target, seq_len: int, global_batch: int, options: SpaceOptions,
                 extra: dict | None = None, model_flag: str | None = None, progress: bool = False) -> PlanSearch:
    """Every plan of the space (space.py) that fits `target`, fastest first (see module docstring).
    `extra`: plan fields held fixed (dtype, optimizer, master_weights, flash_attn, layers)."""
    from ..estimate import resolve_model
    from ..model import arch_from_hf_config

    t0 = time.perf_counter()
    name, _, config = resolve_model(model)
    arch = arch_from_hf_config(config, name)
    extra = dict(extra or {})
    if extra.get("layers"):
        arch = arch.with_layers(extra["layers"])
    model_flag = model_flag or (model if isinstance(model, str) else name)
    runner = _Runner(config, name, arch, target, seq_len, global_batch, options, extra, model_flag)
    bases = list(enumerate_bases(arch, target.gpus, options))
    bar = _Progress(len(bases), progress)
    try:
        for base in bases:
            runner.run_base(base)
            bar.advance(len(runner.results))
    finally:
        bar.close()
    plans = sorted(runner.results, key=lambda p: (p.cost.step_s, p.peak_bytes, p.flags))
    runner.stats.seconds = time.perf_counter() - t0
    return PlanSearch(name, model_flag, arch, target, dict(options.fixed), plans, runner.stats, config,
                      runner.gpu_opts)


class _Runner:
    def __init__(self, config, name, arch, target, seq_len, global_batch, options, extra, model_flag):
        self.config, self.name, self.arch, self.target = config, name, arch, target
        self.seq_len, self.global_batch = seq_len, global_batch
        self.options, self.extra, self.model_flag = options, extra, model_flag
        self.results: list[PlanResult] = []
        self.stats = SearchStats()
        self.gpu_opts = {"gpu": target.gpu} if target.gpu is not None else {"gpu_memory": target.gpu_memory}

    # ------------------------------------------------------------ one base
    def run_base(self, base: Base) -> None:
        conv = self.options.convention
        for sched, placement in schedules_for(conv, base.pp, base.vpp, self.options.schedules):
            style = "v" if placement == "v" else "interleaved"
            statics = None
            for mbs in self.options.micro_batches:
                self.stats.proposed += 1
                kw = {"seq_len": self.seq_len, "global_batch": self.global_batch, "micro_batch": mbs,
                      **base.kwargs(conv), "schedule": sched, "convention": conv, **self.extra}
                plan = self._validate(kw)
                if plan is None:
                    continue
                if statics is None:
                    statics = self._static(plan, style)
                if max(statics) > self.target.budget_bytes:
                    self.stats.pruned_static += 1
                    continue
                try:
                    schedule_for(sched, plan.pp, plan.microbatches, plan.vpp)
                except UserError:
                    self.stats.invalid["schedule"] += 1
                    continue
                res = self._cheapest_fit(kw, plan, sched, style)
                if res is None:
                    self.stats.no_fit += 1
                else:
                    self.results.append(res)

    def _validate(self, kw: dict) -> ParallelPlan | None:
        if self.global_batch % (kw["dp"] * kw["micro_batch"]):
            self.stats.invalid["batch"] += 1
            return None
        try:
            return validate_plan(self.arch, ParallelPlan(**{k: v for k, v in kw.items() if v is not None}))
        except UserError as e:
            self.stats.invalid[_reason(str(e))] += 1
            return None

    def _static(self, plan: ParallelPlan, style: str) -> list[int]:
        """Static bytes of every pipeline rank (what replay starts from)."""
        from ..stages import stage_layer_ranges
        from ..templates.conventions import convention_for
        from ..templates.static import static_bytes

        conv = convention_for(plan)
        layout = stage_layer_ranges(plan)
        return [static_bytes(self.arch, plan, conv, layout, stages_of_rank(r, plan.pp, plan.vpp, style)).total
                for r in range(plan.pp)]

    # ------------------------------------------------------------ recomputation
    def _cheapest_fit(self, kw: dict, plan: ParallelPlan, sched, style) -> PlanResult | None:
        res = self._try(kw, plan, sched, style, "none", None)
        if res is not None:
            return res
        # Recomputation settings cost more the more they recompute; their cost needs no estimate.
        sel_cost = self._cost(plan, sched, style, "selective", None).step_s
        if sel_cost <= self._cost(plan, sched, style, "full", 1).step_s:
            sel = self._try(kw, plan, sched, style, "selective", None)
            if sel is not None:
                return sel        # cheaper than any full recomputation
        full = self._try(kw, plan, sched, style, "full", None)
        if full is None:
            return None           # full recomputation keeps the least (module docstring)
        # fewest layers per stage that fits: bisection over K (module docstring)
        lo, hi, best = 1, max(plan.pp_layout), full
        while lo < hi:
            mid = (lo + hi) // 2
            r = self._try(kw, plan, sched, style, "full", mid)
            if r is not None:
                hi, best = mid, r
            else:
                lo = mid + 1
        if sel_cost < best.cost.step_s and sel_cost > self._cost(plan, sched, style, "full", 1).step_s:
            sel = self._try(kw, plan, sched, style, "selective", None)
            if sel is not None:
                return sel
        return best

    def _cost(self, plan, sched, style, recompute, layers) -> Cost:
        p = replace(plan, recompute=recompute, recompute_layers=layers)
        rank_stages, params = self._busiest_rank(p, style)
        return plan_cost(self.arch, p, sched, rank_stages, params, self.target.gpus_per_node, self.target.speeds)

    def _try(self, kw, plan, sched, style, recompute: str, layers: int | None) -> PlanResult | None:
        """Estimate the plan with this recomputation; the result when it fits, else None."""
        from ..estimate import estimate

        kw = dict(kw, recompute=recompute)
        if layers is not None:
            kw["recompute_layers"] = layers
        call = {k: v for k, v in kw.items() if v is not None}
        self.stats.estimates += 1
        est = estimate(self.config, model_name=self.name, **self.gpu_opts, **call)
        peak = est.max_peak_allocated_bytes
        if peak > self.target.budget_bytes:
            return None
        cost = self._cost(plan, sched, style, recompute, layers)
        return PlanResult(kwargs=call, flags=flags_string(self.model_flag, self.target, call), peak_bytes=peak,
                          rank_peaks=[r.peak_allocated_bytes for r in est.ranks],
                          headroom_bytes=self.target.capacity_bytes - peak, schedule=est.schedule if sched else None,
                          cost=cost)

    def _busiest_rank(self, plan, style) -> tuple[list[int], tuple[int, int]]:
        """Stages and (dense, expert) parameters of the pipeline rank holding the most parameters:
        its communication is the step's."""
        from ..stages import stage_layer_ranges
        from ..templates.conventions import convention_for
        from ..templates.static import rank_param_counts

        conv, layout = convention_for(plan), stage_layer_ranges(plan)
        best = None
        for r in range(plan.pp):
            st = stages_of_rank(r, plan.pp, plan.vpp, style)
            n = rank_param_counts(self.arch, plan, conv, layout, st)
            if best is None or sum(n) > sum(best[1]):
                best = (st, n)
        return best


def stages_of_rank(rank: int, pp: int, vpp: int, style: str) -> list[int]:
    """The stages a named schedule of that placement puts on `rank` (the schedules' own maps)."""
    from ..schedules.actions import loop_stage_map, v_stage_map
    placed = v_stage_map(pp, vpp) if style == "v" else loop_stage_map(pp, vpp)
    return [s for s, r in enumerate(placed) if r == rank]


def _reason(message: str) -> str:
    """A short key for an invalid plan's error message (for the summary counts)."""
    flag = message.split()[0] if message.startswith("--") else "plan"
    return flag.lstrip("-")
