"""`pipemem.estimate(model, **plan)`: the per-rank memory of one training plan.

This module only wires the engine together and packages its answer; every number comes
from the stage jobs (templates, traced or Paddle programs, through liveness) and the schedule
replay. One path for every mode: model (preset / config.json / dict) -> the mode's program
source (pipemem.sources) -> ArchSpec -> the plan validated once -> its `jobs.StagePlan` ->
per-rank static bytes, optimizer and first-backward jobs -> one replay -> one `Estimate`.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from . import frameworks
from .errors import UserError
from .jobs import JobMemory, StagePlan, StaticBytes
from .plan import MAX_GPU_GIB, MIN_GPU_GIB, ParallelPlan
from .sources import SOURCES, copy_plan, default_schedule, schedule_of  # noqa: F401  (the last two: re-exported)

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
    # (the rank) -> peak reserved bytes or None: the rank's allocation stream through the allocator
    # model (pipemem.reserved), run when first read
    reserved_source: Any = field(default=None, repr=False, compare=False)

    @property
    def peak_reserved_bytes(self) -> int | None:
        """The most the CUDA caching allocator reserves on this rank (torch.cuda.max_memory_reserved):
        the allocated stream replayed through pipemem.allocator; None where not modelled (a
        warning says why)."""
        d = self.__dict__
        if "_peak_reserved" not in d:
            d["_peak_reserved"] = self.reserved_source(self) if self.reserved_source is not None else None
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
        # the one first-backward rule (Schedule.first_grad_microbatches): a B or W makes the
        # stage's gradients, an I never does
        done = {s for kind, s in acts if kind in ("B", "W")}
        before = sum(b for s, b in self.grads_made.items() if s in done)
        m = re.match(r"([BW])\d+@s(\d+)$", label)
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


_PLAN_FIELDS: set = set()  # ParallelPlan's field names, filled on first use


def split_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """estimate() keyword arguments -> (plan fields, options); unknown names are a UserError."""
    fields_ = _PLAN_FIELDS or _PLAN_FIELDS.update(ParallelPlan.field_names()) or _PLAN_FIELDS
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
    fast = _fast_key(model, kwargs)
    if fast is not None:
        hit = _FAST.get(fast)
        if hit is not None:
            return _package(model, kwargs, *hit[:3], copy_plan(hit[3]), *hit[4:])
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
    model_key = _model_key(model, opts, mode)
    read = _MODELS.get(model_key) if model_key is not None else None
    if read is None:
        name, source_name, config = resolve_model(
            model, opts.get("model_name") or "", opts.get("model_flag") or "--model"
        )

    plan_kw = {k: v for k, v in plan_kw.items() if v is not None}
    if isinstance(plan_kw.get("pp_layout"), list):
        plan_kw["pp_layout"] = tuple(plan_kw["pp_layout"])
    _flash_for_gpu(plan_kw, opts.get("gpu"))

    # one path for every mode (pipemem.sources): the source reads the model, validates the plan
    # once and builds its stage plan; the replay and the Estimate are the same for all
    source = SOURCES[mode](kernel_policy=policy, runtime=opts.get("runtime"), progress=opts.get("progress"))
    if read is None:
        arch, config, text_note = source.read_arch(config, name)
        read = (name, source_name, arch, text_note, config.get("_pipemem_note"))
        if model_key is not None:
            if len(_MODELS) >= 256:
                del _MODELS[next(iter(_MODELS))]
            _MODELS[model_key] = read
    name, source_name, arch, text_note, config_note = read
    try:
        plan = ParallelPlan(**plan_kw)
    except TypeError as e:  # a wrong type slipped through from the Python API
        raise UserError(f"estimate(): {e}") from None
    from .plan import check_ranges

    check_ranges(plan)  # types and bounds first: nothing below computes with a bad number
    arch, plan = source.validate(arch, plan, "vpp" in plan_kw)
    schedule = source.schedule(plan)
    runtime = source.runtime(plan)
    stage_plan = source.stage_plan(arch, plan, schedule)
    schedule = schedule or stage_plan.schedule
    if source.mode != "templates":
        return _package(
            model, kwargs, name, source_name, arch, plan, source, schedule, runtime, stage_plan, opts,
            gpu_name, gpu_bytes, alloc_conf, text_note, config_note,
        )  # fmt: skip
    parts = (
        name, source_name, arch, copy_plan(plan), source, schedule, runtime, stage_plan, opts,
        gpu_name, gpu_bytes, alloc_conf, text_note, config_note,
    )  # fmt: skip
    if fast is not None and not opts.get("explain"):
        if len(_FAST) >= 256:
            del _FAST[next(iter(_FAST))]
        _FAST[fast] = parts
    return _package(model, kwargs, *parts[:3], plan, *parts[4:])


def _package(
    model, kwargs, name, source_name, arch, plan, source, schedule, runtime, stage_plan, opts,
    gpu_name, gpu_bytes, alloc_conf, text_note, config_note,
) -> Estimate:  # fmt: skip
    """The Estimate of a validated plan and its stage plan: every call its own objects (plan,
    ranks, warnings), the numbers read back where the same plan was replayed before."""
    est = Estimate(
        model_name=name,
        model_source=source_name,
        arch=arch,
        plan=plan,
        mode=source.mode,
        schedule=stage_plan.label or schedule.name,
        ranks=_replayed_ranks(stage_plan, schedule, runtime, plan)
        if source.mode == "templates"
        else per_rank(stage_plan, schedule, runtime, plan),
        gpu_name=gpu_name,
        gpu_memory_bytes=gpu_bytes,
        explain=source.explain(arch, plan) if opts.get("explain") else None,
        world_size=plan.world,
        runtime=runtime,
        warnings=list(stage_plan.warnings),
        reserved_inputs=(stage_plan, schedule) if source.reserved_stream else None,
    )
    _add_outside_allocator(est, opts)
    est.inputs = (model, dict(kwargs))
    from .reserved import attach_reserved

    attach_reserved(est, alloc_conf)
    if text_note:
        est.warnings.insert(0, text_note)
    if config_note:
        est.warnings.insert(0, str(config_note))
    return est


_SCALARS = frozenset((int, str, bool, float, type(None)))


def _fast_key(model, kwargs: dict):
    """The key under which a templates estimate called again with the same arguments (the same
    values of the same types, in the same order) reads back its validated plan and stage plan
    (`_FAST`), or None. Everything the slow path checks or derives from the arguments (the
    plan's bounds, its validation, the model read, the GPU, the allocator settings) is a pure
    function of them, so equal arguments pass and give the same; a model name that is a path
    on this file system is read every time (`_model_key`)."""
    items = []
    for k, v in kwargs.items():
        t = type(v)
        if t is tuple or t is list:
            if not all(type(x) is int for x in v):
                return None
            v = tuple(v)
        elif t is float:
            v = repr(v)  # -0.0 and 0.0 apart
        elif t not in _SCALARS:
            return None
        items.append((k, t, v))
    mode = kwargs.get("mode") or "templates"
    key = _model_key(model, kwargs, mode) if type(mode) is str else None
    return None if key is None else (key, tuple(items))


# _fast_key -> what _package needs besides the call's own arguments
_FAST: dict = {}


def _model_key(model, opts: dict, mode: str):
    """The key under which a model given by name is read back (`_MODELS`), or None. A name that
    is a path on this file system is read again every time (the file may change); any other name
    resolves to a preset (package data) and the same ArchSpec (frozen), so it is read once."""
    if mode != "templates" or not isinstance(model, str) or len(model) > 4096:
        return None
    import os

    if os.path.lexists(os.path.expanduser(model.strip())):
        return None  # a file, a directory, or something else there: resolve_model decides each time
    # nothing there: a preset name, a hub alias, or an error resolve_model raises each time
    return (model, opts.get("model_name") or "", opts.get("model_flag") or "--model")


# (model name, model_name, model_flag) -> (name, source, ArchSpec, text note, config note)
_MODELS: dict = {}


def reads_model_once(model) -> bool:
    """Whether estimates given `model` read it once and keep it (a preset name or hub alias that
    is not a path here); a config dict is read into a model at every estimate."""
    return _model_key(model, {}, "templates") is not None


def _replayed_ranks(stage_plan, schedule, runtime: str, plan: ParallelPlan) -> list[RankEstimate]:
    """per_rank, read back when the same plan is asked again: the same StagePlan (cached per
    plan), Schedule (cached per plan) and runtime replay the same, so their ranks' numbers are
    copied into fresh RankEstimate objects (the warm estimate, the plan search's re-asks)."""
    key = (id(stage_plan), id(schedule), runtime)
    hit = _REPLAYED.get(key)
    if hit is not None and hit[0] is stage_plan and hit[1] is schedule:
        return [_copy_rank(d) for d in hit[2]]
    ranks = per_rank(stage_plan, schedule, runtime, plan)
    if len(_REPLAYED) >= _REPLAYED_MAX:
        del _REPLAYED[next(iter(_REPLAYED))]
    _REPLAYED[key] = (stage_plan, schedule, [dict(r.__dict__) for r in ranks])
    return ranks


# (id(StagePlan), id(Schedule), runtime) -> (the StagePlan, the Schedule, its ranks as replayed)
_REPLAYED: dict = {}
_REPLAYED_MAX = 256


def _copy_rank(d: dict) -> RankEstimate:
    """A RankEstimate from the fields (`__dict__`) of one as per_rank made it, before anything
    was read or attached: the same numbers, its own lists."""
    r = _new_object(RankEstimate)
    r.__dict__ = own = d.copy()
    own["stages"] = list(own["stages"])
    made = own.get("grads_made")
    if made is not None:
        own["grads_made"] = dict(made)
    return r


_new_object = object.__new__


def _add_outside_allocator(est: Estimate, opts: dict) -> None:
    """Each rank's memory beside the caching allocator (pipemem.outside_allocator)."""
    from .outside_allocator import check_override, outside_allocator

    context = check_override("--cuda-context-mib", opts.get("cuda_context_mib"))
    nccl = check_override("--nccl-mib", opts.get("nccl_mib"))
    cc = None  # --gpu-memory alone: unknown hardware, priced as the larger case
    if opts.get("gpu") is not None:
        from .presets import gpu_info

        cc = gpu_info(opts["gpu"]).get("compute_capability")
    # OutsideAllocator is frozen, and a pure function of the plan's group sizes and the rank
    # (outside_allocator reads tp, cp, dp, pp, ep, etp of the plan and nothing else): plans
    # alike there share theirs
    p = est.plan
    tied = bool(est.arch.tied_embeddings)
    groups = (p.tp, p.cp, p.dp, p.pp, p.ep, p.etp, tied, cc, context, nccl)
    for r in est.ranks:
        key = (groups, r.pp_rank)
        hit = _OUTSIDE.get(key)
        if hit is None:
            hit = outside_allocator(p, tied, r.pp_rank, cc, context, nccl)
            if len(_OUTSIDE) >= 4096:
                del _OUTSIDE[next(iter(_OUTSIDE))]
            _OUTSIDE[key] = hit
        r.outside = hit


_OUTSIDE: dict = {}  # ((tp, cp, dp, pp, ep, etp, tied, cc, overrides), rank) -> OutsideAllocator


def batch_bytes(plan: ParallelPlan) -> int:
    """Token ids and labels (int64) of one step's microbatches."""
    return 2 * 8 * plan.micro_batch * plan.microbatches * plan.seq_len


def per_rank(stage_plan: StagePlan, schedule, runtime: str, plan: ParallelPlan) -> list[RankEstimate]:
    """The one route from a source's stage plan to per-rank numbers: each rank's static bytes,
    optimizer job and first-backward jobs from the stage plan, the schedule lowered with the
    runtime profile (unless the programs hold the transfers: `stage_plan.lowered`), one replay,
    and each rank packaged."""
    from .replay import replay
    from .runtime import get_runtime, lower

    statics = stage_plan.static_per_rank(schedule)
    optimizers = stage_plan.optimizer_per_rank(schedule)
    if all(o is None for o in optimizers):
        optimizers = None  # the source's step has no optimizer job to replay
    jobs = stage_plan.replay_jobs(schedule)
    if stage_plan.lowered:
        profile = get_runtime(runtime)
        if profile.batch_on_every_rank and schedule.pp > 1:
            statics = [s.plus(batch_bytes(plan)) for s in statics]
        schedule = lower(schedule, profile.name)
    result = replay(schedule, jobs, statics, optimizer_jobs=optimizers, simulate_time=False)
    stages = stage_plan.stages
    out = []
    for r in result.ranks:
        stage_ids = schedule.stages_of_rank(r.pp_rank)
        rank = RankEstimate(
            pp_rank=r.pp_rank,
            static=statics[r.pp_rank],
            peak_allocated_bytes=int(r.peak_allocated_bytes),
            peak_at=str(r.peak_at),
            activation_hwm_bytes=int(r.activation_hwm_bytes),
            inflight=int(r.max_inflight),
            stages=list(stage_ids),
            source=(
                r,
                [stages[s] for s in stage_ids if s in stages],
                optimizers[r.pp_rank] if optimizers else None,
            ),
            grads_made=stage_plan.grads_made(stage_ids),
        )
        rank.peak_at = stage_plan.peak_name(rank.peak_at, rank.peak_allocated_bytes) or rank.peak_at
        out.append(rank)
    return out


def _rank_jobs(held, optimizer) -> dict[str, JobMemory | None]:
    jobs: dict[str, JobMemory | None] = {}
    for kind in ("F", "B", "I", "W"):
        cands = [c for c in (getattr(s, kind, None) for s in held) if c is not None]
        # a rank with several chunks reports, per kind, its chunk with the largest peak
        jobs[kind] = max(cands, key=lambda j: j.peak_bytes) if cands else None
    jobs["optimizer"] = optimizer
    return jobs


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
