"""`pipemem.estimate(model, **plan)`: the per-rank memory of one training plan.

This module only wires the engine together and packages its answer; every number comes
from the stage jobs (templates or traced programs, through liveness) and the schedule
replay. Flow: model (preset / config.json / dict) -> ArchSpec -> validated ParallelPlan ->
stage jobs + static bytes -> schedule -> replay per rank -> `Estimate`.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Mapping

from . import frameworks
from .errors import UserError
from .jobs import JobMemory, StaticBytes
from .plan import MAX_GPU_GIB, MIN_GPU_GIB, ParallelPlan

MODES = ("templates", "traced", "paddle")
KERNEL_POLICIES = ("cuda", "cpu")
# keyword arguments of estimate() that are not plan fields
OPTIONS = (
    "gpu",
    "gpu_memory",
    "mode",
    "kernel_policy",
    "explain",
    "model_name",
    "model_flag",
    "runtime",
    "progress",
    "cuda_context_mib",
    "nccl_mib",
    "alloc_conf",
)
# The verdict says FITS only with this share of the GPU left over the rank's device total
# (reserved + outside the allocator): the reserved model's error on real runs and the spread of
# NCCL's and the CUDA context's sizes across versions (docs/ACCURACY.md) live in this band.
NEAR_LIMIT = 0.05
# Where reserved memory is not modelled (a mode or runtime without an allocation stream), the
# caching allocator's rounding and fragmentation are unknown: Megatron's report_memory logs show
# max reserved 3-27 % above max allocated on the same line. FITS then needs room for the worst of
# them: allocated + 27 % + outside within the GPU, i.e. allocated + outside within 1 / 1.27 of it.
RESERVED_OVER_ALLOCATED_MAX = 0.27
NEAR_LIMIT_UNMODELLED = 1 - 1 / (1 + RESERVED_OVER_ALLOCATED_MAX)


@dataclass
class TimelinePoint:
    """One action of a rank's replay: allocated bytes (static included) before, at the peak
    inside the action, and after it."""

    label: str
    before: int
    peak: int
    after: int


@dataclass
class RankEstimate:
    pp_rank: int
    static: StaticBytes
    peak_allocated_bytes: int
    peak_at: str
    activation_hwm_bytes: int
    inflight: int
    jobs: dict[str, JobMemory | None] = None  # per kind, the rank's chunk with the largest peak (lazy)
    stages: list[int] = field(default_factory=list)
    # per stage {stage, layers, F, B, I, W} and the per-action timeline: made when first read
    # (a plan's estimate builds neither; --json reads stage_jobs, --plot the timeline)
    stage_jobs: list[dict] = None
    timeline: list[TimelinePoint] = None
    source: Any = field(default=None, repr=False, compare=False)  # (RankReplay, stage jobs, optimizer job)
    # () -> peak reserved bytes or None: the rank's allocation stream through the allocator
    # model (pipemem.reserved), run when first read
    reserved_source: Any = field(default=None, repr=False, compare=False)

    @property
    def peak_reserved_bytes(self) -> int | None:
        """The most the CUDA caching allocator reserves on this rank (torch.cuda.max_memory_reserved):
        the allocated stream replayed through pipemem.allocator; None where not modelled (a
        warning says why)."""
        d = self.__dict__
        if "_peak_reserved" not in d:
            d["_peak_reserved"] = self.reserved_source() if self.reserved_source is not None else None
        return d["_peak_reserved"]

    outside: Any = None  # pipemem.outside_allocator.OutsideAllocator: context, NCCL, cuBLAS workspace

    @property
    def device_peak_bytes(self) -> int:
        """What the rank takes from the GPU at its peak: the caching allocator's reserved bytes
        (its allocated peak where reserved is not modelled) plus the memory outside them."""
        held = self.peak_reserved_bytes if self.peak_reserved_bytes is not None else self.peak_allocated_bytes
        return held + (self.outside.total_bytes if self.outside is not None else 0)

    # stage -> gradient bytes its first backward creates (set-to-none / DDP grads; templates mode)
    grads_made: dict = field(default=None, repr=False, compare=False)

    def _peak_point(self) -> tuple[int, TimelinePoint] | None:
        """(index, point) of the first action at the rank's peak: read from the replay at its
        peak index when the timeline was not made (cheap at any schedule size), else found in it."""
        if self.__dict__.get("_timeline") is None and self.source is not None:
            replay = self.source[0]
            i = replay.peak_action_index
            p = replay.point(i)
            if p is not None and p[0] == self.peak_at and p[2] == self.peak_allocated_bytes:
                return i, TimelinePoint(*p)
        for i, p in enumerate(self.timeline):
            if p.label == self.peak_at and p.peak == self.peak_allocated_bytes:
                return i, p
        return None

    def _stages_backward_before(self, i: int) -> set[int]:
        if self.__dict__.get("_timeline") is None and self.source is not None:
            return self.source[0].stages_backward_before(i)
        return {
            int(lab.split("@s")[1])
            for lab in (p.label for p in self.timeline[:i])
            if lab[:1] in "BW" and "@s" in lab
        }

    def _grads_made_split(self, i: int, label: str) -> tuple[int, int]:
        """(gradient bytes the stages' first backwards made before action i, bytes action i's
        own first backward makes), from `grads_made`."""
        import re

        if self.__dict__.get("_timeline") is None and self.source is not None:
            acts = [(a[0], a[1]) for a in self.source[0]._actions[:i]]
        else:
            acts = [
                (m.group(1), int(m.group(2)))
                for m in (re.match(r"([A-Z]+)\d+@s(\d+)$", p.label) for p in self.timeline[:i])
                if m
            ]
        done = {s for kind, s in acts if kind in ("B", "I", "W")}
        before = sum(b for s, b in self.grads_made.items() if s in done)
        m = re.match(r"([BI])\d+@s(\d+)$", label)
        own = self.grads_made.get(int(m.group(2)), 0) if m and int(m.group(2)) not in done else 0
        return before, own

    def _peak_split(self) -> tuple[int, int]:
        """(gradients the step made that are resident at the peak, activations held around
        the action at the peak): the row's two middle terms, computed once."""
        cached = self.__dict__.get("_split")
        if cached is not None:
            return cached
        found = self._peak_point()
        if found is None:
            out = (0, self.activation_hwm_bytes)
        elif self.grads_made is None or not self.static.grads_in_step:
            p = found[1]
            grads = 0
            if self.static.grads_in_step and self._stages_backward_before(found[0]) >= set(self.stages):
                grads = self.static.grads_in_step
            held = max(p.before, p.after) - self.static.total - grads
            out = (grads, max(0, min(held, self.activation_hwm_bytes)))
        else:
            # the backward that makes gradients frees activations: what it holds after is what it
            # held minus the freed ones plus the made gradients, which are counted as gradients
            i, p = found
            before, own = self._grads_made_split(i, p.label)
            st = self.static.total
            held = max(p.before - st - before, p.after - st - before - own)
            acts = max(0, min(held, self.activation_hwm_bytes))
            grads = before + min(own, max(0, p.peak - st - before - acts))
            out = (grads, acts)
        self.__dict__["_split"] = out
        return out

    @property
    def grads_at_peak_bytes(self) -> int:
        """Gradients the step created (set-to-none / DDP grads, `static.grads_in_step`) that are
        resident at the peak: those the rank's stages' first backwards made before the action at
        the peak, and what that action has made of its own by the peak (templates mode); in
        traced mode all of them once every stage of the rank has run a backward."""
        return self._peak_split()[0]

    @property
    def activations_at_peak_bytes(self) -> int:
        """Activations held around the action at the peak: the larger of what is held before
        and after it (a forward adds its microbatch's, a backward frees them), neither the
        static state nor the gradients the step created counted. At an optimizer-step peak,
        what is still resident then (usually 0). Without a timeline, the high-water mark."""
        return self._peak_split()[1]

    @property
    def transient_bytes(self) -> int:
        """What the action at the peak needs above the static state, the step's gradients and
        the activations held around it: a forward's or backward's working memory, the
        optimizer step's scratch."""
        return max(
            0,
            self.peak_allocated_bytes
            - self.static.total
            - self.grads_at_peak_bytes
            - self.activations_at_peak_bytes,
        )

    @property
    def peak_is_optimizer(self) -> bool:
        return self.peak_at == "optimizer"

    def headroom(self, gpu_bytes: int | None) -> int | None:
        """The GPU's memory left at the rank's peak: capacity minus `device_peak_bytes`."""
        return None if gpu_bytes is None else gpu_bytes - self.device_peak_bytes

    def verdict(self, gpu_bytes: int | None) -> str | None:
        return judge(self.device_peak_bytes, gpu_bytes, self.peak_reserved_bytes is not None)

    def to_dict(self, gpu_bytes: int | None) -> dict:
        jobs = {k: (v.to_dict() if v is not None else None) for k, v in self.jobs.items()}
        head = self.headroom(gpu_bytes)
        verdict = self.verdict(gpu_bytes)
        return {
            "pp_rank": self.pp_rank,
            "stages": list(self.stages),
            "static_bytes": self.static.to_dict(),
            "activation_hwm_bytes": self.activation_hwm_bytes,
            "inflight": self.inflight,
            "activations_at_peak_bytes": self.activations_at_peak_bytes,
            "grads_at_peak_bytes": self.grads_at_peak_bytes,
            "transient_bytes": self.transient_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_at": self.peak_at,
            "outside_allocator": self.outside.to_dict() if self.outside is not None else None,
            "device_peak_bytes": self.device_peak_bytes,
            "headroom_bytes": head,
            "verdict": verdict,
            "fits": None if verdict is None else verdict == "fits",
            "jobs": jobs,
            "stage_jobs": [dict(row, layers=list(row.get("layers", ()))) for row in self.stage_jobs],
        }


