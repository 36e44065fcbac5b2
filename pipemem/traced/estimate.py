"""`traced_estimate`: the traced source behind `pipemem estimate --mode traced`.

Maps a `ParallelPlan` onto the default training step of an HF causal LM (hf.py, step.py),
traces it (K layers + exact replication for deep models, replicate.py) and hands back what
the stage-job layer needs: static bytes, the F / B jobs of stage 0 and the optimizer job.
Only single-rank plans so far (tp = pp = cp = ep = 1; dp without sharding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import frameworks
from ..errors import UserError
from ..jobs import JobMemory, StageJobs, StaticBytes
from ..plan import ParallelPlan

RECOMPUTE = ("none", "full", "selective")


@dataclass
class TracedEstimate:
    static: StaticBytes
    jobs: StageJobs
    optimizer: JobMemory | None
    peak_allocated_bytes: int
    peak_at: str
    kernel_policy: str = "cuda"
    notes: dict = field(default_factory=dict)
    # the step's allocations for the allocator model (pipemem.jobs.RankPlan.recorded: a function
    # giving them, or why there are none, when reserved is first read)
    recorded: object = field(default=None, repr=False)

    def to_dict(self) -> dict:
        jobs = {
            "F": self.jobs.F.to_dict(),
            "B": self.jobs.B.to_dict(),
            "W": None,
            "optimizer": self.optimizer.to_dict() if self.optimizer else None,
        }
        rank = {
            "pp_rank": 0,
            "static_bytes": self.static.to_dict(),
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_at": self.peak_at,
            "jobs": jobs,
        }
        return {
            "mode": "traced",
            "kernel_policy": self.kernel_policy,
            "ranks": [rank],
            "max_peak_allocated_bytes": self.peak_allocated_bytes,
            "notes": dict(self.notes),
        }


def _check_plan(plan: ParallelPlan) -> None:
    degrees = {"tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep, "vpp": plan.vpp}
    bad = [f"{k}={v}" for k, v in degrees.items() if v != 1]
    if bad:
        raise UserError(
            f"traced mode supports only tp=pp=cp=ep=1 so far (got {', '.join(bad)}); use --mode templates"
        )
    if plan.dp > 1 and (plan.zero or plan.fsdp or plan.dist_opt):
        raise UserError(
            "traced mode does not shard model states yet (--zero/--fsdp/--dist-opt with dp > 1); "
            "use --mode templates"
        )
    if plan.recompute not in RECOMPUTE:
        raise UserError(
            f"--recompute {plan.recompute}: traced mode supports {', '.join(RECOMPUTE)}; use --mode templates"
        )
    if plan.recompute_layers is not None:
        raise UserError("--recompute-layers: traced mode recomputes all layers or none; use --mode templates")
    if plan.optimizer not in ("adamw", "adam", "sgd"):
        raise UserError(f"--optimizer {plan.optimizer}: traced mode supports adamw, adam, sgd")
    refuse_unmodelled(plan)
    if plan.grads not in (None, "set-to-none", "buffer"):
        raise UserError(
            f"--grads {plan.grads}: traced mode runs the model without DistributedDataParallel, so it "
            "has no DDP buckets; use --mode templates, or --grads set-to-none / buffer"
        )
    if plan.micro_batch < 1 or plan.seq_len < 1:
        raise UserError("--micro-batch and --seq-len must be positive")


def refuse_unmodelled(plan: ParallelPlan, parallel: bool = False) -> None:
    """Refuse, by name, the pipemem.features switches traced mode does not run (templates do)."""
    fw = frameworks.ALL.get(plan.convention)
    if fw is not None and not fw.traced_mode:
        raise UserError(
            "--mode traced records Hugging Face's modules, not torchtune's; use --mode templates "
            "(--convention torchtune is held against torchtune's own modules by `pipemem validate "
            "features`)"
        )
    unsupported = [
        name
        for name, on in (
            (f"--loss {plan.loss}", plan.loss != "standard"),
            (f"--fp8 {plan.fp8}", bool(plan.fp8)),
            ("--activation-offload", bool(plan.activation_offload)),
            ("--optimizer-offload", bool(plan.optimizer_offload)),
            ("--optimizer-in-backward", plan.optimizer_in_backward),
            ("--optimizer-state-dtype", bool(plan.optimizer_state_dtype)),
            ("--lora-rank / --qlora", bool(getattr(plan, "lora_rank", 0))),
            ("--compile (with --pp, --tp or --fsdp)", parallel and bool(plan.compile)),
        )
        if on
    ]
    if unsupported:
        raise UserError(f"traced mode does not model {', '.join(unsupported)} yet; use --mode templates")


def unmodelled_by_transformers(model_config: dict) -> list[str]:
    """What a config asks for that transformers' module does not build, said beside the numbers:
    multi-token prediction layers (DeepSeek-V3, GLM-4.5: `num_nextn_predict_layers`) are in the
    checkpoints but not in transformers' causal LM, so the traced step has none."""
    from ..model import text_model_config

    c, _ = text_model_config(model_config)
    out = []
    mtp = c.get("num_nextn_predict_layers") or 0
    if isinstance(mtp, int) and mtp > 0:
        out.append(
            f"traced mode: num_nextn_predict_layers={mtp}: transformers' {c.get('model_type')} causal "
            "LM has no multi-token prediction layers, so the step traced has none (a trainer that "
            "trains them, Megatron's --mtp-num-layers, holds their layers, head and loss on top)"
        )
    kernels = _FALLBACK_PATHS.get(str(c.get("model_type")))
    if kernels:
        out.append(
            f"traced mode: the {kernels[0]} ran transformers' pure-PyTorch path (what it runs without "
            f"{kernels[1]}); with those CUDA kernels a GPU step saves other tensors, not modelled"
        )
    return out


