"""The parallel plan: one config object, validated once at the edge (torchtitan's rule).

Field names are the CLI flag names of DESIGN.md with underscores, so
`pipemem.estimate(model, tp=8, pp=16, micro_batch=1)` and `pipemem estimate --tp 8 --pp 16
--micro-batch 1` mean the same thing. `validate_plan(arch, plan)` checks every field against
the model and returns a new plan with every default resolved (sp, microbatches,
main_grad_dtype, layers, pp_layout, recompute_layers, etc.); everything after it trusts the plan.

Rules chosen where frameworks differ (stated here, in the messages and in the docs):
* KV heads and tp: tp must divide the KV heads, or when KV heads < tp, tp must be a multiple
  of them and each rank holds one KV head (replicated tp/kv times, as Megatron and vLLM do).
* Which pipeline rank runs virtual stage s is the schedule's (`Schedule.stage_rank`,
  pipemem.schedules): looped s % pp for interleaved schedules, a V for ZB-V / DualPipeV,
  anything for a `csv:` schedule.
* Without pp_layout the layers are split evenly over the pp*vpp virtual stages (pp*vpp must
  divide the layer count); the embedding sits on stage 0, final norm, head and loss on the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from . import frameworks
from .errors import UserError

CONVENTIONS = frameworks.NAMES
RECOMPUTE = ("none", "selective", "full", "full_attn", "core_attn")
DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd", "adam8bit", "adam4bit")
# How the optimizer step runs (torch.optim's foreach/fused switches, torchtitan's
# [optimizer] implementation): fused kernels need no scratch, foreach materialises one
# temporary the size of the local parameters, for-loop one parameter's at a time.
OPTIMIZER_IMPLS = ("fused", "foreach", "for-loop")
# Each framework's default (pipemem.frameworks, `default_optimizer_impl`): Megatron (TE/Apex
# FusedAdam) and Paddle (in-place adamw kernels) fuse; torchtitan's `implementation` defaults to
# "fused"; HF modules trained with a plain torch.optim.AdamW (what traced mode records) take the
# foreach path on GPUs; torchtune's recipe configs pass `fused: True` to torch.optim.AdamW.
DEFAULT_OPTIMIZER_IMPL = {name: fw.default_optimizer_impl for name, fw in frameworks.ALL.items()}
# How the trainer keeps gradients between steps (what is resident when a step starts):
#   buffer           resident all step: Megatron's / Paddle's contiguous main-grad buffer, or
#                    PyTorch's zero_grad(set_to_none=False)
#   set-to-none      optimizer.zero_grad(set_to_none=True) (PyTorch's default: HF Trainer,
#                    torchtune, torchtitan with disable_cuda_graphs): created by the first
#                    backward of a step, freed after the optimizer step
#   ddp-bucket       DistributedDataParallel(gradient_as_bucket_view=False) (its default):
#                    set-to-none .grad tensors plus DDP's flat all-reduce buckets (one more
#                    copy of every gradient, resident all step)
#   ddp-bucket-view  DistributedDataParallel(gradient_as_bucket_view=True): .grad is a view of
#                    the resident buckets (one copy, resident all step)
GRADS = ("buffer", "set-to-none", "ddp-bucket", "ddp-bucket-view")
# Which training step is reported: "steady" (the second and later steps: optimizer states
# exist, gradients as GRADS says) or "first" (no optimizer states before the first
# optimizer step; gradients created by the first backward).
STEPS = ("steady", "first")

# What a training run can be. Beyond these bounds a number no longer describes a plan (and
# byte counts would leave 64 bits, or a replay would run for minutes); each bound is named in
# the error. They are generous: the largest published runs are far inside them.
LIMITS = {
    "seq_len": 1 << 24,  # 16,777,216 tokens per sequence
    "micro_batch": 1 << 16,  # sequences per microbatch
    "global_batch": 1 << 32,  # sequences per step
    "microbatches": 1 << 16,  # microbatches per pipeline per step
    "dp": 1 << 20,
    "tp": 1 << 20,
    "pp": 1 << 20,
    "cp": 1 << 20,
    "ep": 1 << 20,
    "etp": 1 << 20,
    "vpp": 1 << 10,  # model chunks per pipeline rank
    "layers": 1 << 14,  # 16,384 decoder layers (Llama 3.1 405B has 126)
    "recompute_layers": 1 << 14,
}
BOOL_FIELDS = ("sp", "fsdp", "dist_opt", "master_weights", "recompute_allgather", "flash_attn", "qlora")
MAX_LORA_RANK = 1 << 16
MAX_WORLD = 1 << 20  # 1,048,576 GPUs in one job
MAX_TOKENS = 1 << 32  # tokens per microbatch (seq_len x micro_batch)
# Schedule actions per step are pp x vpp x microbatches (stage, microbatch) pairs; a replay
# costs a few microseconds each, the schedules that search for their order (auto, ZBVPP:
# `ScheduleSpec.searched`) cost ~0.3 ms each. These keep one estimate within a few seconds on
# one core.
MAX_STAGE_MICROBATCHES = 1 << 17
MAX_SEARCHED_STAGE_MICROBATCHES = 1 << 12
# An upper bound of a rank's bytes must stay below this (int64 byte counts, with margin).
MAX_BYTES = 1 << 62
MAX_GPU_GIB = 1 << 20  # 1 PiB of device memory
MIN_GPU_GIB = 1 / 1024  # 1 MiB
# ArchSpec sizes read from a config.json
ARCH_LIMITS = {
    "hidden": 1 << 20,
    "ffn": 1 << 22,
    "expert_ffn": 1 << 22,
    "shared_ffn": 1 << 22,
    "vocab": 1 << 24,
    "heads": 1 << 14,
    "kv_heads": 1 << 14,
    "head_dim": 1 << 14,
    "experts": 1 << 16,
    "top_k": 1 << 16,
    "layers": LIMITS["layers"],
}


@dataclass
class ParallelPlan:
    # batch and sequence
    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int | None = None  # sequences per step over all dp ranks
    microbatches: int | None = None  # per pipeline; derived from global_batch when None
    # parallel degrees
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None = tp
    sp: bool | None = None  # sequence parallel; None = convention default (on when tp > 1)
    pp_layout: tuple[int, ...] | None = None  # decoder layers per (virtual) stage, in stage order
    # sharding of model states
    zero: int = 0
    fsdp: bool = False
    dist_opt: bool = False
    # precision and optimizer
    dtype: str = "bf16"
    master_weights: bool = True
    main_grad_dtype: str | None = None  # None = convention default (fp32 for megatron mixed precision)
    optimizer: str = "adamw"
    optimizer_impl: str | None = None  # fused | foreach | for-loop; None = convention default
    grads: str | None = None  # GRADS; None = convention default (see default_grads)
    step: str = "steady"  # STEPS: which training step is reported
    # activations
    recompute: str = "none"
    recompute_layers: int | None = None  # layers recomputed per stage; None = all
    recompute_allgather: bool = False
    flash_attn: bool = True
    # model overrides and framework
    layers: int | None = None
    convention: str = "megatron"
    schedule: str | None = None  # None = 1F1B when pp > 1
    extra: dict = field(default_factory=dict)
    # what modern trainers switch on (pipemem.features explains each)
    compile: bool | str = False  # torch.compile: "all" (= True: layers and loss) or "layers"
    loss: str = "standard"  # standard | chunked | fused_linear | fused
    loss_chunks: int = 8  # chunks of the chunked cross-entropy
    fp8: str | None = None  # delayed | current | mxfp8 (TE) | tensorwise | rowwise (torchao)
    fp8_param_gather: bool = False  # fp8 primary weights / fp8 FSDP all-gather
    activation_offload: str | None = None  # "all" (torchtune) or module names (Megatron fine-grained)
    optimizer_offload: float = 0.0  # fraction of optimizer states + master weights on the CPU
    optimizer_in_backward: bool = False  # torchtune optimizer_in_bwd
    optimizer_state_dtype: str | None = None  # Adam moments' dtype (Megatron precision-aware optimizer)
    # LoRA / QLoRA fine-tuning (pipemem.lora): the base frozen, adapters of rank `lora_rank` on
    # `lora_targets` (module names or all-linear; None = PEFT's default q_proj,v_proj)
    lora_rank: int = 0  # 0 = every parameter trained
    lora_targets: str | None = None
    lora_alpha: float | None = None  # scales the adapters' output: moves no memory (accepted)
    lora_dropout: float = 0.0
    qlora: bool = False  # base linears 4-bit NF4 (bitsandbytes, double quantization), bf16 compute
    # MoE load: the tokens the busiest expert-parallel rank's experts receive, as a multiple of the
    # balanced mean (top_k x its tokens); 1.0 = balanced (pipemem.templates.moe.rank_load)
    moe_imbalance: float = 1.0

    @property
    def deepspeed_mixed_precision(self) -> bool:
        """--convention hf with --zero 1-3 (not --fsdp) is DeepSpeed's ZeRO (HF Trainer, accelerate,
        Lightning): in fp16 / bf16 its engine converts the model itself to that dtype (no autocast)
        and its ZeRO optimizer keeps fp32 master partitions with the optimizer states; gradients
        are in the model's dtype (DeepSpeed's default grad_accum_dtype). Held against DeepSpeed's
        own engine by `pipemem validate deepspeed`."""
        fw = frameworks.ALL.get(self.convention)
        return (
            fw is not None
            and fw.zero_is_deepspeed
            and self.zero >= 1
            and not self.fsdp
            and self.master_weights
            and self.dtype != "fp32"
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    # Derived quantities (valid after validate_plan) ---------------------------------------
    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        """Expert data parallel size: the dp*cp*tp ranks of one pp stage regrouped as ep x etp x edp."""
        return (self.dp * self.cp * self.tp) // (self.ep * (self.etp or self.tp))

    def shard_key(self) -> tuple:
        """Everything that shapes one rank's programs (not dp/zero/optimizer): a cache key."""
        return (
            self.seq_len,
            self.micro_batch,
            self.tp,
            self.cp,
            self.ep,
            self.etp,
            self.sp,
            self.dtype,
            self.recompute,
            self.recompute_allgather,
            self.flash_attn,
            self.convention,
            self.compile,
            self.loss,
            self.loss_chunks,
            self.fp8,
            self.fp8_param_gather,
            self.activation_offload,
            self.lora_rank,
            self.lora_targets,
            self.lora_dropout,
            self.qlora,
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_positive(plan: ParallelPlan, names: tuple[str, ...]) -> None:
    for n in names:
        v = getattr(plan, n)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UserError(f"{_flag(n)} {v!r}: must be a positive integer")


def _n(x: int) -> str:
    return f"{x:,}"


def check_ranges(plan: ParallelPlan) -> None:
    """Every number of the plan within what a training run can be (LIMITS); one UserError
    naming the flag and the bound otherwise. Call before anything computes with the plan."""
    for n in BOOL_FIELDS:
        v = getattr(plan, n, None)
        if v is not None and not isinstance(v, bool):
            raise UserError(f"{_flag(n)} {v!r}: expected True or False")
    for n in ("schedule", "convention", "dtype", "recompute", "optimizer"):
        v = getattr(plan, n, None)
        if v is not None and not isinstance(v, str):
            raise UserError(f"{_flag(n)} {v!r}: expected a name (a string)")
    names = tuple(LIMITS)
    _check_positive(plan, names)
    for n in names:
        v = getattr(plan, n)
        if v is not None and v > LIMITS[n]:
            raise UserError(f"{_flag(n)} {v}: at most {_n(LIMITS[n])} ({_BOUND_WHY[n]})")
    world = plan.dp * plan.tp * plan.pp * plan.cp
    if world > MAX_WORLD:
        raise UserError(
            f"--dp {plan.dp} x --tp {plan.tp} x --pp {plan.pp} x --cp {plan.cp} = {_n(world)} GPUs: "
            f"at most {_n(MAX_WORLD)} GPUs in one job"
        )
    tokens = plan.seq_len * plan.micro_batch
    if tokens > MAX_TOKENS:
        raise UserError(
            f"--seq-len {plan.seq_len} x --micro-batch {plan.micro_batch} = {_n(tokens)} tokens per "
            f"microbatch: at most {_n(MAX_TOKENS)}"
        )
    if plan.pp_layout is not None:
        for x in plan.pp_layout:
            if not isinstance(x, int) or isinstance(x, bool) or x < 0 or x > LIMITS["layers"]:
                raise UserError(
                    f"--pp-layout entry {x!r}: layer counts are integers from 0 to {_n(LIMITS['layers'])}"
                )


_BOUND_WHY = {
    "seq_len": "tokens per sequence",
    "micro_batch": "sequences per microbatch",
    "global_batch": "sequences per step",
    "microbatches": "microbatches per pipeline per step",
    "dp": "GPUs",
    "tp": "GPUs",
    "pp": "GPUs",
    "cp": "GPUs",
    "ep": "GPUs",
    "etp": "GPUs",
    "vpp": "model chunks per pipeline rank",
    "layers": "decoder layers; the largest published models have ~130",
    "recompute_layers": "decoder layers",
}


def _runs_at_pp1(schedule: str) -> bool:
    """A schedule name that still means something with one pipeline stage (the registry's)."""
    from .schedules.registry import runs_at_pp1

    return runs_at_pp1(schedule)


def check_schedule_size(schedule: str, pp: int, vpp: int, microbatches: int) -> None:
    """A schedule of pp x vpp x microbatches (stage, microbatch) pairs within what one estimate
    replays in seconds (MAX_STAGE_MICROBATCHES; the searching schedulers, less)."""
    from .schedules.registry import is_searched

    units = pp * vpp * microbatches
    searched = is_searched(schedule)
    bound = MAX_SEARCHED_STAGE_MICROBATCHES if searched else MAX_STAGE_MICROBATCHES
    if units > bound:
        what = f"{schedule} searches for its order, so " if searched else ""
        raise UserError(
            f"--pp {pp} x --vpp {vpp} x --microbatches {microbatches} = {_n(units)} stage-microbatches: "
            f"{what}at most {_n(bound)} per step; use fewer microbatches"
        )


def check_arch(arch) -> None:
    """Model sizes read from a config within ARCH_LIMITS (a corrupt or mistyped config.json)."""
    name = arch.name or arch.model_type
    for k, bound in ARCH_LIMITS.items():
        v = getattr(arch, k, 0) or 0
        if not isinstance(v, int) or v < 0 or v > bound:
            raise UserError(
                f"config of {name}: {k} {v!r} is outside 0..{_n(bound)}; check the model configuration"
            )


def check_bytes(arch, plan: ParallelPlan) -> None:
    """A loose upper bound of any rank's bytes (unsharded model states, every microbatch's
    activations in fp32 with generous factors, eager attention scores) below MAX_BYTES, so
    the engine's int64 byte counts cannot overflow."""
    h, layers = arch.hidden, plan.layers or arch.layers
    ffn = max(
        arch.ffn, (arch.expert_ffn or 0) * max(arch.top_k, 1) + (arch.shared_ffn or 0) * arch.shared_experts
    )
    width = max(h, arch.heads * arch.head_dim)
    params = (
        layers * (4 * width * h + 3 * h * max(arch.ffn, (arch.expert_ffn or 0) * max(arch.experts, 1)))
        + 2 * arch.vocab * h
    )
    tokens = plan.seq_len * plan.micro_batch
    scores = 0 if plan.flash_attn else plan.micro_batch * arch.heads * plan.seq_len * plan.seq_len
    per_mb = tokens * (64 * width + 16 * ffn) * layers + 16 * scores * layers + 16 * tokens * arch.vocab
    inflight = (plan.microbatches or plan.pp) * plan.vpp
    total = 32 * params + per_mb * inflight
    if total > MAX_BYTES:
        raise UserError(
            f"this plan would need up to ~{total:.1e} bytes on a rank, beyond 64-bit byte counts "
            f"(2^62): check --seq-len {plan.seq_len}, --micro-batch {plan.micro_batch}"
            f"{'' if plan.flash_attn else ' (without flash attention the scores grow with seq_len^2)'} "
            "and the model's sizes"
        )


def _choice(value, allowed, flag: str):
    if value not in allowed:
        raise UserError(f"{flag} {value!r}: use one of {', '.join(allowed)}")
    return value


def validate_plan(arch, plan: ParallelPlan) -> ParallelPlan:
    """Check `plan` against `arch` (a `pipemem.model.ArchSpec`); return it with defaults resolved."""
    if not isinstance(plan, ParallelPlan):
        raise TypeError("validate_plan expects a ParallelPlan")
    check_ranges(plan)
    check_arch(arch)
    fw = frameworks.get(str(plan.convention).lower())
    conv = fw.name
    dtype = _choice(str(plan.dtype).lower(), DTYPES, "--dtype")
    recompute = _choice(str(plan.recompute).lower(), RECOMPUTE, "--recompute")
    opt = _choice(
        str(plan.optimizer).lower().replace("-", "").replace("_", ""),
        tuple(o.replace("_", "") for o in OPTIMIZERS),
        "--optimizer",
    )
    if plan.zero not in (0, 1, 2, 3) or isinstance(plan.zero, bool):
        raise UserError(f"--zero {plan.zero!r}: use 0, 1, 2 or 3")
    name = arch.name or arch.model_type
    layers = plan.layers or arch.layers

    # The hf convention is HF modules as written (one rank holds whole layers): data parallel,
    # ZeRO/FSDP and pipeline stages compose with it, tensor/context/expert parallelism do not.
    if fw.unsharded_modules:
        for flag in ("tp", "cp", "ep"):
            if getattr(plan, flag) > 1:
                raise UserError(
                    f"--{flag} {getattr(plan, flag)} with --convention {conv}: {conv} modules are modelled "
                    "unsharded; use --convention torchtitan (DTensor) or megatron for model parallelism"
                )
    fw.check_plan(arch, plan, dtype)

    # Tensor parallel vs heads.
    tp = plan.tp
    if arch.heads % tp:
        raise UserError(
            f"--tp {tp} does not divide {arch.heads} attention heads of {name}: "
            f"use a divisor of {arch.heads} ({_divisors(arch.heads)})"
        )
    if arch.kv_heads % tp and (arch.kv_heads >= tp or tp % arch.kv_heads):
        ok = ", ".join(
            str(t)
            for t in range(1, arch.heads + 1)
            if arch.heads % t == 0 and (arch.kv_heads % t == 0 or t % arch.kv_heads == 0)
        )
        raise UserError(
            f"--tp {tp} and {arch.kv_heads} KV heads of {name}: tp must divide the KV heads or be a "
            f"multiple of them (then KV heads are replicated); use one of {ok}"
        )
    if fw.tp_must_divide_kv_heads and arch.kv_heads % tp:
        # megatron-core with tp > KV heads all-gathers the whole QKV projection on every rank and
        # slices it (attention.py get_query_key_value_tensors): not what the templates build.
        ok = ", ".join(
            str(t) for t in range(1, arch.kv_heads + 1) if arch.kv_heads % t == 0 and arch.heads % t == 0
        )
        raise UserError(
            f"--tp {tp} does not divide the {arch.kv_heads} KV heads of {name}: under the megatron "
            f"convention tp must divide the KV heads (num_query_groups); use one of {ok}"
        )
    if arch.ffn and arch.ffn % tp:
        raise UserError(
            f"--tp {tp} does not divide the FFN width {arch.ffn} of {name}: use a divisor of {arch.ffn}"
        )
    # Sequence parallel defaults on with tp > 1 for every convention we model.
    sp = plan.sp if plan.sp is not None else tp > 1
    if sp and tp == 1:
        sp = False  # sequence parallel over one rank is the identity
    if plan.recompute_allgather and not sp and tp > 1:
        raise UserError(
            "--recompute-allgather needs sequence parallel (--sp): it re-gathers the sequence-sharded input"
        )

    # Context parallel.
    cp = plan.cp
    if cp > 1 and not plan.flash_attn:
        raise UserError(
            f"--cp {cp} needs --flash-attn: context parallelism runs ring attention on fused kernels"
        )
    if plan.seq_len % (cp * (tp if sp else 1)):
        div = cp * (tp if sp else 1)
        raise UserError(
            f"--seq-len {plan.seq_len} is not divisible by {div} (= --cp {cp}"
            f"{' x --tp ' + str(tp) + ' with --sp' if sp else ''}): use a multiple of {div}"
        )
    if cp > 1 and plan.seq_len % (2 * cp):
        raise UserError(
            f"--seq-len {plan.seq_len}: context parallel splits the sequence into 2 x --cp {cp} chunks "
            f"(load balancing); use a multiple of {2 * cp}"
        )

    # Pipeline.
    pp, vpp = plan.pp, plan.vpp
    if vpp > 1 and pp == 1:
        raise UserError(f"--vpp {vpp} needs --pp > 1 (virtual stages interleave over pipeline ranks)")
    stages = pp * vpp
    if stages > layers:
        raise UserError(
            f"--pp {pp} x --vpp {vpp} = {stages} stages exceeds the {layers} layers of {name}: "
            "use fewer stages or --layers"
        )
    if plan.pp_layout is not None:
        layout = tuple(int(x) for x in plan.pp_layout)
        if len(layout) != stages:
            raise UserError(
                f"--pp-layout has {len(layout)} entries but --pp {pp} x --vpp {vpp} = {stages} stages"
            )
        if any(x < 0 for x in layout) or sum(layout) != layers:
            raise UserError(
                f"--pp-layout {','.join(map(str, layout))}: entries must be >= 0 and sum to the "
                f"{layers} layers of {name}"
            )
    else:
        from .schedules.layout import layer_layout

        layout = layer_layout(layers, stages)
        if layout is None:
            raise UserError(
                f"--pp {pp} x --vpp {vpp} = {stages} stages does not divide the {layers} layers of "
                f"{name}: use a divisor of {layers} ({_divisors(layers)}) or give --pp-layout"
            )
    rl = plan.recompute_layers
    if rl is not None:
        if recompute == "none":
            raise UserError("--recompute-layers needs --recompute (selective, full, full_attn or core_attn)")
        if rl > max(layout):
            raise UserError(f"--recompute-layers {rl} exceeds the {max(layout)} layers of the largest stage")

    # Batches.
    mbs = plan.micro_batch
    microbatches = plan.microbatches
    if plan.global_batch is not None:
        per = mbs * plan.dp
        if plan.global_batch % per:
            raise UserError(
                f"--global-batch {plan.global_batch} is not divisible by --micro-batch {mbs} x --dp "
                f"{plan.dp} = {per}"
            )
        derived = plan.global_batch // per
        if microbatches is not None and microbatches != derived:
            raise UserError(
                f"--microbatches {microbatches} contradicts --global-batch {plan.global_batch} "
                f"(= {derived} microbatches of {mbs} on {plan.dp} dp rank{'s' if plan.dp != 1 else ''}); "
                "give only one"
            )
        microbatches = derived
    if microbatches is None:
        microbatches = max(pp, 1) if pp > 1 else 1
    if microbatches > LIMITS["microbatches"]:
        raise UserError(
            f"--global-batch {plan.global_batch} / (--micro-batch {mbs} x --dp {plan.dp}) = "
            f"{_n(microbatches)} microbatches: at most {_n(LIMITS['microbatches'])} per step"
        )
    if plan.schedule is not None and pp == 1 and not _runs_at_pp1(plan.schedule):
        # a named schedule orders pipeline stages; frameworks run one stage F, B, F, B... (1F1B,
        # so naming it is harmless; an explicit action list, csv: or torch:, is still an order)
        raise UserError(
            f"--schedule {plan.schedule} does nothing at --pp 1 (one pipeline stage runs no pipeline "
            "schedule): drop --schedule, or set --pp"
        )
    check_schedule_size(plan.schedule or "1F1B", pp, vpp, microbatches)
    if vpp > 1 and fw.interleaved_needs_pp_multiple and microbatches % pp:
        raise UserError(
            f"--microbatches {microbatches} must be a multiple of --pp {pp} with --vpp {vpp} "
            "(Megatron's interleaved schedule)"
        )

    # Experts.
    ep = plan.ep
    etp = plan.etp if plan.etp is not None else (fw.default_etp(tp, ep) if arch.is_moe else 1)
    if not arch.is_moe:
        if ep > 1:
            raise UserError(f"--ep {ep}: {name} has no experts; use --ep 1")
        if plan.etp is not None and plan.etp > 1:
            raise UserError(
                f"--etp {plan.etp} does nothing: {name} has no experts (expert tensor parallelism "
                "splits MoE expert layers); drop --etp"
            )
        etp = 1
    else:
        if arch.experts % ep:
            raise UserError(
                f"--ep {ep} does not divide the {arch.experts} experts of {name}: "
                f"use a divisor of {arch.experts} ({_divisors(arch.experts)})"
            )
        # Expert-parallel groups are carved from the dp x cp x tp ranks of a stage, regrouped as
        # ep x etp x expert-dp (Megatron-Core); with the default etp = tp this is "ep divides dp x cp".
        if (plan.dp * cp * tp) % (ep * etp):
            if etp == tp:
                hint = (
                    f"; or split the experts over fewer tp ranks with --etp 1 (--ep x --etp must "
                    f"divide --dp x --cp x --tp = {plan.dp * cp * tp})"
                    if tp > 1 and (plan.dp * cp * tp) % ep == 0
                    else ""
                )
                raise UserError(
                    f"--ep {ep} must divide --dp {plan.dp} x --cp {cp} = {plan.dp * cp} (expert-parallel "
                    "groups are carved from the data/context-parallel ranks)" + hint
                )
            raise UserError(f"--ep {ep} x --etp {etp} must divide --dp x --cp x --tp = {plan.dp * cp * tp}")
        if arch.expert_ffn % etp:
            raise UserError(f"--etp {etp} does not divide the expert FFN width {arch.expert_ffn} of {name}")

    # Sharding of model states.
    zero = plan.zero
    if plan.fsdp:
        if plan.zero not in (0, 3):
            raise UserError(
                f"--fsdp shards parameters, gradients and optimizer states (ZeRO-3); drop --zero {zero}"
            )
        zero = 3
    if plan.dist_opt and zero >= 2:
        raise UserError(
            "--dist-opt is Megatron's ZeRO-1 (sharded optimizer states); it cannot be combined with "
            f"--zero {zero}; use one of them"
        )
    if plan.dist_opt and not fw.has_dist_opt:
        raise UserError(f"--dist-opt is a Megatron option; with --convention {conv} use --zero 1")

    # Precision. (recompute_allgather changes Paddle's programs and torchtitan's, whose linears
    # then use pipemem.torch_tp.RegatherColwiseParallel; Megatron always gathers again in backward.)
    # torchtune has no mixed precision: the model, its grads and optimizer states are in `dtype`
    master = plan.master_weights and dtype != "fp32" and fw.mixed_precision
    mgd = plan.main_grad_dtype
    if mgd is None:
        # Mixed precision keeps fp32 gradients everywhere: Megatron/Paddle fp32 main grads,
        # torchtitan (FSDP2 reduce_dtype fp32) and HF autocast grads of fp32 parameters.
        # Pure low-precision training (--no-master-weights) keeps them in the param dtype.
        mgd = "fp32" if (dtype == "fp32" or master) else dtype
        if master and fw.zero_is_deepspeed and zero >= 1 and not plan.fsdp:
            mgd = dtype  # DeepSpeed: grads in the model's dtype (deepspeed_mixed_precision)
    mgd = _choice(str(mgd).lower(), DTYPES, "--main-grad-dtype")
    impl = plan.optimizer_impl
    impl = (
        fw.default_optimizer_impl
        if impl is None
        else _choice(
            str(impl).lower().replace("_", "-").replace("forloop", "for-loop"),
            OPTIMIZER_IMPLS,
            "--optimizer-impl",
        )
    )

    # Gradients between steps, and which step is reported.
    grads = plan.grads if plan.grads is not None else fw.default_grads(plan.dp, zero, bool(plan.fsdp))
    grads = _choice(str(grads).lower().replace("_", "-"), GRADS, "--grads")
    if grads.startswith("ddp") and (zero or plan.dist_opt):
        raise UserError(
            f"--grads {grads} is DistributedDataParallel's; with --zero {zero}"
            f"{' / --dist-opt' if plan.dist_opt else ''} the sharding runtime owns the gradients: "
            "use --grads buffer or set-to-none"
        )
    if grads.startswith("ddp") and fw.contiguous_grad_buffer:
        raise UserError(
            f"--grads {grads} is PyTorch DDP's; --convention {conv} keeps a contiguous grad buffer "
            "(--grads buffer)"
        )
    step = _choice(str(plan.step).lower(), STEPS, "--step")

    modern = _validate_features(plan, fw, _canon_opt(opt), microbatches)
    modern.update(_validate_lora(arch, plan, fw, dtype))
    out = replace(
        plan,
        convention=conv,
        dtype=dtype,
        recompute=recompute,
        optimizer=_canon_opt(opt),
        sp=sp,
        etp=etp,
        zero=zero,
        microbatches=microbatches,
        main_grad_dtype=mgd,
        master_weights=master,
        optimizer_impl=impl,
        layers=layers,
        pp_layout=layout,
        recompute_layers=rl,
        grads=grads,
        step=step,
        extra=dict(plan.extra),
        **modern,
    )
    check_bytes(arch, out)
    return out


def _validate_lora(arch, plan: ParallelPlan, fw, dtype: str) -> dict:
    """LoRA / QLoRA switches (pipemem.lora), canonicalised; one UserError per bad value or
    combination the templates do not model."""
    from .lora import parse_targets, targets_text

    rank = plan.lora_rank
    if rank in (None, False):
        rank = 0
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_LORA_RANK:
        raise UserError(f"--lora-rank {rank!r}: a whole number from 1 to {_n(MAX_LORA_RANK)} (0 = no LoRA)")
    drop = plan.lora_dropout if plan.lora_dropout is not None else 0.0
    if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop < 1:
        raise UserError(f"--lora-dropout {drop!r}: a probability from 0 to below 1")
    alpha = plan.lora_alpha
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise UserError(f"--lora-alpha {alpha!r}: a number (it scales the adapters' output)")
    if not rank:
        for flag, on in (
            ("--qlora", plan.qlora),
            ("--lora-targets", plan.lora_targets),
            ("--lora-dropout", drop),
            ("--lora-alpha", alpha is not None),
        ):
            if on:
                raise UserError(f"{flag} needs --lora-rank (the adapters' rank): set it, or drop {flag}")
        return {"lora_rank": 0, "lora_targets": None, "lora_dropout": 0.0, "qlora": False}
    targets = parse_targets(plan.lora_targets)
    conv = fw.name
    name = arch.name or arch.model_type
    if fw.lora_adapter_dtype is None:
        raise UserError(
            f"--lora-rank with --convention {conv}: LoRA is modelled for PEFT on HF modules "
            "(--convention hf) and torchtune's LoRALinear (--convention torchtune)"
        )
    if arch.is_moe or arch.fused_qkv or arch.activation not in ("swiglu", "geglu"):
        what = (
            "mixture-of-experts layers"
            if arch.is_moe
            else "a fused QKV projection"
            if arch.fused_qkv
            else "a non-gated MLP"
        )
        raise UserError(
            f"--lora-rank on {name}: LoRA is modelled on Llama-like layers (separate q/k/v, gated "
            f"MLP); {name} has {what}"
        )
    if plan.qlora and dtype == "fp32":
        raise UserError("--qlora computes in bf16 (or fp16) from the NF4 weights: use --dtype bf16")
    for flag, on in (
        ("--fp8", plan.fp8 not in (None, "", "none", False)),
        ("--compile", plan.compile not in (False, None, "", "none", "false", "0")),
        ("--activation-offload", plan.activation_offload not in (None, "", "none", False)),
        ("--optimizer-in-backward", plan.optimizer_in_backward),
        ("--optimizer-offload", bool(plan.optimizer_offload)),
    ):
        if on:
            raise UserError(f"{flag} with --lora-rank: not modelled together (not checked against a trace)")
    return {
        "lora_rank": rank,
        "lora_targets": targets_text(targets),
        "lora_dropout": float(drop),
        "qlora": bool(plan.qlora),
    }


def default_grads(convention: str, dp: int = 1, zero: int = 0, fsdp: bool = False) -> str:
    """How a convention's trainer keeps gradients between steps (GRADS), by its framework
    (pipemem.frameworks, `Framework.default_grads`): Megatron, Paddle and torchtitan in a
    resident buffer; torchtune and HF-style loops with PyTorch's zero_grad(set_to_none=True),
    HF's wrapped in DistributedDataParallel (default buckets) when they data-parallelise without
    sharding, DeepSpeed's ZeRO-3 in its flat partition buffer. A name that is no convention
    (an unvalidated plan's) gets PyTorch's default, set-to-none."""
    fw = frameworks.ALL.get(convention)
    return fw.default_grads(dp, zero, fsdp) if fw is not None else "set-to-none"


def _canon_opt(o: str) -> str:
    return {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "adam8bit": "adam8bit", "adam4bit": "adam4bit"}[o]


def _validate_features(plan: ParallelPlan, fw, opt: str, microbatches: int) -> dict:
    """Check the modern-trainer switches (pipemem.features) under framework `fw` and return them
    canonicalised."""
    conv = fw.name
    from .features import FP8_RECIPES, LOSSES, OFFLOAD_MODULES, STATE_DTYPES, TE_RECIPES, parse_offload

    loss = _choice(str(plan.loss).lower().replace("-", "_"), LOSSES, "--loss")
    chunks = plan.loss_chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise UserError(f"--loss-chunks {chunks!r}: must be a positive integer (torchtune uses 8)")
    if loss in ("fused", "fused_te") and not fw.fused_ce_loss:
        raise UserError(
            f"--loss {loss} is Megatron's --cross-entropy-loss-fusion; with --convention {conv} use "
            "--loss chunked (torchtune) or fused_linear (Liger)"
        )
    if loss == "shifted" and (not fw.whole_logits_loss or plan.tp > 1):
        raise UserError(
            f"--loss shifted is a loss a PyTorch training step writes on the whole logits: use it with "
            f"--convention hf and --tp 1 (got --convention {conv}"
            + (f", --tp {plan.tp}" if plan.tp > 1 else "")
            + ")"
        )
    own_chunked = loss == "chunked" and fw.chunked_loss_wrapper  # torchtitan's ChunkedLossWrapper
    if loss in ("chunked", "fused_linear") and (plan.tp > 1 or not fw.torch_modules) and not own_chunked:
        raise UserError(
            f"--loss {loss} (torchtune / Liger) runs on unsharded logits in PyTorch trainers: use it "
            "with --tp 1 and --convention hf or torchtitan (Megatron: --loss fused or fused_te)"
        )
    fp8 = plan.fp8
    if fp8 in ("", "none", None, False):
        fp8 = None
    if fp8 is not None:
        fp8 = _choice(str(fp8).lower(), FP8_RECIPES, "--fp8")
        if fw.fp8 is None:
            raise UserError(
                "--fp8 with --convention paddle: PaddleNLP's fp8 linears are not modelled; "
                "drop --fp8 or use --convention megatron / torchtitan"
            )
        if fp8 in TE_RECIPES and fw.fp8 != "te":
            raise UserError(
                f"--fp8 {fp8} is a Transformer Engine recipe (Megatron); with --convention {conv} use "
                "--fp8 tensorwise or rowwise (torchao Float8)"
            )
        if fp8 not in TE_RECIPES and fw.fp8 == "te":
            raise UserError(
                f"--fp8 {fp8} is torchao's Float8 (torchtitan / PyTorch trainers); Megatron runs "
                "Transformer Engine: use --fp8 delayed, current or mxfp8"
            )
        if plan.dtype == "fp32":
            raise UserError("--fp8 needs --dtype bf16 or fp16 (fp8 linears run inside mixed precision)")
    if plan.fp8_param_gather and fp8 is None:
        raise UserError("--fp8-param-gather needs --fp8 (it gathers fp8 weights)")
    mods = parse_offload(plan.activation_offload)
    bad = sorted(m for m in mods if m != "*" and m not in OFFLOAD_MODULES)
    if bad:
        raise UserError(
            f"--activation-offload {plan.activation_offload!r}: unknown module {bad[0]!r}; use all or "
            f"a comma list of {', '.join(OFFLOAD_MODULES)}"
        )
    if mods and not fw.activation_offload:
        raise UserError(
            "--activation-offload with --convention paddle is not modelled (Paddle's recompute "
            "offload keeps checkpoints on the CPU); use --convention megatron, torchtitan or hf"
        )
    frac = plan.optimizer_offload
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac <= 1:
        raise UserError(
            f"--optimizer-offload {frac!r}: a fraction of the optimizer states between 0 and 1 "
            "(1 = all on the CPU, as DeepSpeed ZeRO-Offload)"
        )
    if plan.optimizer_in_backward:
        if plan.pp > 1 or microbatches > 1:
            raise UserError(
                "--optimizer-in-backward steps each parameter during backward, so gradients cannot "
                "accumulate over microbatches (torchtune refuses it too): use --pp 1 and one "
                "microbatch, or drop it"
            )
        if frac:
            raise UserError(
                "--optimizer-in-backward with --optimizer-offload: no framework runs both; drop one"
            )
        if not fw.torch_modules:
            raise UserError(
                f"--optimizer-in-backward is torchtune's optimizer_in_bwd (PyTorch modules); with "
                f"--convention {conv} the weight-grad GEMMs accumulate into persistent grad buffers"
            )
    sdt = plan.optimizer_state_dtype
    if sdt is not None:
        sdt = _choice(str(sdt).lower(), STATE_DTYPES, "--optimizer-state-dtype")
        if opt in ("adam8bit", "adam4bit", "sgd"):
            raise UserError(
                f"--optimizer-state-dtype with --optimizer {opt}: the optimizer fixes its state format"
            )
    comp = plan.compile
    if comp in (True, "all", "true", "1"):
        comp = "all"
    elif comp in (False, None, "", "none", "false", "0"):
        comp = False
    elif comp != "layers":
        raise UserError(
            f"--compile {plan.compile!r}: use all (layers and loss, as torchtune and torchtitan 0.3 "
            "compile them) or layers (decoder layers only, torchtitan before the loss component)"
        )
    if comp and not fw.torch_compile:
        raise UserError("--compile is torch.compile; with --convention paddle it does not apply")
    imb = plan.moe_imbalance
    if isinstance(imb, bool) or not isinstance(imb, (int, float)) or not 1 <= imb <= 1 << 20:
        raise UserError(
            f"--moe-imbalance {imb!r}: the busiest expert-parallel rank's tokens as a multiple of the "
            "balanced mean, at least 1 (1 = balanced)"
        )
    return {
        "moe_imbalance": float(imb),
        "loss": loss,
        "fp8": fp8,
        "activation_offload": ("all" if mods == {"*"} else ",".join(sorted(mods)) if mods else None),
        "optimizer_offload": float(frac),
        "optimizer_state_dtype": sdt,
        "compile": comp,
        "optimizer_in_backward": bool(plan.optimizer_in_backward),
        "fp8_param_gather": bool(plan.fp8_param_gather),
    }
