"""Program sources: where a plan's stage jobs come from (DESIGN.md, "The flow").

`pipemem.estimate` takes one path for every `--mode`:

    source = SOURCES[mode](...)           # templates | traced | paddle
    arch, config, note = source.read_arch(config, name)
    arch, plan = source.validate(arch, plan, vpp_given)   # the plan's one validation
    schedule = source.schedule(plan)      # None: the source's programs carry their own
    runtime = source.runtime(plan)
    stage_plan = source.stage_plan(arch, plan, schedule)  # a pipemem.jobs.StagePlan
    -> per-rank static bytes, optimizer jobs, first-backward jobs -> replay -> Estimate

A source answers those five questions and nothing else; every source returns the same
`jobs.StagePlan` type, so the estimate builds the replay's inputs, replays and packages the
answer once. To add a source: a class with these methods (and `mode`, `reserved_stream`), its
name in `SOURCES` and in `estimate.MODES`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from . import frameworks
from .errors import UserError
from .jobs import RankPlan, StageJobs, StagePlan
from .plan import ParallelPlan, validate_plan


def default_schedule(plan: ParallelPlan) -> str:
    if plan.vpp > 1:
        # the plan may not be validated yet: its convention as given (a name in another case
        # gets the default)
        fw = frameworks.ALL.get(plan.convention)
        return fw.default_interleaved_schedule if fw is not None else "VPP"
    return "1F1B"


def schedule_of(plan: ParallelPlan):
    """The plan's schedule (named ones cached: a Schedule is never changed once built)."""
    from .schedules import get_schedule

    name = plan.schedule or default_schedule(plan)  # pp 1: no schedule named, one stage replayed as 1F1B
    if name.lower().startswith(("csv:", "torch:")):
        return _check_placement(get_schedule(name, plan.pp, plan.microbatches, vpp=plan.vpp), plan)
    return named_schedule(name, plan.pp, plan.microbatches, plan.vpp)


@lru_cache(maxsize=256)
def named_schedule(name: str, pp: int, microbatches: int, vpp: int):
    """get_schedule of a named schedule, cached (the planner's cost model asks for the same)."""
    from .schedules import get_schedule

    return get_schedule(name, pp, microbatches, vpp=vpp)


def _check_placement(schedule, plan: ParallelPlan):
    if schedule.vpp != plan.vpp:
        raise UserError(
            f"--schedule {plan.schedule}: the schedule runs {schedule.vpp} stage(s) per rank; "
            f"pass --vpp {schedule.vpp}"
        )
    return schedule


def with_schedule(arch, plan: ParallelPlan, vpp_given: bool):
    """The validated plan with its schedule named (V schedules: 2 chunks per rank unless
    --vpp was given), the model with the plan's layer count."""
    return with_schedule_key(arch, plan, vpp_given)[:2]


def with_schedule_key(arch, plan: ParallelPlan, vpp_given: bool):
    """with_schedule, and the validated plan's `stages.plan_key` (None where it has none). The
    same plan given again validates the same: it is read back (a copy: callers may change it)."""
    from .schedules import canonical_name, default_vpp
    from .stages import plan_key

    key = plan_key(plan)
    if key is not None:
        key = (arch, key, vpp_given)
        hit = _VALIDATED.get(key)
        if hit is not None:
            return hit[0], copy_plan(hit[1]), hit[2]
    sched_name = plan.schedule or default_schedule(plan)
    if not sched_name.lower().startswith(("csv:", "torch:")):
        sched_name = canonical_name(sched_name)
        if plan.pp > 1 and not vpp_given and default_vpp(sched_name) > 1:
            plan = replace(plan, vpp=default_vpp(sched_name))
    # at pp 1 no schedule runs: a named one is refused by validate_plan, none is replayed as 1F1B
    arch, plan = _with_layers(
        arch, validate_plan(arch, replace(plan, schedule=sched_name if plan.pp > 1 else plan.schedule))
    )
    stage_key = plan_key(plan)
    if key is not None:
        if len(_VALIDATED) >= 1024:
            del _VALIDATED[next(iter(_VALIDATED))]
        _VALIDATED[key] = (arch, copy_plan(plan), stage_key)
    return arch, plan, stage_key


