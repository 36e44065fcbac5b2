"""What modern trainers switch on when memory is tight, as one frozen record per plan.

Each switch is a `ParallelPlan` field (and a CLI flag of the same name); `features_of(plan)`
collects the ones that change a layer's programs into `Features`, which the templates carry
in their `Shard` (so it is part of every cache key). What each switch does to memory is
modelled op by op where the programs are generated (pipemem.templates.compiled,
pipemem.templates.losses, pipemem.templates.layers' fp8 operands, pipemem.templates.offload)
and in the static bytes (pipemem.templates.static); the names below are the frameworks' own
words.

* `compile`: torch.compile of each decoder layer (torchtune, torchtitan, litgpt): AOTAutograd's
  min-cut partitioner decides what the compiled layer saves for backward. "all" (or True) also
  compiles the loss (torchtune's compile_loss, torchtitan's "loss" component); "layers" leaves
  the loss eager (torchtitan before it had compile components).
* `loss`: how the cross-entropy sees the logits.
    standard      fp32 copy of the whole logits, log-softmax / vocab-parallel CE;
    chunked       torchtune's CEWithChunkedOutputLoss: the output projection and the fp32
                  upcast + CE run per chunk of tokens (`loss_chunks`, default 8);
    fused_linear  Liger's fused linear cross-entropy (and Megatron/TE's equivalent): logits are
                  computed chunk by chunk inside the loss, their grads are formed on the spot and
                  never kept; only the hidden states are saved;
    fused         Megatron --cross-entropy-loss-fusion (native impl): same memory as the
                  unfused vocab-parallel CE (it upcasts and keeps the fp32 exp-logits);
    fused_te      ... with --cross-entropy-fusion-impl te: TE's CE in place on the bf16
                  logits, no fp32 copy;
    shifted       the loss a training step writes itself on the model's logits, as transformers
                  before 4.46 did for GPT-2 and Lightning / custom steps do:
                  `F.cross_entropy(logits[..., :-1, :].contiguous().view(-1, V), ...)` -- a
                  shifted copy of the logits, no `.float()`: the log-softmax runs in the
                  logits' dtype (half when the model is, as under DeepSpeed or pure bf16; fp32
                  under autocast, whose fp32 op list holds log_softmax).
* `fp8`: low-precision linears. Transformer Engine recipes (Megatron): `delayed`, `current`
  (per-tensor current scaling), `mxfp8` (block scaling); torchao Float8 (torchtitan, any
  PyTorch trainer): `tensorwise` (dynamic per-tensor), `rowwise`. `fp8_param_gather`: Megatron
  --fp8-param-gather (fp8 primary weights) / torchao enable_fsdp_float8_all_gather.
* `activation_offload`: saved activations copied to the CPU after their layer's forward and
  brought back before its backward. `all` = torchtune's offloading context (every decoder
  layer); a comma list of module names (`attn`, `mlp`, `attn_norm`, `mlp_norm`, `qkv`,
  `core_attn`, `attn_proj`, `expert_fc1`, `moe_act`) = Megatron's fine-grained offloading.
* `optimizer_offload`: fraction of optimizer states and master weights kept on the CPU
  (DeepSpeed ZeRO-Offload = 1.0; Megatron --optimizer-cpu-offload --optimizer-offload-fraction).
* `optimizer_in_backward`: torchtune's optimizer_in_bwd: each parameter is stepped as soon as
  its gradient is accumulated and the gradient is freed.
* `optimizer_state_dtype`: Adam moments in bf16 / fp16 / fp8 (Megatron's precision-aware
  optimizer --exp-avg-dtype/--exp-avg-sq-dtype); 8-bit and 4-bit optimizers are `--optimizer
  adam8bit` (bitsandbytes, torchao AdamW8bit) and `adam4bit` (torchao AdamW4bit).
"""

from __future__ import annotations

from dataclasses import dataclass

LOSSES = ("standard", "chunked", "fused_linear", "fused", "fused_te", "shifted")
FP8_RECIPES = ("delayed", "current", "mxfp8", "tensorwise", "rowwise")
TE_RECIPES = ("delayed", "current", "mxfp8")  # Transformer Engine (Megatron)
TORCHAO_RECIPES = ("tensorwise", "rowwise")  # torchao Float8Linear
OFFLOAD_MODULES = (
    "attn",
    "mlp",
    "attn_norm",
    "mlp_norm",
    "qkv",
    "core_attn",
    "attn_proj",
    "expert_fc1",
    "moe_act",
)
STATE_DTYPES = ("fp32", "bf16", "fp16", "fp8")


