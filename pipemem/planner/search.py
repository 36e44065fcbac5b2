"""The plan search: every plan of the space that fits, each estimated by `pipemem.estimate`.

For each proposal of `space.enumerate_bases` x schedule x micro-batch size:

1. validity: `validate_plan` (the rules of `pipemem estimate`) and the schedule generator
   (e.g. Megatron's interleaved order needs microbatches % pp == 0); invalid plans are
   counted by reason, never listed;
2. exact pruning: a rank's replayed peak is at least its static bytes (replay starts there and
   no job has a negative peak), so when the static bytes of some rank (the same
   `static_bytes` the estimate uses, for the ranks' stages as the schedule places them) plus
   the reserve exceed the GPU, no micro-batch size or recomputation can fit: those plans are
   counted, not estimated;
3. recomputation: the cheapest setting that fits. No recomputation when it fits (any
   recomputation only adds work); otherwise selective, and full recomputation of the fewest
   layers per stage that fits (`--recompute-layers K`, found by bisection over K), whichever
   the cost model finds faster. Bisection relies on the peak not growing when one more layer
   per stage is recomputed (each recomputed layer keeps a subset of what it kept before:
   tests/test_planner.py checks it on random plans); every listed plan is estimated as listed,
   so this can only cost a missed lighter setting, never a wrong FITS;
4. plans that differ only in sharding and run the same stage jobs (Megatron, Paddle: ddp,
   ZeRO-1/2, distributed optimizer) are tried most sharded first; a setting that did not fit
   with fewer static bytes is not estimated again with more, and a setting's per-rank peaks
   carry over exactly (`_Ladder`);
5. micro-batch sizes are tried smallest first; a setting that did not fit a plan does not fit
   it with a larger micro-batch, and it needs at least as many recomputed layers, as long as
   the larger micro-batch still leaves at least 2 x pp microbatches: then every schedule
   (1F1B, interleaved, zero-bubble, V) has filled its pipeline and holds as many microbatches
   in flight as with the smaller one, each larger, so the peak does not fall (with fewer
   microbatches the count in flight drops and the peak can fall: Llama 405B at pp 2 with 1
   or 2 microbatches).
   tests/test_planner.py checks it on random plans, like the recomputation bisection: at
   worst a missed plan, never a wrong FITS;
6. each listed plan carries its estimate's peak, its cost (cost.py) and the flags that
   reproduce it with `pipemem estimate`.

`search_plans(..., prune=False)` switches 2, 4 and 5 off; the listing must not change (tested).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from .. import frameworks
from ..errors import UserError
from ..plan import ParallelPlan, validate_plan
from .cost import Cost, plan_cost, schedule_for
from .hardware import Speeds
from .space import Base, SpaceOptions, enumerate_bases, schedules_for


@dataclass(frozen=True)
class Target:
    """Where the plans must run. A plan is listed only when `pipemem estimate` calls it FITS
    on this GPU (its device peak: reserved + outside the allocator, within the verdict's
    margin) with `reserve_bytes` more kept free."""

    gpus: int
    capacity_bytes: int
    reserve_bytes: int  # kept free beyond the verdict's own margin (--reserve)
    speeds: Speeds
    gpu: str | None = None  # preset key, or None with gpu_memory
    gpu_memory: float | None = None  # GiB, when given instead of a preset
    gpus_per_node: int = 8
    cuda_context_mib: float | None = None  # estimate()'s overrides of the outside-allocator sizes
    nccl_mib: float | None = None

    @property
    def budget_bytes(self) -> int:
        """The most a rank's device peak may reach: the verdict's FITS line less the reserve."""
        from ..estimate import NEAR_LIMIT

        return int(self.capacity_bytes * (1 - NEAR_LIMIT)) - self.reserve_bytes

    def budget_for(self, plan, tied_embeddings: bool) -> int:
        """The most a rank's *allocated* peak may reach under `plan`: the budget less the
        memory outside the allocator of the plan's costliest rank. Reserved is at least
        allocated, so a plan over this cannot fit: the search prunes on it, and the listed
        plans are judged on their full device peak (`_Probe.result`)."""
        key = (plan.tp, plan.cp, plan.dp, plan.pp, plan.ep, plan.etp, tied_embeddings)
        outside = _OUTSIDE.get((self, key))
        if outside is None:
            from ..outside_allocator import outside_allocator
            from ..presets import gpu_info

            cc = gpu_info(self.gpu).get("compute_capability") if self.gpu is not None else None
            outside = _OUTSIDE[(self, key)] = max(
                outside_allocator(
                    plan, tied_embeddings, r, cc, self.cuda_context_mib, self.nccl_mib
                ).total_bytes
                for r in {0, plan.pp - 1}
            )
        return self.budget_bytes - outside


_OUTSIDE: dict = {}  # (target, the plan's group sizes) -> the costliest rank's outside-allocator bytes


@dataclass
class PlanResult:
    kwargs: dict  # pipemem.estimate keyword arguments of the plan
    flags: str  # the same plan as `pipemem estimate` flags
    peak_bytes: int  # highest allocated peak over the pipeline ranks
    rank_peaks: list[int]
    headroom_bytes: int  # GPU capacity - the highest device peak (reserved + outside the allocator)
    schedule: str | None
    cost: Cost
    # the highest device peak over the ranks (reserved + outside the allocator) once the plan is
    # judged (`PlanSearch.verify`); until then allocated + outside, the screen's lower bound
    device_peak_bytes: int = 0
    verdict: str | None = None  # "fits" once judged by pipemem estimate's verdict; None: screened only

    def to_dict(self) -> dict:
        kw = dict(self.kwargs)
        if kw.get("pp_layout") is not None:
            kw["pp_layout"] = list(kw["pp_layout"])
        return {
            "flags": self.flags,
            "plan": kw,
            "schedule": self.schedule,
            "max_peak_allocated_bytes": self.peak_bytes,
            "rank_peak_allocated_bytes": list(self.rank_peaks),
            "max_device_peak_bytes": self.device_peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "verdict": self.verdict,
            **self.cost.to_dict(),
        }


@dataclass
class SearchStats:
    proposed: int = 0
    invalid: Counter = field(default_factory=Counter)  # reason -> count
    invalid_why: dict = field(default_factory=dict)  # reason -> the first refusal's message
    pruned_static: int = 0  # skipped by the static-bytes bound
    no_fit: int = 0  # estimated, nothing of the ladder fits
    implied: int = 0  # settings known not to fit without an estimate
    derived: int = 0  # settings whose peaks carried over (_Ladder)
    derivation_mismatch: int = 0  # should stay 0 (_Probe.result)
    dropped_on_reserved: int = 0  # screened in, then not FITS by the verdict (verify)
    estimates: int = 0  # pipemem.estimate calls
    # recomputation settings of a valid plan that pipemem.estimate refused (the plan itself is
    # counted once, as fitting or not): not invalid plans
    refused_settings: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def add(self, other: "SearchStats") -> None:
        """Count `other`'s plans too (one group's search, possibly in another process)."""
        for f in (
            "proposed",
            "pruned_static",
            "no_fit",
            "implied",
            "derived",
            "derivation_mismatch",
            "estimates",
            "dropped_on_reserved",
        ):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.invalid.update(other.invalid)
        self.refused_settings.update(other.refused_settings)
        for k, v in other.invalid_why.items():
            self.invalid_why.setdefault(k, v)

    def refuse(self, message: str) -> None:
        key = _reason(message)
        self.invalid[key] += 1
        self.invalid_why.setdefault(key, message)

    def to_dict(self) -> dict:
        return {
            "proposed": self.proposed,
            "invalid": dict(self.invalid),
            "pruned_by_static_bound": self.pruned_static,
            "estimated_no_fit": self.no_fit,
            "estimate_calls": self.estimates,
            "settings_implied_too_large": self.implied,
            "settings_derived": self.derived,
            "derivation_mismatch": self.derivation_mismatch,
            "dropped_on_reserved": self.dropped_on_reserved,
            "settings_refused": dict(self.refused_settings),
            "seconds": self.seconds,
        }


@dataclass
class PlanSearch:
    model: str
    model_flag: str
    arch: object
    target: Target
    fixed: dict
    plans: list[PlanResult]  # fitting plans, fastest first
    stats: SearchStats
    config: dict = field(default_factory=dict, repr=False)  # the model's HF config
    gpu_opts: dict = field(default_factory=dict)  # estimate()'s gpu / gpu_memory

    def verify(self, top: int, budget_s: float = 10.0, jobs: int = 1) -> int:
        """Judge the plans a user is shown (the `top` fastest, then the Pareto sets' first
        `top`) by `pipemem estimate`'s own verdict, reserved memory included, and drop those it
        does not call FITS; returns how many were dropped. The search screens every plan on
        allocated + outside-the-allocator bytes (a lower bound of the device peak) because the
        allocator model costs up to seconds per plan (its events grow with the microbatches):
        judging stops after `budget_s` seconds, and the plans left unjudged keep
        `verdict=None` ("screened" in the table). `jobs` > 1 judges that many plans at a time in
        forked processes (each plan's verdict is its own: the same, sooner)."""
        import time

        start = time.perf_counter()
        dropped = 0
        pool = None
        global _JUDGE
        try:
            while time.perf_counter() - start < budget_s:
                shown = self.plans[:top] + self.pareto[:top] + self.pareto_step_time[-top:]
                todo = list({id(p): p for p in shown if p.verdict is None}.values())
                if not todo:
                    break
                if jobs > 1 and len(todo) > 1 and pool is None:
                    import multiprocessing as mp

                    if "fork" in mp.get_all_start_methods():
                        _JUDGE = self
                        pool = mp.get_context("fork").Pool(jobs)
                if pool is not None:
                    # plans likely to replay the same rank streams go to one worker, whose
                    # allocator replays are cached by the streams' content (pipemem.reserved)
                    groups: dict = {}
                    for p in todo:
                        groups.setdefault(_stream_twins(p.kwargs), []).append(p)
                    todo = [p for g in groups.values() for p in g]
                    verdicts = (
                        v
                        for vs in pool.imap(
                            _judge_group_in_worker, [[p.kwargs for p in g] for g in groups.values()]
                        )
                        for v in vs
                    )
                else:
                    verdicts = (self._judge(p.kwargs) for p in todo)
                for p in todo:
                    if time.perf_counter() - start >= budget_s:
                        break
                    listable, device_peak = next(verdicts)
                    if listable:
                        p.verdict = "fits"
                        p.device_peak_bytes = device_peak
                        p.headroom_bytes = self.target.capacity_bytes - p.device_peak_bytes
                    else:
                        self.plans.remove(p)
                        dropped += 1
                        self.stats.dropped_on_reserved += 1
        finally:
            if pool is not None:
                pool.terminate()
                _JUDGE = None
        return dropped

    def _judge(self, kwargs: dict) -> tuple[bool, int]:
        """(FITS with the reserve kept free, the highest device peak) by pipemem estimate."""
        from ..estimate import estimate

        est = estimate(self.config, model_name=self.model, **self.gpu_opts, **kwargs)
        return _listable(est, self.target), est.max_device_peak_bytes

    @property
    def pareto(self) -> list[PlanResult]:
        """Pipeline plans (pp > 1) no other pipeline plan beats on both peak memory and bubble,
        lowest peak first. (Plans without a pipeline have no bubble at all.)"""
        return pareto_front([p for p in self.plans if p.kwargs.get("pp", 1) > 1], lambda p: p.cost.bubble)

    @property
    def pareto_step_time(self) -> list[PlanResult]:
        """Plans no other plan beats on both peak memory and estimated step time."""
        return pareto_front(self.plans, lambda p: p.cost.step_s)


_JUDGE: "PlanSearch | None" = None  # the search whose plans forked judges estimate (verify)


def _judge_group_in_worker(group: list[dict]) -> list[tuple[bool, int]]:
    return [_JUDGE._judge(kwargs) for kwargs in group]


def _stream_twins(kwargs: dict) -> tuple:
    """A guess at which plans make the same allocation streams (the same tokens per microbatch
    on a context-parallel rank, the same data x context group, the same microbatch count):
    only where the plans are judged (one worker each), never what is judged."""
    kw = dict(kwargs)
    mbs, cp, dp = kw.pop("micro_batch", 1), kw.pop("cp", 1) or 1, kw.pop("dp", 1) or 1
    seq, batch = kw.get("seq_len", 0), kw.get("global_batch", 0)
    rest = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items()))
    return rest, mbs * seq // cp, dp * cp, batch // max(1, dp * mbs)


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


