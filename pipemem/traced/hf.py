"""HF transformers causal LMs for traced mode: configs, model building, checkpointing, quirks.

Models are built from a config only (no weights): on the meta device, then given fake CPU
tensors by `step.meta_to_fake` (the real CPU run of `pipemem validate cpu` builds the same
model with real tensors). Every fake-tensor quirk of transformers is handled in
`fake_tensor_quirks()` and nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from ..errors import UserError  # noqa: E402

RECOMPUTE = ("none", "full", "selective")
ATTENTION = ("sdpa", "eager")

# Tiny configurations (seconds on a CPU) for validation and tests, one per architecture; the
# Llama-like ones share their shape, and differ in what their family changes
_TINY_BASE = dict(
    hidden_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
TINY = {
    "llama": dict(_TINY_BASE, model_type="llama", intermediate_size=344, vocab_size=1024),
    "mistral": dict(
        _TINY_BASE,
        model_type="mistral",
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=1000,
        sliding_window=None,
    ),
    "qwen2": dict(
        _TINY_BASE, model_type="qwen2", intermediate_size=320, vocab_size=1200, tie_word_embeddings=True
    ),
    "gpt2": dict(model_type="gpt2", n_embd=128, n_layer=3, n_head=4, vocab_size=1024, n_positions=1024),
    "mixtral": dict(
        _TINY_BASE,
        model_type="mixtral",
        intermediate_size=192,
        vocab_size=1024,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
}


@dataclass(frozen=True)
class Precision:
    """How a dtype flag trains: parameter dtype and autocast dtype (None = no autocast)."""

    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    @classmethod
    def parse(cls, dtype: str, master_weights: bool = True) -> "Precision":
        """fp32; bf16/fp16 = autocast with fp32 master weights (master_weights) or pure
        low-precision parameters; 'bf16-pure' / 'fp16-pure' / '*-autocast' force one."""
        base, _, how = dtype.partition("-")
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}
        if base == "fp32" and not how:
            return cls(torch.float32, None)
        if base not in low or how not in ("", "pure", "autocast"):
            raise UserError(
                f"--dtype {dtype!r}: use fp32, bf16, fp16 (or bf16-pure, "
                "bf16-autocast, fp16-pure, fp16-autocast)"
            )
        pure = how == "pure" or (how == "" and not master_weights)
        return cls(low[base], None) if pure else cls(torch.float32, low[base])

    @property
    def name(self) -> str:
        if self.autocast_dtype is None:
            return {torch.float32: "fp32", torch.bfloat16: "bf16-pure", torch.float16: "fp16-pure"}[
                self.param_dtype
            ]
        return {torch.bfloat16: "bf16-autocast", torch.float16: "fp16-autocast"}[self.autocast_dtype]


def make_config(model_config, attn: str = "sdpa", layers: int | None = None, notes: list | None = None):
    """An HF config from a config.json dict (or a config object), with the attention
    implementation and an optional layer-count override. A multimodal config gives its text
    model's; what differs from what was asked (an attention path transformers lacks for this
    model) is appended to `notes`."""
    from transformers import AutoConfig, PretrainedConfig

    from ..model import text_model_config

    if attn not in ATTENTION:
        raise UserError(f"attention {attn!r}: use one of {', '.join(ATTENTION)}")
    d = model_config.to_dict() if isinstance(model_config, PretrainedConfig) else dict(model_config)
    d, _ = text_model_config(d)
    d["model_type"] = _known_model_type(d)
    quant = d.pop("quantization_config", None)
    if quant and notes is not None:
        # a checkpoint's storage format (DeepSeek-V3's fp8 blocks, GPT-OSS's mxfp4 experts): training
        # loads the weights in the step's dtype, as from_config builds them
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        notes.append(
            f"traced mode: the checkpoint's quantization_config ({method}) is not applied; "
            "parameters are held in the --dtype given"
        )
    if layers is not None:
        d = _with_layers(d, int(layers))
    model_type = d.pop("model_type")
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except Exception as e:  # noqa: BLE001 - the config class's validation (ValueError, field types...)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise UserError(
            f"model config: transformers cannot build model_type {model_type!r} from it "
            f"({'; '.join(lines[:2]) if lines else type(e).__name__})"
        ) from None
    cls = causal_lm_class(cfg)
    if attn == "sdpa" and not getattr(cls, "_supports_sdpa", True):
        attn = "eager"
        if notes is not None:
            notes.append(
                f"traced mode: transformers' {cls.__name__} has no SDPA path; its eager attention "
                "was traced (it keeps the seq x seq scores a flash kernel would not)"
            )
    cfg.use_cache = False
    cfg._attn_implementation = attn
    moe = any(hasattr(cfg, k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    if moe and cls is not None and cls._can_set_experts_implementation():
        # grouped_mm (HF's default for MoE) keeps every shape independent of the routing; the
        # "eager" experts loop slices tokens by data-dependent masks, which fake tensors cannot.
        cfg._experts_implementation = "grouped_mm"
    return cfg


def causal_lm_class(cfg):
    """The transformers class `AutoModelForCausalLM` builds for `cfg` (None if it has none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except KeyError:
        return None


def _known_model_type(d: dict) -> str:
    """The config's model_type, or, for a type transformers does not know whose `architectures`
    names a causal-LM class it has (Kimi-K2: model_type kimi_k2, DeepseekV3ForCausalLM), that
    class's model_type."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = d.get("model_type")
    if not mt:
        raise UserError(
            'model config: no "model_type" (needed to pick the HF architecture); use an HF config.json'
        )
    if mt in CONFIG_MAPPING:
        return mt
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for arch in d.get("architectures") or ():
        types = [t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == arch]
        # several types may share a class: the one whose config class it is named after first
        # (DeepseekV3ForCausalLM -> deepseek_v3 / DeepseekV3Config)
        types.sort(key=lambda t: CONFIG_MAPPING_NAMES.get(t) != arch.replace("ForCausalLM", "Config"))
        if types:
            return types[0]
    raise UserError(
        f"model config: model_type {mt!r} is not known to transformers and its architectures "
        f"{d.get('architectures')!r} name no causal-LM class it has; use a config transformers "
        "can build"
    )


def traced_arch(model_config: dict, name: str = ""):
    """The ArchSpec traced mode reports and checks plans against: the template reader's when
    templates know the family, else the sizes any decoder config states, read from the config
    as transformers fills it in (its defaults included)."""
    from ..model import UnmodelledFamily, arch_from_hf_config, check_config, sizes_from_hf_config

    check_config(model_config, name, family_keys=True)
    try:
        return arch_from_hf_config(model_config, name)
    except UnmodelledFamily:
        pass
    cfg = make_config(model_config, "eager")
    d = cfg.to_dict()
    d["model_type"] = cfg.model_type
    for k in _SIZE_KEYS:  # sizes some config classes hold as properties (Nemotron-H's layer count)
        v = getattr(cfg, k, None)
        if d.get(k) is None and isinstance(v, int) and not isinstance(v, bool):
            d[k] = v
    return sizes_from_hf_config(d, name)


_SIZE_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


def _with_layers(d: dict, layers: int) -> dict:
    """Config dict with `layers` decoder layers; per-layer lists (`layer_types`: Qwen2,
    Gemma...; `no_rope_layers`: Llama 4) and per-layer pattern strings (Nemotron-H's
    `hybrid_override_pattern`) repeat their pattern so HF's validation accepts the new count."""
    d = dict(d)
    key = "n_layer" if d.get("model_type") == "gpt2" else "num_hidden_layers"
    d[key] = layers
    for k in PER_LAYER_KEYS:
        v = d.get(k)
        if isinstance(v, (list, str)) and v:
            rep = [v[i % len(v)] for i in range(layers)]
            d[k] = "".join(rep) if isinstance(v, str) else rep
    return d


PER_LAYER_KEYS = ("layer_types", "no_rope_layers", "hybrid_override_pattern")


def build_model(cfg, param_dtype: torch.dtype = torch.float32, device: str = "meta") -> torch.nn.Module:
    """The causal LM of `cfg` in training mode, on `device` ("meta" for tracing, "cpu" for a
    real run: initialised by HF, then cast)."""
    from transformers import AutoModelForCausalLM

    if device == "meta":
        # No weight initialisation on meta: the values are never read, and HF's init of an
        # 80-layer model costs 1.5 s, more than the rest of a replicated trace.
        from transformers.initialization import no_init_weights

        with torch.device("meta"), no_init_weights():
            model = AutoModelForCausalLM.from_config(cfg)
            model.tie_weights()  # skipped with the initialisation; tied embeddings are one tensor
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(param_dtype).train()


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    from .kernel_policy import saved_ops_for_selective

    return (
        CheckpointPolicy.MUST_SAVE if op in saved_ops_for_selective() else CheckpointPolicy.PREFER_RECOMPUTE
    )


def enable_recompute(model: torch.nn.Module, recompute: str) -> None:
    """Activation checkpointing per decoder layer: none; full (non-reentrant
    `torch.utils.checkpoint`); selective (torch SAC via `create_selective_checkpoint_contexts`:
    matmul and attention outputs saved, everything else recomputed)."""
    if recompute not in RECOMPUTE:
        raise UserError(f"--recompute {recompute!r}: traced mode supports {', '.join(RECOMPUTE)}")
    if recompute == "none":
        return
    kwargs = {"use_reentrant": False}
    if recompute == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def step_inputs(cfg, batch: int, seq: int):
    """The default step's inputs: ``input_ids=ids, labels=ids, use_cache=False`` (one tensor)."""

    def make(_model=None):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return make


def hf_loss(output):
    return output.loss


@contextlib.contextmanager
def fake_tensor_quirks():
    """The one place where transformers is adapted to fake tensors.

    masking_utils.find_packed_sequence_indices: with no attention mask and no cache, it
    decides from position_ids *values* whether sequences are packed. Fake tensors have no
    values, so `is_tracing(fake)` makes it assume packing and build a [B,1,S,S] mask that a
    real run never builds (and that stops SDPA from using is_causal). We run the same ops
    a real run does and return the real run's answer for unpacked inputs (None). Inputs
    with genuinely packed position_ids are therefore not supported by traced mode."""
    import transformers.masking_utils as mu

    original = mu.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids):
        first_dummy_value = position_ids[:, :1] - 1
        position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
        packed_sequence_mask = (position_diff != 1).cumsum(-1)
        (packed_sequence_mask[:, -1] == 0).all()  # the real run's check (its value is unknowable here)
        return None

    mu.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