def judge(device_bytes: int, gpu_bytes: int | None, reserved_modelled: bool) -> str | None:
    """ "fits", "tight" (within NEAR_LIMIT of the GPU: it may OOM) or "oom"; None without a GPU."""
    if gpu_bytes is None:
        return None
    if device_bytes > gpu_bytes:
        return "oom"
    margin = NEAR_LIMIT if reserved_modelled else NEAR_LIMIT_UNMODELLED
    return "fits" if device_bytes <= gpu_bytes * (1 - margin) else "tight"


def _lazy(name: str, build):
    attr = "_" + name

    def get(self):
        v = self.__dict__.get(attr)
        if v is None:
            v = build(self) if self.source is not None else ({} if name == "jobs" else [])
            self.__dict__[attr] = v
        return v

    def put(self, value):
        self.__dict__[attr] = None if isinstance(value, property) else value

    return property(get, put)


def _stage_rows(r: RankEstimate) -> list[dict]:
    rows = []
    for s in r.source[1]:
        row = {"stage": s.stage, "layers": s.layers}
        for kind in ("F", "B", "I", "W"):
            j = getattr(s, kind, None)
            row[kind] = j.to_dict() if j is not None else None
        rows.append(row)
    return rows


def _timeline_points(r: RankEstimate) -> list[TimelinePoint]:
    return [TimelinePoint(*p) for p in r.source[0].timeline]


def _jobs_of(r: RankEstimate) -> dict:
    return _rank_jobs(r.source[1], r.source[2])


RankEstimate.stage_jobs = _lazy("stage_jobs", _stage_rows)
RankEstimate.jobs = _lazy("jobs", _jobs_of)
RankEstimate.timeline = _lazy("timeline", _timeline_points)