FLAG_ORDER = (
    "seq_len",
    "global_batch",
    "micro_batch",
    "dp",
    "tp",
    "pp",
    "vpp",
    "pp_layout",
    "cp",
    "ep",
    "etp",
    "zero",
    "fsdp",
    "dist_opt",
    "recompute",
    "recompute_layers",
    "schedule",
    "convention",
    "dtype",
    "master_weights",
    "optimizer",
    "flash_attn",
    "layers",
    "lora_rank",
    "lora_targets",
    "lora_alpha",
    "lora_dropout",
    "qlora",
)


def flags_string(model_flag: str, target: Target, kwargs: dict) -> str:
    """`pipemem estimate` flags that reproduce the plan."""
    import shlex

    parts = ["--model", shlex.quote(model_flag)]
    if target.gpu is not None:
        parts += ["--gpu", target.gpu]
    else:
        parts += ["--gpu-memory", f"{target.gpu_memory:g}"]
    if target.cuda_context_mib is not None:
        parts += ["--cuda-context-mib", f"{target.cuda_context_mib:g}"]
    if target.nccl_mib is not None:
        parts += ["--nccl-mib", f"{target.nccl_mib:g}"]
    for k in FLAG_ORDER:
        v = kwargs.get(k)
        if v is None:
            continue
        if isinstance(v, bool):
            if k in ("fsdp", "dist_opt", "qlora"):
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
        parts += [_flag(k), shlex.quote(f"{v:g}" if isinstance(v, float) else str(v))]
    return " ".join(parts)