def optimizer_factory(name: str):
    """adamw / adam / sgd with PyTorch defaults (lr only), or None for 'none'."""
    name = (name or "adamw").lower()
    if name == "none":
        return None
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-4)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=1e-4)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    raise UserError(f"--optimizer {name!r}: traced mode supports adamw, adam, sgd")


def trace_hf_step(
    model_config,
    batch: int,
    seq: int,
    dtype: str = "fp32",
    attn: str = "sdpa",
    recompute: str = "none",
    optimizer: str = "adamw",
    kernel_policy: str = "cuda",
    layers: int | None = None,
    master_weights: bool = True,
    step: str = "steady",
    set_to_none: bool = True,
):
    """Trace the default training step of an HF causal LM built from `model_config`
    (`step`, `set_to_none`: see `step.trace_step`)."""
    from .step import trace_step

    cfg = make_config(model_config, attn, layers)
    prec = Precision.parse(dtype, master_weights)
    return trace_step(
        lambda: build_model(cfg, prec.param_dtype),
        step_inputs(cfg, batch, seq),
        hf_loss,
        optimizer_factory(optimizer),
        kernel_policy,
        autocast_dtype=prec.autocast_dtype,
        prepare=lambda m: enable_recompute(m, recompute),
        patches=fake_tensor_quirks(),
        step=step,
        set_to_none=set_to_none,
    )