# layers whose CUDA kernels come from optional packages transformers falls back from
_FALLBACK_PATHS = {
    "nemotron_h": ("Mamba-2 mixers", "mamba_ssm / causal-conv1d"),
    "falcon_h1": ("Mamba-2 mixers", "mamba_ssm / causal-conv1d"),
    "bamba": ("Mamba-2 mixers", "mamba_ssm / causal-conv1d"),
    "mamba2": ("Mamba-2 mixers", "mamba_ssm / causal-conv1d"),
    "jamba": ("Mamba mixers", "mamba_ssm / causal-conv1d"),
    "qwen3_next": ("gated DeltaNet layers", "flash-linear-attention / causal-conv1d"),
}


def traced_estimate(model_config: dict, plan: ParallelPlan, kernel_policy: str = "cuda") -> TracedEstimate:
    """Estimate one training step of the HF model `model_config` (a config.json dict) under
    `plan` by tracing it on fake tensors."""
    from . import kernel_policy as policies
    from .hf import Precision, make_config
    from .replicate import trace_hf_replicated

    policies.check(kernel_policy)
    _check_plan(plan)
    if not isinstance(model_config, dict):
        raise UserError('traced mode needs an HF config.json (a dict with "model_type")')
    attn = "sdpa" if plan.flash_attn else "eager"
    warnings: list[str] = []
    cfg = make_config(model_config, attn, plan.layers, notes=warnings)
    attn = cfg._attn_implementation
    warnings += unmodelled_by_transformers(model_config)
    prec = Precision.parse(plan.dtype, plan.master_weights)
    set_to_none = (plan.grads or "set-to-none") == "set-to-none"
    step = trace_hf_replicated(
        cfg,
        plan.micro_batch,
        plan.seq_len,
        dtype=prec.name,
        attn=attn,
        recompute=plan.recompute,
        optimizer=plan.optimizer,
        kernel_policy=kernel_policy,
        step=plan.step,
        set_to_none=set_to_none,
        compile=plan.compile,
    )
    s = step.static
    grads, optim = s.get("grads", 0), s.get("optimizer", 0)
    static = StaticBytes(
        params=s["params"],
        grads=grads,
        optimizer=optim,
        other=s["total"] - s["params"] - grads - optim,
        grads_in_step=s["params"] if set_to_none or plan.step == "first" else 0,
    )
    f, b, o = step.phase("forward"), step.phase("backward"), step.phase("optimizer")
    n = step.layers
    what = (
        "steady state (second step): optimizer states resident"
        if plan.step == "steady"
        else "first step: optimizer states created in the optimizer job"
    )
    jobs = StageJobs(
        stage=0,
        F=JobMemory(f.net_bytes, f.peak_bytes),
        B=JobMemory(b.net_bytes, b.peak_bytes),
        layers=tuple(range(n)),
        notes={"step": what},
    )
    notes = {
        "layers": n,
        "precision": prec.name,
        "attention": attn,
        "recompute": plan.recompute,
        "traced_layers": step.traced.layers if step.traced else n,
        "static_detail": dict(s),
        "step": plan.step,
        "grads": plan.grads,
        "warnings": warnings,
    }
    if plan.compile:
        from .compiled import MODE

        notes["compile"] = MODE
    return TracedEstimate(
        static=static,
        jobs=jobs,
        optimizer=JobMemory(o.net_bytes, o.peak_bytes),
        peak_allocated_bytes=step.peak_bytes,
        peak_at=step.peak_at,
        kernel_policy=kernel_policy,
        notes=notes,
        recorded=lambda: recorded_step(step),
    )


def recorded_step(step):
    """The traced step's allocations as `RankPlan.recorded` wants them (pipemem.traced.allocs),
    or why there are none."""
    from ..jobs import StreamNotModelled
    from ..liveness import analyze_sequence
    from .allocs import one_step_allocs

    t = step.traced if hasattr(step, "traced") else step
    if t is None:
        return "the traced step's programs were not kept"
    try:
        if getattr(step, "replicated", False):
            from .replicate import replicated_allocs

            return replicated_allocs(step)
        results = analyze_sequence(t.programs, live_on_entry=t.entry_storages)
        return one_step_allocs(t.programs, results, t.entry_sizes)
    except StreamNotModelled as e:
        return str(e)