@dataclass
class Estimate:
    model_name: str
    model_source: str
    arch: Any  # pipemem.model.ArchSpec
    plan: ParallelPlan
    mode: str
    schedule: str
    ranks: list[RankEstimate]
    gpu_name: str | None = None
    gpu_memory_bytes: int | None = None
    warnings: list[str] = field(default_factory=list)
    explain: Any = None  # stages.layer_explain rows when asked for
    world_size: int = 1
    inputs: tuple | None = field(default=None, repr=False)  # (model, kwargs) as given to estimate()
    suggestions: list[dict] = field(default_factory=list)  # suggest_fixes() results, when asked for
    suggestions_tried: bool = False  # suggest() ran (an empty list means none helps)
    runtime: str | None = None  # the pipeline runtime profile replayed (pipemem.runtime)
    alloc_conf: str | None = (
        None  # the allocator settings reserved is modelled under (PYTORCH_CUDA_ALLOC_CONF)
    )
    reserved_inputs: Any = field(
        default=None, repr=False
    )  # (StagePlan, Schedule) a templates estimate replayed

    @property
    def max_peak_allocated_bytes(self) -> int:
        return max(r.peak_allocated_bytes for r in self.ranks)

    @property
    def max_peak_reserved_bytes(self) -> int | None:
        """The largest rank's peak reserved; None where reserved is not modelled."""
        vals = [r.peak_reserved_bytes for r in self.ranks]
        return None if any(v is None for v in vals) else max(vals)

    @property
    def worst_rank(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.peak_allocated_bytes)

    @property
    def max_device_peak_bytes(self) -> int:
        return max(r.device_peak_bytes for r in self.ranks)

    @property
    def device_worst_rank(self) -> RankEstimate:
        """The rank closest to an OOM: the largest reserved + outside-the-allocator peak."""
        return max(self.ranks, key=lambda r: r.device_peak_bytes)

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.gpu_memory_bytes is None else self.gpu_memory_bytes - self.max_device_peak_bytes

    @property
    def verdict(self) -> str | None:
        """ "fits", "tight" or "oom" for the rank closest to the GPU's capacity (`judge`)."""
        if self.gpu_memory_bytes is None:
            return None
        order = {"oom": 2, "tight": 1, "fits": 0}
        return max((r.verdict(self.gpu_memory_bytes) for r in self.ranks), key=order.__getitem__)

    @property
    def reserved_modelled(self) -> bool:
        return all(r.peak_reserved_bytes is not None for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        """True only for a FITS verdict: a plan near the limit ("tight") is not called fitting."""
        v = self.verdict
        return None if v is None else v == "fits"

    def to_dict(self) -> dict:
        from .version import __version__

        plan = asdict(self.plan)
        if plan.get("pp_layout") is not None:
            plan["pp_layout"] = list(plan["pp_layout"])
        a = self.arch
        ranks = [r.to_dict(self.gpu_memory_bytes) for r in self.ranks]  # first: it may add a warning
        return {
            "pipemem_version": __version__,
            "model": {
                "name": self.model_name,
                "source": self.model_source,
                "model_type": a.model_type,
                "layers": a.layers,
                "hidden": a.hidden,
                "heads": a.heads,
                "kv_heads": a.kv_heads,
                "head_dim": a.head_dim,
                "ffn": a.ffn,
                "vocab": a.vocab,
                "experts": a.experts,
                "top_k": a.top_k,
                "tied_embeddings": a.tied_embeddings,
            },
            "plan": plan,
            "step": {"step": self.plan.step, "grads": self.plan.grads},
            "world_size": self.world_size,
            "mode": self.mode,
            "schedule": self.schedule,
            "runtime": self.runtime,
            "gpu": self.gpu_name,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "ranks": ranks,
            "max_peak_allocated_bytes": self.max_peak_allocated_bytes,
            "max_device_peak_bytes": self.max_device_peak_bytes,
            "max_peak_reserved_bytes": self.max_peak_reserved_bytes,
            "alloc_conf": self.alloc_conf,
            "worst_rank": self.worst_rank.pp_rank,
            "headroom_bytes": self.headroom_bytes,
            "verdict": self.verdict,
            "fits": self.fits,
            "features": _features(self.plan),
            "suggestions": list(self.suggestions),
            "warnings": list(self.warnings),
        }

    def suggest(self, limit: int = 2) -> list[dict]:
        """One-step plan changes that make an OOM plan fit (see suggest_fixes); kept in .suggestions."""
        self.suggestions = suggest_fixes(self, limit)
        self.suggestions_tried = self.fits is False and self.mode == "templates" and self.inputs is not None
        return self.suggestions


def _features(plan) -> list[str]:
    from .features import describe

    return describe(plan)


# ---------------------------------------------------------------- inputs


def resolve_model(model: str | Mapping, name: str = "", flag: str = "--model") -> tuple[str, str, dict]:
    """Preset name / hub alias / config path / config dict -> (name, source, HF config dict)."""
    from .presets import load_model_config

    if isinstance(model, Mapping):
        cfg = dict(model)
        return name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"), "dict", cfg
    if not isinstance(model, str):
        raise UserError(
            f"model must be a preset name, a config.json path or a config dict, got {type(model).__name__}"
        )
    display, cfg = load_model_config(model, flag)
    return name or display, str(cfg.get("_pipemem_source") or model), cfg


def split_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """estimate() keyword arguments -> (plan fields, options); unknown names are a UserError."""
    fields_ = set(ParallelPlan.field_names())
    plan, opts = {}, {}
    for k, v in kwargs.items():
        if k in OPTIONS:
            opts[k] = v
        elif k in fields_:
            plan[k] = v
        else:
            near = difflib.get_close_matches(k, sorted(fields_ | set(OPTIONS)), n=2)
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            raise UserError(f"estimate(): unknown argument {k!r}{hint}")
    return plan, opts


def default_schedule(plan: ParallelPlan) -> str:
    if plan.vpp > 1:
        # the plan may not be validated yet: its convention as given (a name in another case
        # gets the default)
        fw = frameworks.ALL.get(plan.convention)
        return fw.default_interleaved_schedule if fw is not None else "VPP"
    return "1F1B"


def gpu_capacity(gpu: str | None, gpu_memory: float | None) -> tuple[str | None, int | None]:
    from .presets import gpu_info

    if gpu is not None and gpu_memory is not None:
        raise UserError("give --gpu NAME or --gpu-memory GIB, not both")
    if gpu is not None:
        info = gpu_info(gpu)
        return info["key"], int(info["bytes"])
    if gpu_memory is not None:
        if isinstance(gpu_memory, bool) or not isinstance(gpu_memory, (int, float)) or not gpu_memory > 0:
            raise UserError(f"--gpu-memory {gpu_memory!r}: expected a positive number of GiB, e.g. 80")
        if not MIN_GPU_GIB <= gpu_memory <= MAX_GPU_GIB:  # also inf
            raise UserError(
                f"--gpu-memory {gpu_memory!r}: give {MIN_GPU_GIB:g} to {MAX_GPU_GIB:,} GiB (1 PiB) of "
                "device memory"
            )
        return f"{gpu_memory:g} GiB", int(round(gpu_memory * (1 << 30)))
    return None, None


def _flash_for_gpu(plan_kw: dict, gpu: str | None) -> None:
    """Flash attention defaults off on a GPU preset that cannot run it (gpus.json
    `flash_attention`); asking for it there is an error, not a quietly wrong estimate."""
    if gpu is None:
        return
    from .presets import gpu_info

    info = gpu_info(gpu)
    if info.get("flash_attention", True):
        return
    if plan_kw.get("flash_attn") is True:
        raise UserError(
            f"--flash-attn: {info['key']} (compute capability {info.get('compute_capability', '?')}) "
            "cannot run flash attention kernels (they need sm 8.0+); drop --flash-attn"
        )
    plan_kw["flash_attn"] = False


# ---------------------------------------------------------------- the estimate


def estimate(model: str | Mapping, **kwargs) -> Estimate:
    """Per-rank memory of training `model` with the plan given as keyword arguments (the CLI's
    flag names with underscores: `tp=8, pp=4, micro_batch=1, recompute="full", gpu="h100-80g"`).
    Bad input of any kind raises `UserError`."""
    try:
        return _estimate(model, **kwargs)
    except (OverflowError, MemoryError) as e:
        # validate_plan bounds every number; this is the net under it (a config value that
        # slipped past the bounds): one clear error, never a traceback or a wrapped number.
        raise UserError(
            f"the numbers of this plan are too large to estimate ({type(e).__name__}: {e}); "
            "check --seq-len, --micro-batch, --layers and the model's sizes"
        ) from e


def _estimate(model: str | Mapping, **kwargs) -> Estimate:
    plan_kw, opts = split_kwargs(kwargs)
    mode = opts.get("mode") or "templates"
    if mode not in MODES:
        raise UserError(f"--mode {mode!r}: expected one of {', '.join(MODES)}")
    policy = opts.get("kernel_policy") or "cuda"
    if policy not in KERNEL_POLICIES:
        raise UserError(f"--kernel-policy {policy!r}: expected one of {', '.join(KERNEL_POLICIES)}")
    gpu_name, gpu_bytes = gpu_capacity(opts.get("gpu"), opts.get("gpu_memory"))
    from .reserved import alloc_config

    alloc_conf = alloc_config(opts.get("alloc_conf"))  # a bad key or value: UserError, before any work
    name, source, config = resolve_model(
        model, opts.get("model_name") or "", opts.get("model_flag") or "--model"
    )

    plan_kw = {k: v for k, v in plan_kw.items() if v is not None}
    if isinstance(plan_kw.get("pp_layout"), list):
        plan_kw["pp_layout"] = tuple(plan_kw["pp_layout"])
    _flash_for_gpu(plan_kw, opts.get("gpu"))

    arch, config, text_note = _arch(config, name, mode)
    try:
        plan = ParallelPlan(**plan_kw)
    except TypeError as e:  # a wrong type slipped through from the Python API
        raise UserError(f"estimate(): {e}") from None
    from .plan import check_ranges

    check_ranges(plan)  # types and bounds first: nothing below computes with a bad number
    if mode == "traced":
        est = _traced(name, source, config, arch, plan, "vpp" in plan_kw, policy, gpu_name, gpu_bytes, opts)
    elif mode == "paddle":
        est = _paddle_programs(name, source, arch, plan, gpu_name, gpu_bytes, opts)
    else:
        est = _templates(name, source, arch, plan, "vpp" in plan_kw, gpu_name, gpu_bytes, opts)
    _add_outside_allocator(est, opts)
    est.inputs = (model, dict(kwargs))
    from .reserved import attach_reserved

    attach_reserved(est, alloc_conf)
    if text_note:
        est.warnings.insert(0, text_note)
    if config.get("_pipemem_note"):
        est.warnings.insert(0, str(config["_pipemem_note"]))
    return est


def _add_outside_allocator(est: Estimate, opts: dict) -> None:
    """Each rank's memory beside the caching allocator (pipemem.outside_allocator)."""
    from .outside_allocator import check_override, outside_allocator

    context = check_override("--cuda-context-mib", opts.get("cuda_context_mib"))
    nccl = check_override("--nccl-mib", opts.get("nccl_mib"))
    cc = None  # --gpu-memory alone: unknown hardware, priced as the larger case
    if opts.get("gpu") is not None:
        from .presets import gpu_info

        cc = gpu_info(opts["gpu"]).get("compute_capability")
    for r in est.ranks:
        r.outside = outside_allocator(est.plan, bool(est.arch.tied_embeddings), r.pp_rank, cc, context, nccl)


def _arch(config: dict, name: str, mode: str):
    """(ArchSpec, the config estimated, a note): a multimodal config's text model; templates read
    their families (and refuse others by name); traced mode runs any family transformers builds."""
    from .model import arch_from_hf_config, check_config, text_model_config

    config, note = text_model_config(config)
    if mode != "traced":
        check_config(config, name)
        return arch_from_hf_config(config, name), config, note
    try:
        from .traced.hf import traced_arch

        return traced_arch(config, name), config, note
    except ModuleNotFoundError as e:
        err = _needs_torch(e)
        if err is None:
            raise
        raise err from None


def _with_schedule(arch, plan, vpp_given: bool):
    """The validated plan with its schedule named (V schedules: 2 chunks per rank unless
    --vpp was given), the model with the plan's layer count."""
    from dataclasses import replace

    from .plan import validate_plan
    from .schedules import canonical_name, default_vpp

    sched_name = plan.schedule or default_schedule(plan)
    if not sched_name.lower().startswith(("csv:", "torch:")):
        sched_name = canonical_name(sched_name)
        if plan.pp > 1 and not vpp_given and default_vpp(sched_name) > 1:
            plan = replace(plan, vpp=default_vpp(sched_name))
    # at pp 1 no schedule runs: a named one is refused by validate_plan, none is replayed as 1F1B
    plan = validate_plan(arch, replace(plan, schedule=sched_name if plan.pp > 1 else plan.schedule))
    if plan.layers is not None and plan.layers != arch.layers:
        arch = arch.with_layers(plan.layers)
    return arch, plan


def _templates(name, source, arch, plan, vpp_given, gpu_name, gpu_bytes, opts) -> Estimate:
    from .stages import build_stage_jobs, layer_explain

    arch, plan = _with_schedule(arch, plan, vpp_given)
    schedule = schedule_of(plan)
    runtime = _runtime(opts, plan)
    stage_plan = build_stage_jobs(arch, plan)
    ranks = per_rank(
        stage_plan.stages,
        schedule,
        runtime,
        stage_plan.static_per_rank(schedule),
        stage_plan.optimizer_per_rank(schedule),
        plan,
        overrides=stage_plan.first_backward_overrides(schedule),
    )
    explain = layer_explain(arch, plan) if opts.get("explain") else None
    return Estimate(
        model_name=name,
        model_source=source,
        arch=arch,
        plan=plan,
        mode="templates",
        schedule=schedule.name,
        ranks=ranks,
        gpu_name=gpu_name,
        gpu_memory_bytes=gpu_bytes,
        explain=explain,
        world_size=_world(plan),
        runtime=runtime,
        warnings=_template_warnings(arch, plan),
        reserved_inputs=(stage_plan, schedule),
    )


def _template_warnings(arch, plan) -> list[str]:
    """What the templates model less surely for this plan, said beside the numbers."""
    from .templates.moe import load_note

    out = [n for n in (load_note(arch, plan),) if n]  # what the MoE routing is taken as
    if plan.activation_offload == "all" and arch.activation not in ("swiglu", "geglu"):
        # docs/ACCURACY.md, "Modern-trainer features": torchtune's OffloadActivations traced on
        # GPT-2 layers held ~1.6 MB more of a 4.5 MB layer forward peak than the template
        out.append(
            "--activation-offload all: torchtune's offloading is checked against its own code on gated-MLP "
            "(Llama-style) layers; in this model's layers (a non-gated MLP) Python locals hold tensors the "
            "template frees and its forward stash moves differently: an offloaded layer's forward and "
            "backward peaks can be higher than shown (GPT-2: +55 % / +39 % of a layer's peak)"
        )
    if frameworks.get(plan.convention).zero_is_deepspeed and plan.zero >= 1 and not plan.fsdp:
        from .ir import dtype_bytes
        from .templates.static import DEEPSPEED_REDUCE_BUCKET
        from .units import fmt_bytes

        # docs/ACCURACY.md, "DeepSpeed's own engine" (validate deepspeed): the bucket is counted at
        # DeepSpeed's default unless plan.extra names reduce_bucket_size; the gather / prefetch
        # buckets of ZeRO-3's parameter fetches are not counted
        parts = []
        if "reduce_bucket_size" not in (plan.extra or {}):
            b = dtype_bytes(plan.main_grad_dtype or plan.dtype)
            parts.append(
                f"its reduce bucket is counted at DeepSpeed's default reduce_bucket_size 5e8 "
                f"({fmt_bytes(DEEPSPEED_REDUCE_BUCKET * b)}); HF's Trainer fills in hidden^2 for 'auto' "
                f"({fmt_bytes(arch.hidden**2 * b)}), Lightning 2e8"
            )
        if plan.zero == 3:
            parts.append("ZeRO-3's all-gather and prefetch buckets (transient) are not counted")
        if plan.optimizer_offload:
            # read from DeepSpeed's code, not measured: on its CPU accelerator (validate deepspeed)
            # host and device memory are one allocator
            parts.append(
                "ZeRO-Offload is taken from DeepSpeed's code, not measured: the fp32 master, Adam "
                "states and the step's fp32 grad partition are off the GPU (ZeRO-3: its grad partition "
                "too), ZeRO-1/2's GPU staging buffer (the largest parameter's size) is counted"
            )
        if parts:
            out.append(f"--zero {plan.zero} under --convention hf is DeepSpeed's ZeRO: " + "; ".join(parts))
    return out


def _runtime(opts, plan, default: str | None = None) -> str:
    from .runtime import default_runtime, get_runtime

    name = opts.get("runtime") or default or default_runtime(plan.convention)
    return get_runtime(name).name


def schedule_of(plan: ParallelPlan):
    """The plan's schedule (named ones cached: a Schedule is never changed once built)."""
    from .schedules import get_schedule

    name = plan.schedule or default_schedule(plan)  # pp 1: no schedule named, one stage replayed as 1F1B
    if name.lower().startswith(("csv:", "torch:")):
        return _check_placement(get_schedule(name, plan.pp, plan.microbatches, vpp=plan.vpp), plan)
    return _named_schedule(name, plan.pp, plan.microbatches, plan.vpp)


@lru_cache(maxsize=256)
def _named_schedule(name: str, pp: int, microbatches: int, vpp: int):
    from .schedules import get_schedule

    return get_schedule(name, pp, microbatches, vpp=vpp)


def _check_placement(schedule, plan: ParallelPlan):
    if schedule.vpp != plan.vpp:
        raise UserError(
            f"--schedule {plan.schedule}: the schedule runs {schedule.vpp} stage(s) per rank; "
            f"pass --vpp {schedule.vpp}"
        )
    return schedule


def batch_bytes(plan: ParallelPlan) -> int:
    """Token ids and labels (int64) of one step's microbatches."""
    return 2 * 8 * plan.micro_batch * plan.microbatches * plan.seq_len


def per_rank(
    stages: dict,
    schedule,
    runtime: str,
    statics: list[StaticBytes],
    optimizers: list[JobMemory] | None,
    plan: ParallelPlan,
    overrides: dict | None = None,
) -> list[RankEstimate]:
    """The one route from stage jobs to per-rank numbers: lower the schedule with the runtime
    profile, replay it, and package each rank (templates and traced mode alike)."""
    from .replay import replay
    from .runtime import get_runtime, lower

    profile = get_runtime(runtime)
    if profile.batch_on_every_rank and schedule.pp > 1:
        statics = [s.plus(batch_bytes(plan)) for s in statics]
    jobs = dict(stages)
    if overrides:
        jobs.update(overrides)
    result = replay(
        lower(schedule, profile.name), jobs, statics, optimizer_jobs=optimizers, simulate_time=False
    )
    # gradient bytes each stage's first backward makes (the override's B over the steady one)
    made = (
        {
            s: int(j.B.net_bytes - stages[s].B.net_bytes)
            for (s, _mb), j in (overrides or {}).items()
            if isinstance(s, int) and s in stages and hasattr(j, "B")
        }
        if overrides
        else None
    )
    out = []
    for r in result.ranks:
        stage_ids = schedule.stages_of_rank(r.pp_rank)
        held = [stages[s] for s in stage_ids]
        out.append(
            RankEstimate(
                pp_rank=r.pp_rank,
                static=statics[r.pp_rank],
                peak_allocated_bytes=int(r.peak_allocated_bytes),
                peak_at=str(r.peak_at),
                activation_hwm_bytes=int(r.activation_hwm_bytes),
                inflight=int(r.max_inflight),
                stages=list(stage_ids),
                source=(r, held, optimizers[r.pp_rank] if optimizers else None),
                grads_made=None if made is None else {s: made.get(s, 0) for s in stage_ids},
            )
        )
    return out


def _world(plan: ParallelPlan) -> int:
    return plan.world


def _rank_jobs(held, optimizer) -> dict[str, JobMemory | None]:
    jobs: dict[str, JobMemory | None] = {}
    for kind in ("F", "B", "I", "W"):
        cands = [c for c in (getattr(s, kind, None) for s in held) if c is not None]
        # a rank with several chunks reports, per kind, its chunk with the largest peak
        jobs[kind] = max(cands, key=lambda j: j.peak_bytes) if cands else None
    jobs["optimizer"] = optimizer
    return jobs


def _needs_torch(e: ModuleNotFoundError):
    if e.name and e.name.split(".")[0] in ("torch", "transformers"):
        return UserError(
            f"--mode traced needs {e.name.split('.')[0]}: pip install torch==2.13.0 transformers "
            "(or use the default --mode templates)"
        )
    return None


def _traced(name, source, config, arch, plan, vpp_given, policy, gpu_name, gpu_bytes, opts) -> Estimate:
    from dataclasses import replace

    from .plan import validate_plan

    if not isinstance(config, dict):
        raise UserError('traced mode needs an HF config.json (a dict with "model_type")')
    sharded = plan.tp > 1 or (plan.dp > 1 and (plan.fsdp or plan.zero == 3)) or _ddp_rank(plan)
    from .traced.estimate import refuse_unmodelled

    refuse_unmodelled(plan, parallel=plan.pp > 1 or sharded)
    if plan.pp > 1 or sharded:
        try:
            return _traced_parallel(
                name, source, config, arch, plan, vpp_given, policy, gpu_name, gpu_bytes, opts
            )
        except ModuleNotFoundError as e:
            err = _needs_torch(e)
            if err is None:
                raise
            raise err from None
    plan = validate_plan(arch, plan)
    if plan.layers is not None and plan.layers != arch.layers:
        arch = arch.with_layers(plan.layers)
    try:
        from .traced import traced_estimate

        t = traced_estimate(config, plan, policy)
    except ModuleNotFoundError as e:
        err = _needs_torch(e)
        if err is None:
            raise
        raise err from None
    sj = t.jobs
    # The traced step is one microbatch's forward, backward and optimizer step: replayed as a
    # one-microbatch schedule, like every other estimate.
    (rank,) = per_rank(
        {0: sj},
        schedule_of(replace(plan, schedule="1F1B", microbatches=1)),
        "torch",
        [t.static],
        [t.optimizer] if t.optimizer is not None else None,
        plan,
    )
    if rank.peak_allocated_bytes == t.peak_allocated_bytes:
        rank.peak_at = str(t.peak_at)  # the same moment, named down to the op
    warnings = (
        []
        if plan.step == "steady"
        else [
            "traced mode, --step first: the first training step as recorded (gradients are created in "
            "backward and optimizer states in the optimizer step, so they count under 'transient')"
        ]
    )
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
            f"traced mode traces one microbatch; the {plan.microbatches} accumulation steps are not replayed"
        )
    return Estimate(
        model_name=name,
        model_source=source,
        arch=arch,
        plan=plan,
        mode="traced",
        schedule="one step (pp 1)",
        ranks=[rank],
        gpu_name=gpu_name,
        gpu_memory_bytes=gpu_bytes,
        warnings=warnings,
        world_size=_world(plan),
        runtime="torch",
    )