class _Progress:
    """A rich progress bar on stderr, shown only once the search has run for a second."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.t0 = time.perf_counter()
        self.done = 0
        self.bar = None

    def advance(self, fitting: int, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is None:
            if time.perf_counter() - self.t0 < 1.0:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("planning"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[fit]} fit"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("plans", total=self.total, completed=self.done, fit=fitting)
        self.bar.update(self.task, completed=self.done, fit=fitting)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def search_plans(
    model,
    target: Target,
    seq_len: int,
    global_batch: int,
    options: SpaceOptions,
    extra: dict | None = None,
    model_flag: str | None = None,
    progress: bool = False,
    prune: bool = True,
    jobs: int = 1,
) -> PlanSearch:
    """Every plan of the space (space.py) that fits `target`, fastest first (see module docstring).
    `extra`: plan fields held fixed (dtype, optimizer, master_weights, flash_attn, layers).
    `prune=False` estimates what the static-bytes bound and the shared ladder would skip (for
    tests: the listing must not change). `jobs` > 1 searches groups of plans in that many
    processes (each estimate is independent; the listing is the same)."""
    with _fewer_collections():
        return _search_plans(
            model, target, seq_len, global_batch, options, extra, model_flag, progress, prune, jobs
        )


@contextmanager
def _fewer_collections():
    """A search makes millions of short-lived objects (jobs, actions, arrays, estimates) beside
    a growing set of cached programs and schedules. None of them forms a reference cycle (an
    estimate and its ranks hold each other only weakly: `reserved._Sources`; tested), so
    reference counting frees them all, and the cyclic collector would only traverse the caches
    again and again (~25 % of the time with the default thresholds, ~10 % with rare
    collections). It is paused during the search; what the search leaves alive (the caches) is
    then moved out of its sight (`gc.freeze`), so that the first collection after the search
    does not traverse it either (its cycles, if any, are never collected: a search makes few).
    The forked workers inherit it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


