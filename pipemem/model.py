"""Architecture spec of a decoder-only transformer, read from a Hugging Face ``config.json``.

`ArchSpec` holds what the templates need to generate one rank's op-level programs: sizes
(layers, hidden, heads, KV heads, head dim, FFN, experts, vocab), kinds (norm, activation,
position embedding) and switches (biases, tied embeddings, dropout, QK-norm, parallel
residual). It is frozen and hashable, so program caches can key on it.

The vocabulary is stored unpadded; each framework convention pads it its own way
(`pipemem.templates.conventions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from .errors import UserError

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu", "relu", "geglu")

# model_type -> family handled by the same reader.
_LLAMA_LIKE = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo",
    "olmo2",
    "internlm2",
    "yi",
}
_MOE_LLAMA_LIKE = {
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe",
    "olmoe",
}
MODEL_TYPES = tuple(sorted(_LLAMA_LIKE | _MOE_LLAMA_LIKE | {"gpt2", "gpt_neox"}))

# Families transformers builds that template mode does not model yet: what each one lacks, named
# in the refusal (traced mode runs transformers' own modules for them).
UNMODELLED = {"qwen3_next": "gated DeltaNet linear attention", "nemotron_h": "Mamba-2 layers"}


class UnmodelledFamily(UserError):
    """A well-formed config of a family template mode does not model: traced mode can run it."""


def refuse_unmodelled(name: str, model_type: str, feature: str | None = None) -> UnmodelledFamily:
    """The one-line refusal of template mode for a family or feature it does not model."""
    feature = feature or UNMODELLED.get(model_type)
    what = (
        f"template mode does not model {feature} (model_type {model_type!r})"
        if feature
        else f"model_type {model_type!r} has no template family (those: {', '.join(MODEL_TYPES)})"
    )
    return UnmodelledFamily(
        f"config of {name}: {what}; use --mode traced (pipemem estimate), which runs "
        "transformers' own modules"
    )


@dataclass(frozen=True, slots=True)
class ArchSpec:
    name: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense FFN width (intermediate size)
    vocab: int  # unpadded
    norm: str = "rmsnorm"
    activation: str = "swiglu"
    act_fn: str = ""  # the HF name (gelu_new, gelu_pytorch_tanh, silu...): how eager HF computes it
    position: str = "rope"  # rope | learned
    max_positions: int = 0
    tied_embeddings: bool = False
    qkv_bias: bool = False
    out_bias: bool = False  # attention output projection bias
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"  # head: per head (qwen3); proj: over the whole q / k projection (olmo2)
    norm_affine: bool = True  # False: LayerNorm without weight and bias (olmo)
    norm_weight_first: bool = False  # RMSNorm scales by the fp32 weight, then casts (olmo2, gemma), not
    # cast, then scale (llama)
    norm_placement: str = "pre"  # pre: norm -> block -> add; post: block -> norm -> add (olmo2);
    # sandwich: norm -> block -> norm -> add (gemma2)
    parallel_residual: bool = False  # gpt_neox: attention and MLP read the same input
    fused_qkv: bool = False  # the HF module computes q, k, v with one linear (gpt2 c_attn, neox)
    conv1d: bool = False  # HF Conv1D linears (gpt2): `addmm(b, x, W)` saves the parameter W itself
    attn_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embd_dropout: float = 0.0
    # Mixture of experts (experts == 0: dense model)
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0  # count of shared experts (width shared_ffn each, fused)
    shared_ffn: int = 0
    attn_softcap: float = 0.0  # tanh soft-capping of the attention scores (gemma2; 0: none)
    final_softcap: float = 0.0  # tanh soft-capping of the output logits (gemma2; 0: none)
    hf_sdpa: bool = True  # HF's module can run SDPA (gemma2's cannot: HF trains it with eager attention)
    shared_expert_gate: bool = (
        False  # a sigmoid gate [1, hidden] scales the shared expert's output (qwen2_moe)
    )
    router_norm_topk: bool = True  # top-k routing weights renormalised to sum 1 (HF norm_topk_prob)
    router_weights_cast: bool = False  # routing weights cast back to the logits' dtype (HF qwen MoE routers)
    dense_layers: tuple[int, ...] = ()  # layer indices that stay dense in a MoE model
    sliding_window: int = 0  # window of the sliding-window layers (gemma3_text); 0: none modelled
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; kv_lora_rank 0: none). head_dim is then
    # the query / key head, qk_nope_head_dim + qk_rope_head_dim (pipemem/templates/mla.py)
    q_lora_rank: int = 0  # 0: the query is one projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_style: str = "half"  # half (rotate_half) | interleave (DeepSeek-V3) | complex (DeepSeek-V2)
    # group-limited routing (DeepSeek, GLM-4 MoE): top-k within the router_topk_groups best of
    # router_groups expert groups (n_group / topk_group)
    router_groups: int = 1
    router_topk_groups: int = 1
    mtp_layers: int = 0  # multi-token prediction depths (num_nextn_predict_layers / --mtp-num-layers)
    # Newer MoE families (pipemem.model `_newer_moe`): GLM-4 MoE
    rotary_fraction: float = 1.0  # rope over this part of each head (glm4_moe partial_rotary_factor)
    router: str = "softmax"  # softmax | sigmoid_group (glm4_moe: sigmoid scores + correction bias,
    # group-limited top-k over n_group groups, scaled by routed_scaling_factor)
    # (router_groups / router_topk_groups: n_group / topk_group, above)
    routed_scaling: float = 1.0  # routed_scaling_factor
    shared_first: bool = (
        True  # the shared expert runs before the routed ones (qwen2_moe), or after (glm4_moe)
    )
    # GPT-OSS: a learnable sink logit per head, biased experts with a clamped SwiGLU, router bias
    attn_sinks: bool = False
    expert_bias: bool = False  # per-expert gate_up and down biases
    expert_act: str = "swiglu"  # swiglu | clamped_swiglu (gpt_oss: interleaved gate/up, clamp, sigmoid(a x))
    router_linear_bias: bool = False  # the router linear's bias (gpt_oss)
    # Llama 4: NoPE layers (no rope, no q/k norm; their queries scaled by position: temperature
    # tuning), L2 q/k norm without weight after the rope, every token through every expert
    nope_layers: tuple[int, ...] = ()
    attn_temperature: bool = False
    attention_chunk: int = 0  # attention_chunk_size of the chunked layers (0: none)
    expert_compute: str = "sparse"  # sparse (sorted tokens, grouped GEMMs) | dense (HF Llama 4: all experts)
    # periods of the per-layer patterns past the config's layer count (--layers N): 0, none (cut);
    # Llama 4's NoPE layers every no_rope_layer_interval-th (or its per-layer list, repeated), its
    # dense layers between the interleave_moe_layer_step-th
    nope_period: int = 0
    dense_period: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def is_moe_layer(self, index: int) -> bool:
        return self.experts > 0 and index not in self.dense_layers

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def with_layers(self, layers: int) -> "ArchSpec":
        """The same model with `layers` decoder layers (``--layers N``): per-layer patterns are cut,
        or carried on where they repeat (`_extend_pattern`)."""
        dense = _extend_pattern(self.dense_layers, self.dense_period, layers)
        nope = _extend_pattern(self.nope_layers, self.nope_period, layers)
        return replace(self, layers=layers, dense_layers=dense, nope_layers=nope)

    def param_count(self) -> int:
        """Unsharded parameter count with the unpadded vocabulary (for reports and tests)."""
        total = sum(
            math.prod(s) for _, s in embedding_param_shapes(self, self.vocab, tp=1, head=True).items()
        )
        dense = [i for i in self.dense_layers if i < self.layers] if self.is_moe else []
        moe_index = next((i for i in range(len(dense) + 1) if i not in dense), 0)
        kinds = (
            ((moe_index, self.layers - len(dense)), (dense[0], len(dense)))
            if self.is_moe and dense
            else ((moe_index, self.layers),)
        )
        for index, n in kinds:  # one layer of each kind: the cost does not grow with the layer count
            total += n * sum(
                math.prod(s) for _, (s, _e) in layer_param_shapes(self, index, tp=1, etp=1, ep=1).items()
            )
        return total


def _extend_pattern(indices: tuple[int, ...], period: int, layers: int) -> tuple[int, ...]:
    """The layer indices of a per-layer pattern over `layers` layers: a pattern with a period
    carries on with it (as the config class builds it for any layer count, or as a per-layer
    list repeats), any other is cut (DeepSeek's first k dense layers stay the first k)."""
    if period:
        members = {i % period for i in indices}
        return tuple(i for i in range(layers) if i % period in members)
    return tuple(i for i in indices if i < layers)


class _Reader:
    """Reads keys from a config dict; a missing required key is a UserError naming it."""

    def __init__(self, config: Mapping[str, Any], name: str):
        self.c = config
        self.name = name or str(config.get("_name_or_path") or config.get("model_type") or "model")

    def req(self, *keys: str) -> Any:
        for k in keys:
            v = self.c.get(k)
            if v is not None:
                return v
        alts = " or ".join(repr(k) for k in keys)
        raise UserError(
            f"config of {self.name}: missing key {alts} (model_type {self.c.get('model_type')!r}); "
            "add it to the config (a Hugging Face config.json of the model has it)"
        )

    def opt(self, key: str, default: Any) -> Any:
        v = self.c.get(key)
        return default if v is None else v

    def pos_int(self, *keys: str) -> int:
        v = self.req(*keys)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UserError(f"config of {self.name}: {keys[0]!r} must be a positive integer, got {v!r}")
        return v

    def gqa_heads(self) -> tuple[int, int, int]:
        """(hidden_size, num_attention_heads, num_key_value_heads): the key-value heads (default
        one per head) must divide the heads."""
        hidden = self.pos_int("hidden_size")
        heads = self.pos_int("num_attention_heads")
        kv = int(self.opt("num_key_value_heads", heads))
        if kv <= 0 or heads % kv:
            raise UserError(
                f"config of {self.name}: num_key_value_heads={kv} must be positive and divide "
                f"num_attention_heads={heads}"
            )
        return hidden, heads, kv

    def spec(self, model_type: str, **fields) -> ArchSpec:
        """The ArchSpec of a family's `fields`, with what the families read alike where `fields`
        does not give it: the reader's name, vocab_size, num_hidden_layers, the longest position
        (max_position_embeddings, 0 when unknown) and untied embeddings unless the config ties
        them."""
        if "layers" not in fields:
            fields["layers"] = self.pos_int("num_hidden_layers")
        if "max_positions" not in fields:
            fields["max_positions"] = int(self.opt("max_position_embeddings", 0) or 0)
        if "tied_embeddings" not in fields:
            fields["tied_embeddings"] = bool(self.opt("tie_word_embeddings", False))
        return ArchSpec(name=self.name, model_type=model_type, vocab=self.pos_int("vocab_size"), **fields)


def _activation(act: str, gated: bool, name: str) -> str:
    a = str(act).lower()
    if a in ("silu", "swish"):
        return "swiglu" if gated else "gelu"  # ungated silu is rare; treat like gelu (same saves)
    if a.startswith("gelu"):
        return "geglu" if gated else "gelu"
    if a == "relu":
        return "relu"
    raise UserError(f"config of {name}: activation {act!r} not supported; use silu, gelu or relu")


def arch_from_hf_config(config: Mapping[str, Any], name: str = "") -> ArchSpec:
    """ArchSpec from a Hugging Face config dict (the contents of ``config.json``)."""
    if not isinstance(config, Mapping):
        raise UserError("model config must be a JSON object (the contents of an HF config.json)")
    config, _ = text_model_config(config)
    mt = config.get("model_type")
    if str(mt).lower() in _HF_DEFAULTS:
        config = {**_HF_DEFAULTS[str(mt).lower()], **{k: v for k, v in config.items() if v is not None}}
    r = _Reader(config, name)
    if mt is None:
        raise UserError(f"config of {r.name}: missing key 'model_type'; supported: {', '.join(MODEL_TYPES)}")
    mt = str(mt).lower()
    if mt == "gpt2":
        return _gpt2(r)
    if mt == "gpt_neox":
        return _gpt_neox(r)
    if mt == "gpt_oss":
        return _gpt_oss(r)
    if mt == "llama4_text":
        return _llama4_text(r)
    if mt in _NEWER_MOE:
        return _newer_moe(r, mt)
    if mt in _LLAMA_LIKE or mt in _MOE_LLAMA_LIKE:
        return _llama_like(r, mt)
    raise refuse_unmodelled(r.name, mt)


# Multimodal configs whose text model trains as a causal LM: model_type -> the text config's type
_TEXT_MODEL = {"gemma3": "gemma3_text", "llama4": "llama4_text"}


def text_model_config(config: Mapping[str, Any]) -> tuple[dict, str | None]:
    """A multimodal config (a `text_config` inside: Gemma 3, Llama 4) -> the config of its text
    model and a note saying so; any other config unchanged, with no note."""
    text = config.get("text_config")
    mt = str(config.get("model_type") or "").lower()
    if not isinstance(text, Mapping) or not (mt in _TEXT_MODEL or text.get("model_type")):
        return dict(config), None
    out = dict(text)
    out.setdefault("model_type", _TEXT_MODEL.get(mt))
    for k in ("_pipemem_source", "_pipemem_note", "_name_or_path", "tie_word_embeddings"):
        if k in config and k not in out:
            out[k] = config[k]
    note = (
        f"model_type {mt!r} is multimodal: its text model ({out['model_type']}) is estimated; the "
        "vision encoder's parameters and activations are not counted"
    )
    return out, note


# DeepSeek-V2's multi-head latent attention and routed experts (V3 and Kimi K2 are built alike)
_MLA_MOE_KEYS = (
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
# Keys without which transformers would build a different model from its defaults, per family
_FAMILY_KEYS = {
    "deepseek_v2": _MLA_MOE_KEYS,
    "deepseek_v3": _MLA_MOE_KEYS,
    "kimi_k2": _MLA_MOE_KEYS,
    "glm4_moe": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "gpt_oss": ("num_local_experts", "num_experts_per_tok"),
    "olmoe": ("num_experts", "num_experts_per_tok"),
    "llama4_text": ("num_local_experts", "num_experts_per_tok"),
    "qwen3_next": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
}
_MLA_KEYS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
# per-layer lists, one entry per decoder layer
_PER_LAYER_KEYS = ("layer_types", "no_rope_layers")


def check_config(config: Mapping[str, Any], name: str = "", family_keys: bool = False) -> None:
    """Consistency of the keys the newer families read (multi-head latent attention, grouped
    routing, per-layer lists), for every mode: one UserError naming the key. `family_keys`:
    also require the keys whose absence would make transformers build its default shapes
    (traced mode builds from transformers' defaults)."""
    r = _Reader(config, name)
    mt = str(config.get("model_type") or "").lower()
    if family_keys:
        missing = [k for k in _FAMILY_KEYS.get(mt, ()) if k not in config]
        if missing:
            raise UserError(
                f"config of {r.name}: missing key {missing[0]!r} (model_type {mt!r} needs "
                f"{', '.join(repr(k) for k in _FAMILY_KEYS[mt])}); transformers would build its "
                "default shapes without it; add it from the model's config.json"
            )
    if config.get("kv_lora_rank"):  # multi-head latent attention
        for k in _MLA_KEYS:
            r.pos_int(k)
        heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
        if kv is not None and heads is not None and kv != heads:
            raise UserError(
                f"config of {r.name}: num_key_value_heads={kv} must equal num_attention_heads="
                f"{heads} with multi-head latent attention (kv_lora_rank): K and V are "
                "up-projected per head"
            )
    experts = next((config[k] for k in _EXPERT_KEYS if config.get(k) is not None), None)
    n_group = config.get("n_group")
    if experts is not None and n_group is not None:
        if not isinstance(n_group, int) or n_group <= 0 or not isinstance(experts, int) or experts % n_group:
            raise UserError(
                f"config of {r.name}: n_group={n_group!r} must be a positive divisor of the "
                f"{experts!r} routed experts (group-limited routing splits them into equal "
                "groups)"
            )
        topk_group = config.get("topk_group")
        if topk_group is not None and not (isinstance(topk_group, int) and 0 < topk_group <= n_group):
            raise UserError(
                f"config of {r.name}: topk_group={topk_group!r} must be in 1..{n_group} (n_group)"
            )
    top_k = config.get("num_experts_per_tok")
    if (
        experts is not None
        and top_k is not None
        and isinstance(experts, int)
        and isinstance(top_k, int)
        and not 0 < top_k <= experts
    ):
        raise UserError(f"config of {r.name}: num_experts_per_tok={top_k} must be in 1..{experts} (experts)")
    layers = config.get("num_hidden_layers")
    for k in _PER_LAYER_KEYS:
        v = config.get(k)
        if k == "no_rope_layers" and v == []:  # Llama 4: empty = transformers' default pattern
            continue
        if isinstance(layers, int) and v is not None and (not isinstance(v, list) or len(v) != layers):
            got = f"{len(v)} entries" if isinstance(v, list) else type(v).__name__
            raise UserError(
                f"config of {r.name}: {k!r} must list one entry per layer (num_hidden_layers="
                f"{layers}), got {got}"
            )
    first_dense = config.get("first_k_dense_replace")
    if isinstance(layers, int) and isinstance(first_dense, int) and not 0 <= first_dense <= layers:
        raise UserError(
            f"config of {r.name}: first_k_dense_replace={first_dense} must be in 0..{layers} "
            "(num_hidden_layers)"
        )


def sizes_from_hf_config(config: Mapping[str, Any], name: str = "") -> ArchSpec:
    """An ArchSpec of the sizes any decoder LM config states (layers, hidden, heads, head dim,
    FFN, experts, vocabulary), for a family template mode does not model: what traced mode
    reports and checks a plan against. Reads `config` as transformers filled it in."""
    r = _Reader(config, name)
    hidden = r.pos_int("hidden_size", "n_embd", "d_model")
    heads = r.pos_int("num_attention_heads", "n_head")
    kv = int(r.opt("num_key_value_heads", heads) or heads)
    # MLA: the query / key head (nope + rope parts); transformers' DeepSeek configs set head_dim to
    # the rope part alone
    mla = (
        (r.opt("qk_nope_head_dim", 0) or 0) + (r.opt("qk_rope_head_dim", 0) or 0)
        if config.get("kv_lora_rank")
        else 0
    )
    head_dim = mla or r.opt("head_dim", None) or hidden // heads
    experts = int(next((config[k] for k in _EXPERT_KEYS if config.get(k)), 0) or 0)
    layers = r.pos_int("num_hidden_layers", "n_layer")
    first_dense = int(r.opt("first_k_dense_replace", 0) or 0)
    return r.spec(
        str(config.get("model_type") or "model"),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=int(head_dim),
        ffn=int(r.opt("intermediate_size", 0) or r.opt("n_inner", 0) or 0),
        experts=experts,
        top_k=int(r.opt("num_experts_per_tok", 0) or 0) if experts else 0,
        expert_ffn=int(r.opt("moe_intermediate_size", 0) or r.opt("intermediate_size", 0) or 0)
        if experts
        else 0,
        dense_layers=tuple(range(min(first_dense, layers))) if experts else (),
    )


def _gpt2(r: _Reader) -> ArchSpec:
    hidden = r.pos_int("n_embd", "hidden_size")
    heads = r.pos_int("n_head", "num_attention_heads")
    _check_div(r, hidden, heads, "n_embd", "n_head")
    inner = r.opt("n_inner", None) or 4 * hidden
    bias = bool(
        r.opt("add_bias_linear", True)
    )  # Megatron's --disable-bias-linear (HF GPT-2 always has biases)
    return r.spec(
        "gpt2",
        layers=r.pos_int("n_layer", "num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        ffn=int(inner),
        norm="layernorm",
        activation=_activation(r.opt("activation_function", "gelu_new"), False, r.name),
        act_fn=str(r.opt("activation_function", "gelu_new")),
        position="learned",
        max_positions=int(r.opt("n_positions", r.opt("max_position_embeddings", 0))),
        tied_embeddings=bool(r.opt("tie_word_embeddings", True)),
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=bias,
        fused_qkv=True,
        conv1d=True,
        attn_dropout=float(r.opt("attn_pdrop", 0.1)),
        hidden_dropout=float(r.opt("resid_pdrop", 0.1)),
        embd_dropout=float(r.opt("embd_pdrop", 0.1)),
    )


def _gpt_neox(r: _Reader) -> ArchSpec:
    hidden = r.pos_int("hidden_size")
    heads = r.pos_int("num_attention_heads")
    _check_div(r, hidden, heads, "hidden_size", "num_attention_heads")
    return r.spec(
        "gpt_neox",
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        ffn=r.pos_int("intermediate_size"),
        norm="layernorm",
        activation=_activation(r.opt("hidden_act", "gelu"), False, r.name),
        position="rope",
        act_fn=str(r.opt("hidden_act", "gelu")),
        qkv_bias=bool(r.opt("attention_bias", True)),
        out_bias=bool(r.opt("attention_bias", True)),
        mlp_bias=True,
        parallel_residual=bool(r.opt("use_parallel_residual", True)),
        fused_qkv=True,
        attn_dropout=float(r.opt("attention_dropout", 0.0)),
        hidden_dropout=float(r.opt("hidden_dropout", 0.0)),
    )


# HF config classes whose head_dim default is a number, not hidden_size / num_attention_heads
_HF_HEAD_DIM = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}
# ... and whose activation default is not silu
_HF_ACT = {"gemma": "gelu_pytorch_tanh", "gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh"}
# Defaults of config classes whose published config.json files leave shape keys out (Gemma 3's
# text configs: transformers 5.24 Gemma3TextConfig)
_HF_DEFAULTS = {
    "gemma3_text": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
    }
}
_GEMMA = ("gemma", "gemma2", "gemma3_text")


def _softcap(r: _Reader, key: str, default: float) -> float:
    """A soft-capping value: HF's default when the key is absent, none when it is null."""
    v = r.c[key] if key in r.c else default
    return float(v) if v else 0.0


def _llama_like(r: _Reader, mt: str) -> ArchSpec:
    c = r.c
    if c.get("kv_lora_rank") or c.get("q_lora_rank"):
        if mt not in _MLA_FAMILIES:
            raise refuse_unmodelled(r.name, mt, "multi-head latent attention (key 'kv_lora_rank')")
        return _deepseek_mla(r, mt)
    hidden, heads, kv = r.gqa_heads()
    head_dim = c.get("head_dim", _HF_HEAD_DIM.get(mt))
    if head_dim is None:
        _check_div(r, hidden, heads, "hidden_size", "num_attention_heads")
        head_dim = hidden // heads
    layers = r.pos_int("num_hidden_layers")
    experts = top_k = expert_ffn = shared = shared_ffn = 0
    shared_gate = False
    dense_layers: tuple[int, ...] = ()
    if mt in _MOE_LLAMA_LIKE:
        experts = int(r.req("num_local_experts", "num_experts", "n_routed_experts"))
        top_k = int(r.req("num_experts_per_tok", "num_experts_per_token"))
        if experts <= 0 or not 0 < top_k <= experts:
            raise UserError(
                f"config of {r.name}: num_experts_per_tok={top_k} must be in 1..{experts} (experts)"
            )
        if mt == "mixtral":
            expert_ffn = r.pos_int("intermediate_size")
        else:
            expert_ffn = r.pos_int("moe_intermediate_size")
        if mt == "qwen2_moe":
            shared_ffn = int(r.opt("shared_expert_intermediate_size", 0))
            shared = 1 if shared_ffn else 0
            shared_gate = bool(shared)  # Qwen2MoeSparseMoeBlock.shared_expert_gate
        elif mt.startswith("deepseek") or mt == "kimi_k2":
            shared = int(r.opt("n_shared_experts", 0))
            shared_ffn = expert_ffn if shared else 0
        first_dense = int(r.opt("first_k_dense_replace", 0))
        step = int(r.opt("decoder_sparse_step", r.opt("moe_layer_freq", 1)) or 1)
        mlp_only = set(r.opt("mlp_only_layers", []) or [])
        dense_layers = tuple(
            i for i in range(layers) if i < first_dense or i in mlp_only or (step > 1 and (i + 1) % step != 0)
        )
    needs_dense_ffn = experts == 0 or bool(dense_layers)
    ffn = r.pos_int("intermediate_size") if needs_dense_ffn or "intermediate_size" in c else 0
    qkv_bias = bool(r.opt("attention_bias", mt in ("qwen2", "qwen2_moe")))
    act_fn = str(r.opt("hidden_act", None) or r.opt("hidden_activation", None) or _HF_ACT.get(mt, "silu"))
    return r.spec(
        mt,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=int(head_dim),
        # olmo: LayerNorm in fp32 without weight or bias (OlmoLayerNorm)
        ffn=ffn,
        norm="layernorm" if mt == "olmo" else "rmsnorm",
        norm_affine=mt != "olmo",
        activation=_activation(act_fn, True, r.name),
        act_fn=act_fn,
        position="rope",
        # HF's config classes tie by default only for gemma / gemma2
        tied_embeddings=bool(r.opt("tie_word_embeddings", mt in _GEMMA)),
        qkv_bias=qkv_bias,
        out_bias=bool(r.opt("attention_bias", False)) and mt not in ("qwen2", "qwen2_moe"),
        mlp_bias=bool(r.opt("mlp_bias", False)),
        qk_norm=mt in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text") or bool(r.opt("qk_layernorm", False)),
        qk_norm_scope="proj" if mt == "olmo2" else "head",
        norm_placement={"olmo2": "post", "gemma2": "sandwich", "gemma3_text": "sandwich"}.get(mt, "pre"),
        norm_weight_first=mt in ("olmo2",) + _GEMMA,
        attn_dropout=float(r.opt("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        experts=experts,
        top_k=top_k,
        expert_ffn=expert_ffn,
        shared_experts=shared,
        shared_ffn=shared_ffn,
        shared_expert_gate=shared_gate,
        attn_softcap=_softcap(r, "attn_logit_softcapping", 50.0 if mt == "gemma2" else 0)
        if mt in _GEMMA[1:]
        else 0.0,
        final_softcap=_softcap(r, "final_logit_softcapping", 30.0 if mt == "gemma2" else 0)
        if mt in _GEMMA[1:]
        else 0.0,
        # Gemma 3: local layers attend to a window, global ones to everything
        sliding_window=int(r.opt("sliding_window", 0) or 0) if mt == "gemma3_text" else 0,
        hf_sdpa=mt != "gemma2",
        # HF routers: Mixtral always renormalises its fp32 top-k weights; the Qwen MoE routers
        # only with norm_topk_prob (their configs default it off) and cast them to the logits' dtype
        router_norm_topk=mt == "mixtral"
        or bool(r.opt("norm_topk_prob", mt not in ("qwen2_moe", "qwen3_moe"))),
        router_weights_cast=mt in ("qwen2_moe", "qwen3_moe"),
        dense_layers=dense_layers,
    )


_MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
_MLA_DEFAULTS = {
    "v3": {"n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4},
    "v2": {"n_shared_experts": 2, "first_k_dense_replace": 0},
}


def _deepseek_mla(r: _Reader, mt: str) -> ArchSpec:
    """DeepSeek-V2 / V3 and Kimi-K2 (transformers' DeepseekV2 / DeepseekV3 modules): multi-head
    latent attention, shared experts beside the routed ones, `first_k_dense_replace` dense layers;
    V3's sigmoid router with its score-correction bias and group-limited top-k, V2's softmax
    router (greedy, or group-limited greedy)."""
    c = r.c
    check_config(c, r.name)
    if "kv_lora_rank" not in c or not c.get("kv_lora_rank"):
        raise UserError(
            f"config of {r.name}: 'q_lora_rank' without 'kv_lora_rank': multi-head latent attention "
            "needs kv_lora_rank (the key / value latent's width)"
        )
    if r.opt("attention_bias", False):
        raise refuse_unmodelled(r.name, mt, "multi-head latent attention with attention_bias")
    if "q_lora_rank" not in c:
        raise UserError(
            f"config of {r.name}: missing key 'q_lora_rank' (null when the query has no low-rank "
            "projection, as DeepSeek-V2-Lite); transformers would build its default of 1536"
        )
    v3 = mt != "deepseek_v2"
    # transformers' config defaults (DeepseekV2Config / DeepseekV3Config, 5.24) for the keys
    # the generic MoE reader reads with other defaults
    defaults = _MLA_DEFAULTS["v3" if v3 else "v2"]
    c = {k: v for k, v in c.items() if k not in ("kv_lora_rank", "q_lora_rank")}
    for k, v in defaults.items():
        if c.get(k) is None:
            c[k] = v
    base = _llama_like(_Reader(c, r.name), mt)
    nope, rope = r.pos_int("qk_nope_head_dim"), r.pos_int("qk_rope_head_dim")
    heads = base.heads
    if base.kv_heads != heads:
        raise UserError(
            f"config of {r.name}: num_key_value_heads={base.kv_heads} must equal num_attention_heads="
            f"{heads} with multi-head latent attention (kv_lora_rank)"
        )
    experts = base.experts
    groups = int(c.get("n_group") or 1)
    topk_groups = int(c.get("topk_group") or groups)
    method = str(r.opt("topk_method", "greedy" if not v3 else "noaux_tc"))
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise UserError(f"config of {r.name}: topk_method {method!r}: use greedy or group_limited_greedy")
    if not v3 and method == "greedy":
        groups = topk_groups = 1
    if experts and experts % groups:
        raise UserError(f"config of {r.name}: n_group={groups} must divide the {experts} routed experts")
    if not 0 < topk_groups <= groups:
        raise UserError(f"config of {r.name}: topk_group={topk_groups} must be in 1..{groups} (n_group)")
    if rope % 2:
        raise UserError(f"config of {r.name}: qk_rope_head_dim={rope} must be even (rotary pairs)")
    return replace(
        base,
        head_dim=nope + rope,
        q_lora_rank=int(r.c.get("q_lora_rank") or 0),
        kv_lora_rank=r.pos_int("kv_lora_rank"),
        qk_rope_head_dim=rope,
        v_head_dim=r.pos_int("v_head_dim"),
        rope_style=("interleave" if r.opt("rope_interleave", True) else "half") if v3 else "complex",
        # V3: DeepseekV3TopkRouter, the router GLM-4 MoE copies (templates/moe.py); V2 softmax
        router="sigmoid_group" if v3 else "softmax",
        router_groups=groups,
        router_topk_groups=topk_groups,
        routed_scaling=float(r.opt("routed_scaling_factor", 1.0)),
        router_norm_topk=bool(r.opt("norm_topk_prob", True)) if v3 else False,
        mtp_layers=int(r.opt("num_nextn_predict_layers", 0) or 0),
    )


def _check_div(r: _Reader, a: int, b: int, ka: str, kb: str) -> None:
    if a % b:
        raise UserError(
            f"config of {r.name}: {ka}={a} is not divisible by {kb}={b}; add 'head_dim' to the config"
        )


# Parameter shapes of one rank's shard -----------------------------------------------------
# Each decoder-layer entry is `name -> (shape, is_expert)`: expert weights are sharded over ep
# and etp and their gradients reduced over the expert-data-parallel group; the rest over tp
# and dp. Norm weights and the router are replicated across tp.


def layer_param_shapes(
    arch, index: int, tp: int, etp: int, ep: int
) -> dict[str, tuple[tuple[int, ...], bool]]:
    h, d = arch.hidden, arch.head_dim
    a = arch.heads // tp
    kv = arch.kv_heads // tp if arch.kv_heads >= tp else 1
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    ln_parts = (2 if arch.norm == "layernorm" else 1) if arch.norm_affine else 0
    out["input_norm"] = ((ln_parts * h,), False)
    out["post_attention_norm"] = ((ln_parts * h,), False)
    if arch.kv_lora_rank:
        out.update(mla_param_shapes(arch, tp))
    else:
        out["qkv"] = (((a + 2 * kv) * d, h), False)
        if arch.qkv_bias:
            out["qkv_bias"] = (((a + 2 * kv) * d,), False)
        out["o_proj"] = ((h, a * d), False)
    if arch.out_bias:
        out["o_proj_bias"] = ((h,), False)
    if arch.attn_sinks:
        out["sinks"] = ((a,), False)
    if arch.qk_norm and arch.qk_norm_scope != "l2":  # Llama 4's L2 norm has no weight
        out["qk_norm"] = (((a + kv) * d if arch.qk_norm_scope == "proj" else 2 * d,), False)
    if arch.norm_placement == "sandwich":  # gemma2: a second norm around each block
        out["sandwich_norms"] = ((2 * ln_parts * h,), False)
    gated = arch.activation in ("swiglu", "geglu")
    if arch.is_moe_layer(index):
        e = arch.experts // ep
        f = arch.expert_ffn // etp
        out["router"] = ((arch.experts, h), False)
        out["experts"] = ((e, (3 if gated else 2) * f, h), True)
        if arch.expert_bias:
            out["expert_bias"] = ((e, (2 if gated else 1) * f + h), True)
        if arch.router_linear_bias:
            out["router_bias"] = ((arch.experts,), False)
        if arch.shared_experts:
            sf = arch.shared_experts * arch.shared_ffn // tp
            out["shared_mlp"] = (((3 if gated else 2) * sf, h), False)
            if arch.shared_expert_gate:
                out["shared_gate"] = ((1, h), False)
    else:
        f = arch.ffn // tp
        out["mlp"] = (((3 if gated else 2) * f, h), False)
        if arch.mlp_bias:
            out["mlp_bias"] = (((2 if gated else 1) * f + h,), False)
    return out


def layer_param_tensors(
    arch, index: int, tp: int, etp: int, ep: int, fused_qkv: bool, fused_gate_up: bool
) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, is_expert) of each parameter tensor of one decoder layer as the framework's modules
    hold them (what the caching allocator sees: one block per tensor): `layer_param_shapes`'
    lumps split where the modules keep separate tensors. q / k / v as three projections unless
    `fused_qkv` (Megatron's linear_qkv); gate / up / down as three unless `fused_gate_up`
    (Megatron's linear_fc1 holds gate and up, linear_fc2 the down projection); a LayerNorm's
    weight and bias, q and k norms, and the MLP biases each their own tensor. Experts stay one
    entry per layer (their total; grouped expert weights)."""
    h, d = arch.hidden, arch.head_dim
    a = arch.heads // tp
    kv = arch.kv_heads // tp if arch.kv_heads >= tp else 1
    gated = arch.activation in ("swiglu", "geglu")
    ln_parts = (2 if arch.norm == "layernorm" else 1) if arch.norm_affine else 0

    def mlp(f: int, bias: bool) -> list:
        if gated and not fused_gate_up:
            mats = [(f, h), (f, h), (h, f)]
            biases = [(f,), (f,), (h,)]
        else:
            mats = [((2 if gated else 1) * f, h), (h, f)]
            biases = [((2 if gated else 1) * f,), (h,)]
        return mats + (biases if bias else [])

    out: list[tuple[tuple[int, ...], bool]] = []
    for name, (shape, expert) in layer_param_shapes(arch, index, tp, etp, ep).items():
        if name in ("input_norm", "post_attention_norm", "sandwich_norms"):
            parts = ln_parts * (2 if name == "sandwich_norms" else 1)
            out += [((h,), False)] * parts
        elif name == "qkv" and not fused_qkv:
            out += [((a * d, h), False), ((kv * d, h), False), ((kv * d, h), False)]
        elif name == "qkv_bias" and not fused_qkv:
            out += [((a * d,), False), ((kv * d,), False), ((kv * d,), False)]
        elif name == "qk_norm":
            q, k = (a * d, kv * d) if arch.qk_norm_scope == "proj" else (d, d)
            out += [((q,), False), ((k,), False)]
        elif name == "mlp":
            out += [(x, False) for x in mlp(arch.ffn // tp, arch.mlp_bias)]
        elif name == "mlp_bias":
            continue  # with the MLP's matrices, above
        elif name == "shared_mlp":
            out += [(x, False) for x in mlp(arch.shared_experts * arch.shared_ffn // tp, False)]
        else:
            out.append((shape, expert))
    return out


def mla_param_shapes(arch, tp: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Multi-head latent attention's parameters on one rank: the down projections and their norms
    replicated, the up projections split by heads (column-parallel), the output row-parallel."""
    h, a = arch.hidden, arch.heads // tp
    nope = arch.head_dim - arch.qk_rope_head_dim
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    if arch.q_lora_rank:
        out["q_a_proj"] = ((arch.q_lora_rank, h), False)
        out["q_a_layernorm"] = ((arch.q_lora_rank,), False)
        out["q_b_proj"] = ((a * arch.head_dim, arch.q_lora_rank), False)
    else:
        out["q_proj"] = ((a * arch.head_dim, h), False)
    out["kv_a_proj_with_mqa"] = ((arch.kv_lora_rank + arch.qk_rope_head_dim, h), False)
    out["kv_a_layernorm"] = ((arch.kv_lora_rank,), False)
    out["kv_b_proj"] = ((a * (nope + arch.v_head_dim), arch.kv_lora_rank), False)
    out["o_proj"] = ((h, a * arch.v_head_dim), False)
    return out


def mtp_param_shapes(
    arch, padded_vocab: int, tp: int, etp: int, ep: int, with_embedding: bool
) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, is_expert) of the parameters of megatron-core's multi-token prediction block on
    the last stage (`arch.mtp_layers` depths): per depth its enorm, hnorm, eh_proj (column
    parallel, 2h -> h), one layer of the decoder's last layer kind and its final norm; with
    `with_embedding`, the stage's own copy of the word embedding (a stage without the first)."""
    h = arch.hidden
    out: list[tuple[tuple[int, ...], bool]] = []
    for _ in range(arch.mtp_layers):
        out += [((h,), False), ((h,), False), ((h // tp, 2 * h), False), ((h,), False)]
        out += list(layer_param_shapes(arch, arch.layers - 1, tp, etp, ep).values())
    if with_embedding and arch.mtp_layers:
        out.append(((padded_vocab // tp, h), False))
    return out


def embedding_param_shapes(arch, padded_vocab: int, tp: int, head: bool) -> dict[str, tuple[int, ...]]:
    """Word (and learned position) embedding; with `head`, also the final norm and output
    layer (the output layer is a separate weight unless tied on a single stage)."""
    h = arch.hidden
    out = {"word_embeddings": (padded_vocab // tp, h)}
    if arch.position == "learned":
        out["position_embeddings"] = (arch.max_positions, h)
    if head:
        out.update(head_param_shapes(arch, padded_vocab, tp, same_stage_as_embedding=True))
    return out


def head_param_shapes(
    arch, padded_vocab: int, tp: int, same_stage_as_embedding: bool
) -> dict[str, tuple[int, ...]]:
    """Final norm and output layer. Tied embeddings share the word embedding on the same stage;
    on a different stage (pp > 1) the last stage holds its own copy (Megatron)."""
    h = arch.hidden
    out = {"final_norm": ((2 if arch.norm == "layernorm" else 1) * h * arch.norm_affine,)}
    if not (arch.tied_embeddings and same_stage_as_embedding):
        out["output_layer"] = (padded_vocab // tp, h)
    return out


# Newer MoE families -------------------------------------------------------------------------
# GLM-4 MoE and OLMoE read as Llama-like MoE models, then what their HF modules do differently
# (transformers 5.24 modeling_glm4_moe.py, modeling_olmoe.py).

# defaults of their config classes for the keys that change the layers (Glm4MoeConfig, OlmoeConfig)
_NEWER_MOE = {
    "glm4_moe": {
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "use_qk_norm": False,
        "attention_bias": False,
    },
    "olmoe": {"norm_topk_prob": False, "attention_bias": False},
}


def _newer_moe(r: _Reader, mt: str) -> ArchSpec:
    """GLM-4 MoE: q/k/v biases with `attention_bias` (o_proj never), per-head q/k RMSNorm with
    `use_qk_norm`, rope over `partial_rotary_factor` of each head (default 0.5), the first
    `first_k_dense_replace` layers dense, a sigmoid router in fp32 with a correction bias and
    group-limited top-k, shared experts (n_shared_experts x moe_intermediate_size) added after the
    routed ones. OLMoE: q/k RMSNorm over the whole projections, experts of width
    `intermediate_size`, softmax router whose top-k weights are cast to the logits' dtype."""
    c = {**_NEWER_MOE[mt], **{k: v for k, v in r.c.items() if v is not None}}
    r = _Reader(c, r.name)
    if mt == "olmoe":
        if c.get("clip_qkv") is not None:
            raise refuse_unmodelled(r.name, mt, "OLMoE's in-place clamp of q, k, v (key 'clip_qkv')")
        # the Llama reader takes OLMoE's experts as intermediate_size wide (its expert width)
        c.setdefault("moe_intermediate_size", r.pos_int("intermediate_size"))
        spec = _llama_like(_Reader(c, r.name), mt)
        return replace(
            spec,
            qk_norm=True,
            qk_norm_scope="proj",
            router_norm_topk=bool(c["norm_topk_prob"]),
            router_weights_cast=True,
        )
    spec = _llama_like(r, mt)
    experts = spec.experts
    groups, topk_groups = int(r.pos_int("n_group")), int(r.pos_int("topk_group"))
    if experts % groups or topk_groups > groups:
        raise UserError(
            f"config of {r.name}: n_group={groups} must divide the {experts} routed experts and "
            f"topk_group={topk_groups} be at most n_group"
        )
    if experts // groups < 2:
        raise UserError(
            f"config of {r.name}: n_group={groups} leaves fewer than 2 experts per group (GLM-4 MoE's "
            "router scores each group by its best two experts)"
        )
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    fraction = c.get(
        "partial_rotary_factor", rope.get("partial_rotary_factor", 0.5) if isinstance(rope, Mapping) else 0.5
    )
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise UserError(f"config of {r.name}: partial_rotary_factor must be in (0, 1], got {fraction!r}")
    shared = int(c["n_shared_experts"])
    return replace(
        spec,
        qk_norm=bool(c["use_qk_norm"]),
        qkv_bias=bool(c["attention_bias"]),
        out_bias=False,
        shared_experts=1 if shared else 0,  # one MLP n_shared_experts x moe_intermediate_size wide
        shared_ffn=shared * spec.expert_ffn,
        router="sigmoid_group",
        router_groups=groups,
        router_topk_groups=topk_groups,
        routed_scaling=float(c["routed_scaling_factor"]),
        router_norm_topk=bool(c["norm_topk_prob"]),
        router_weights_cast=False,
        rotary_fraction=float(fraction),
        shared_first=False,
        mtp_layers=int(r.opt("num_nextn_predict_layers", 0) or 0),
    )


def _gpt_oss(r: _Reader) -> ArchSpec:
    """GPT-OSS (transformers 5.24 modeling_gpt_oss.py): every layer MoE; attention with q/k/v/o
    biases (`attention_bias`, default on), a learnable sink logit per head and no SDPA path (HF
    trains it with eager attention, where a sliding-window layer differs from a full one only
    in its mask: same tensors saved); RMSNorm scaling by the fp32 weight before the cast; a
    router with a bias (top-k of the logits, softmax over those k); experts
    `intermediate_size` wide with biases and a clamped SwiGLU over interleaved gate / up columns."""
    c = r.c
    hidden = r.pos_int("hidden_size")
    heads = r.pos_int("num_attention_heads")
    kv = int(r.opt("num_key_value_heads", 8))
    if kv <= 0 or heads % kv:
        raise UserError(
            f"config of {r.name}: num_key_value_heads={kv} must be positive and divide "
            f"num_attention_heads={heads}"
        )
    experts = r.pos_int("num_local_experts")
    top_k = r.pos_int("num_experts_per_tok")
    if top_k > experts:
        raise UserError(f"config of {r.name}: num_experts_per_tok={top_k} must be in 1..{experts} (experts)")
    if c.get("output_router_logits"):
        raise refuse_unmodelled(r.name, "gpt_oss", "GPT-OSS's router auxiliary loss (output_router_logits)")
    bias = bool(r.opt("attention_bias", True))
    return r.spec(
        "gpt_oss",
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=int(r.opt("head_dim", 64)),
        ffn=0,
        activation="swiglu",
        act_fn="silu",
        qkv_bias=bias,
        out_bias=bias,
        norm_weight_first=True,
        attn_dropout=float(r.opt("attention_dropout", 0.0)),
        experts=experts,
        top_k=top_k,
        expert_ffn=r.pos_int("intermediate_size"),
        hf_sdpa=False,
        router="topk_softmax",
        router_norm_topk=False,
        attn_sinks=True,
        expert_bias=True,
        expert_act="clamped_swiglu",
        router_linear_bias=True,
    )


def _llama4_text(r: _Reader) -> ArchSpec:
    """Llama 4's text model (transformers 5.24 modeling_llama4.py): MoE layers at `moe_layers`
    (default every `interleave_moe_layer_step`-th), the others dense MLPs `intermediate_size_mlp`
    wide; a MoE layer's router (top-k scattered into -inf logits, sigmoid in fp32) weights every
    token for every expert and the experts run densely over all tokens (`hidden.repeat(E, 1)`,
    batched GEMMs), beside one shared expert (`intermediate_size` wide, as each expert);
    NoPE layers (`no_rope_layers` 0, default every 4th) skip the rope and the q/k norm, and with
    `attn_temperature_tuning` scale their queries by position; the others apply the rope (complex
    product) then an L2 norm without weight to q and k (`use_qk_norm`); chunked attention
    (`attention_chunk_size`) on the rope layers."""
    c = r.c
    hidden, heads, kv = r.gqa_heads()
    layers = r.pos_int("num_hidden_layers")
    experts = r.pos_int("num_local_experts")
    top_k = int(r.opt("num_experts_per_tok", 1))
    if not 0 < top_k <= experts:
        raise UserError(f"config of {r.name}: num_experts_per_tok={top_k} must be in 1..{experts} (experts)")
    if c.get("output_router_logits"):
        raise refuse_unmodelled(
            r.name, "llama4_text", "Llama 4's router auxiliary loss (output_router_logits)"
        )
    moe_layers = c.get("moe_layers")
    # a listed moe_layers repeats nothing past the config: --layers beyond it counts those layers
    # as MoE layers (HF builds them dense; MoE layers, every token through every expert, hold more)
    dense_period = 0
    if moe_layers is None:
        step = dense_period = int(r.opt("interleave_moe_layer_step", 1))
        if step <= 0:
            raise UserError(f"config of {r.name}: interleave_moe_layer_step must be positive, got {step}")
        moe_layers = list(range(step - 1, layers, step))
    if not isinstance(moe_layers, list) or any(
        not isinstance(i, int) or not 0 <= i < layers for i in moe_layers
    ):
        raise UserError(f"config of {r.name}: moe_layers must list layer indices in 0..{layers - 1}")
    listed_flags = c.get("no_rope_layers")
    nope_period = len(listed_flags) if listed_flags else int(r.opt("no_rope_layer_interval", 4))
    if nope_period <= 0:
        raise UserError(f"config of {r.name}: no_rope_layer_interval must be positive, got {nope_period}")
    rope_flags = listed_flags or [int((i + 1) % nope_period != 0) for i in range(layers)]
    if len(rope_flags) != layers:
        raise UserError(
            f"config of {r.name}: 'no_rope_layers' must list one entry per layer (num_hidden_layers="
            f"{layers}), got {len(rope_flags)} entries"
        )
    dense = tuple(i for i in range(layers) if i not in set(moe_layers))
    ffn = r.pos_int("intermediate_size")
    bias = bool(r.opt("attention_bias", False))
    chunk = c.get("attention_chunk_size", 8192)
    return r.spec(
        "llama4_text",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=int(r.opt("head_dim", 128)),
        ffn=r.pos_int("intermediate_size_mlp") if dense else int(r.opt("intermediate_size_mlp", 0)),
        activation=_activation(r.opt("hidden_act", "silu"), True, r.name),
        act_fn=str(r.opt("hidden_act", "silu")),
        qkv_bias=bias,
        out_bias=bias,
        qk_norm=bool(r.opt("use_qk_norm", True)),
        qk_norm_scope="l2",
        attn_dropout=float(r.opt("attention_dropout", 0.0)),
        experts=experts,
        top_k=top_k,
        expert_ffn=ffn,
        shared_experts=1,
        shared_ffn=ffn,
        shared_first=False,
        router="sigmoid_scatter",
        dense_layers=dense,
        nope_layers=tuple(i for i, f in enumerate(rope_flags) if not f),
        dense_period=dense_period,
        nope_period=nope_period,
        attn_temperature=bool(r.opt("attn_temperature_tuning", True)),
        attention_chunk=int(chunk or 0),
        expert_compute="dense",
    )