def _ddp_rank(plan: ParallelPlan) -> bool:
    """A rank in DistributedDataParallel (replicated, its buckets asked for by --grads or the
    convention's default; at --dp 1 too: DDP keeps its buckets in a world of one)."""
    from .plan import default_grads

    grads = plan.grads or default_grads(plan.convention, plan.dp, plan.zero)
    return not (plan.fsdp or plan.zero) and str(grads).lower().replace("_", "-") in (
        "ddp-bucket",
        "ddp-bucket-view",
    )


def _first_step_only(plan: ParallelPlan) -> None:
    """Traced pipelines and sharded ranks record one step of a fresh model: the first step. A
    steady-state answer from it could say FITS wrongly (optimizer states not yet resident)."""
    if plan.step != "first":
        raise UserError(
            "traced mode traces pipelines (--pp), sharded ranks (--tp, --fsdp) and DDP ranks (--grads "
            "ddp-bucket / ddp-bucket-view) for the first training step only so far: pass --step first, "
            "or use --mode templates for the steady state"
        )


def _traced_parallel(
    name, source, config, arch, plan, vpp_given, policy, gpu_name, gpu_bytes, opts
) -> Estimate:
    """Traced pipelines (pp > 1) and tensor / fully sharded data parallel ranks: traced stage
    jobs or a traced rank step, then the same schedule, runtime lowering and replay as templates
    (`per_rank`). Traced code is PyTorch's: the runtime defaults to torch."""
    from dataclasses import replace

    from .traced.parallel import trace_sharded_rank, traced_stage_plan

    if plan.pp > 1 and (plan.tp > 1 or plan.dp > 1 and (plan.fsdp or plan.zero == 3) or _ddp_rank(plan)):
        raise UserError(
            "traced mode traces either a pipeline (--pp) or one sharded or DDP rank (--tp, or --dp "
            "with --fsdp or DDP's --grads), not both yet; use --mode templates"
        )
    warnings = []
    if plan.pp > 1:
        arch, plan = _with_schedule(arch, plan, vpp_given)
        _first_step_only(plan)
        schedule = schedule_of(plan)
        runtime = _runtime(opts, plan, default="torch")
        sp = traced_stage_plan(config, plan, schedule.split_backward, policy)
        ranks = per_rank(
            sp.stages,
            schedule,
            runtime,
            sp.static_per_rank(schedule),
            sp.optimizer_per_rank(schedule),
            plan,
            overrides=sp.first_grad_overrides(schedule),
        )
        sched_name = schedule.name
    else:
        from .plan import validate_plan

        if plan.tp > 1 and plan.dp > 1 and (plan.fsdp or plan.zero == 3):
            raise UserError(
                "traced mode traces one sharding at a time: --tp or --fsdp with --dp, not both yet"
            )
        plan = validate_plan(arch, replace(plan, schedule="1F1B", microbatches=1))
        _first_step_only(plan)
        if plan.layers is not None and plan.layers != arch.layers:
            arch = arch.with_layers(plan.layers)
        if plan.tp > 1 and _ddp_rank(plan):
            raise UserError(
                "traced mode traces one parallelism at a time: --tp or DDP (--dp with --grads "
                f"{plan.grads}), not both yet; use --mode templates"
            )
        kind = "tp" if plan.tp > 1 else "ddp" if _ddp_rank(plan) else "fsdp"
        t = trace_sharded_rank(config, plan, kind, policy)
        from .jobs import StageJobs

        runtime = _runtime(opts, plan, default="torch")
        (rank,) = per_rank(
            {0: StageJobs(0, F=t["F"], B=t["B"], layers=range(arch.layers))},
            schedule_of(plan),
            runtime,
            [t["static"]],
            [t["optimizer"]],
            plan,
        )
        phase = {"F0@s0": "forward", "B0@s0": "backward", "optimizer": "optimizer"}.get(rank.peak_at)
        if phase in t["peak_op"]:
            rank.peak_at = t["peak_op"][phase]  # the same moment, named down to the op
        ranks = [rank]
        sched_name = f"one step ({kind} rank 0 of {plan.tp if kind == 'tp' else plan.dp})"
        warnings.append(f"traced mode: rank 0 of the {kind} group traced; its ranks run the same program")
        if kind == "ddp":
            warnings.append(
                f"traced mode, DDP: the Reducer's {len(t['ddp_buckets'])} first-step gradient bucket(s) "
                f"({sum(t['ddp_buckets'])} B, one per dtype whatever bucket_cap_mb, resident) modelled on "
                f"the traced step, gradient_as_bucket_view={plan.grads == 'ddp-bucket-view'}"
            )
    warnings.append(
        "traced mode, --step first: the first training step as recorded (gradients are created in "
        "backward and optimizer states in the optimizer step, so they count under 'transient')"
    )
    return Estimate(
        model_name=name,
        model_source=source,
        arch=arch,
        plan=plan,
        mode="traced",
        schedule=sched_name,
        ranks=ranks,
        gpu_name=gpu_name,
        gpu_memory_bytes=gpu_bytes,
        warnings=warnings,
        world_size=_world(plan),
        runtime=runtime,
    )