def _search_plans(
    model,
    target: Target,
    seq_len: int,
    global_batch: int,
    options: SpaceOptions,
    extra: dict | None,
    model_flag: str | None,
    progress: bool,
    prune: bool,
    jobs: int,
) -> PlanSearch:
    from ..estimate import resolve_model
    from ..model import arch_from_hf_config

    t0 = time.perf_counter()
    name, _, config = resolve_model(model)
    arch = arch_from_hf_config(config, name)
    from ..templates.mla import check_mla_convention

    check_mla_convention(arch, options.convention)  # every plan would be refused: say so once
    extra = dict(extra or {})
    if extra.get("layers"):
        arch = arch.with_layers(extra["layers"])
    model_flag = model_flag or (model if isinstance(model, str) else name)
    runner = _Runner(config, name, arch, target, seq_len, global_batch, options, extra, model_flag)
    runner.prune = prune
    from ..estimate import reads_model_once

    if reads_model_once(model):
        # a preset name (not a file): the estimates read the model once by that name and keep
        # it, where the config dict would be read into a model again at every estimate
        runner.model = model
    groups: dict[tuple, list[Base]] = {}
    for base in enumerate_bases(arch, target.gpus, options):
        groups.setdefault(replace(base, sharding=""), []).append(base)
    groups = list(groups.values())
    bar = _Progress(sum(len(g) for g in groups), progress)
    results: list[PlanResult] = []
    stats = SearchStats()
    try:
        for n, (found, counted) in _run_groups(runner, groups, jobs):
            results += found
            stats.add(counted)
            bar.advance(len(results), n)
    finally:
        bar.close()
    plans = sorted(results, key=lambda p: (p.cost.step_s, p.peak_bytes, p.flags))
    stats.seconds = time.perf_counter() - t0
    return PlanSearch(
        name, model_flag, arch, target, dict(options.fixed), plans, stats, config, runner.gpu_opts
    )


