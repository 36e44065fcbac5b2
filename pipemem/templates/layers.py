"""Op-level programs of one rank for the parts of a decoder-only transformer.

`Shard` holds the local sizes of one rank under a plan (sequence after CP and SP, heads and
FFN after TP, experts after EP). The generators below describe each part as autograd nodes on
a `Tape` (pipemem.templates.tape), which writes the forward, backward and split-backward
programs. What each node saves follows the PyTorch / Megatron autograd functions on CUDA:

* linear: saves its input for the weight grad (the weight itself is a parameter);
* LayerNorm / RMSNorm (fused kernels): input + fp32 mean/rstd per token;
* GeLU / SiLU: their input; fused bias-SwiGLU: the fc1 output; product: both factors;
* dropout (native_dropout on CUDA): a bool mask; residual add: nothing;
* eager attention: q, k for QK^T, the softmax output, the dropout mask and output, v;
* flash attention: q, k, v, out and the fp32 logsumexp; backward allocates an fp32 dq
  accumulator and, with GQA, full-head dk/dv before reducing them (kernel workspace, assumed
  from flash-attention's source: traced/kernel_workspace.py);
* collectives write comm_buffer tensors; Megatron's sequence-parallel linear keeps the
  sharded input and all-gathers it again in backward (the others: see conventions.py).

Layout is Megatron's [s, b, ...]; only sizes matter to memory.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import lru_cache

from ..features import NONE as NO_FEATURES
from ..features import Features, features_of
from ..ir import dtype_bytes
from ..traced.kernel_workspace import flash_attention_backward_workspace_bytes
from .conventions import CONVENTIONS, Convention, padded_vocab
from .moe import MEGATRON_GROUP_MASK, group_limited
from .tape import COMM, PARAM, BwdOp, Tape

MASK = "bool"
CONVENTIONS_PADDLE = CONVENTIONS["paddle"]
CAST_BYTES = 9  # peak bytes per element of torchao's eager fp8 cast (fp32 scaled + clamped + fp8)
STAT = "fp32"


@dataclass(frozen=True, slots=True)
class Shard:
    """Local sizes of one rank. `s` = sequence after CP; `s_sp` = after SP as well."""

    s: int
    s_sp: int
    b: int
    h: int
    heads: int
    kv: int
    d: int
    ffn: int
    vocab: int  # local (padded) vocab shard
    tp: int
    sp: bool
    cp: int
    dt: str
    # MoE
    experts: int = 0  # local experts
    top_k: int = 0
    expert_ffn: int = 0  # local expert width (after etp)
    etp: int = 1
    ep: int = 1
    shared_ffn: int = 0  # local shared-expert width (after tp)
    moe_load: float = 1.0  # tokens this rank's experts receive / the balanced mean (templates.moe.rank_load)
    autocast: bool = (
        False  # torch autocast over fp32 params (hf convention, mixed precision; not DeepSpeed's)
    )
    first_step: bool = False  # eager wgrads become .grad (step 1) instead of being accumulated
    fsdp: bool = False  # ZeRO-3 / FSDP: per-part parameter all-gather, grads reduce-scattered
    feat: Features = NO_FEATURES  # compile, loss, fp8, offload (pipemem.features)
    # Gradients created by this backward (the first backward of a step after
    # zero_grad(set_to_none=True)): each .grad is allocated where it is first written, in
    # `grad_dt`, 1/`grad_shard` of the parameter (FSDP keeps only its shard), and stays alive.
    fsdp_reshard: bool = True  # FSDP2 reshard_after_forward
    # torchtune without custom_sharded_layers: the embedding, final norm and output layer are
    # FSDP2's root unit (gathered when the forward starts, never resharded before the backward
    # ends, their grads reduce-scattered when it ends)
    fsdp_root: bool = False
    # the output layer's FSDP unit reshards after the forward (torchtitan: only with
    # fsdp_reshard_after_forward = "always"; its default keeps [norm, output] gathered)
    fsdp_head_reshard: bool = True
    # the embedding's unit reshards after the forward (DeepSpeed ZeRO-3 keeps it gathered when
    # its next use is within stage3_max_reuse_distance)
    fsdp_embed_reshard: bool = True
    zero3_kept_layers: int = 0  # DeepSpeed ZeRO-3: a stage's last layers kept gathered into the backward
    backward_bucket_bytes: int = 0  # DeepSpeed ZeRO-1/2's reduce bucket, alive through each backward
    loss_chunks: int = 1  # torchtitan's ChunkedLossWrapper: output layer + loss per sequence chunk
    grads_created: bool = False
    grad_dt: str = "fp32"
    grad_shard: int = 1

    @property
    def res_dt(self) -> str:
        """dtype of the residual stream: fp32 under autocast (fp32 params, fp32 adds)."""
        return "fp32" if self.autocast else self.dt

    @property
    def boundary_bytes(self) -> int:
        """Bytes of one layer input / output [s_sp, b, h]."""
        return self.s_sp * self.b * self.h * dtype_bytes(self.res_dt)


def _check_sliding_window(arch, plan) -> None:
    """Gemma 3 is held against traced mode (HF's modules) only as HF runs it under SDPA with no
    sliding mask: from seq_len = window on, HF masks the local layers with a [B, 1, S, S] bias
    SDPA keeps for backward; its eager path kept 13 % less in fp32 than the template (not
    found); other frameworks' sliding-window kernels are not checked."""
    from ..model import refuse_unmodelled

    what = None
    if not CONVENTIONS[plan.convention].framework.transformers_modules:
        what = f"sliding-window layers under --convention {plan.convention} (only --convention hf is checked)"
    elif not plan.flash_attn:
        what = "Gemma 3's eager attention (--no-flash-attn)"
    elif plan.seq_len >= arch.sliding_window:
        what = (
            f"sliding-window layers with --seq-len {plan.seq_len} >= their window "
            f"({arch.sliding_window}: HF masks them with a [B, 1, S, S] bias SDPA keeps for backward)"
        )
    if what:
        raise refuse_unmodelled(arch.name or arch.model_type, arch.model_type, what)


def make_shard(arch, plan, conv: Convention) -> Shard:
    if arch.sliding_window:
        _check_sliding_window(arch, plan)
    if getattr(arch, "kv_lora_rank", 0):
        from .mla import check_mla_plan

        check_mla_plan(arch, plan)
    if (
        arch.attention_chunk
        and arch.nope_layers != tuple(range(arch.layers))
        and plan.seq_len > arch.attention_chunk
    ):
        from ..model import refuse_unmodelled

        raise refuse_unmodelled(
            arch.name or arch.model_type,
            arch.model_type,
            f"chunked attention with --seq-len {plan.seq_len} > attention_chunk_size {arch.attention_chunk} "
            "(past one chunk its mask is built and kept by the attention: not modelled)",
        )
    if arch.attn_sinks and not CONVENTIONS[plan.convention].framework.transformers_modules:
        from ..model import refuse_unmodelled

        raise refuse_unmodelled(
            arch.name or arch.model_type,
            arch.model_type,
            f"attention sinks under --convention {plan.convention} (only HF's eager attention with "
            "sinks, --convention hf, is checked)",
        )
    if arch.model_type == "gemma2":
        from ..errors import UserError

        raise UserError(
            "gemma2: template mode does not model its attention and final-logit soft-capping "
            "(eager attention, tanh over the logits); use --mode traced --no-flash-attn"
        )
    tp, cp = plan.tp, plan.cp
    s = plan.seq_len // cp
    sp = bool(plan.sp) and tp > 1
    kv_local = arch.kv_heads // tp if arch.kv_heads >= tp else 1
    etp = plan.etp or 1
    from .moe import rank_load
    from .static import deepspeed_bucket_bytes, pipelined_fsdp

    reuse = zero3_reuse(arch, plan, conv)
    # gathered once per stage under pipelining (static bytes), so its programs gather nothing
    fsdp = (plan.zero >= 3 or bool(plan.fsdp)) and not pipelined_fsdp(plan, conv)
    return Shard(
        s=s,
        s_sp=s // tp if sp else s,
        b=plan.micro_batch,
        h=arch.hidden,
        heads=arch.heads // tp,
        kv=kv_local,
        d=arch.head_dim,
        ffn=arch.ffn // tp if arch.ffn else 0,
        vocab=padded_vocab(arch.vocab, tp, conv) // tp,
        tp=tp,
        sp=sp,
        cp=cp,
        dt=plan.dtype,
        experts=arch.experts // plan.ep if arch.experts else 0,
        top_k=arch.top_k,
        expert_ffn=arch.expert_ffn // etp if arch.experts else 0,
        etp=etp,
        ep=plan.ep,
        shared_ffn=(arch.shared_experts * arch.shared_ffn) // tp if arch.shared_experts else 0,
        moe_load=rank_load(arch, plan),
        autocast=conv.framework.autocast
        and not plan.lora_rank  # LoRA: the frozen base is loaded in the compute dtype
        and plan.master_weights
        and plan.dtype != "fp32"
        and not plan.deepspeed_mixed_precision,
        first_step=bool((plan.extra or {}).get("first_step", False)),
        fsdp=fsdp,
        fsdp_reshard=bool((plan.extra or {}).get("fsdp_reshard_after_forward", True)),
        fsdp_root=fsdp_root_unit(plan, conv),
        fsdp_head_reshard=bool((plan.extra or {}).get("fsdp_reshard_after_forward", True))
        and (conv.framework.fsdp_reshards_head or bool((plan.extra or {}).get("fsdp_reshard_head", False)))
        and not reuse.head,
        # the embedding's unit too keeps its parameters gathered after the forward when
        # resharding is off (torchtitan's fsdp_reshard_after_forward = "never" on every block)
        fsdp_embed_reshard=not reuse.embedding
        and bool((plan.extra or {}).get("fsdp_reshard_after_forward", True)),
        zero3_kept_layers=reuse.layers,
        backward_bucket_bytes=deepspeed_bucket_bytes(plan) if plan.zero in (1, 2) else 0,
        loss_chunks=conv.framework.loss_chunks(plan),
        # In a backward that accumulates, only FSDP2's all-gather and reduce-scatter buffers
        # (torchtitan, torchtune: _Gen's fsdp_ag_state) see the data-parallel group; grad_dt and ZeRO-2's
        # shard matter once the backward creates the grads (first_backward_shard). Kept out of
        # the shard otherwise, so plans that differ only in dp share every part's programs.
        grad_shard=plan.dp * plan.cp if fsdp and conv.fsdp2 else 1,
        feat=features_of(plan),
    )


@dataclass(frozen=True, slots=True)
class Zero3Reuse:
    """What DeepSpeed's ZeRO-3 keeps gathered from the forward into the backward."""

    layers: int = 0  # a stage's last decoder layers
    head: bool = False
    embedding: bool = False


# DeepSpeed's default stage3_max_reuse_distance (elements); plan.extra["stage3_max_reuse_distance"]
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000


def zero3_reuse(arch, plan, conv: Convention) -> Zero3Reuse:
    """DeepSpeed ZeRO-3 (hf convention, --zero 3, not --fsdp) releases a module's gathered
    parameters after its forward only when they are not used again within
    `stage3_max_reuse_distance` elements of the parameters the step's trace visits in between
    (partitioned_param_coordinator.py `__params_to_release`). A decoder layer is used next in its
    own backward: in between run the later layers' forwards, the head's forward and backward and
    the later layers' backwards (twice each under activation checkpointing: the recomputed
    forward fetches them again), so the last layers stay gathered -- all of them when the model
    is small. The head is reused at once; the embedding by a tied head at the forward's end, else
    by its own backward at the step's end. Within a pipeline stage counted as if it were the whole
    model. Held against DeepSpeed's own engine by `pipemem validate deepspeed`."""
    if not conv.framework.zero_is_deepspeed or plan.zero != 3 or plan.fsdp:
        return Zero3Reuse()
    from .static import layer_kind_counts, moe_layers_in

    window = int((plan.extra or {}).get("stage3_max_reuse_distance", ZERO3_MAX_REUSE_DISTANCE))
    n = arch.layers
    n_moe = moe_layers_in(arch, range(n))
    total = sum(
        k * sum(layer_kind_counts(arch, moe, plan.tp, plan.etp or 1, plan.ep))
        for moe, k in ((True, n_moe), (False, n - n_moe))
        if k
    )
    per_layer = total / max(1, n)
    head = padded_vocab(arch.vocab, plan.tp, conv) // plan.tp * arch.hidden
    visits = 2 if plan.recompute == "full" else 1  # backward visits of a later layer

    def distance(later_layers: int) -> float:
        return later_layers * per_layer * (1 + visits) + 2 * head

    kept = sum(1 for i in range(n) if distance(n - 1 - i) < window)
    tied = bool(getattr(arch, "tied_embeddings", False))
    emb = n * per_layer if tied else distance(n) + head
    return Zero3Reuse(layers=kept, head=2 * head < window, embedding=emb < window)


def root_unit_bytes(arch, sh: Shard) -> int:
    """Unsharded bytes of FSDP2's root unit under torchtune: the word embedding, the final
    norm's weight and, untied, the output layer."""
    tied = bool(getattr(arch, "tied_embeddings", False))
    return (sh.vocab * sh.h * (1 if tied else 2) + sh.h) * dtype_bytes(sh.dt)


def layer_unit_bytes(arch, sh: Shard) -> int:
    """The all-gather output buffer of the stage's last decoder layer as an FSDP2 unit: its
    parameters in the model's dtype, each rank's shard padded to a whole share."""
    from ..model import layer_param_shapes

    elems = 0
    for shape, _ in layer_param_shapes(arch, arch.layers - 1, sh.tp, 1, 1).values():
        n = 1
        for d in shape:
            n *= d
        elems += n
    group = max(1, sh.grad_shard)
    return -(-elems * dtype_bytes(sh.dt) // group) * group


def fsdp_root_unit(plan, conv: Convention) -> bool:
    """Whether the embedding and the output layer are in FSDP2's root unit: torchtune's
    `shard_model` wraps each decoder layer and the modules `custom_sharded_layers` names
    (plan.extra, as --from-torchtune reads it), then the whole model; what is left is the
    root's. Both or neither: a list naming one of them is refused by the torchtune reader."""
    if not conv.framework.fsdp_root_holds_ends or not (plan.fsdp or plan.zero >= 3):
        return False
    custom = set((plan.extra or {}).get("custom_sharded_layers") or ())
    return not ({"tok_embeddings", "output"} & custom)


def first_backward_shard(sh: Shard, plan) -> Shard:
    """The shard of a step's first backward when gradients were set to None: eager weight
    grads become .grad (stolen, not accumulated) and every gradient is a new tensor, in the
    main-grad dtype, 1/(dp x cp) of the parameter under ZeRO-2 and FSDP."""
    from dataclasses import replace

    return replace(
        sh,
        first_step=True,
        grads_created=True,
        grad_dt=_grad_dtype(plan),
        grad_shard=plan.dp * plan.cp if (plan.zero >= 2 or plan.fsdp) else 1,
    )


def _grad_dtype(plan) -> str:
    """The dtype of the gradients a backward creates: the main grads', or LoRA's adapters' own."""
    if plan.lora_rank:
        from .static import lora_adapter_dtype

        return lora_adapter_dtype(plan)
    return plan.main_grad_dtype or plan.dtype


@dataclass(frozen=True, slots=True)
class LayerOptions:
    """Per-layer switches that change the program (a cache key together with Shard)."""

    norm: str
    activation: str
    act_fn: str
    moe: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    qk_norm: bool
    qk_norm_proj: bool  # q/k norm over the whole projection (olmo2), not per head
    norm_placement: str  # pre | post | sandwich (ArchSpec.norm_placement)
    norm_weight_first: bool  # HF RMSNorm: (weight * x_normed).to(dtype), not weight * x_normed.to(dtype)
    parallel_residual: bool
    native_fused_qkv: bool  # the model's own modules fuse q, k, v (used by the hf convention)
    attn_dropout: bool
    hidden_dropout: bool
    flash: bool
    recompute: str  # none | selective | core_attn | full_attn | full
    offload_keep: int = 0  # activation offload: the layer's last saved tensors left on the GPU
    # DeepSpeed ZeRO-3: the parameters gathered for the layer's forward stay gathered into its
    # backward (reused within stage3_max_reuse_distance: `zero3_kept_layers`)
    fsdp_keep: bool = False
    # HF MoE router and shared expert (ArchSpec fields of the same names)
    router_norm_topk: bool = True
    router_weights_cast: bool = False
    shared_expert_gate: bool = False
    # newer MoE routers (ArchSpec fields of the same names; pipemem.templates.moe)
    router: str = "softmax"
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling: float = 1.0
    shared_first: bool = True
    rope_cat: bool = False  # q, k concatenated after a partial rope (glm4_moe): a [b, heads, s, d] query
    # GPT-OSS (pipemem.templates.gpt_oss)
    attn_sinks: bool = False
    expert_bias: bool = False
    expert_act: str = "swiglu"
    # Llama 4 (pipemem.templates.llama4)
    nope: bool = False  # a NoPE layer: no rope, no q/k norm
    qk_l2: bool = False  # L2 q/k norm without weight after the rope
    attn_temperature: bool = False  # NoPE layers' queries scaled by position
    expert_compute: str = "sparse"


def norm_kind(arch) -> str:
    """The norm a layer's tape builds: rmsnorm, layernorm, or layernorm-noaffine (olmo)."""
    return arch.norm if arch.norm_affine else arch.norm + "-noaffine"


def layer_options(arch, plan, index: int, recomputed: bool) -> LayerOptions:
    return layer_options_of(
        arch,
        arch.is_moe_layer(index),
        plan.flash_attn,
        plan.recompute if recomputed else "none",
        index in arch.nope_layers,
    )


# LayerOptions fields that are the ArchSpec fields of the same name, as they are
ARCH_FIELDS = (
    "activation",
    "act_fn",
    "qkv_bias",
    "out_bias",
    "mlp_bias",
    "norm_placement",
    "norm_weight_first",
    "parallel_residual",
    "router_norm_topk",
    "router_weights_cast",
    "shared_expert_gate",
    "router",
    "router_groups",
    "router_topk_groups",
    "routed_scaling",
    "shared_first",
    "attn_sinks",
    "expert_bias",
    "expert_act",
    "expert_compute",
)


@lru_cache(maxsize=4096)
def layer_options_of(arch, moe: bool, flash: bool, recompute: str, nope: bool = False) -> LayerOptions:
    l2 = arch.qk_norm and arch.qk_norm_scope == "l2"
    return LayerOptions(
        **{f: getattr(arch, f) for f in ARCH_FIELDS},
        norm=norm_kind(arch),
        moe=moe,
        qk_norm=arch.qk_norm and not l2,
        qk_norm_proj=arch.qk_norm_scope == "proj",
        native_fused_qkv=arch.fused_qkv,
        attn_dropout=arch.attn_dropout > 0,
        hidden_dropout=arch.hidden_dropout > 0,
        flash=flash,
        recompute=recompute,
        rope_cat=arch.model_type == "glm4_moe",
        nope=nope,
        qk_l2=l2 and not nope,
        attn_temperature=arch.attn_temperature and nope,
    )


# Building blocks --------------------------------------------------------------------------


class _Gen:
    """Helpers over one tape with the shard's sizes."""

    def __init__(self, tape: Tape, sh: Shard, conv: Convention, prefix: str):
        if not conv.wgrad_fused or sh.fsdp:
            chain = (sh.dt, "fp32") if sh.autocast else (sh.dt,)
            tape.wgrad_chain = chain
            tape.wgrad_final = "steal_grad" if sh.first_step else "accumulate_grad"
        tape.fsdp = sh.fsdp
        tape.step_in_backward = sh.feat.opt_in_bwd
        tape.fsdp_reshard = sh.fsdp_reshard
        tape.fsdp_ag_state = conv.fsdp2
        tape.fsdp_reduce_dtype = "fp32" if conv.fsdp2_reduce_fp32 else sh.dt
        tape.fsdp_group = max(1, sh.grad_shard)
        tape.keep_recompute_outputs = conv.checkpoint_keeps_outputs
        if sh.feat.lora_rank:
            tape.trainable = set()  # LoRA: the base is frozen; the adapters add themselves
        if sh.grads_created:
            tape.grad_create = (sh.grad_dt, sh.grad_shard)
        self.t = tape
        self.sac = False
        # a compiled graph computes identical casts once (common-subexpression elimination)
        self.cse: dict | None = {} if sh.feat.compile else None
        self.sh = sh
        self.conv = conv
        self.p = prefix
        self.dt = sh.dt
        self.norm_weight_first = conv.norm_weight_first

    def n(self, name: str) -> str:
        return f"{self.p}{name}"

    def act(self, name: str, shape, dtype: str | None = None, kind=None, storage: str = "") -> str:
        nm = self.n(name)
        if kind is None:
            self.t.t(nm, shape, dtype or self.dt, storage=storage)
        else:
            self.t.t(nm, shape, dtype or self.dt, kind, storage=storage)
        return nm

    # Norms --------------------------------------------------------------------------------
    def dtype_of(self, x: str) -> str:
        return self.t.tensors[x].dtype

    def norm(self, x: str, name: str, kind: str, tokens_shape: tuple) -> str:
        h = tokens_shape[-1]
        tok = tokens_shape[:-1]
        x_dt = self.dtype_of(x)
        if kind.endswith("-noaffine"):
            # F.layer_norm(x.float(), no weight, no bias).to(x.dtype) (OlmoLayerNorm): saves the
            # fp32 input and the statistics
            xf = x
            if x_dt != "fp32":
                xf = self.act(name + ".xf", tokens_shape, "fp32")
                self.t.node("to_fp32", (x,), (xf,), diff_inputs=(x,))
            mean, rstd = self.act(name + ".mean", tok, STAT), self.act(name + ".rstd", tok, STAT)
            yf = self.act(name + ".out" if x_dt == "fp32" else name + ".outf", tokens_shape, "fp32")
            self.t.node("layernorm", (xf,), (yf, mean, rstd), diff_inputs=(xf,), save_i=(xf, mean, rstd))
            if x_dt == "fp32":
                return yf
            y = self.act(name + ".out", tokens_shape, x_dt)
            self.t.node("to_dtype", (yf,), (y,), diff_inputs=(yf,))
            return y
        w = self.t.param(self.n(name + ".weight"), (h,), self.dt)
        # Under autocast the fp32 weight promotes the output to fp32.
        y = self.act(name + ".out", tokens_shape, "fp32" if self.sh.autocast else x_dt)
        if self.conv.fused_norm or kind == "layernorm":
            rstd = self.act(name + ".rstd", tok, STAT)
            outs = (y, rstd)
            saves = (x, rstd, w)
            if kind == "layernorm":
                mean = self.act(name + ".mean", tok, STAT)
                outs = (y, mean, rstd)
                saves = (x, mean, rstd, w)
            self.t.node(kind, (x, w), outs, diff_inputs=(x,), save_i=saves)
            return y
        # Unfused RMSNorm as HF writes it: x.float(); var = x.pow(2).mean(); x * rsqrt(var + eps);
        # weight * x.to(input dtype). Each op saves what its backward needs; casts to the dtype a
        # tensor already has are no-ops.
        xf = x
        if x_dt != "fp32":
            xf = self.act(name + ".xf", tokens_shape, "fp32")
            self.t.node("to_fp32", (x,), (xf,), diff_inputs=(x,))
        var = self.act(name + ".var", tok + (1,), "fp32")
        # its backward, eager: mean's grad expanded and divided ([tokens, h] fp32), then pow's
        # `grad * (2 * x.pow(1))` -- x.pow(1), 2 * it -- before the product (the op's output):
        # three [tokens, h] fp32 temporaries beside it
        self.t.node(
            "pow_mean",
            (xf,),
            (var,),
            diff_inputs=(xf,),
            save_i=(xf,),
            workspace_i=3 * _numel(tokens_shape) * 4,
        )
        rs = self.act(name + ".rsqrt", tok + (1,), "fp32")
        self.t.node("rsqrt", (var,), (rs,), diff_inputs=(var,), save_i=(rs,))
        xn = self.act(name + ".xn", tokens_shape, "fp32")
        self.t.node("mul", (xf, rs), (xn,), diff_inputs=(xf, rs), save_i=(xf, rs))
        if self.norm_weight_first and not self.conv.fused_norm:
            # (weight * xn).to(input dtype): the fp32 product saves xn; then one cast
            y = self.act(name + ".out", tokens_shape, x_dt)
            yf = y if x_dt == "fp32" else self.act(name + ".scaled", tokens_shape, "fp32")
            self.t.node(
                "mul_weight", (xn, w), (yf,), diff_inputs=(xn,), params=(w,), save_i=(w,), save_w=(xn,)
            )
            if yf != y:
                self.t.node("to_dtype", (yf,), (y,), diff_inputs=(yf,))
            return y
        xc = xn
        if x_dt != "fp32":
            xc = self.act(name + ".xc", tokens_shape, x_dt)
            self.t.node("to_dtype", (xn,), (xc,), diff_inputs=(xn,))
        self.t.node("mul_weight", (xc, w), (y,), diff_inputs=(xc,), params=(w,), save_i=(w,), save_w=(xc,))
        return y

    def to_compute(self, x: str, name: str) -> str:
        """Autocast's input cast: a low-precision copy of an fp32 activation (a new tensor per
        consumer; autocast caches only casts of parameters)."""
        if not self.sh.autocast or self.dtype_of(x) == self.dt:
            return x
        if self.cse is not None and x in self.cse:
            return self.cse[x]
        xc = self.act(name + ".autocast_in", self.t.tensors[x].shape)
        self.t.node("autocast_cast", (x,), (xc,), diff_inputs=(x,))
        if self.cse is not None:
            self.cse[x] = xc
        return xc

    # Linears ------------------------------------------------------------------------------
    def linear(
        self, x: str, name: str, out_shape: tuple, in_features: int, bias: bool, experts: int = 0
    ) -> str:
        """y = x W^T (+ b), local shapes; saves x for the weight gradient. Under autocast the
        input and the fp32 weight are cast first, and the matmul saves both copies.
        `experts`: a grouped GEMM over that many local experts' weights (one weight each)."""
        w_shape = (out_shape[-1], in_features)
        w = self.t.param(
            self.n(name + ".weight"), ((experts,) if experts else ()) + w_shape, self.weight_dt(name)
        )
        params = (w,)
        if bias:
            params += (self.t.param(self.n(name + ".bias"), (out_shape[-1],), self.dt),)
        y = self.act(name + ".out", out_shape)
        if self.sh.autocast:
            x = self.to_compute(x, name)
            wc = self.act(name + ".weight_bf16", (out_shape[-1], in_features))
            self.t.node("autocast_weight", (w,), (wc,))
            x_fwd, x_saved, ws = self.fp8_operands(x, name, out_shape, in_features)
            self.t.node(
                "linear",
                (x_fwd, wc) + params[1:],
                (y,),
                diff_inputs=(x,),
                params=params,
                save_i=(wc,),
                save_w=(x_saved,),
                workspace_f=ws[0],
                workspace_i=ws[1],
            )
            return y
        x_fwd, x_saved, ws = self.fp8_operands(x, name, out_shape, in_features)
        if self.sh.feat.lora_rank:
            ws = self.nf4_base(w, name, out_shape[-1] * in_features, ws)
        self.t.node(
            "linear",
            (x_fwd,) + params,
            (y,),
            diff_inputs=(x,),
            params=params,
            save_w=(x_saved,),
            workspace_f=ws[0],
            workspace_i=ws[1],
        )
        if self.sh.feat.lora_on(name):
            return self.lora(x, name, y, out_shape, in_features)
        return y

    # LoRA / QLoRA (pipemem.lora) ---------------------------------------------------------------
    def nf4_base(self, w: str, name: str, elems: int, ws: tuple) -> tuple:
        """QLoRA: the base weight is stored NF4 (its parameter's bytes) and dequantized to the
        compute dtype for the forward GEMM and again for the input-grad GEMM (bitsandbytes'
        MatMul4Bit, torchtune's linear_nf4): one weight-sized transient in each."""
        from ..lora import TEMPLATE_LINEARS, dequant_bytes, nf4_bytes

        f = self.sh.feat
        if not f.qlora or name not in TEMPLATE_LINEARS or not (f.qlora_all or f.lora_on(name)):
            return ws
        old = self.t.tensors[w]
        self.t.tensors[w] = type(old)(w, old.shape, old.dtype, old.kind, bytes=nf4_bytes(elems))
        deq = dequant_bytes(elems, dtype_bytes(self.dt))
        return (ws[0] + deq, ws[1] + deq)

    def lora(self, x: str, name: str, y: str, out_shape: tuple, in_features: int) -> str:
        """y + scale * B(A(dropout(x))) beside a frozen linear (PEFT's LoraLayer.forward,
        torchtune's LoRALinear.forward). A saves its input: `x` itself unless the adapters'
        dtype (PEFT casts the input to it) or dropout makes a new tensor; B saves A's r-wide
        output; the scaling and the sum save nothing. Under autocast (HF Trainer --bf16 with
        fp32 adapters) A and B run in the compute dtype on casts of their input and weight."""
        f = self.sh.feat
        r = f.lora_rank
        adt = f.lora_dt or self.dt
        cdt = self.dt if f.lora_autocast else adt
        tok = out_shape[:-1]
        in_shape = tok + (in_features,)
        src, cast_in = x, None
        if self.dtype_of(x) != adt:
            src = cast_in = self.act(name + ".lora_in", in_shape, adt)
            self.t.node("to_dtype", (x,), (src,), diff_inputs=(x,))
        if f.lora_dropout:
            src = self.dropout(src, name + ".lora_dropout", in_shape)
        if self.dtype_of(src) != cdt:
            cast = self.act(name + ".lora_autocast_in", in_shape, cdt)
            self.t.node("autocast_cast", (src,), (cast,), diff_inputs=(src,))
            src = cast
        chain = (cdt, adt) if cdt != adt else (adt,)
        out = src
        for part, shape in (("lora_a", (r, in_features)), ("lora_b", (out_shape[-1], r))):
            wp = self.t.param(self.n(f"{name}.{part}.weight"), shape, adt)
            self.t.trainable.add(wp)
            wc, save_i = wp, ()
            if cdt != adt:
                wc = self.act(f"{name}.{part}.weight_cast", shape, cdt)
                self.t.node("autocast_weight", (wp,), (wc,))
                save_i = (wc,)
            nxt = self.act(f"{name}.{part}.out", tok + (shape[0],), cdt)
            self.t.node(
                "linear",
                (out, wc),
                (nxt,),
                diff_inputs=(out,),
                params=(wp,),
                save_i=save_i,
                save_w=(out,),
                wgrad_chain=chain,
            )
            out = nxt
        scaled = self.act(name + ".lora_scaled", out_shape, cdt)
        self.t.node("mul_scalar", (out,), (scaled,), diff_inputs=(out,))
        total = self.add(y, scaled, name + ".lora_sum", out_shape)
        if self.dtype_of(total) != self.dtype_of(y):  # PEFT: result.to(torch_result_dtype)
            back = self.act(name + ".lora_result", out_shape, self.dtype_of(y))
            self.t.node("to_dtype", (total,), (back,), diff_inputs=(total,))
            total = back
        # the module's input (its caller's argument) and PEFT's cast of it (the rebound local
        # `x`) are referenced until the forward returns
        self.t.held_until.setdefault(len(self.t.nodes) - 1, []).extend(
            t for t in (x, cast_in) if t is not None
        )
        return total

    # FP8 linears ---------------------------------------------------------------------------
    def weight_dt(self, name: str) -> str:
        """dtype a linear's weight has where it is used: torchao's fp8 FSDP all-gather
        (enable_fsdp_float8_all_gather) gathers the fp8 cast of each shard, so the gathered
        buffer holds 1 byte per weight."""
        f = self.sh.feat
        if f.torchao_fp8 and f.fp8_param_gather and self.sh.fsdp and self.fp8_linear(name):
            return "fp8"
        return self.dt

    def fp8_linear(self, name: str) -> bool:
        """Is this linear run in fp8? Neither Megatron (the output layer is not a TE module,
        the router is a plain linear) nor torchtitan (its float8 converter filters the output
        projection) runs the head or the router in fp8."""
        f = self.sh.feat
        return (
            bool(f.fp8)
            and self.p not in ("head.", "emb.")
            and not name.startswith(("head.", "moe.router", "moe.shared_gate"))
        )

    def fp8_operands(
        self, x: str, name: str, out_shape: tuple, in_features: int, rowwise_only: bool = False
    ) -> tuple[str, str, tuple]:
        """(forward operand, tensor saved for the weight grad, (forward, backward) workspace).

        Transformer Engine (te_fp8; transformer_engine/pytorch/module/linear.py): the input is
        quantized with both usages -- rowwise for this GEMM, columnwise (the transpose) for the
        weight-grad GEMM -- and after the forward only the columnwise copy is kept (1 B per
        element, + 1 B per 32 for MXFP8's block scales); the backward quantizes the output
        grad with both usages. torchao Float8 (float8_linear.py `matmul_with_hp_or_float8_args`)
        saves the high-precision input and weight and casts them again in backward: its fp8
        copies (input and weight, then output grad twice, weight and input) are transient."""
        if not self.fp8_linear(name):
            return x, x, (0, 0)
        f = self.sh.feat
        t = self.t.tensors[x]
        n_in, n_w = _numel(t.shape), out_shape[-1] * in_features
        n_out = n_in // max(1, t.shape[-1]) * out_shape[-1]
        if f.te_fp8:
            scale = 1 + 1 / 32 if f.fp8 == "mxfp8" else 1
            row = self.t.t(self.n(name + ".input_fp8_rowwise"), t.shape, "fp8")
            if rowwise_only:
                # sequence parallel, per-tensor recipes (layernorm_linear.py / linear.py: the
                # shard is quantized rowwise only, and that is what is gathered and saved)
                self.t.node("te_quantize", (x,), (row,))
                return row, row, (0, int(2 * n_out))
            col = self.t.t(self.n(name + ".input_fp8_columnwise"), t.shape, "fp8")
            if scale != 1:
                for nm in (row, col):
                    old = self.t.tensors[nm]
                    self.t.tensors[nm] = type(old)(nm, old.shape, "fp8", old.kind, bytes=int(n_in * scale))
            self.t.node("te_quantize", (x,), (row, col))
            return row, col, (0, int(2 * n_out * scale))
        # torchao's eager cast (float8_training_tensor.py `_ToFloat8ConstrFunc`): abs + max for
        # the scale, then `x.to(fp32) * scale` and its clamp are both alive while the fp8 copy
        # is made: 9 bytes per element at the cast, 1 kept until the GEMM (or the backward's
        # end: the fp8 operands are locals of `matmul_with_hp_or_float8_args.backward`)
        # Compiled (torchtitan always compiles Float8), inductor fuses each cast into one kernel
        # writing the fp8 copy: only the fp8 operands themselves are transient
        c = 1 if f.compile else CAST_BYTES
        # the casts run before the GEMM allocates its output (the op's workspace is counted
        # alongside its outputs): the input's cast, the weight's next to the fp8 input, then
        # both fp8 operands under the GEMM
        out_b = n_out * dtype_bytes(t.dtype)
        ws_f = max(c * n_in - out_b, n_in + c * n_w - out_b, n_in + n_w, 0)
        ws_i = max(c * n_out, n_out + c * n_w, n_out + n_w + c * n_out, 2 * n_out + n_w + c * n_in)
        return x, x, (ws_f, ws_i)

    def column_linears(
        self,
        x: str,
        block: str,
        specs: list[tuple[str, int, bool]],
        gathered_by_linear: bool = False,
        in_features: int | None = None,
    ) -> list[str]:
        """Column-parallel linears reading the same input `x` ([s_sp, b, in_features], the
        hidden size unless given); specs are (name, local out features, bias). Handles the
        sequence-parallel all-gather. `gathered_by_linear`: the linear gathers its own input
        (DTensor: `input_layouts=Shard`, as the LM head) rather than a `PrepareModuleInput`
        before the block."""
        sh, conv = self.sh, self.conv
        hin = in_features or sh.h
        full = (sh.s, sh.b, hin)
        if not sh.sp:
            return [self.linear(x, nm, (sh.s, sh.b, f), hin, bias) for nm, f, bias in specs]
        if conv.sp_save == "gathered":
            # DTensor: one all-gather feeds every projection, which save the gathered tensor;
            # its backward is a reduce-scatter of the accumulated grad into the shard's grad.
            xg = self.act(block + ".allgather", full, kind=COMM)
            self.t.node("all_gather", (x,), (xg,), diff_inputs=(x,))
            return [self.linear(xg, nm, (sh.s, sh.b, f), hin, bias) for nm, f, bias in specs]
        if conv.sp_save == "shard_regather":
            assert hin == sh.h, "DTensor's regathered linears read the hidden size"
            return self._regather_linears(x, block, specs, gathered_by_linear)
        outs = []
        for nm, f, bias in specs:
            w = self.t.param(self.n(nm + ".weight"), (f, hin), self.weight_dt(nm))
            params = (w,)
            if bias:
                params += (self.t.param(self.n(nm + ".bias"), (f,), self.dt),)
            y = self.act(nm + ".out", (sh.s, sh.b, f))
            dfull = self.act(nm + ".dinput_full", full)
            rs = BwdOp("reduce_scatter", (dfull,), ("d." + x,))
            if conv.sp_save == "shard":
                # Megatron / Paddle recompute_allgather: keep the shard, gather again for dW.
                # TE fp8 (layernorm_linear.py): the shard is quantized and the fp8 data gathered;
                # MXFP8 quantizes both usages and gathers (and keeps) the columnwise data;
                # per-tensor FP8 quantizes the shard rowwise only, keeps that, gathers it again
                # in backward and makes the gathered tensor's transpose for the weight grad (a
                # transient of 1 B per gathered element)
                src, ws, gdt, keep = x, (0, 0), None, ()
                if self.fp8_linear(nm) and self.sh.feat.te_fp8:
                    mx = self.sh.feat.fp8 == "mxfp8"
                    row, col, ws = self.fp8_operands(x, nm, (sh.s_sp, sh.b, f), hin, rowwise_only=not mx)
                    gdt = "fp8"
                    src = col if mx else row
                    if not mx:
                        ws = (ws[0], ws[1] + _numel(full) // sh.tp)
                xg = self.act(nm + ".allgather", full, gdt, kind=COMM)
                xg2 = self.act(nm + ".allgather_bwd", full, gdt, kind=COMM)
                fwd_in = row if gdt else x
                self.t.node(
                    "linear_sp",
                    (fwd_in,) + params,
                    (y,),
                    diff_inputs=(x,),
                    params=params,
                    fwd_ops=(_op("all_gather", (fwd_in,), (xg,)), _op("matmul", (xg,) + params, (y,))),
                    grad_via={x: dfull},
                    post_i=(rs,),
                    save_w=(xg2,) + keep,
                    pre_w=(BwdOp("all_gather", (src,), (xg2,)),),
                    w_pre_first=True,
                    workspace_i=ws[1] * sh.tp,
                )
            else:
                # Paddle's SPInnerOverlapLinear: saves x and the gathered input.
                xg = self.act(nm + ".allgather", full, kind=COMM)
                self.t.node(
                    "linear_sp",
                    (x,) + params,
                    (y,),
                    diff_inputs=(x,),
                    params=params,
                    fwd_ops=(_op("all_gather", (x,), (xg,)), _op("matmul", (xg,) + params, (y,))),
                    grad_via={x: dfull},
                    post_i=(rs,),
                    save_i=(x,),
                    save_w=(xg,),
                )
            outs.append(y)
        return outs

    def _regather_linears(
        self, x: str, block: str, specs: list[tuple[str, int, bool]], gathered_by_linear: bool
    ) -> list[str]:
        """DTensor with `pipemem.torch_tp.RegatherColwiseParallel`: one all-gather feeds every
        projection as before, but they save this rank's shard of it -- the input itself when
        the linear gathered it, else a copy of its chunk of the gathered tensor (the sharded
        norm output is freed as usual) -- and the first of their backward nodes all-gathers
        it again into one tensor that every projection's weight grad reads, freed with the
        last of them (the first in forward order)."""
        sh = self.sh
        full = (sh.s, sh.b, sh.h)
        xg = self.act(block + ".allgather", full, kind=COMM)
        self.t.node("all_gather", (x,), (xg,), diff_inputs=(x,))
        kept = x
        if not gathered_by_linear:
            kept = self.act(block + ".shard_copy", (sh.s_sp, sh.b, sh.h), self.dtype_of(x))
            self.t.node("copy_shard", (xg,), (kept,))
        xg2 = self.act(block + ".allgather_bwd", full, kind=COMM)
        outs = []
        for i, (nm, f, bias) in enumerate(specs):
            w = self.t.param(self.n(nm + ".weight"), (f, sh.h), self.weight_dt(nm))
            params = (w,)
            if bias:
                params += (self.t.param(self.n(nm + ".bias"), (f,), self.dt),)
            y = self.act(nm + ".out", (sh.s, sh.b, f))
            last = i == len(specs) - 1  # its backward runs first: it gathers
            self.t.node(
                "linear",
                (xg,) + params,
                (y,),
                diff_inputs=(xg,),
                params=params,
                save_w=(kept,) if i == 0 else (),
                read_w=(xg2,),
                pre_w=(BwdOp("all_gather", (kept,), (xg2,)),) if last else (),
                w_pre_first=last,
            )
            outs.append(y)
        return outs

    def row_linear(self, x: str, name: str, in_features: int, bias: bool) -> str:
        """Row-parallel linear to [s_sp, b, h]: all-reduce (no SP) or reduce-scatter (SP)."""
        sh = self.sh
        if sh.tp == 1 or self.sh.autocast:
            # one rank: an ordinary linear with its bias inside the GEMM (addmm)
            return self.linear(x, name, (sh.s_sp, sh.b, sh.h), in_features, bias)
        w = self.t.param(self.n(name + ".weight"), (sh.h, in_features), self.weight_dt(name))
        partial = self.act(name + ".partial", (sh.s, sh.b, sh.h))
        x_fwd, x_saved, ws = self.fp8_operands(x, name, (sh.s, sh.b, sh.h), in_features)
        self.t.node(
            "linear",
            (x_fwd, w),
            (partial,),
            diff_inputs=(x,),
            params=(w,),
            save_w=(x_saved,),
            workspace_f=ws[0],
            workspace_i=ws[1],
        )
        y = partial
        if sh.tp > 1:
            if sh.sp:
                y = self.act(name + ".out", (sh.s_sp, sh.b, sh.h), kind=COMM)
                # backward of the reduce-scatter: all-gather of the output grad
                self.t.node("reduce_scatter", (partial,), (y,), diff_inputs=(partial,))
            else:
                y = self.act(name + ".out", (sh.s, sh.b, sh.h), storage=partial)
                self.t.node("all_reduce", (partial,), (y,), diff_inputs=(partial,), grad_alias=True)
        if bias:
            b = self.t.param(self.n(name + ".bias"), (sh.h,), self.dt)
            yb = self.act(name + ".biased", (sh.s_sp, sh.b, sh.h))
            # bias added after the reduction (Megatron's bias-dropout-add): its grad is a token
            # sum done with the input grads, never deferred to the weight-grad pass
            self.t.node("add_bias", (y, b), (yb,), diff_inputs=(y,), grad_alias=True)
            y = yb
        return y

    def dropout(self, x: str, name: str, shape: tuple) -> str:
        mask = self.act(name + ".mask", shape, MASK)
        y = self.act(name + ".out", shape, self.dtype_of(x))
        self.t.node("dropout", (x,), (y, mask), diff_inputs=(x,), save_i=(mask,))
        return y

    def add(self, a: str, b: str, name: str, shape: tuple) -> str:
        # type promotion: an fp32 operand (autocast's residual stream) makes an fp32 sum
        dt = "fp32" if "fp32" in (self.dtype_of(a), self.dtype_of(b)) else self.dt
        y = self.act(name, shape, dt)
        # the grad of an operand of another dtype is cast (a new tensor); the others alias it
        alias = tuple(x for x in (a, b) if self.dtype_of(x) == dt)
        self.t.node("add", (a, b), (y,), diff_inputs=(a, b), grad_alias=alias)
        return y

    def embed_lookup(self, ids: str, w: str) -> str:
        """The vocab-parallel word embedding of `ids` ([b, s] int64) with weight `w`, reduced
        over tp (scattered over the sequence under SP) -> [s_sp, b, h]."""
        sh, tape = self.sh, self.t
        full = (sh.s, sh.b, sh.h)
        tok = (sh.s_sp, sh.b, sh.h)
        partial = self.act("lookup", full, sh.res_dt)
        if sh.tp > 1 and self.conv.framework.vocab_parallel_embedding_mask:
            # VocabParallelEmbedding: ids outside the shard are masked (a bool mask) and shifted (an
            # int64 copy, what the lookup saves); the output rows of masked ids are zeroed (the
            # mask is kept for that index_put's backward)
            mask = self.act("input_mask", (sh.b, sh.s), "bool")
            masked = self.act("masked_ids", (sh.b, sh.s), "int64")
            tape.node("mask_ids", (ids,), (mask, masked))
            tape.node(
                "embedding",
                (masked, w, mask),
                (partial,),
                diff_inputs=(),
                params=(w,),
                save_w=(ids, masked, mask),
            )
        else:
            tape.node("embedding", (ids, w), (partial,), diff_inputs=(), params=(w,), save_w=(ids,))
        y = partial
        if sh.tp > 1:
            if sh.sp:
                y = self.act("reduce_scatter", tok, sh.res_dt, kind=COMM)
                tape.node("reduce_scatter", (partial,), (y,), diff_inputs=(partial,))
            else:
                y = self.act("all_reduce", full, sh.res_dt, storage=partial)
                tape.node("all_reduce", (partial,), (y,), diff_inputs=(partial,), grad_alias=True)
        return y

    # Attention ----------------------------------------------------------------------------
    def attention(self, x: str, opt: LayerOptions) -> str:
        sh, conv = self.sh, self.conv
        a, kv, d = sh.heads, sh.kv, sh.d
        s, b = sh.s, sh.b
        region = opt.recompute == "full_attn"
        if region:
            self.t.begin_region()
        if conv.fused_qkv or (conv.framework.model_fused_qkv and opt.native_fused_qkv):
            (qkv,) = self.column_linears(x, "attn", [("attn.qkv", (a + 2 * kv) * d, opt.qkv_bias)])
            q = self.act("attn.q", (s, b, a, d), storage=qkv)
            k = self.act("attn.k", (s, b, kv, d), storage=qkv)
            v = self.act("attn.v", (s, b, kv, d), storage=qkv)
            self.t.node("split_qkv", (qkv,), (q, k, v), diff_inputs=(qkv,))
        else:
            if conv.framework.qkv_one_matmul:  # torchtitan 0.3 computes them as one wqkv matmul
                self.t.share_pin(3)
            q2, k2, v2 = self.column_linears(
                x,
                "attn",
                [
                    ("attn.q_proj", a * d, opt.qkv_bias),
                    ("attn.k_proj", kv * d, opt.qkv_bias),
                    ("attn.v_proj", kv * d, opt.qkv_bias),
                ],
            )
            if opt.qk_norm and opt.qk_norm_proj:
                q2 = self.norm(q2, "attn.q_norm", "rmsnorm", (s, b, a * d))
                k2 = self.norm(k2, "attn.k_norm", "rmsnorm", (s, b, kv * d))
            q = self.act("attn.q", (s, b, a, d), storage=q2)
            k = self.act("attn.k", (s, b, kv, d), storage=k2)
            v = self.act("attn.v", (s, b, kv, d), storage=v2)
            for src, dst in ((q2, q), (k2, k), (v2, v)):
                self.t.node("view", (src,), (dst,), diff_inputs=(src,), grad_alias=True)
        if opt.qk_norm and not opt.qk_norm_proj:
            q = self.norm(q, "attn.q_norm", "rmsnorm", (s, b, a, d))
            k = self.norm(k, "attn.k_norm", "rmsnorm", (s, b, kv, d))
        if opt.nope and opt.attn_temperature:
            from .llama4 import temperature_scaled_query

            q = temperature_scaled_query(self, q)
        if self._uses_rope and not opt.nope:
            # HF casts cos/sin to the hidden states' dtype: fp32 under autocast, so q, k become fp32
            rope_dt = "fp32" if self.sh.autocast else None
            qr = self.act("attn.q_rope", (s, b, a, d), rope_dt)
            kr = self.act("attn.k_rope", (s, b, kv, d), rope_dt)
            if self.conv.fused_rope:
                self.t.node("rope", (q,), (qr,), diff_inputs=(q,))
                self.t.node("rope", (k,), (kr,), diff_inputs=(k,))
            else:
                self.rotate_half_rope(q, qr, "attn.q", (s, b, a, d))
                self.rotate_half_rope(k, kr, "attn.k", (s, b, kv, d))
            q, k = qr, kr
        if opt.qk_l2:
            from .llama4 import l2_norm

            q = l2_norm(self, q, "attn.q_norm")
            k = l2_norm(self, k, "attn.k_norm")
        core = opt.recompute in ("selective", "core_attn") and not self.sac
        if core:
            self.t.begin_region()
        ctx = self.core_attention(q, k, v, opt)
        if core:
            self.t.end_region()
        if opt.flash and opt.rope_cat and self.conv.framework.transformers_modules:
            ctx = self._attn_out_copy(ctx)
        out = self.row_linear(ctx, "attn.o_proj", a * d, opt.out_bias)
        if region:
            self.t.end_region()
        self.held_by_caller(x)
        return out

    def _attn_out_copy(self, ctx: str) -> str:
        """GLM-4 MoE's rope concatenates the rotated and passed parts of q ([b, heads, s, d]
        contiguous), so the SDPA kernel's output comes back in that layout (its output is
        `empty_like` the query) and `transpose(1, 2).contiguous()` copies it: o_proj saves the
        copy, the kernel its output."""
        sh = self.sh
        out = self.act("attn.ctx_contiguous", (sh.s, sh.b, sh.heads, sh.d))
        self.t.node("contiguous", (ctx,), (out,), diff_inputs=(ctx,))
        return out

    def held_by_caller(self, x: str) -> None:
        """`y = block(x)` in eager code: the caller's reference keeps the block's input alive
        until the block returns (after its last node), whatever the block's last use of it."""
        if self.conv.caller_holds_input and self.t.nodes:
            self.t.held_until.setdefault(len(self.t.nodes) - 1, []).append(x)

    _uses_rope = True

    def rotate_half_rope(self, x: str, y: str, name: str, shape: tuple) -> None:
        """PaddleNLP's unfused rope, x*cos + rotate_half(x)*sin: the two half slices, the
        negated half and their concat are new tensors; the products' backward reads x and the
        concat, the concat's backward only the halves' shapes (no_need_buffer): recomputed,
        they die after the concat; kept from a forward job, the pipeline's skip_gc rule keeps
        them and the backward never frees them (as Paddle 3.3.1's executor does)."""
        half = shape[:-1] + (shape[-1] // 2,)
        h1 = self.act(name + ".rope_x1", half)
        h2 = self.act(name + ".rope_x2_neg", half)
        rot = self.act(name + ".rope_rotated", shape)
        self.t.node(
            "rope_rotate_half",
            (x,),
            (y,),
            diff_inputs=(x,),
            save_i=(x, rot),
            meta_i=(h1, h2),
            fwd_ops=(
                _op("slice", (x,), (h1,)),
                _op("scale", (x,), (h2,)),
                _op("concat", (h1, h2), (rot,)),
                _op("rope_mul_add", (x, rot), (y,)),
            ),
        )

    def _repeat_kv(self, k: str, v: str, shape: tuple) -> tuple[str, str]:
        ke, ve = self.act("attn.k_expand", shape), self.act("attn.v_expand", shape)
        self.t.node("repeat_kv", (k,), (ke,), diff_inputs=(k,))
        self.t.node("repeat_kv", (v,), (ve,), diff_inputs=(v,))
        return ke, ve

    def flash_attention(
        self, q: str, k: str, v: str, ctx: str, kv_heads: int, head_dim: int, ws_f: int = 0, ws_i: int = 0
    ) -> None:
        """The flash-attention kernel: q, k, v [s, b, heads / kv_heads, head_dim] -> `ctx` and the
        fp32 log-sum-exp [b, heads, s], all five saved for backward. Its backward's workspace: the
        fp32 dq accumulator and softmax_d, with GQA full-head dk, dv before the group sum (assumed
        from flash-attention's source, traced/kernel_workspace.py, not traced) plus `ws_i`; `ws_f`
        the forward's."""
        sh = self.sh
        s, b, a = sh.s, sh.b, sh.heads
        lse = self.act("attn.lse", (b, a, s), STAT)
        ws_i += flash_attention_backward_workspace_bytes(s, b, a, kv_heads, head_dim, dtype_bytes(self.dt))
        self.t.node(
            "flash_attn",
            (q, k, v),
            (ctx, lse),
            diff_inputs=(q, k, v),
            save_i=(q, k, v, ctx, lse),
            workspace_f=ws_f,
            workspace_i=ws_i,
        )

    def core_attention(self, q: str, k: str, v: str, opt: LayerOptions) -> str:
        if opt.attn_sinks:  # GPT-OSS: HF's eager attention with a sink logit per head
            from .gpt_oss import sink_attention

            return sink_attention(self, q, k, v, opt)
        sh = self.sh
        a, kv, d, s, b = sh.heads, sh.kv, sh.d, sh.s, sh.b
        eb = dtype_bytes(self.dt)
        ctx = self.act("attn.ctx", (s, b, a, d))
        q, k, v = (self.to_compute(q, "attn.q"), self.to_compute(k, "attn.k"), self.to_compute(v, "attn.v"))
        ring = sh.cp > 1 and self.conv.framework.cp_attention == "ring"
        if sh.cp > 1 and not ring:
            # torchtitan 0.3's context parallel for its (flex) attention: K and V all-gathered
            # over the cp ranks, the whole-sequence copies saved; their grads reduce-scattered
            s_all = s * sh.cp
            kg, vg = (
                self.act("attn.k_cp_gathered", (s_all, b, kv, d)),
                self.act("attn.v_cp_gathered", (s_all, b, kv, d)),
            )
            self.t.node("cp_all_gather", (k,), (kg,), diff_inputs=(k,))
            self.t.node("cp_all_gather", (v,), (vg,), diff_inputs=(v,))
            k, v = kg, vg
        if opt.flash and kv < a and self.conv.gqa_expand_always:
            # torchtune: k/v expanded to every head (copies) before SDPA / flex attention; the
            # kernel saves the expanded copies and its backward writes full-head dk, dv into them
            k, v = self._repeat_kv(k, v, (s, b, a, d))
            kv = a
        if opt.flash:
            kv_bytes = 2 * s * b * kv * d * eb
            # ring: the KV chunk in flight, double-buffered; in backward the KV and dKV chunks
            self.flash_attention(
                q, k, v, ctx, kv, d, 2 * kv_bytes if ring else 0, 4 * kv_bytes if ring else 0
            )
            return ctx
        if kv < a and self.conv.gqa_expand_eager:
            k, v = self._repeat_kv(k, v, (s, b, a, d))
        scores = self.act("attn.scores", (b, a, s, s))
        self.t.node("bmm_qk", (q, k), (scores,), diff_inputs=(q, k), save_i=(q, k))
        softmax = self.conv.framework.eager_softmax
        if softmax == "fp32_softmax_cast":
            # HF eager: (q k^T) * scale + mask, softmax(dtype=fp32) (saves its fp32 output), .to(dtype)
            scaled = self.act("attn.scaled", (b, a, s, s))
            self.t.node("mul_scale", (scores,), (scaled,), diff_inputs=(scores,))
            masked = self.act("attn.masked", (b, a, s, s))
            self.t.node("add_mask", (scaled,), (masked,), diff_inputs=(scaled,), grad_alias=True)
            p32 = self.act("attn.probs_fp32", (b, a, s, s), "fp32")
            self.t.node("softmax", (masked,), (p32,), diff_inputs=(masked,), save_i=(p32,))
            probs = self.act("attn.probs", (b, a, s, s))
            self.t.node("to_dtype", (p32,), (probs,), diff_inputs=(p32,))
        elif softmax == "inplace_mask_softmax":
            # PaddleNLP (non-flash): scores + mask, softmax in fp32. Paddle's in-place pass runs
            # the add and the softmax in the scores' buffer when they die there; under AMP the
            # fp32 softmax output (kept by softmax_grad) is cast to a low-precision copy (kept
            # by the PV matmul).
            # A layer kept for backward hands its QK^T output to the backward program (add_grad
            # names it), so the mask add cannot reuse its buffer; a recomputed layer's can.
            masked = scores
            if opt.recompute == "none":
                masked = self.act("attn.masked", (b, a, s, s))
                self.t.node("mask_add", (scores,), (masked,), diff_inputs=(scores,), grad_alias=True)
            if self.dt == "fp32":
                probs = self.act("attn.probs", (b, a, s, s), storage=masked)
                self.t.node("mask_add_softmax_", (masked,), (probs,), diff_inputs=(masked,), save_i=(probs,))
            else:
                p32 = self.act("attn.probs_fp32", (b, a, s, s), "fp32")
                self.t.node("mask_add_softmax_fp32", (masked,), (p32,), diff_inputs=(masked,), save_i=(p32,))
                probs = self.act("attn.probs", (b, a, s, s))
                self.t.node("cast", (p32,), (probs,), diff_inputs=(p32,))
        else:
            probs = self.act("attn.probs", (b, a, s, s))
            self.t.node("scale_mask_softmax", (scores,), (probs,), diff_inputs=(scores,), save_i=(probs,))
        if opt.attn_dropout:
            probs = self.dropout(probs, "attn.dropout", (b, a, s, s))
        self.t.node("bmm_pv", (probs, v), (ctx,), diff_inputs=(probs, v), save_i=(probs, v))
        return ctx

    # MLP ----------------------------------------------------------------------------------
    def mlp(self, x: str, opt: LayerOptions, name: str = "mlp", width: int | None = None) -> str:
        sh, conv = self.sh, self.conv
        f = sh.ffn if width is None else width
        s, b = sh.s, sh.b
        if opt.activation in ("swiglu", "geglu"):
            if conv.fused_gate_up:
                (fc1,) = self.column_linears(x, name, [(name + ".fc1", 2 * f, opt.mlp_bias)])
                act = self.act(name + ".act", (s, b, f))
                self.t.node("bias_swiglu", (fc1,), (act,), diff_inputs=(fc1,), save_i=(fc1,))
            elif not sh.sp:
                # `down(act(gate(x)) * up(x))` (HF, torchtitan): the activation runs before the
                # up projection, and autograd's backward visits up before the activation
                (gate,) = self.column_linears(x, name, [(name + ".gate_proj", f, opt.mlp_bias)])
                g = self.act(name + ".silu", (s, b, f))
                self.t.node("silu", (gate,), (g,), diff_inputs=(gate,), save_i=(gate,))
                (up,) = self.column_linears(x, name, [(name + ".up_proj", f, opt.mlp_bias)])
                act = self.act(name + ".act", (s, b, f))
                self.t.node("mul", (g, up), (act,), diff_inputs=(g, up), save_i=(g, up))
            else:
                # sequence parallel: one all-gather (or shard) feeds both projections
                gate, up = self.column_linears(
                    x, name, [(name + ".gate_proj", f, opt.mlp_bias), (name + ".up_proj", f, opt.mlp_bias)]
                )
                g = self.act(name + ".silu", (s, b, f))
                self.t.node("silu", (gate,), (g,), diff_inputs=(gate,), save_i=(gate,))
                act = self.act(name + ".act", (s, b, f))
                self.t.node("mul", (g, up), (act,), diff_inputs=(g, up), save_i=(g, up))
        else:
            (fc1,) = self.column_linears(x, name, [(name + ".fc1", f, opt.mlp_bias)])
            if conv.framework.gelu_new_op_by_op and opt.act_fn == "gelu_new":
                act = self.gelu_new(fc1, name, (s, b, f))
            else:
                act = self.act(name + ".act", (s, b, f))
                # ReLU's backward reads its output (threshold_backward(grad, result, 0); Paddle's
                # relu_grad reads Out), which fc2 saves anyway: fc1's output dies in the forward
                self.t.node(
                    opt.activation,
                    (fc1,),
                    (act,),
                    diff_inputs=(fc1,),
                    save_i=(act,) if opt.activation == "relu" else (fc1,),
                )
        out = self.row_linear(act, name + ".fc2", f, opt.mlp_bias)
        self.held_by_caller(x)
        return out

    def gelu_new(self, u: str, name: str, shape: tuple) -> str:
        """HF's NewGELUActivation, op by op: 0.5*u*(1+tanh(c*(u+0.044715*u^3))).

        Under CUDA autocast `pow` is on the fp32 op list (torch/csrc/autograd/autocast_mode /
        the autocast docs' "CUDA Ops that can autocast to float32"): u is cast to an fp32 copy
        that pow saves, and type promotion carries fp32 through the rest of the chain, so the
        tanh output, 1+tanh and the result are fp32; only 0.5*u stays in u's dtype."""
        wide = "fp32" if self.sh.autocast else None

        def new(tag, dtype=wide):
            return self.act(f"{name}.gelu.{tag}", shape, dtype)

        # Python evaluates `0.5 * input` first: it lives through the whole chain, and autograd
        # reaches its backward last (the lowest sequence number)
        hx, g = new("half_x", None), new("out")
        self.t.node("mul_scalar", (u,), (hx,), diff_inputs=(u,))
        base = u
        if self.sh.autocast:
            base = new("pow_in_fp32")
            self.t.node("autocast_cast", (u,), (base,), diff_inputs=(u,))
        p3, p2, a1, a2, th, t1 = (new(t) for t in ("pow", "scaled", "sum", "arg", "tanh", "one_plus"))
        self.t.node("pow", (base,), (p3,), diff_inputs=(base,), save_i=(base,))
        self.t.node("mul_scalar", (p3,), (p2,), diff_inputs=(p3,))
        self.t.node("add", (u, p2), (a1,), diff_inputs=(u, p2), grad_alias=True, promote_grads=True)
        self.t.node("mul_scalar", (a1,), (a2,), diff_inputs=(a1,))
        self.t.node("tanh", (a2,), (th,), diff_inputs=(a2,), save_i=(th,))
        self.t.node("add_scalar", (th,), (t1,), diff_inputs=(th,), grad_alias=True)
        self.t.node("mul", (hx, t1), (g,), diff_inputs=(hx, t1), save_i=(hx, t1), promote_grads=True)
        return g

    def moe_hf(self, x: str, opt: LayerOptions) -> str:
        """HF transformers' sparse MoE block (its TopKRouter + grouped_mm experts, + Qwen2-MoE's
        gated shared expert), op by op: the shared expert's MLP first, then the router softmax
        in fp32, top-k (renormalised in place when the model does: autograd clones the top-k
        values; cast back to the logits' dtype by the Qwen routers), tokens sorted by expert and
        gathered, grouped GEMMs, the routing weights applied in their dtype, the original order
        restored and the top-k copies summed, cast back; then sigmoid(gate(x)) x shared + experts.
        The newer families' routers (GLM-4 MoE, GPT-OSS) and Llama 4's dense experts are in
        templates/moe.py, gpt_oss.py and llama4.py."""
        sh = self.sh
        shared = (
            self.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
            if sh.shared_ffn and opt.shared_first
            else None
        )
        if opt.expert_compute == "dense":  # Llama 4: every token through every expert
            from .llama4 import dense_experts, sigmoid_scatter_router

            return dense_experts(self, x, sigmoid_scatter_router(self, x, opt), opt)
        if opt.router == "sigmoid_group":
            from .moe import sigmoid_group_router

            topn, topi, wdt = sigmoid_group_router(self, x, opt)
        elif opt.router == "topk_softmax":
            from .gpt_oss import topk_softmax_router

            topn, topi, wdt = topk_softmax_router(self, x, opt)
        else:
            topn, topi, wdt = self._softmax_router(x, opt)
        return self._moe_hf_experts(x, opt, topn, topi, wdt, shared)

    def _softmax_router(self, x: str, opt: LayerOptions) -> tuple[str, str, str]:
        sh = self.sh
        T, E, K, h = sh.s_sp * sh.b, sh.experts * sh.ep, sh.top_k, sh.h
        logits = self.linear(x, "moe.router", (T, E), h, False)
        lf = self.act("moe.logits_fp32", (T, E), "fp32")
        self.t.node("to_fp32", (logits,), (lf,), diff_inputs=(logits,))
        probs = self.act("moe.probs", (T, E), "fp32")
        self.t.node("softmax", (lf,), (probs,), diff_inputs=(lf,), save_i=(probs,))
        from .moe import router_topk

        topv, topi = router_topk(self, probs, "fp32")
        topn = topv
        if opt.router_norm_topk:
            ssum = self.act("moe.topk_sum", (T, 1), "fp32")
            self.t.node("sum", (topv,), (ssum,), diff_inputs=(topv,))
            orig = self.act("moe.topk_values_orig", (T, K), "fp32")
            topn = self.act("moe.topk_weights", (T, K), "fp32", storage=topv)
            self.t.node(
                "div_",
                (topv, ssum),
                (orig, topn),
                diff_inputs=(topv, ssum),
                save_i=(orig, ssum),
                fwd_ops=(_op("clone", (topv,), (orig,)), _op("div_", (topv, ssum), (topn,))),
            )
        wdt = "fp32"
        if opt.router_weights_cast and self.dtype_of(logits) != "fp32":
            wdt = self.dtype_of(logits)
            topc = self.act("moe.topk_weights_cast", (T, K), wdt)
            self.t.node("to_dtype", (topn,), (topc,), diff_inputs=(topn,))
            topn = topc
        return topn, topi, wdt

    def _moe_hf_experts(self, x: str, opt: LayerOptions, topn: str, topi: str, wdt: str, shared) -> str:
        sh = self.sh
        T, K, h = sh.s_sp * sh.b, sh.top_k, sh.h
        S = T * K
        f = sh.expert_ffn
        E = sh.experts * sh.ep
        ids_g = self.act("moe.expert_ids_sorted", (S,), "int64")
        perm = self.act("moe.perm", (S,), "int64")
        self.t.node("sort", (topi,), (ids_g, perm))
        tok_idx = self.act("moe.token_idx", (S,), "int64")
        self.t.node("floor_divide", (perm,), (tok_idx,))
        xdt = self.dtype_of(x)
        hs_g = self.act("moe.permuted", (S, h), xdt)
        self.t.node(
            "index",
            (x, tok_idx),
            (hs_g,),
            diff_inputs=(x,),
            save_i=(tok_idx,),
            workspace_i=T * h * dtype_bytes(xdt),
        )  # new_zeros before index_put
        sw_g = self.act("moe.sample_weights", (S,), wdt)
        self.t.node("index", (topn, perm), (sw_g,), diff_inputs=(topn,), save_i=(perm,))
        offs = self.act("moe.offsets", (E,), "int32")
        self.t.node("histc_cumsum", (ids_g,), (offs,))
        gated = opt.activation in ("swiglu", "geglu")
        with self.hf_experts_dtype():
            hs_g = self.to_dtype(hs_g, "moe.permuted")
            out = self._hf_expert_mlps(hs_g, ids_g, offs, opt, S, f, h, gated)
        return self._hf_experts_combine(x, opt, out, sw_g, perm, wdt, shared)

    def hf_experts_dtype(self):
        """transformers' grouped_mm experts run in their weights' dtype: `_grouped_mm` casts the
        tokens with `input.to(weight.dtype)` and grouped GEMMs are on no autocast list (PyTorch
        registers no AutocastCPU / AutocastCUDA kernel for aten::_grouped_mm). Under autocast
        (fp32 parameters) the experts' GEMMs, activations and biases are fp32: the tensors
        declared inside this context take that dtype."""
        return self._dtype_swapped("fp32" if self.sh.autocast else self.dt)

    @contextlib.contextmanager
    def _dtype_swapped(self, dt: str):
        saved, self.dt = self.dt, dt
        try:
            yield
        finally:
            self.dt = saved

    def to_dtype(self, x: str, name: str) -> str:
        """`x.to(self.dt)`: x itself when it has that dtype, else a cast copy."""
        if self.dtype_of(x) == self.dt:
            return x
        y = self.act(name + ".cast", self.t.tensors[x].shape)
        self.t.node("to_dtype", (x,), (y,), diff_inputs=(x,))
        return y

    def _hf_expert_mlps(self, hs_g, ids_g, offs, opt, S, f, h, gated) -> str:
        fc1 = self.grouped_linear(hs_g, offs, "moe.experts.fc1", (S, 2 * f if gated else f), h)
        if opt.expert_bias:
            from .gpt_oss import expert_bias

            fc1 = expert_bias(self, fc1, ids_g, "moe.experts.fc1")
        if opt.expert_act == "clamped_swiglu":
            from .gpt_oss import clamped_swiglu

            act = clamped_swiglu(self, fc1, f)
        elif gated:
            act = self.act("moe.experts.act", (S, f))
            gate = self.act("moe.experts.gate", (S, f), storage=fc1)
            up = self.act("moe.experts.up", (S, f), storage=fc1)
            self.t.node("chunk", (fc1,), (gate, up), diff_inputs=(fc1,))
            sg = self.act("moe.experts.silu", (S, f))
            self.t.node("silu", (gate,), (sg,), diff_inputs=(gate,), save_i=(gate,))
            self.t.node("mul", (sg, up), (act,), diff_inputs=(sg, up), save_i=(sg, up))
        else:
            act = self.act("moe.experts.act", (S, f))
            self.t.node(opt.activation, (fc1,), (act,), diff_inputs=(fc1,), save_i=(fc1,))
        out = self.grouped_linear(act, offs, "moe.experts.fc2", (S, h), f)
        if opt.expert_bias:
            out = expert_bias(self, out, ids_g, "moe.experts.fc2")
        return out

    def _hf_experts_combine(self, x, opt, out, sw_g, perm, wdt, shared) -> str:
        """The routing weights applied (type promotion of the experts' output and the weights),
        the original order restored, the top-k copies summed and cast to the input's dtype
        (`final_hidden_states.to(hidden_states.dtype)`); then a shared expert."""
        sh = self.sh
        S, h = self.t.tensors[out].shape
        inv = self.act("moe.inv_perm", (S,), "int64")
        self.t.node("inverse_perm", (perm,), (inv,))
        odt = self.dtype_of(x)
        wdt = "fp32" if "fp32" in (wdt, self.dtype_of(out)) else wdt
        wb = dtype_bytes(wdt)
        wout = self.act("moe.weighted", (S, h), wdt)
        # grad of the low-precision factor: a product in the weights' dtype then a cast; grad of
        # the weights: a product, summed
        self.t.node(
            "mul",
            (out, sw_g),
            (wout,),
            diff_inputs=(out, sw_g),
            save_i=(out, sw_g),
            workspace_i=2 * S * h * wb,
        )
        wperm = self.act("moe.unpermuted", (S, h), wdt)
        self.t.node(
            "index", (wout, inv), (wperm,), diff_inputs=(wout,), save_i=(inv,), workspace_i=S * h * wb
        )
        y = self.act("moe.out_" + wdt if wdt != odt else "moe.out", (sh.s_sp, sh.b, h), wdt)
        self.t.node("sum_topk", (wperm,), (y,), diff_inputs=(wperm,))
        if wdt != odt:
            yc = self.act("moe.out", (sh.s_sp, sh.b, h), odt)
            self.t.node("to_dtype", (y,), (yc,), diff_inputs=(y,))
            y = yc
        if sh.shared_ffn and not opt.shared_first:  # GLM-4 MoE: experts, then the shared MLP
            shared = self.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
        if shared is None:
            return y
        if opt.shared_expert_gate:
            g = self.linear(x, "moe.shared_gate", (sh.s_sp, sh.b, 1), h, False)
            sig = self.act("moe.shared_gate_sigmoid", (sh.s_sp, sh.b, 1))
            self.t.node("sigmoid", (g,), (sig,), diff_inputs=(g,), save_i=(sig,))
            gated_shared = self.act("moe.shared_gated", (sh.s_sp, sh.b, h))
            self.t.node(
                "mul", (sig, shared), (gated_shared,), diff_inputs=(sig, shared), save_i=(sig, shared)
            )
            shared = gated_shared
        return self.add(y, shared, "moe.out_shared", (sh.s_sp, sh.b, h))

    def grouped_linear(self, x: str, offs: str, name: str, out_shape: tuple, in_features: int) -> str:
        """torch._grouped_mm over the local experts: saves its input (and the offsets)."""
        sh = self.sh
        w = self.t.param(self.n(name + ".weight"), (sh.experts, out_shape[-1], in_features), sh.dt)
        y = self.act(name + ".out", out_shape)
        self.t.node(
            "grouped_mm", (x, w, offs), (y,), diff_inputs=(x,), params=(w,), save_i=(offs,), save_w=(x, offs)
        )
        return y

    def moe_megatron(self, x: str, opt: LayerOptions) -> str:
        """megatron-core's MoELayer with the alltoall dispatcher and grouped experts, node by node
        (validated against its own code by `pipemem validate megatron`). Router: fp32 logits,
        top-k, softmax over the k scores, scattered back into dense [T, E] probs and a bool
        routing map (both also held by the dispatcher until the layer's next forward).
        Dispatch: masked_select of the transposed routing map gives the sorted token indices
        and the permuted probs, index_select permutes the tokens, all-to-all over ep (tp:
        all-gather), chunks sorted by local expert. Experts: grouped fc1, weighted SwiGLU
        (applies the probs; saves fc1's output and the probs), grouped fc2. Combine: the
        reverse, then unpermute (scatter-add into [T, h], keeps the indices); shared experts
        added. Routing is taken as balanced and dropless: each rank's experts get T x top_k
        tokens in total."""
        sh = self.sh
        T, E, K, h = sh.s_sp * sh.b, sh.experts * sh.ep, sh.top_k, sh.h
        N = T * K
        w = self.t.param(self.n("moe.router.weight"), (E, h), self.dt)
        logits = self.act("moe.router_logits", (T, E), "fp32")
        idx = self.act("moe.topk_idx", (T, K), "int64")
        probs = self.act("moe.probs", (T, E), "fp32")
        rmap = self.act("moe.routing_map", (T, E), "bool")
        self.t.node("router_gemm", (x, w), (logits,), diff_inputs=(x,), params=(w,), save_w=(x,))
        if opt.router == "sigmoid_group":
            p = self._megatron_sigmoid_scores(logits, idx, probs, rmap, opt)
        else:
            scores = self.act("moe.topk_scores", (T, K), "fp32")
            p = self.act("moe.topk_probs", (T, K), "fp32")
            # the dispatcher's references to probs and the routing map outlive the layer's backward
            self.t.node("topk", (logits,), (scores, idx), diff_inputs=(logits,), save_i=(idx, probs, rmap))
            self.t.node("softmax", (scores,), (p,), diff_inputs=(scores,), save_i=(p,))
        self.t.node("scatter", (p, idx), (probs,), diff_inputs=(p,), save_i=(idx,))
        self.t.node("routing_map", (idx,), (rmap,))
        mask_t = self.act("moe.routing_map_t", (E, T), "bool")
        self.t.node("transpose_contiguous", (rmap,), (mask_t,))
        sidx = self.act("moe.sorted_indices", (N,), "int64")
        self.t.node("masked_select", (mask_t,), (sidx,))
        probs_t = self.act("moe.probs_t", (E, T), "fp32")
        self.t.node("transpose_contiguous", (probs,), (probs_t,), diff_inputs=(probs,))
        tprobs = self.act("moe.permuted_probs", (N,), "fp32")
        self.t.node("masked_select", (probs_t, mask_t), (tprobs,), diff_inputs=(probs_t,), save_i=(mask_t,))
        # the rank's experts receive Nr tokens (moe_load x the balanced N); with --ep 1 only
        # padding to capacity changes it, in the permutation itself
        Nr = _loaded(N, sh.moe_load)
        tokens = self.act("moe.permuted", (N if sh.ep > 1 else Nr, h))
        self.t.node("index_select", (x, sidx), (tokens,), diff_inputs=(x,), save_i=(sidx,))
        if sh.ep > 1:
            recv = self.act("moe.dispatch_a2a", (Nr, h), kind=COMM)
            self.t.node("all_to_all", (tokens,), (recv,), diff_inputs=(tokens,))
            precv = self.act("moe.dispatch_a2a_probs", (Nr,), "fp32", kind=COMM)
            self.t.node("all_to_all", (tprobs,), (precv,), diff_inputs=(tprobs,))
            tokens, tprobs = recv, precv
        elif Nr != N:
            padded = self.act("moe.permuted_probs_padded", (Nr,), "fp32")
            self.t.node("pad_to_capacity", (tprobs,), (padded,), diff_inputs=(tprobs,))
            tprobs = padded
        M = Nr
        if sh.tp > 1 and sh.sp:
            M = Nr * sh.tp
            g = self.act("moe.tp_allgather", (M, h), kind=COMM)
            self.t.node("all_gather", (tokens,), (g,), diff_inputs=(tokens,))
            gp = self.act("moe.tp_allgather_probs", (M,), "fp32", kind=COMM)
            self.t.node("all_gather", (tprobs,), (gp,), diff_inputs=(tprobs,))
            tokens, tprobs = g, gp
        if sh.experts > 1:
            st = self.act("moe.sorted_tokens", (M, h))
            self.t.node("sort_chunks", (tokens,), (st,), diff_inputs=(tokens,))
            sp_ = self.act("moe.sorted_probs", (M,), "fp32")
            self.t.node("sort_chunks", (tprobs,), (sp_,), diff_inputs=(tprobs,))
            tokens, tprobs = st, sp_
        f = sh.expert_ffn
        gated = opt.activation in ("swiglu", "geglu")
        fc1 = self.linear(tokens, "moe.experts.fc1", (M, 2 * f if gated else f), h, False)
        act = self.act("moe.experts.act", (M, f))
        self.t.node(
            "weighted_swiglu" if gated else "weighted_" + opt.activation,
            (fc1, tprobs),
            (act,),
            diff_inputs=(fc1, tprobs),
            save_i=(fc1, tprobs),
        )
        out = self.linear(act, "moe.experts.fc2", (M, h), f, False)
        if sh.experts > 1:
            us = self.act("moe.unsorted_tokens", (M, h))
            self.t.node("sort_chunks", (out,), (us,), diff_inputs=(out,))
            out = us
        if sh.tp > 1 and sh.sp:
            rs = self.act("moe.tp_reduce_scatter", (Nr, h), kind=COMM)
            self.t.node("reduce_scatter", (out,), (rs,), diff_inputs=(out,))
            out = rs
        if sh.ep > 1:
            back = self.act("moe.combine_a2a", (N, h), kind=COMM)
            self.t.node("all_to_all", (out,), (back,), diff_inputs=(out,))
            out = back
        y = self.act("moe.out", (sh.s_sp, sh.b, h))
        self.t.node("unpermute", (out, sidx), (y,), diff_inputs=(out,), save_i=(sidx,))
        if sh.shared_ffn:
            shared = self.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
            y = self.add(y, shared, "moe.out_shared", (sh.s_sp, sh.b, h))
        return y

    def moe_torchtitan(self, x: str, opt: LayerOptions) -> str:
        """torchtitan's MoE module (templates/torchtitan_moe.py); llama4's (its sigmoid router
        scattered over the experts) is torchtitan 0.2.2's (templates/torchtitan_llama4.py)
        without tensor or expert parallelism."""
        if opt.router == "sigmoid_scatter" and self.sh.tp == 1 and self.sh.ep == 1:
            from .torchtitan_llama4 import moe as moe_022

            return moe_022(self, x, opt)
        from .torchtitan_moe import moe

        return moe(self, x, opt)

    def _megatron_sigmoid_scores(self, logits: str, idx: str, probs: str, rmap: str, opt) -> str:
        """megatron-core's `topk_routing_with_score_function(score_function="sigmoid")`
        (transformer/moe/moe_utils.py) on fp32 logits: sigmoid scores (kept); the choice adds the
        expert bias (`--moe-router-enable-expert-bias`, an fp32 buffer) and takes the top k, within
        the best `--moe-router-group-topk` of `--moe-router-num-groups` groups when given
        (`group_limited_topk`: transients with no path to the loss); the scores gathered at the
        chosen experts (the gather keeps the indices), normalised over the k (the division keeps
        both operands) and scaled by `--moe-router-topk-scaling-factor`. -> the [T, K] probs."""
        sh, t = self.sh, self.t
        T, E, K = sh.s_sp * sh.b, sh.experts * sh.ep, sh.top_k
        scores = self.act("moe.sigmoid_scores", (T, E), "fp32")
        # the dispatcher's references to probs and the routing map outlive the layer's backward
        t.node("sigmoid", (logits,), (scores,), diff_inputs=(logits,), save_i=(scores, probs, rmap))
        biased = self.act("moe.choice.biased", (T, E), "fp32")
        t.node("add_expert_bias", (scores,), (biased,))
        choice = biased
        if opt.router_topk_groups and opt.router_groups > 1:
            per = max(1, K // opt.router_topk_groups)
            choice = group_limited(self, biased, T, opt, per, MEGATRON_GROUP_MASK)
        tval = self.act("moe.choice.topk_values", (T, K), "fp32")
        t.node("topk", (choice,), (tval, idx))
        sk = self.act("moe.topk_scores", (T, K), "fp32")
        t.node("gather", (scores, idx), (sk,), diff_inputs=(scores,), save_i=(idx,))
        p = sk
        if K > 1:
            ssum = self.act("moe.topk_sum", (T, 1), "fp32")
            t.node("sum", (sk,), (ssum,), diff_inputs=(sk,))
            den = self.act("moe.topk_denominator", (T, 1), "fp32")
            t.node("add_scalar", (ssum,), (den,), diff_inputs=(ssum,), grad_alias=True)
            p = self.act("moe.topk_probs", (T, K), "fp32")
            t.node("div", (sk, den), (p,), diff_inputs=(sk, den), save_i=(sk, den))
        if opt.routed_scaling != 1.0:
            scaled = self.act("moe.topk_probs_scaled", (T, K), "fp32")
            t.node("mul_scalar", (p,), (scaled,), diff_inputs=(p,))
            p = scaled
        return p

    def moe(self, x: str, opt: LayerOptions) -> str:
        """Router, token permutation, all-to-all over ep, grouped expert FFN, and back.
        Routing is taken as balanced: each rank's experts receive top_k x its tokens."""
        sh = self.sh
        T = sh.s_sp * sh.b
        E = sh.experts * sh.ep
        h = sh.h
        # Router (replicated weight): logits, softmax / top-k probabilities.
        logits = self.linear(x, "moe.router", (sh.s_sp, sh.b, E), h, False)
        probs = self.act("moe.probs", (T, E), "fp32")
        self.t.node("router_softmax", (logits,), (probs,), diff_inputs=(logits,), save_i=(probs,))
        topk = self.act("moe.topk_probs", (T, sh.top_k), "fp32")
        idx = self.act("moe.topk_idx", (T, sh.top_k), "int64")
        self.t.node("topk", (probs,), (topk, idx), diff_inputs=(probs,), save_i=(idx,))
        N = T * sh.top_k
        Nr = _loaded(N, sh.moe_load)  # what this rank's experts receive
        perm = self.act("moe.permuted", (N if sh.ep > 1 else Nr, h))
        self.t.node("permute", (x, idx), (perm,), diff_inputs=(x,), save_i=(idx,))
        tokens = perm
        if sh.ep > 1:
            recv = self.act("moe.dispatch_a2a", (Nr, h), kind=COMM)
            self.t.node("all_to_all", (tokens,), (recv,), diff_inputs=(tokens,))
            tokens = recv
        M = Nr
        if sh.etp > 1 and sh.sp:
            M = Nr * sh.etp
            g = self.act("moe.etp_allgather", (M, h), kind=COMM)
            self.t.node("all_gather", (tokens,), (g,), diff_inputs=(tokens,))
            tokens = g
        f = sh.expert_ffn
        gated = opt.activation in ("swiglu", "geglu")
        fc1 = self.linear(tokens, "moe.experts.fc1", (M, 2 * f if gated else f), h, False, experts=sh.experts)
        act = self.act("moe.experts.act", (M, f))
        if gated and not self.conv.fused_gate_up:
            # gate_up = grouped GEMM; gate, up = chunk (views); silu(gate) * up, unfused
            gate = self.act("moe.experts.gate", (M, f), storage=fc1)
            up = self.act("moe.experts.up", (M, f), storage=fc1)
            self.t.node("chunk", (fc1,), (gate, up), diff_inputs=(fc1,))
            sg = self.act("moe.experts.silu", (M, f))
            self.t.node("silu", (gate,), (sg,), diff_inputs=(gate,), save_i=(gate,))
            self.t.node("mul", (sg, up), (act,), diff_inputs=(sg, up), save_i=(sg, up))
        else:
            self.t.node(
                "bias_swiglu" if gated else opt.activation, (fc1,), (act,), diff_inputs=(fc1,), save_i=(fc1,)
            )
        out = self.linear(act, "moe.experts.fc2", (M, h), f, False, experts=sh.experts)
        if sh.etp > 1 and sh.sp:
            rs = self.act("moe.etp_reduce_scatter", (Nr, h), kind=COMM)
            self.t.node("reduce_scatter", (out,), (rs,), diff_inputs=(out,))
            out = rs
        elif sh.etp > 1:
            ar = self.act("moe.etp_allreduce", (Nr, h), storage=out)
            self.t.node("all_reduce", (out,), (ar,), diff_inputs=(out,), grad_alias=True)
            out = ar
        if sh.ep > 1:
            back = self.act("moe.combine_a2a", (N, h), kind=COMM)
            self.t.node("all_to_all", (out,), (back,), diff_inputs=(out,))
            out = back
        y = self.act("moe.out", (sh.s_sp, sh.b, h))
        self.t.node(
            "unpermute_weighted", (out, topk, idx), (y,), diff_inputs=(out, topk), save_i=(out, topk, idx)
        )
        if sh.shared_ffn:
            shared = self.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
            y = self.add(y, shared, "moe.out_shared", (sh.s_sp, sh.b, h))
        return y


def _loaded(n: int, load: float) -> int:
    """Tokens a rank's experts receive: `load` x the balanced `n`, rounded up."""
    return n if load == 1.0 else math.ceil(n * load - 1e-9)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _op(type_: str, inputs, outputs):
    from ..ir import Op

    return Op(type_, tuple(inputs), tuple(outputs))


# Programs ---------------------------------------------------------------------------------


def decoder_layer_tape(
    arch, sh: Shard, conv: Convention, opt: LayerOptions, prefix: str = ""
) -> tuple[Tape, str, str]:
    """Tape of one decoder layer; returns (tape, input name, output name)."""
    tape = Tape(prefix)
    g = _Gen(tape, sh, conv, prefix)
    if opt.fsdp_keep:
        tape.fsdp_reshard = False
    g._uses_rope = arch.position == "rope"
    g.norm_weight_first = opt.norm_weight_first or conv.norm_weight_first
    tok = (sh.s_sp, sh.b, sh.h)
    x = g.act("input", tok, sh.res_dt)
    g.sac = opt.recompute == "selective" and conv.framework.op_level_sac
    if g.sac:
        tape.pin = _torchtitan_op_sac()
    # torch.compile of a layer without activation checkpointing: the partitioner picks what to
    # save (with checkpointing the checkpoint policy decides, compiled or not)
    compiled = sh.feat.compile and opt.recompute == "none"
    if opt.recompute == "full" or g.sac or compiled:
        tape.begin_region()
    attn, y = _layer_body(g, arch, sh, conv, opt, x)
    if opt.recompute == "full" or g.sac or compiled:
        tape.end_region()
    if compiled:
        from .compiled import min_cut_region

        min_cut_region(tape, 0)
    if sh.feat.offload:
        from .offload import mark_offloaded

        tape.weights_saved_as_params = arch.conv1d and conv.framework.conv1d_weight_saved
        mark_offloaded(
            tape, sh.feat, keep=opt.offload_keep, te_spec=conv.framework.te_offload_spec, moe=opt.moe
        )
    held = (x,) if conv.caller_holds_input else ()
    if conv.attn_out_held_to_return:
        held += (attn,)
    tape.held_to_return = held
    return tape, x, y


def _layer_body(g, arch, sh: Shard, conv: Convention, opt: LayerOptions, x: str) -> tuple[str, str]:
    """The ops of one decoder layer on g's tape from its input `x` -> (the attention block's
    output, the layer's output)."""
    tape = g.t
    tok = (sh.s_sp, sh.b, sh.h)
    # norm placement: pre (llama) normalises each block's input; post (olmo2) its output
    # before the residual add; sandwich (gemma2) both
    pre = opt.norm_placement in ("pre", "sandwich")
    post = opt.norm_placement in ("post", "sandwich")
    h1 = g.norm(x, "input_norm", opt.norm, tok) if pre else x
    tape.module = "attn"
    if arch.kv_lora_rank:  # DeepSeek-V2 / V3, Kimi-K2 (templates/mla.py)
        from . import mla

        attn = mla.attention(g, arch, h1, opt)
    else:
        attn = g.attention(h1, opt)
    if opt.hidden_dropout:
        attn = g.dropout(attn, "attn.dropout_out", tok)
    tape.module = ""
    if post:
        attn = g.norm(attn, "post_attention_norm" if not pre else "post_attention_out_norm", opt.norm, tok)
    if opt.parallel_residual:
        h2 = g.norm(x, "post_attention_norm", opt.norm, tok)
    else:
        r1 = g.add(x, attn, "residual1", tok)
        h2 = g.norm(r1, "pre_mlp_norm" if post else "post_attention_norm", opt.norm, tok) if pre else r1
    tape.module = "mlp"
    if opt.moe and arch.kv_lora_rank and not conv.framework.moe_program_runs_mla:
        from . import mla

        m = mla.moe(g, arch, h2, opt)
    elif opt.moe:
        m = getattr(g, conv.framework.moe_program)(h2, opt)
    else:
        m = g.mlp(h2, opt)
    if opt.hidden_dropout:
        m = g.dropout(m, "mlp.dropout_out", tok)
    tape.module = ""
    if post:
        m = g.norm(m, "post_mlp_norm", opt.norm, tok)
    if opt.parallel_residual:
        r = g.add(x, attn, "residual_attn", tok)
        y = g.add(r, m, "output", tok)
    else:
        y = g.add(r1, m, "output", tok)
    return attn, y


def _torchtitan_op_sac():
    """torchtitan's op-level selective checkpointing ("selective_ac_option = 'op'"): inside a
    checkpointed layer, keep the outputs of SDPA, of topk, of reduce-scatters / all-to-alls and of
    every odd-numbered matmul (1st, 3rd, ...), recompute everything else (its custom policy over
    aten ops)."""
    count = [0]

    def pin(node_type: str) -> bool:
        if node_type == "linear":
            count[0] += 1
            return count[0] % 2 == 1
        # torchtitan's save list (distributed/activation_checkpoint.py `_get_default_save_ops`):
        # the partitioner's compute-intensive ops (mm, flash / efficient SDPA; not _grouped_mm),
        # topk (MoE routing), reduce-scatters and all-to-alls
        return node_type in ("flash_attn", "efficient_attn", "reduce_scatter", "topk", "all_to_all")

    return pin


def embedding_tape(arch, sh: Shard, conv: Convention, plan, tied_head: bool = False) -> tuple[Tape, str, str]:
    """Token ids -> vocab-parallel embedding (+ learned positions, dropout): the first stage's
    extra work. Returns (tape, ids name, output name). tied_head: the word embedding is the
    output layer's weight on this stage; when the backward creates the gradients, the head's
    backward (which runs first) has created its .grad and this one accumulates into it."""
    tape = Tape("emb.")
    g = _Gen(tape, sh, conv, "emb.")
    tape.fsdp_reshard = sh.fsdp_embed_reshard
    if sh.fsdp_root:
        # FSDP2's root unit, gathered here with the final norm and the output layer (tape.py)
        tape.root_role = "first"
        tape.root_bytes = root_unit_bytes(arch, sh)
        # the head's grads (none under LoRA: the final norm and the output layer are frozen)
        tape.root_grad_bytes = 0 if sh.feat.lora_rank else (sh.h + sh.vocab * sh.h) * dtype_bytes(sh.dt)
        tape.root_grad_elem_bytes = dtype_bytes(sh.dt)
    if tied_head and tape.grad_create is not None and not tape.fsdp:
        # (FSDP / ZeRO-3 reduce-scatters each part's grads into shards: not handled here, the
        # tied shard is counted twice, 1/dp of the word embedding)
        tape.existing_grads = frozenset({"emb.word.weight"})
    ids = g.act("input_ids", (sh.b, sh.s), "int64")
    tape.node("load_batch", (), (ids,))
    w = tape.param("emb.word.weight", (sh.vocab, sh.h), sh.dt)
    tok = (sh.s_sp, sh.b, sh.h)
    y = g.embed_lookup(ids, w)
    if arch.position == "learned":
        pw = tape.param("emb.position.weight", (max(arch.max_positions, plan.seq_len), sh.h), sh.dt)
        pos = g.act("positions", tok, sh.res_dt)
        tape.node("embedding", (pw,), (pos,), params=(pw,))
        y = g.add(y, pos, "with_positions", tok)
    if arch.embd_dropout > 0:
        y = g.dropout(y, "dropout", tok)
    return tape, ids, y


def causal_mask_tape(sh: Shard, keep: bool) -> tuple[Tape, str, str]:
    """PaddleNLP's non-flash causal mask, built by every pipeline stage for each microbatch
    (`LlamaModelAuto._prepare_decoder_attention_mask`, as Paddle's programs run it): bool
    [b,1,s,s] padding and tril masks and their AND, cast to fp32, three adds and a `where`
    give the additive fp32 mask [b,1,s,s]. It is kept for backward only when the layers are
    recomputed (their attention runs again); otherwise the forward frees it. Returns (tape,
    input name, output name); the output is a token marker so the part chains like the others."""
    tape = Tape("mask.")
    g = _Gen(tape, sh, CONVENTIONS_PADDLE, "mask.")
    full = (sh.b, 1, sh.s, sh.s)
    x = g.act("input", (1,), "fp32")
    ok = g.act("and", full, "bool")
    tape.node("expand_tril_and", (x,), (ok,), workspace_f=2 * sh.b * sh.s * sh.s + sh.s * sh.s)
    ones = g.act("ones_f32", full, "fp32")
    tape.node("full_like_cast", (ok,), (ones,))
    okf = g.act("and_f32", full, "fp32")
    tape.node("cast", (ok,), (okf,))
    base = g.act("base", full, "fp32")
    tape.node("add", (ones,), (base,))
    hi = g.act("allowed", full, "fp32")
    tape.node("add", (base,), (hi,))
    lo = g.act("blocked", full, "fp32")
    tape.node("add", (base,), (lo,))
    cond32 = g.act("cond_f32", full, "fp32", storage=okf)
    tape.node("add_", (okf, base), (cond32,))
    cond = g.act("cond", full, "bool")
    tape.node("cast", (cond32,), (cond,))
    mask = g.act("mask", full, "fp32")
    tape.node("where", (cond, hi, lo), (mask,))
    y = g.act("output", (1,), "fp32")
    tape.node(
        "mask_for_layers", (mask,) if keep else (), (y,), diff_inputs=(x,), save_i=(mask,) if keep else ()
    )
    return tape, x, y


def head_tape(
    arch, sh: Shard, conv: Convention, tied_gathered: bool = False, mtp=None
) -> tuple[Tape, str, str]:
    """Final norm, vocab-parallel output linear, fp32 logits and cross entropy (last stage).
    Returns (tape, input name, loss name). tied_gathered: the output weight is the word
    embedding and the stage's embedding keeps it gathered from its forward to its backward
    (DeepSpeed ZeRO-3's reuse window, `zero3_reuse`): one parameter, which DeepSpeed gathers
    once, so the head's gathers leave it out. mtp: (depths, LayerOptions of their layers) of
    megatron-core's multi-token prediction block, run before the head (templates/mtp.py)."""
    tape, x, loss = _head_tape(arch, sh, conv, mtp)
    if tied_gathered:
        tape.fsdp_gathered_elsewhere = frozenset(
            n for n, t in tape.tensors.items() if t.kind is PARAM and n.endswith("output.weight")
        )
    return tape, x, loss


def megatron_cross_entropy(g, logits: str, lf: str, labels: str, loss: str) -> str:
    """Megatron's vocab-parallel CE (tensor_parallel/cross_entropy.py) on labels transposed to
    [s, b]: max/sub/exp/div in place on the fp32 copy `lf` of `logits`, which it saves as the
    softmax with the bool target mask and the int64 masked target; backward edits the softmax
    in place into the logits grad. Inside it: logits max, predicted logits (+ a clone), the sum
    of exps (fp32) and an int64 arange per token. GPTModel still holds the bf16 logits and the
    transposed labels when it transposes the loss back to [b, s]. -> the [b, s] loss."""
    sh, tape = g.sh, g.t
    tokens = sh.s * sh.b
    labels_t = g.act("labels_t", (sh.s, sh.b), "int64")
    tape.node("transpose_contiguous", (labels,), (labels_t,))
    soft = g.act("softmax", (sh.s, sh.b, sh.vocab), "fp32", storage=lf)
    tmask = g.act("target_mask", (sh.s, sh.b), "bool")
    mtarget = g.act("masked_target", (tokens,), "int64")
    tape.node(
        "vocab_parallel_cross_entropy",
        (lf, labels_t),
        (soft, loss, tmask, mtarget),
        diff_inputs=(lf,),
        save_i=(soft, tmask, mtarget),
        workspace_f=tokens * (4 + 4 + 4 + 4 + 8),
    )
    tape.tensors["d." + lf] = type(tape.tensors[lf])("d." + lf, (sh.s, sh.b, sh.vocab), "fp32", storage=lf)
    loss_t = g.act("loss_bs", (sh.b, sh.s), "fp32")
    tape.node(
        "transpose_contiguous", (loss, logits, labels_t), (loss_t,), diff_inputs=(loss,), grad_alias=True
    )
    return loss_t


def _head_tape(arch, sh: Shard, conv: Convention, mtp=None) -> tuple[Tape, str, str]:
    tape = Tape("head.")
    g = _Gen(tape, sh, conv, "head.")
    g.norm_weight_first = arch.norm_weight_first or conv.norm_weight_first  # the final norm as the layers'
    tape.fsdp_reshard = sh.fsdp_head_reshard
    tape.fsdp_state_to_backward = tape.fsdp_ag_state and not sh.fsdp_head_reshard
    if sh.fsdp_root:
        # in FSDP2's root unit with the embedding (tape.py): resharded when the model's forward
        # ends, gathered again for the backward, its grads reduced when the backward ends
        tape.root_role = "last"
        tape.root_bytes = root_unit_bytes(arch, sh)
        tape.root_bwd_prefetch_bytes = layer_unit_bytes(arch, sh)
    tok = (sh.s_sp, sh.b, sh.h)
    x = g.act("input", tok, sh.res_dt)
    hn = g.norm(x, "final_norm", norm_kind(arch), tok)
    mtp_hold: list[str] = []
    if mtp is not None:  # megatron-core's MTP block, its heads and losses (templates/mtp.py)
        from .mtp import mtp_block

        hn, mtp_hold = mtp_block(tape, arch, sh, conv, mtp, hn, (_Gen, _layer_body, megatron_cross_entropy))
    # torch.compile covers the loss too (torchtune compiles its loss; torchtitan's "loss" component)
    compiled_loss = sh.feat.compile_loss and conv.framework.compile_covers_loss
    if sh.feat.loss in ("chunked", "fused_linear", "fused_te") or compiled_loss:
        from .losses import loss_from_hidden

        return tape, x, loss_from_hidden(g, tape, hn, sh, compiled_loss)
    (logits,) = g.column_linears(hn, "head", [("head.output", sh.vocab, False)], gathered_by_linear=True)
    tape.fsdp_unit_end = len(tape.nodes)  # the loss runs outside the output layer's FSDP unit
    labels = g.act("labels", (sh.b, sh.s), "int64")
    tape.node("load_labels", (), (labels,))
    vocab = sh.vocab
    if conv.full_vocab_loss and sh.tp > 1:
        # the reshard to the full vocabulary: all_gather (tp copies stacked), split + concat
        vocab = sh.vocab * sh.tp
        gathered = g.act("logits_gathered", (sh.tp * sh.s, sh.b, sh.vocab), kind=COMM)
        tape.node("all_gather", (logits,), (gathered,), diff_inputs=(logits,))
        full = g.act("logits_full", (sh.s, sh.b, vocab))
        tape.node("split_concat", (gathered,), (full,), diff_inputs=(gathered,))
        logits = full
    if sh.feat.loss == "shifted":
        from .losses import shifted_cross_entropy

        return tape, x, shifted_cross_entropy(g, tape, logits, labels, vocab)
    if sh.dt == "fp32":
        lf = logits  # .float() / astype("float32") of an fp32 tensor is the tensor itself
    else:
        lf = g.act("logits_fp32", (sh.s, sh.b, vocab), "fp32")
        tape.node("to_fp32", (logits,), (lf,), diff_inputs=(logits,))
        if conv.logits_fp32_in_model:
            tape.model_end = len(tape.nodes)  # torchtune's decoder returns output(h).float()
    loss = g.act("loss", (sh.s, sh.b), "fp32")
    if conv.ce_inplace and conv.framework.ce_with_softmax_inplace:
        # Paddle's cross_entropy_with_softmax, in place on the fp32 logits (the executor's
        # in-place pass), saving the softmax; its grad is a new logits grad.
        soft = g.act("softmax", (sh.s, sh.b, vocab), "fp32", storage=lf)
        tape.node(
            "cross_entropy_with_softmax_",
            (lf, labels),
            (soft, loss),
            diff_inputs=(lf,),
            save_i=(soft, labels),
        )
    elif conv.ce_inplace:
        loss_t = megatron_cross_entropy(g, logits, lf, labels, loss)
        if mtp_hold:  # GPTModel._postprocess's locals: the last depth's logits
            tape.held_until.setdefault(len(tape.nodes) - 1, []).extend(mtp_hold)
        return tape, x, loss_t
    else:
        logp = g.act("log_softmax", (sh.s, sh.b, vocab), "fp32")
        tape.node("log_softmax", (lf,), (logp,), diff_inputs=(lf,), save_i=(logp,))
        tape.node("nll_loss", (logp, labels), (loss,), diff_inputs=(logp,), save_i=(labels,))
    return tape, x, loss