# (ArchSpec, the plan's fields as given, vpp given) -> (ArchSpec, the validated plan, its plan_key)
_VALIDATED: dict = {}


def copy_plan(plan: ParallelPlan) -> ParallelPlan:
    """A copy of a plan with its own dicts and lists (the plan is a plain dataclass)."""
    p = ParallelPlan.__new__(ParallelPlan)
    d = p.__dict__
    d.update(plan.__dict__)
    for k, v in d.items():
        if isinstance(v, dict):
            d[k] = dict(v)
        elif isinstance(v, list):
            d[k] = list(v)
    return p


def _with_layers(arch, plan: ParallelPlan):
    if plan.layers is not None and plan.layers != arch.layers:
        arch = arch.with_layers(plan.layers)
    return arch, plan


class TemplateSource:
    """Generated programs (`templates/`, composed per stage by `stages.build_stage_jobs`)."""

    mode = "templates"
    reserved_stream = True  # pipemem.alloc_stream rebuilds the stage jobs as allocations

    def __init__(self, runtime: str | None = None, **_):
        self.asked_runtime = runtime

    def read_arch(self, config: dict, name: str):
        """(ArchSpec, the config estimated, a note): a multimodal config's text model; the
        families templates do not model are refused by name."""
        from .model import arch_from_hf_config, check_config, text_model_config

        config, note = text_model_config(config)
        check_config(config, name)
        return arch_from_hf_config(config, name), config, note

    def validate(self, arch, plan: ParallelPlan, vpp_given: bool):
        arch, plan, self.stage_key = with_schedule_key(arch, plan, vpp_given)
        return arch, plan

    def schedule(self, plan: ParallelPlan):
        return schedule_of(plan)

    def runtime(self, plan: ParallelPlan) -> str:
        from .runtime import default_runtime, get_runtime

        return get_runtime(self.asked_runtime or default_runtime(plan.convention)).name

    def stage_plan(self, arch, plan: ParallelPlan, schedule) -> StagePlan:
        from .stages import build_stage_jobs

        return build_stage_jobs(arch, plan, getattr(self, "stage_key", None))

    def explain(self, arch, plan: ParallelPlan):
        from .stages import layer_explain

        return layer_explain(arch, plan)


def _needs_torch(e: ModuleNotFoundError):
    if e.name and e.name.split(".")[0] in ("torch", "transformers"):
        return UserError(
            f"--mode traced needs {e.name.split('.')[0]}: pip install torch==2.13.0 transformers "
            "(or use the default --mode templates)"
        )
    return None


def _ddp_rank(plan: ParallelPlan) -> bool:
    """A rank in DistributedDataParallel (replicated, its buckets asked for by --grads or the
    convention's default; at --dp 1 too: DDP keeps its buckets in a world of one)."""
    from .plan import default_grads

    grads = plan.grads or default_grads(plan.convention, plan.dp, plan.zero)
    return not (plan.fsdp or plan.zero) and str(grads).lower().replace("_", "-") in (
        "ddp-bucket",
        "ddp-bucket-view",
    )


def _sharded(plan: ParallelPlan) -> bool:
    return plan.tp > 1 or (plan.dp > 1 and (plan.fsdp or plan.zero == 3)) or _ddp_rank(plan)


def _first_step_only(plan: ParallelPlan) -> None:
    """Traced pipelines and sharded ranks record one step of a fresh model: the first step. A
    steady-state answer from it could say FITS wrongly (optimizer states not yet resident)."""
    if plan.step != "first":
        raise UserError(
            "traced mode traces pipelines (--pp), sharded ranks (--tp, --fsdp) and DDP ranks (--grads "
            "ddp-bucket / ddp-bucket-view) for the first training step only so far: pass --step first, "
            "or use --mode templates for the steady state"
        )


FIRST_STEP_WARNING = (
    "traced mode, --step first: the first training step as recorded (gradients are created in "
    "backward and optimizer states in the optimizer step, so they count under 'transient')"
)