def _paddle_programs(name, source, arch, plan, gpu_name, gpu_bytes, opts) -> Estimate:
    """PaddleNLP's own job programs, built by Paddle's passes for one card per pipeline rank,
    walked by liveness and replayed along each card's own job list (pipemem.paddle.paddlenlp_programs)."""
    from dataclasses import replace

    from .paddle.paddlenlp_programs import build_spec, card_of_stage, job_memory, rank_documents, stage_plan
    from .plan import validate_plan
    from .replay import replay

    fw = frameworks.ALL.get(plan.convention)
    if fw is None or not fw.paddle_programs:
        raise UserError(
            "--exact (mode paddle) builds PaddleNLP's programs: use --from-paddlenlp or --convention paddle"
        )
    plan = validate_plan(arch, replace(plan, schedule=plan.schedule or default_schedule(plan)))
    if plan.layers is not None and plan.layers != arch.layers:
        arch = arch.with_layers(plan.layers)
    spec = build_spec(arch, plan)
    cards = [card_of_stage(spec, r) for r in range(plan.pp)]
    docs = rank_documents(spec, cards, progress=opts.get("progress"))
    ps = stage_plan(spec, [job_memory(docs[c]) for c in cards], name=spec["schedule"])
    optimizers = [o or JobMemory(0, 0) for o in ps.optimizer]
    # The programs hold the pipeline's transfers themselves (recv/send jobs, folded into the
    # actions): the schedule is replayed as it is, with no runtime profile's buffers added.
    result = replay(ps.schedule, ps.stages, ps.static, optimizer_jobs=optimizers, simulate_time=False)
    ranks = []
    for r in result.ranks:
        stage_ids = ps.schedule.stages_of_rank(r.pp_rank)
        held = [ps.stages[s] for s in stage_ids if s in ps.stages]
        ranks.append(
            RankEstimate(
                pp_rank=r.pp_rank,
                static=ps.static[r.pp_rank],
                peak_allocated_bytes=int(r.peak_allocated_bytes),
                peak_at=str(r.peak_at),
                activation_hwm_bytes=int(r.activation_hwm_bytes),
                inflight=int(r.max_inflight),
                stages=list(stage_ids),
                source=(r, held, optimizers[r.pp_rank]),
            )
        )
    warnings = [
        f"paddle programs: cards {', '.join(map(str, cards))} (the first card of each pipeline stage) "
        f"built by Paddle's own passes; fed inputs ({ps.cards[0].fed_bytes} B on card 0) are outside "
        "the jobs"
    ]
    return Estimate(
        model_name=name,
        model_source=source,
        arch=arch,
        plan=plan,
        mode="paddle",
        schedule=f"{spec['schedule']} (Paddle's job lists)",
        ranks=ranks,
        gpu_name=gpu_name,
        gpu_memory_bytes=gpu_bytes,
        warnings=warnings,
        world_size=_world(plan),
        runtime="paddle",
    )