_WORKER: "_Runner | None" = None


def _run_groups(runner: "_Runner", groups: list[list[Base]], jobs: int):
    """Yield (bases done, results, stats) per task, in this process or in `jobs` forked ones.
    A task is the groups that share pp, vpp and dp, so share their schedules: the first
    estimate of a schedule builds and lowers it (tens to hundreds of milliseconds at
    thousands of microbatches), and a worker keeps it for the rest of its task."""
    import multiprocessing as mp

    tasks: dict[tuple, list[list[Base]]] = {}
    for g in groups:
        tasks.setdefault((g[0].pp, g[0].vpp, g[0].dp), []).append(g)
    task_list = sorted(tasks.values(), key=lambda t: -sum(len(g) for g in t))  # big ones first
    if jobs > 1 and len(task_list) > 1 and "fork" in mp.get_all_start_methods():
        global _WORKER
        _WORKER = runner  # inherited by the forked workers
        try:
            with mp.get_context("fork").Pool(min(jobs, len(task_list))) as pool:
                yield from pool.imap_unordered(_run_task_in_worker, task_list)
        finally:
            _WORKER = None
        return
    for task in task_list:
        yield _run_task(runner, task)


def _run_task(runner: "_Runner", task: list[list[Base]]):
    runner.results, runner.stats = [], SearchStats()
    for group in task:
        runner.run_group(group)
    return sum(len(g) for g in task), (runner.results, runner.stats)


def _run_task_in_worker(task: list[list[Base]]):
    return _run_task(_WORKER, task)