class TracedSource:
    """The real eager training step of a PyTorch module on fake tensors (`traced/`): one rank's
    whole step (pp 1), a pipeline's traced stages (`traced.parallel.traced_stage_plan`), or one
    tensor- / fully-sharded / DDP rank (`traced.parallel.trace_sharded_rank`). Traced code is
    PyTorch's: the runtime defaults to torch."""

    mode = "traced"
    reserved_stream = True  # the traced programs' allocations (pipemem.traced.allocs)

    def __init__(
        self, config: dict | None = None, kernel_policy: str = "cuda", runtime: str | None = None, **_
    ):
        self.config = config
        self.kernel_policy = kernel_policy
        self.asked_runtime = runtime

    def read_arch(self, config: dict, name: str):
        """Any family transformers builds: the sizes read from the config as it fills it in."""
        from .model import text_model_config

        config, note = text_model_config(config)
        self.config = config
        try:
            from .traced.hf import traced_arch

            return traced_arch(config, name), config, note
        except ModuleNotFoundError as e:
            raise _torch_error(e) from None

    def validate(self, arch, plan: ParallelPlan, vpp_given: bool):
        from .traced.estimate import refuse_unmodelled

        if not isinstance(self.config, dict):
            raise UserError('traced mode needs an HF config.json (a dict with "model_type")')
        sharded = _sharded(plan)
        refuse_unmodelled(plan, parallel=plan.pp > 1 or sharded)
        if plan.pp > 1 and sharded:
            raise UserError(
                "traced mode traces either a pipeline (--pp) or one sharded or DDP rank (--tp, or --dp "
                "with --fsdp or DDP's --grads), not both yet; use --mode templates"
            )
        if plan.pp > 1:
            arch, plan = with_schedule(arch, plan, vpp_given)
            _first_step_only(plan)
            return arch, plan
        if not sharded:
            return _with_layers(arch, validate_plan(arch, plan))
        if plan.tp > 1 and plan.dp > 1 and (plan.fsdp or plan.zero == 3):
            raise UserError(
                "traced mode traces one sharding at a time: --tp or --fsdp with --dp, not both yet"
            )
        plan = validate_plan(arch, replace(plan, schedule="1F1B", microbatches=1))
        _first_step_only(plan)
        arch, plan = _with_layers(arch, plan)
        if plan.tp > 1 and _ddp_rank(plan):
            raise UserError(
                "traced mode traces one parallelism at a time: --tp or DDP (--dp with --grads "
                f"{plan.grads}), not both yet; use --mode templates"
            )
        return arch, plan

    def schedule(self, plan: ParallelPlan):
        if plan.pp == 1 and not _sharded(plan):
            # the traced step is one microbatch's forward, backward and optimizer step: replayed
            # as a one-microbatch schedule, like every other estimate
            return schedule_of(replace(plan, schedule="1F1B", microbatches=1))
        return schedule_of(plan)

    def runtime(self, plan: ParallelPlan) -> str:
        from .runtime import get_runtime

        if plan.pp == 1 and not _sharded(plan):
            return "torch"
        return get_runtime(self.asked_runtime or "torch").name

    def stage_plan(self, arch, plan: ParallelPlan, schedule) -> StagePlan:
        try:
            if plan.pp > 1:
                from .traced.parallel import traced_stage_plan

                sp = traced_stage_plan(self.config, plan, schedule.split_backward, self.kernel_policy)
                sp.warnings = [FIRST_STEP_WARNING]
                return sp
            if _sharded(plan):
                return self._sharded_rank(arch, plan)
            return self._one_step(plan)
        except ModuleNotFoundError as e:
            raise _torch_error(e) from None

    def explain(self, arch, plan: ParallelPlan):
        return None

    def _one_step(self, plan: ParallelPlan) -> RankPlan:
        from .traced import traced_estimate

        t = traced_estimate(self.config, plan, self.kernel_policy)
        warnings = [] if plan.step == "steady" else [FIRST_STEP_WARNING]
        if plan.compile:
            warnings.append(
                "traced mode, --compile: " + t.notes.get("compile", "") + "; what each compiled layer "
                "saves is the partitioner's, its transient buffers are the unfused graph's"
                + (
                    "; the HF model's own loss runs eager here (templates compile it)"
                    if plan.compile == "all"
                    else ""
                )
            )
        warnings += t.notes.get("warnings", [])
        if (plan.microbatches or 1) > 1:
            warnings.append(
                f"traced mode traces one microbatch; the {plan.microbatches} accumulation steps are not "
                "replayed"
            )

        def namer(peak_at: str, peak_bytes: int):
            # the same moment, named down to the op
            return str(t.peak_at) if peak_bytes == t.peak_allocated_bytes else None

        return RankPlan(
            stages={0: t.jobs},
            statics=[t.static],
            optimizers=[t.optimizer],
            label="one step (pp 1)",
            warnings=warnings,
            namer=namer,
            recorded=t.recorded,
        )

    def _sharded_rank(self, arch, plan: ParallelPlan) -> RankPlan:
        from .traced.parallel import trace_sharded_rank

        kind = "tp" if plan.tp > 1 else "ddp" if _ddp_rank(plan) else "fsdp"
        t = trace_sharded_rank(self.config, plan, kind, self.kernel_policy)
        warnings = [f"traced mode: rank 0 of the {kind} group traced; its ranks run the same program"]
        if kind == "ddp":
            warnings.append(
                f"traced mode, DDP: the Reducer's {len(t['ddp_buckets'])} first-step gradient bucket(s) "
                f"({sum(t['ddp_buckets'])} B, one per dtype whatever bucket_cap_mb, resident) modelled on "
                f"the traced step, gradient_as_bucket_view={plan.grads == 'ddp-bucket-view'}"
            )
        warnings.append(FIRST_STEP_WARNING)
        phases = {"F0@s0": "forward", "B0@s0": "backward", "optimizer": "optimizer"}

        def namer(peak_at: str, peak_bytes: int):
            # the same moment, named down to the op
            return t["peak_op"].get(phases.get(peak_at))

        return RankPlan(
            stages={0: StageJobs(0, F=t["F"], B=t["B"], layers=range(arch.layers))},
            statics=[t["static"]],
            optimizers=[t["optimizer"]],
            label=f"one step ({kind} rank 0 of {plan.tp if kind == 'tp' else plan.dp})",
            warnings=warnings,
            namer=namer,
            recorded=t.get("recorded"),
        )