# ---------------------------------------------------------------- what would fit


def suggest_fixes(est: Estimate, limit: int = 2, budget_s: float = 3.0) -> list[dict]:
    """For a plan that does not fit: re-run the engine on a few one-step changes (on the same
    number of GPUs) that could lower the *peak* (the device peak: reserved + outside the
    allocator), and return those that fit, or else the one that lowers it most; a change that
    does not lower it is never returned: [{"flags": "--recompute full",
    "max_peak_allocated_bytes": ..., "max_device_peak_bytes": ..., "fits": bool}].
    When the worst rank peaks in the optimizer step only optimizer levers are tried (sharding
    its states, a fused or per-parameter step, fewer dp ranks for more tp/pp): recompute or a
    smaller micro-batch cannot lower that peak. Stops trying after `budget_s` seconds."""
    import time

    if est.fits is not False or est.inputs is None or est.mode != "templates":
        return []
    model, kw = est.inputs
    kw = {k: v for k, v in kw.items() if k != "explain"}
    p = est.plan
    cands = (
        _optimizer_levers(p)
        if est.worst_rank.peak_is_optimizer
        else _activation_levers(p, kw) + _sharding_levers(p)
    )
    if p.dp % 2 == 0:  # same GPUs: trade data parallelism for model parallelism
        cands.append((f"--tp {p.tp * 2} --dp {p.dp // 2}", {"tp": p.tp * 2, "dp": p.dp // 2}))
        cands.append(
            (f"--pp {p.pp * 2} --dp {p.dp // 2}", {"pp": p.pp * 2, "dp": p.dp // 2, "pp_layout": None})
        )
    now = est.max_device_peak_bytes
    tried = []
    start = time.perf_counter()
    slowest = 0.0
    for flags, change in cands:
        if time.perf_counter() - start + slowest > budget_s:
            break  # a huge plan: fewer suggestions rather than a long wait
        t0 = time.perf_counter()
        trial = dict(kw)
        trial.update(change)
        trial = {k: v for k, v in trial.items() if v is not None}
        try:
            e = estimate(model, **trial)
        except UserError:
            continue  # not a valid plan for this model (e.g. tp would not divide the heads)
        finally:
            slowest = max(slowest, time.perf_counter() - t0)
        # allocated + outside the allocator bounds the device peak from below: a change that
        # does not lower the bound cannot lower the peak, and needs no allocator model run
        if max(r.peak_allocated_bytes + r.outside.total_bytes for r in e.ranks) >= now:
            continue
        if e.max_device_peak_bytes < now:
            tried.append(
                {
                    "flags": flags,
                    "max_peak_allocated_bytes": e.max_peak_allocated_bytes,
                    "max_device_peak_bytes": e.max_device_peak_bytes,
                    "fits": bool(e.fits),
                }
            )
    fitting = [t for t in tried if t["fits"]]
    if fitting:
        return fitting[:limit]
    return sorted(tried, key=lambda t: t["max_device_peak_bytes"])[:1]


def _activation_levers(p: ParallelPlan, kw: dict) -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = []
    if p.recompute == "none":
        out.append(("--recompute selective", {"recompute": "selective"}))
    if p.recompute != "full" or p.recompute_layers is not None:
        out.append(("--recompute full", {"recompute": "full", "recompute_layers": None}))
    if p.tp > 1 and not p.sp:
        out.append(("--sp", {"sp": True}))
    if p.micro_batch > 1:
        half = p.micro_batch // 2
        change = {"micro_batch": half}
        if "global_batch" not in kw:
            change["microbatches"] = p.microbatches * p.micro_batch // half
        out.append((f"--micro-batch {half}", change))
    if frameworks.get(p.convention).torch_modules:
        # what PyTorch trainers switch on when memory is tight (pipemem.features)
        if p.loss == "standard" and p.tp == 1:
            out.append(("--loss chunked", {"loss": "chunked"}))
        if not p.compile:
            out.append(("--compile", {"compile": "all"}))
        if not p.activation_offload:
            out.append(("--activation-offload all", {"activation_offload": "all"}))
    return out


def _sharding_levers(p: ParallelPlan) -> list[tuple[str, dict]]:
    """Shard the optimizer states (and more) over the data-parallel ranks."""
    if p.dp * p.cp == 1 or p.zero >= 3 or p.fsdp:
        return []
    return frameworks.get(p.convention).sharding_levers(p)


def _optimizer_levers(p: ParallelPlan) -> list[tuple[str, dict]]:
    """What lowers a peak in the optimizer step: sharding what it updates, no scratch."""
    out = _sharding_levers(p)
    if p.optimizer_impl != "fused":
        out.append(("--optimizer-impl fused", {"optimizer_impl": "fused"}))
    if p.optimizer_impl == "foreach":
        out.append(("--optimizer-impl for-loop", {"optimizer_impl": "for-loop"}))
    return out