class _Runner:
    def __init__(self, config, name, arch, target, seq_len, global_batch, options, extra, model_flag):
        self.config, self.name, self.arch, self.target = config, name, arch, target
        self.model = config  # what the estimates are given (a preset's name where there is one)
        self.seq_len, self.global_batch = seq_len, global_batch
        self.options, self.extra, self.model_flag = options, extra, model_flag
        self.results: list[PlanResult] = []
        self.stats = SearchStats()
        self.gpu_opts = {"gpu": target.gpu} if target.gpu is not None else {"gpu_memory": target.gpu_memory}
        self.gpu_opts.update(
            {
                k: v
                for k, v in (("cuda_context_mib", target.cuda_context_mib), ("nccl_mib", target.nccl_mib))
                if v is not None
            }
        )
        self._busiest: dict = {}
        self.prune = True

    # ------------------------------------------------------------ one group of bases
    def run_group(self, bases: list[Base]) -> None:
        """Bases that differ only in model-state sharding, most sharded first. Where gradients live
        in a resident buffer (Megatron, Paddle), ddp, ZeRO-1/2 and the distributed optimizer (not
        ZeRO-3/FSDP) run the same stage jobs from different static bytes, so a setting that does
        not fit with more sharding does not fit with less (`_Ladder.failed`)."""
        conv = self.options.convention
        fw = frameworks.get(conv)
        b0 = bases[0]
        bases = sorted(bases, key=lambda b: SHARDING_ORDER.get(b.sharding, 0))
        for sched, _ in schedules_for(conv, b0.pp, b0.vpp, self.options.schedules):
            statics: dict[str, list[int]] = {}
            smaller: dict[str, tuple[set, int]] = {}  # sharding -> outcome at a smaller micro-batch
            for mbs in sorted(self.options.micro_batches):
                ladder = _Ladder()
                for base in bases:
                    self.stats.proposed += 1
                    kw = {
                        "seq_len": self.seq_len,
                        "global_batch": self.global_batch,
                        "micro_batch": mbs,
                        **base.kwargs(conv),
                        "schedule": sched,
                        "convention": conv,
                        **self.extra,
                    }
                    plan = self._validate(kw)
                    if plan is None:
                        continue
                    try:
                        schedule = schedule_for(sched, plan.pp, plan.microbatches, plan.vpp)
                    except UserError:
                        self.stats.invalid["schedule"] += 1
                        continue
                    # the virtual stages each pipeline rank runs (the schedule's placement)
                    placement = tuple(tuple(schedule.stages_of_rank(r)) for r in range(plan.pp))
                    if base.sharding not in statics:
                        statics[base.sharding] = self._static(plan, placement)
                    if self.prune and max(statics[base.sharding]) > self.target.budget_for(
                        plan, self.arch.tied_embeddings
                    ):
                        self.stats.pruned_static += 1
                        continue
                    # (paddle's optimizer step copies the clipped gradients: sharding them changes it)
                    same = (
                        SAME_JOBS
                        if not fw.convention.grad_clip_copy
                        else tuple(x for x in SAME_JOBS if x != "zero2")
                    )
                    shared = (
                        ladder
                        if (base.sharding in same and fw.contiguous_grad_buffer and self.prune)
                        else _Ladder()
                    )
                    # what a smaller micro-batch showed carries over while the pipeline stays full
                    full_pipe = plan.microbatches >= 2 * plan.pp
                    res, smaller[base.sharding] = self._cheapest_fit(
                        kw,
                        plan,
                        sched,
                        placement,
                        statics[base.sharding],
                        shared,
                        smaller.get(base.sharding) if self.prune and full_pipe else None,
                    )
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
            self.stats.refuse(str(e))
            return None

    def _static(self, plan: ParallelPlan, placement) -> list[int]:
        """Static bytes of every pipeline rank (what replay starts from)."""
        from ..stages import stage_layer_ranges
        from ..templates.conventions import convention_for
        from ..templates.static import static_bytes

        conv = convention_for(plan)
        layout = stage_layer_ranges(plan)
        return [static_bytes(self.arch, plan, conv, layout, list(stages)).total for stages in placement]

    # ------------------------------------------------------------ recomputation
    def _cheapest_fit(
        self,
        kw: dict,
        plan: ParallelPlan,
        sched,
        placement,
        statics: list[int],
        ladder: "_Ladder",
        smaller: tuple[set, int] | None = None,
    ):
        """(the cheapest recomputation setting that fits, or None; (the settings that did not fit,
        the fewest layers per stage fully recomputed that did)) -- the second part is `smaller`
        for the same plan at the next micro-batch size (module docstring)."""
        probe = _Probe(self, kw, plan, sched, placement, statics, ladder, smaller)
        res = self._ladder(probe, plan, sched, placement)
        return res, (probe.failed_here, probe.min_layers)

    def _ladder(self, probe: "_Probe", plan: ParallelPlan, sched, placement) -> PlanResult | None:
        ladder = probe.ladder
        if probe.fits("none", None):
            return probe.result("none", None)
        if frameworks.get(self.options.convention).recompute_whole_model:
            return probe.result("full", None) if probe.fits("full", None) else None
        # Recomputation settings cost more the more they recompute; their cost needs no estimate.
        sel_first = self._selective_cheaper(plan, sched, placement, 1)
        if sel_first and probe.fits("selective", None):
            return probe.result("selective", None)  # cheaper than any full recomputation
        if not probe.fits("full", None):
            return None  # full recomputation keeps the least (module docstring)
        # Fewest layers per stage K that fits: bisection over K (module docstring), from the
        # fewest a more sharded plan with the same jobs, or this plan at a smaller micro-batch,
        # needed; the first probes go where the peaks of no and full recomputation put K if the
        # peak fell linearly with K, and just below or above it, so a good guess costs two estimates.
        layers = max(plan.pp_layout)
        lo, hi = max(1, ladder.min_layers, probe.smaller_min), layers
        lo = min(lo, hi)
        guess = _interpolate(
            probe.peak("none", None),
            probe.peak("full", None),
            self.target.budget_for(probe.plan, self.arch.tied_embeddings),
            layers,
        )
        pivots = [guess] if guess is not None else []
        while lo < hi:
            mid = pivots.pop(0) if pivots and lo <= pivots[0] < hi else (lo + hi) // 2
            if probe.fits("full", mid):
                hi = mid
                if mid == guess:
                    pivots = [mid - 1]
            else:
                lo = mid + 1
                if mid == guess:
                    pivots = [mid + 1]
        ladder.min_layers = probe.min_layers = hi
        k = hi if hi < layers else None
        if (
            not sel_first
            and hi > 1
            and self._selective_cheaper(plan, sched, placement, hi)
            and probe.fits("selective", None)
        ):
            return probe.result("selective", None)
        return probe.result("full", k)

    def _selective_cheaper(self, plan, sched, placement, layers: int) -> bool:
        """Does selective recomputation cost less than full recomputation of `layers` layers per
        stage? Settled without simulating when one adds no more FLOPs to any stage than the other
        (the simulated makespan only grows with durations, and full recomputation also repeats
        the forward's tp traffic); simulated otherwise."""
        from .cost import stage_flops

        a = stage_flops(self.arch, plan.pp_layout, plan.seq_len, "selective", None)
        b = stage_flops(self.arch, plan.pp_layout, plan.seq_len, "full", layers)
        if all(x[1] <= y[1] for x, y in zip(a, b)):
            return True
        if all(x[1] >= y[1] for x, y in zip(a, b)) and plan.tp == 1:
            return False
        return (
            self._cost(plan, sched, placement, "selective", None).step_s
            < self._cost(plan, sched, placement, "full", layers).step_s
        )

    def _cost(self, plan, sched, placement, recompute, layers) -> Cost:
        p = replace(plan, recompute=recompute, recompute_layers=layers)
        rank_stages, params = self._busiest_rank(p, placement)
        return plan_cost(
            self.arch, p, sched, rank_stages, params, self.target.gpus_per_node, self.target.speeds
        )

    def _estimate(self, kw: dict, recompute: str, layers: int | None):
        """pipemem.estimate of the plan with this recomputation, or None when it refuses the plan."""
        from ..estimate import estimate

        call = self._call(kw, recompute, layers)
        self.stats.estimates += 1
        try:
            return estimate(self.model, model_name=self.name, **self.gpu_opts, **call)
        except UserError as e:  # a rule beyond validate_plan (e.g. the schedule's); never listed
            self.stats.refused_settings[_reason(str(e))] += 1
            return None

    @staticmethod
    def _call(kw: dict, recompute: str, layers: int | None) -> dict:
        kw = dict(kw, recompute=recompute)
        if layers is not None:
            kw["recompute_layers"] = layers
        return {k: v for k, v in kw.items() if v is not None}

    def _result(self, kw, plan, sched, placement, recompute, layers, est) -> PlanResult:
        call = self._call(kw, recompute, layers)
        peak = est.max_peak_allocated_bytes
        screened = _screen_bytes(est)
        return PlanResult(
            kwargs=call,
            flags=flags_string(self.model_flag, self.target, call),
            peak_bytes=peak,
            rank_peaks=[r.peak_allocated_bytes for r in est.ranks],
            headroom_bytes=self.target.capacity_bytes - screened,
            schedule=est.schedule if sched else None,
            cost=self._cost(plan, sched, placement, recompute, layers),
            device_peak_bytes=screened,
        )

    def _busiest_rank(self, plan, placement) -> tuple[list[int], tuple[int, int]]:
        """Stages and (dense, expert) parameters of the pipeline rank holding the most parameters:
        its communication is the step's."""
        key = (plan.tp, plan.pp, plan.vpp, plan.ep, plan.etp, plan.pp_layout, placement)
        hit = self._busiest.get(key)
        if hit is None:
            hit = self._busiest[key] = self._find_busiest_rank(plan, placement)
        return hit

    def _find_busiest_rank(self, plan, placement) -> tuple[list[int], tuple[int, int]]:
        from ..stages import stage_layer_ranges
        from ..templates.conventions import convention_for
        from ..templates.static import rank_param_counts

        conv, layout = convention_for(plan), stage_layer_ranges(plan)
        best = None
        for r in range(plan.pp):
            st = list(placement[r])
            n = rank_param_counts(self.arch, plan, conv, layout, st)
            if best is None or sum(n) > sum(best[1]):
                best = (st, n)
        return best