def _torch_error(e: ModuleNotFoundError) -> Exception:
    err = _needs_torch(e)
    return e if err is None else err


class PaddleSource:
    """PaddleNLP's own job programs, built by Paddle's passes for one card per pipeline rank and
    walked by liveness (`paddle.paddlenlp_programs`); replayed along each card's own job list."""

    mode = "paddle"
    reserved_stream = False

    def __init__(self, progress=None, **_):
        self.progress = progress

    read_arch = TemplateSource.read_arch

    def validate(self, arch, plan: ParallelPlan, vpp_given: bool):
        fw = frameworks.ALL.get(plan.convention)
        if fw is None or not fw.paddle_programs:
            raise UserError(
                "--exact (mode paddle) builds PaddleNLP's programs: use --from-paddlenlp or --convention "
                "paddle"
            )
        return _with_layers(
            arch, validate_plan(arch, replace(plan, schedule=plan.schedule or default_schedule(plan)))
        )

    def schedule(self, plan: ParallelPlan):
        return None  # each card's own job list: the stage plan's

    def runtime(self, plan: ParallelPlan) -> str:
        return "paddle"

    def stage_plan(self, arch, plan: ParallelPlan, schedule) -> StagePlan:
        from .paddle.paddlenlp_programs import (
            build_spec,
            card_of_stage,
            job_memory,
            rank_documents,
            stage_plan,
        )

        spec = build_spec(arch, plan)
        cards = [card_of_stage(spec, r) for r in range(plan.pp)]
        docs = rank_documents(spec, cards, progress=self.progress)
        ps = stage_plan(spec, [job_memory(docs[c]) for c in cards], name=spec["schedule"])
        ps.label = f"{spec['schedule']} (Paddle's job lists)"
        ps.warnings = [
            f"paddle programs: cards {', '.join(map(str, cards))} (the first card of each pipeline stage) "
            f"built by Paddle's own passes; fed inputs ({ps.cards[0].fed_bytes} B on card 0) are outside "
            "the jobs"
        ]
        return ps

    def explain(self, arch, plan: ParallelPlan):
        return None


SOURCES = {"templates": TemplateSource, "traced": TracedSource, "paddle": PaddleSource}
