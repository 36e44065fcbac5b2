"""Whole-step cases: the steady-state training step of small HF models, traced (the real HF
modules on fake tensors) against templates (the `hf` convention), through `pipemem.estimate`.

Shared by tests/test_steady_state.py (a CI subset) and bench/steady_state.py (every family,
fp32 and bf16; its output is in docs/ACCURACY.md).
"""

from __future__ import annotations

BASE = dict(
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=4,
    intermediate_size=688,
    vocab_size=4000,
    max_position_embeddings=1024,
)

# Qwen's MoE blocks: 4 experts, top-2
QWEN_MOE = dict(BASE, num_experts=4, num_experts_per_tok=2)
# DeepSeek V2 / V3: multi-head latent attention (a value head unlike the query's: SDPA's
# memory-efficient kernel), 8 routed experts, top-2, a dense first layer
DEEPSEEK = dict(
    BASE,
    num_key_value_heads=8,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    first_k_dense_replace=1,
)

FAMILIES = {
    "llama": dict(BASE, model_type="llama"),
    "qwen2": dict(BASE, model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(BASE, model_type="qwen3", head_dim=32),
    "mistral": dict(BASE, model_type="mistral", num_key_value_heads=2, sliding_window=None),
    "gemma": dict(BASE, model_type="gemma", head_dim=32, num_key_value_heads=8),
    "olmo": dict(BASE, model_type="olmo"),
    "olmo2": dict(BASE, model_type="olmo2"),
    "gpt2": dict(model_type="gpt2", n_embd=256, n_layer=4, n_head=8, vocab_size=4000, n_positions=1024),
    "gpt_neox": dict(
        model_type="gpt_neox",
        hidden_size=256,
        num_attention_heads=8,
        num_hidden_layers=4,
        intermediate_size=1024,
        vocab_size=4000,
        max_position_embeddings=1024,
    ),
    # HF's grouped_mm experts: bf16 is pure bf16 here (master_weights=True for autocast, where
    # HF runs the experts in the fp32 weights' dtype)
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(QWEN_MOE, model_type="qwen3_moe", moe_intermediate_size=256, head_dim=32),
    # a gated shared expert, top-k weights neither renormalised nor kept in fp32 (HF defaults)
    "qwen2_moe": dict(
        QWEN_MOE, model_type="qwen2_moe", moe_intermediate_size=128, shared_expert_intermediate_size=512
    ),
    # a query LoRA, a sigmoid router with group-limited top-k, one shared expert
    "deepseek_v3": dict(
        DEEPSEEK, model_type="deepseek_v3", q_lora_rank=96, n_shared_experts=1, n_group=4, topk_group=2
    ),
    # no query LoRA, complex rotary embedding, softmax router, two shared experts (V2-Lite's form)
    "deepseek_v2": dict(DEEPSEEK, model_type="deepseek_v2", q_lora_rank=None, n_shared_experts=2),
    # GLM-4.5's form: sigmoid group-limited router, a shared expert after the routed ones, a dense
    # first layer, partial rope, q/k/v biases, per-head q/k norms
    "glm4_moe": dict(
        BASE,
        model_type="glm4_moe",
        head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
    ),
    # q/k norms over the projections, 8 experts top-2
    "olmoe": dict(QWEN_MOE, model_type="olmoe", num_experts=8, intermediate_size=128),
    # attention sinks (HF runs it eagerly), alternating sliding (window 64 < seq 256) and full
    # layers, biased clamped-SwiGLU experts, a router bias
    "gpt_oss": dict(
        BASE,
        model_type="gpt_oss",
        head_dim=32,
        intermediate_size=128,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}
MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "glm4_moe", "olmoe", "gpt_oss")


def plan_for(family: str, dtype: str, **extra) -> dict:
    """estimate() keywords of a case: hf convention, micro batch 2, seq 256."""
    kw = dict(convention="hf", micro_batch=2, seq_len=256, dtype=dtype)
    if family in MOE and dtype == "bf16":
        kw.update(master_weights=False)
    kw.update(extra)
    return kw


def compare(family: str, dtype: str, **extra) -> dict:
    """Traced and template estimates of one case: {traced, templates, rel_error, peak_at}."""
    from ..estimate import estimate
    from .compare import rel_error

    kw = plan_for(family, dtype, **extra)
    traced = estimate(FAMILIES[family], mode="traced", **kw)
    templ = estimate(FAMILIES[family], mode="templates", **kw)
    t, m = traced.max_peak_allocated_bytes, templ.max_peak_allocated_bytes
    return {
        "name": f"{family}-{kw['dtype']}{'' if kw.get('master_weights', True) else '-pure'}",
        "traced": t,
        "templates": m,
        "rel_error": rel_error(m, t),
        "traced_peak_at": traced.ranks[0].peak_at,
        "templates_peak_at": templ.ranks[0].peak_at,
        "step": templ.plan.step,
        "grads": templ.plan.grads,
    }