# sharding labels, most sharded first; those in SAME_JOBS leave the stage jobs unchanged
SHARDING_ORDER = {"fsdp": 0, "zero3": 0, "zero2": 1, "dist-opt": 2, "zero1": 2, "ddp": 3}
SAME_JOBS = ("zero2", "dist-opt", "zero1", "ddp")


class _Ladder:
    """What plans with the same stage jobs (same schedule, placement and micro-batch size;
    sharding levels that leave the jobs unchanged) showed, for the next one with more static
    bytes. Replay is a walk that starts at a rank's static bytes and adds the same job sequence,
    so with the same jobs each rank's peak moves by exactly its change in static bytes: a
    setting's per-rank peaks carry over (`derive`), and a setting that did not fit cannot fit
    with more static bytes (`failed`). Also the fewest fully recomputed layers per stage that
    fitted."""

    def __init__(self):
        self._failed: set = set()
        self._peaks: dict = {}  # (recompute, layers) -> (rank peaks, rank statics)
        self.min_layers = 1

    def failed(self, recompute: str, layers: int | None) -> bool:
        return (recompute, layers) in self._failed

    def fail(self, recompute: str, layers: int | None) -> None:
        self._failed.add((recompute, layers))

    def record(self, key, rank_peaks: list[int], statics: list[int]) -> None:
        self._peaks[key] = (list(rank_peaks), list(statics))

    def derive(self, key, statics: list[int]) -> list[int] | None:
        hit = self._peaks.get(key)
        if hit is None:
            return None
        peaks, base = hit
        return [p - a + b for p, a, b in zip(peaks, base, statics)]