@dataclass(frozen=True, slots=True)
class Features:
    """The per-layer switches of one plan that change its programs (a cache key)."""

    compile: bool = False  # decoder layers compiled
    loss: str = "standard"
    loss_chunks: int = 8
    fp8: str = ""  # "" = none, else one of FP8_RECIPES
    fp8_param_gather: bool = False
    offload: frozenset = frozenset()  # module tags whose saved activations go to the CPU; {"*"} = all
    opt_in_bwd: bool = False  # weight grads stepped and freed inside the backward
    compile_loss: bool = False  # the loss compiled too
    # LoRA / QLoRA (pipemem.lora): adapters of this rank on the targeted linears; the base frozen
    lora_rank: int = 0
    lora_targets: frozenset = frozenset()  # canonical names (pipemem.lora.TARGETS)
    lora_dropout: bool = False  # each adapter's own dropout: a new input copy and a mask saved
    lora_dt: str = ""  # the adapters' dtype ("" = the model's)
    lora_autocast: bool = False  # fp32 adapters computed under autocast (HF Trainer --bf16 / --fp16)
    qlora: bool = False  # base linears NF4, dequantized to the compute dtype at each use
    qlora_all: bool = False  # every layer linear is NF4 (bitsandbytes), not only the targeted ones

    @property
    def te_fp8(self) -> bool:
        return self.fp8 in TE_RECIPES

    @property
    def torchao_fp8(self) -> bool:
        return self.fp8 in TORCHAO_RECIPES

    def lora_on(self, linear: str) -> bool:
        """Does the template linear `linear` (e.g. "attn.q_proj") carry an adapter?"""
        from .lora import TEMPLATE_LINEARS

        return self.lora_rank > 0 and TEMPLATE_LINEARS.get(linear) in self.lora_targets

    def offloads(self, module: str) -> bool:
        return "*" in self.offload or module in self.offload


NONE = Features()


def parse_offload(value) -> frozenset:
    """`activation_offload` (None, "none", "all", "a,b" or a sequence) -> module tags."""
    if value in (None, "", "none", False):
        return frozenset()
    if value is True or value == "all":
        return frozenset({"*"})
    items = value.split(",") if isinstance(value, str) else list(value)
    return frozenset(str(x).strip() for x in items if str(x).strip())


def features_of(plan) -> Features:
    """The Features of a validated plan."""
    return _features(
        bool(plan.compile),
        plan.loss,
        plan.loss_chunks,
        plan.fp8 or "",
        bool(plan.fp8_param_gather),
        parse_offload(plan.activation_offload),
        bool(plan.optimizer_in_backward),
        plan.compile in (True, "all"),
        *_lora_key(plan),
    )


def _lora_key(plan) -> tuple:
    rank = int(getattr(plan, "lora_rank", 0) or 0)
    if not rank:
        return ()
    from .frameworks import ALL
    from .lora import parse_targets

    fw = ALL.get(plan.convention)
    extra = plan.extra or {}
    dt = extra.get("lora_dtype") or (fw.lora_adapter_dtype if fw is not None else "")
    if dt in ("model", plan.dtype) or getattr(plan, "deepspeed_mixed_precision", False):
        dt = ""
    return (
        rank,
        parse_targets(plan.lora_targets),
        bool(plan.lora_dropout),
        dt,
        bool(dt == "fp32" and plan.master_weights and plan.dtype != "fp32"),
        bool(plan.qlora),
        bool(plan.qlora and fw is not None and fw.qlora_quantizes_all_linears),
    )


_CACHE: dict = {}


def _features(*key) -> Features:
    f = _CACHE.get(key)
    if f is None:
        f = _CACHE[key] = Features(*key)
    return f


def _own_chunked_loss(plan) -> bool:
    from .frameworks import ALL

    fw = ALL.get(plan.convention)
    return fw is not None and fw.chunked_loss_wrapper


def describe(plan) -> list[str]:
    """One phrase per switched-on feature, for reports and verdicts."""
    out = []
    if plan.compile:
        what = "layers" if plan.compile == "layers" else "layers and loss"
        out.append(f"torch.compile of the {what} (min-cut partitioner decides the saved activations)")
    if plan.loss != "standard":
        chunked = (
            f"torchtitan's ChunkedLossWrapper ({plan.loss_chunks} chunks: output layer, loss and backward "
            "per chunk)"
            if _own_chunked_loss(plan)
            else f"chunked cross-entropy ({plan.loss_chunks} chunks)"
        )
        out.append(
            {
                "chunked": chunked,
                "fused_linear": "fused linear cross-entropy (logits never whole)",
                "fused": "Megatron fused cross-entropy (native)",
                "fused_te": "TE fused cross-entropy (no fp32 logits copy)",
                "shifted": "the step's own cross-entropy on shifted logits (no .float())",
            }[plan.loss]
        )
    if plan.fp8:
        out.append(f"fp8 linears ({plan.fp8}{', fp8 param gather' if plan.fp8_param_gather else ''})")
    if parse_offload(plan.activation_offload):
        out.append(f"activation offload ({plan.activation_offload})")
    if plan.optimizer_offload:
        out.append(f"optimizer offload ({plan.optimizer_offload:g} of the states on CPU)")
    if plan.optimizer_in_backward:
        out.append("optimizer step in backward")
    if plan.optimizer_state_dtype:
        out.append(f"optimizer states in {plan.optimizer_state_dtype}")
    if getattr(plan, "lora_rank", 0):
        from .lora import parse_targets, targets_text

        what = "QLoRA (NF4 base)" if plan.qlora else "LoRA"
        drop = f", dropout {plan.lora_dropout:g}" if plan.lora_dropout else ""
        out.append(f"{what} rank {plan.lora_rank} on {targets_text(parse_targets(plan.lora_targets))}{drop}")
    return out