class _Probe:
    """The recomputation settings of one plan: does each fit, and the listed result. A setting
    is estimated unless the ladder settles it; one that the ladder says fits is estimated before
    it is listed, and must give the bytes the ladder derived (else the ladder is dropped and the
    setting estimated afresh: `SearchStats.derivation_mismatch`, tested to stay 0)."""

    def __init__(self, runner, kw, plan, sched, placement, statics, ladder, smaller=None):
        self.r, self.kw, self.plan, self.sched, self.placement = runner, kw, plan, sched, placement
        self.statics, self.ladder = statics, ladder
        self.smaller_failed, self.smaller_min = smaller or (set(), 1)
        self.peaks: dict = {}  # key -> rank peaks (estimated or derived)
        self.ests: dict = {}  # key -> Estimate
        self.failed_here: set = set()
        self.min_layers = 1

    def peak(self, recompute, layers) -> int | None:
        p = self.peaks.get((recompute, layers))
        return max(p) if p else None

    def fits(self, recompute: str, layers: int | None) -> bool:
        key = (recompute, layers)
        budget = self.r.target.budget_for(self.plan, self.r.arch.tied_embeddings)
        if key not in self.peaks:
            if self.ladder.failed(*key) or key in self.smaller_failed:
                self.r.stats.implied += 1
                self.failed_here.add(key)
                return False
            derived = self.ladder.derive(key, self.statics)
            if derived is not None:
                self.r.stats.derived += 1
                self.peaks[key] = derived
            else:
                est = self.r._estimate(self.kw, recompute, layers)
                if est is None:
                    self.ladder.fail(*key)
                    self.failed_here.add(key)
                    return False
                self.ests[key] = est
                self.peaks[key] = [x.peak_allocated_bytes for x in est.ranks]
            self.ladder.record(key, self.peaks[key], self.statics)
        est = self.ests.get(key)
        # estimated: allocated + outside the allocator per rank; derived by the ladder: the
        # allocated bound (result() estimates it and screens it before listing)
        ok = (
            _screen_bytes(est) <= self.r.target.budget_bytes
            if est is not None
            else max(self.peaks[key]) <= budget
        )
        if not ok:
            self.ladder.fail(*key)
            self.failed_here.add(key)
        return ok

    def result(self, recompute: str, layers: int | None) -> PlanResult | None:
        key = (recompute, layers)
        est = self.ests.get(key)
        if est is None:
            est = self.r._estimate(self.kw, recompute, layers)
            if est is None or [x.peak_allocated_bytes for x in est.ranks] != self.peaks.get(key):
                # the ladder's derivation disagrees with the engine: never trust it here
                self.r.stats.derivation_mismatch += 1
                return self.r._ladder(
                    _Probe(self.r, self.kw, self.plan, self.sched, self.placement, self.statics, _Ladder()),
                    self.plan,
                    self.sched,
                    self.placement,
                )
        if _screen_bytes(est) > self.r.target.budget_bytes:
            return None
        return self.r._result(self.kw, self.plan, self.sched, self.placement, recompute, layers, est)


def _screen_bytes(est) -> int:
    """The highest allocated + outside-the-allocator peak over the ranks: a lower bound of the
    device peak (reserved is at least allocated) that costs no allocator model."""
    return max(
        r.peak_allocated_bytes + (r.outside.total_bytes if r.outside is not None else 0) for r in est.ranks
    )


def _listable(est, target: Target) -> bool:
    """A shown plan is one the estimate itself calls FITS, with the reserve kept free."""
    return bool(est.fits) and est.max_device_peak_bytes <= target.budget_bytes


def _interpolate(peak_none: int | None, peak_full: int, budget: int, layers: int) -> int | None:
    """K (1..layers-1) at which a peak falling linearly from `peak_none` (K = 0) to `peak_full`
    (K = layers) meets `budget`; only a first guess for the bisection."""
    if peak_none is None or peak_none <= peak_full or layers < 2:
        return None
    k = -(-(peak_none - budget) * layers // (peak_none - peak_full))
    return min(max(int(k), 1), layers - 1)


def _reason(message: str) -> str:
    """A short key for an invalid plan's error message (for the summary counts)."""
    flag = message.split()[0] if message.startswith("--") else "plan"
    return flag.lstrip("-")
