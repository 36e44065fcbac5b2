"""Families template mode does not model (GPT-OSS, Llama 4, GLM-4 MoE, OLMoE, Qwen3-Next):
traced mode runs transformers' own modules for them on fake tensors; template mode refuses each
by name and points to traced mode; inconsistent configs fail on
one line naming the key."""

import json

import pytest

from pipemem.errors import UserError
from pipemem.model import UnmodelledFamily, arch_from_hf_config, check_config

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    intermediate_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
)
TINY = {
    "deepseek_v3": dict(
        BASE,
        model_type="deepseek_v3",
        **MLA,
        q_lora_rank=48,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        num_nextn_predict_layers=1,
    ),
    "deepseek_v2": dict(
        BASE, model_type="deepseek_v2", **MLA, q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2
    ),
    "gpt_oss": dict(
        BASE,
        model_type="gpt_oss",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma3_text": dict(
        BASE,
        model_type="gemma3_text",
        head_dim=16,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "llama4_text": dict(
        BASE,
        model_type="llama4_text",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=128,
        interleave_moe_layer_step=2,
        attention_chunk_size=32,
        no_rope_layers=[1, 0],
    ),
    "glm4_moe": dict(
        BASE,
        model_type="glm4_moe",
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "olmoe": dict(BASE, model_type="olmoe", num_experts=8, num_experts_per_tok=2),
    "qwen3_next": dict(
        BASE,
        model_type="qwen3_next",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
}
PLAN = dict(seq_len=64, micro_batch=1, dtype="bf16", master_weights=False, flash_attn=True)


def _known(model_type):
    transformers = pytest.importorskip("transformers")
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


# families templates read (Gemma 3 below its window, DeepSeek-V2 / V3 multi-head latent attention,
# GLM-4 MoE, OLMoE, GPT-OSS under --convention hf, Llama 4 within one attention chunk): held
# against traced mode in their own tests
TEMPLATED = {"gemma3_text", "deepseek_v3", "deepseek_v2", "glm4_moe", "olmoe", "gpt_oss", "llama4_text"}


@pytest.mark.parametrize("family", sorted(set(TINY) - TEMPLATED))
def test_template_mode_refuses_by_name_and_points_to_traced(family):
    with pytest.raises(UnmodelledFamily, match=r"template mode does not model .*use --mode traced") as e:
        arch_from_hf_config(TINY[family], "tiny")
    assert "\n" not in str(e.value) and family in str(e.value)


@pytest.mark.parametrize("family", sorted(TINY))
def test_traced_mode_runs_transformers_own_modules(family):
    _known(family)
    pytest.importorskip("torch")
    import torch

    from pipemem import estimate
    from pipemem.traced.hf import build_model, make_config

    est = estimate(dict(TINY[family]), mode="traced", **PLAN)
    assert est.mode == "traced" and est.arch.model_type == family and est.arch.layers == 2
    r = est.ranks[0]
    # the parameters traced are those of the model transformers builds from this config
    with torch.device("meta"):
        model = build_model(make_config(TINY[family]), torch.bfloat16)
    assert r.static.params == sum(p.numel() * p.element_size() for p in model.parameters())
    assert r.peak_allocated_bytes > r.static.total > 0
    assert est.to_dict()["mode"] == "traced"
    # what transformers' module lacks is said: no SDPA path (GPT-OSS), no MTP layers (DeepSeek-V3)
    assert any("no SDPA path" in w for w in est.warnings) == (family == "gpt_oss")
    assert any("num_nextn_predict_layers=1" in w for w in est.warnings) == (family == "deepseek_v3")
    assert any("pure-PyTorch path" in w for w in est.warnings) == (family == "qwen3_next")


def test_nemotron_h_hybrid_traces_and_says_its_mamba_path():
    """Mamba-2 mixed with attention: the layer count is a property of transformers' config class,
    the Mamba mixers run its pure-PyTorch path (said)."""
    _known("nemotron_h")
    from pipemem import estimate

    cfg = dict(
        model_type="nemotron_h",
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        intermediate_size=128,
        hybrid_override_pattern="M-M*",
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        mamba_d_conv=4,
        expand=1,
        chunk_size=16,
        max_position_embeddings=512,
    )
    est = estimate(cfg, mode="traced", **PLAN)
    assert est.arch.layers == 4 and any("Mamba-2 mixers" in w for w in est.warnings)
    with pytest.raises(UnmodelledFamily, match="Mamba-2 layers"):
        estimate(cfg, **PLAN)


GEMMA3 = dict(
    BASE,
    model_type="gemma3_text",
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=4,
    intermediate_size=512,
    vocab_size=1000,
    head_dim=32,
    sliding_window=4096,
    query_pre_attn_scalar=32,
)


@pytest.mark.parametrize("dtype,master", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_gemma3_template_matches_traced(dtype, master):
    """Gemma 3 (sandwich norms, per-head q/k norms, GeGLU, tied embedding) under --convention hf
    with SDPA and no sliding mask (seq_len < window): templates vs transformers' own modules,
    the step's peak and the forward's net within 1 %."""
    _known("gemma3_text")
    from pipemem import estimate

    kw = dict(
        seq_len=128,
        micro_batch=2,
        dtype=dtype,
        master_weights=master,
        flash_attn=True,
        convention="hf",
        step="first",
    )
    t = estimate(dict(GEMMA3), **kw).ranks[0]
    r = estimate(dict(GEMMA3), mode="traced", **kw).ranks[0]
    assert t.static.params == r.static.params
    assert abs(t.peak_allocated_bytes - r.peak_allocated_bytes) <= 0.01 * r.peak_allocated_bytes
    assert abs(t.jobs["F"].net_bytes - r.jobs["F"].net_bytes) <= 0.01 * r.jobs["F"].net_bytes


GLM4_MOE = dict(
    BASE,
    model_type="glm4_moe",
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=4,
    head_dim=32,
    intermediate_size=512,
    moe_intermediate_size=128,
    vocab_size=1000,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    attention_bias=True,
    use_qk_norm=True,
    partial_rotary_factor=0.5,
)
OLMOE = dict(
    BASE,
    model_type="olmoe",
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=4,
    intermediate_size=128,
    vocab_size=1000,
    num_experts=8,
    num_experts_per_tok=2,
)
GPT_OSS = dict(
    BASE,
    model_type="gpt_oss",
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=4,
    head_dim=32,
    intermediate_size=128,
    vocab_size=1000,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=64,
    layer_types=["sliding_attention", "full_attention"] * 2,
)
LLAMA4 = dict(
    BASE,
    model_type="llama4_text",
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=4,
    head_dim=32,
    intermediate_size=128,
    intermediate_size_mlp=512,
    vocab_size=1000,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=1024,
    no_rope_layers=[1, 1, 1, 0],
    max_position_embeddings=2048,
)
MOE_CASES = {
    # dense and MoE layers interleaved, every token through every expert, a NoPE layer with
    # temperature-scaled queries, L2 q/k norms on the rope layers
    "llama4_text": LLAMA4,
    "llama4_text-all-moe-top2-plain": dict(
        LLAMA4,
        interleave_moe_layer_step=1,
        num_experts_per_tok=2,
        use_qk_norm=False,
        attn_temperature_tuning=False,
    ),
    # sinks, eager attention (HF has no SDPA path for it; seq 512 is past the 64 window: a sliding
    # layer saves what a full one does), biased clamped-SwiGLU experts, router bias
    "gpt_oss": GPT_OSS,
    "gpt_oss-no-bias": dict(GPT_OSS, attention_bias=False),
    "glm4_moe": GLM4_MOE,
    # group-limited routing (2 of 4 groups), no renormalisation, scaled weights, no qk norm
    "glm4_moe-groups": dict(
        GLM4_MOE, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5, use_qk_norm=False
    ),
    "olmoe": OLMOE,
    "olmoe-norm-topk": dict(OLMOE, norm_topk_prob=True),
}


@pytest.mark.parametrize("precision", ["bf16-pure", "bf16-autocast", "fp32"])
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_family_template_matches_traced(case, precision):
    """GLM-4 MoE (sigmoid router in fp32 with group-limited top-k, shared expert after the routed
    ones, first layer dense, partial rope whose concatenated query makes SDPA's output a copy
    o_proj saves, q/k/v biases, per-head q/k norms) and OLMoE (q/k norms over the projections)
    under --convention hf, pure bf16, bf16 autocast over fp32 weights (HF's grouped_mm experts
    then run in fp32, the weights' dtype) and fp32: templates vs transformers' own modules, the
    step's peak and the forward's net within 1 %."""
    cfg = MOE_CASES[case]
    _known(cfg["model_type"])
    from pipemem import estimate

    dtype = precision.split("-")[0]
    kw = dict(
        seq_len=512,
        micro_batch=2,
        dtype=dtype,
        master_weights=precision != "bf16-pure",
        flash_attn=True,
        convention="hf",
        step="first",
    )
    t = estimate(dict(cfg), **kw).ranks[0]
    r = estimate(dict(cfg), mode="traced", **kw).ranks[0]
    assert t.static.params == r.static.params
    assert abs(t.jobs["F"].net_bytes - r.jobs["F"].net_bytes) <= 0.01 * r.jobs["F"].net_bytes
    if cfg["model_type"] == "gpt_oss" and precision == "bf16-autocast":
        # the saved tensors agree (the forward's net above); the traced peak is a transient in the
        # last layer's eager sink attention under autocast that templates do not hold (ACCURACY.md)
        assert r.peak_at.startswith("forward:") and "self_attn" in r.peak_at
        pytest.xfail("gpt-oss under autocast: the attention's forward transient is not modelled (-4.9 %)")
    assert abs(t.peak_allocated_bytes - r.peak_allocated_bytes) <= 0.01 * r.peak_allocated_bytes


def test_glm4_moe_reads_its_family():
    """What the GLM-4 MoE reader takes from the config and from Glm4MoeConfig's defaults."""
    a = arch_from_hf_config({k: v for k, v in GLM4_MOE.items() if k != "first_k_dense_replace"}, "g")
    assert a.dense_layers == (0,)  # first_k_dense_replace defaults to 1
    assert (a.qkv_bias, a.out_bias, a.qk_norm, a.rotary_fraction) == (True, False, True, 0.5)
    assert (a.router, a.shared_experts, a.shared_ffn, a.shared_first) == ("sigmoid_group", 1, 128, False)
    two = arch_from_hf_config(dict(GLM4_MOE, n_shared_experts=2), "g")
    assert two.shared_ffn == 256 and two.param_count() - a.param_count() == 3 * 3 * 128 * 256
    o = arch_from_hf_config(OLMOE, "o")
    assert (o.expert_ffn, o.qk_norm_scope, o.router_norm_topk, o.router_weights_cast) == (
        128,
        "proj",
        False,
        True,
    )


@pytest.mark.parametrize(
    "cfg,what",
    [
        (dict(GLM4_MOE, partial_rotary_factor=1.5), "partial_rotary_factor"),
        (dict(GLM4_MOE, n_group=8), "n_group=8"),
    ],
)
def test_glm4_moe_bad_keys_exit_2(tmp_path, capsys, cfg, what):
    from pipemem.cli.main import main

    path = tmp_path / "glm.json"
    path.write_text(json.dumps(cfg))
    assert main(["estimate", "--model", str(path), "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert what in err and len(err.splitlines()) == 1


def test_gpt_oss_reads_its_family_and_refuses_other_conventions():
    from pipemem import estimate

    a = arch_from_hf_config(GPT_OSS, "g")
    assert a.is_moe and a.dense_layers == () and (a.expert_ffn, a.ffn) == (128, 0)
    assert (a.attn_sinks, a.expert_bias, a.router_linear_bias, a.qkv_bias, a.out_bias) == (True,) * 5
    # the parameters the sinks and the biases add, per layer: heads + experts x (2 ffn + hidden) + experts
    from dataclasses import replace

    bare = replace(a, attn_sinks=False, expert_bias=False, router_linear_bias=False)
    assert a.param_count() - bare.param_count() == 4 * (8 + 8 * (2 * 128 + 256) + 8)
    with pytest.raises(UnmodelledFamily, match="attention sinks under --convention megatron") as e:
        estimate(dict(GPT_OSS), seq_len=128, convention="megatron")
    assert "--mode traced" in str(e.value)


@pytest.mark.parametrize("dtype,master", [("bf16", True), ("fp32", True)])
def test_llama4_template_matches_traced_in_autocast_and_fp32(dtype, master):
    """Llama 4's experts are HF's own batched GEMMs (not grouped_mm), so traced mode runs it in
    every precision: under autocast each expert GEMM keeps its bf16 weight copy, as a linear."""
    _known("llama4_text")
    from pipemem import estimate

    kw = dict(seq_len=512, micro_batch=2, dtype=dtype, master_weights=master, convention="hf", step="first")
    t = estimate(dict(LLAMA4), **kw).ranks[0]
    r = estimate(dict(LLAMA4), mode="traced", **kw).ranks[0]
    assert abs(t.peak_allocated_bytes - r.peak_allocated_bytes) <= 0.01 * r.peak_allocated_bytes
    assert abs(t.jobs["F"].net_bytes - r.jobs["F"].net_bytes) <= 0.01 * r.jobs["F"].net_bytes


def test_llama4_reads_its_layers_and_runs_every_expert():
    """Llama 4's experts see every token: the layer keeps E x the tokens for them (HF's dense
    MoE), growing with the expert count where a sparse MoE's does not."""
    from pipemem import estimate

    a = arch_from_hf_config(LLAMA4, "l4")
    assert (a.dense_layers, a.nope_layers, a.ffn, a.expert_ffn, a.shared_ffn) == ((0, 2), (3,), 512, 128, 128)
    assert a.expert_compute == "dense" and a.router == "sigmoid_scatter"
    default = arch_from_hf_config(dict(LLAMA4, num_hidden_layers=8, no_rope_layers=[]), "l4")
    assert default.nope_layers == (3, 7)  # every 4th layer (no_rope_layer_interval)
    kw = dict(seq_len=256, micro_batch=1, dtype="bf16", master_weights=False, convention="hf")
    f4 = estimate(dict(LLAMA4), **kw).ranks[0].jobs["F"].net_bytes
    f8 = estimate(dict(LLAMA4, num_local_experts=8), **kw).ranks[0].jobs["F"].net_bytes
    # per MoE layer (2 of them), per extra expert, per token (256): the repeated input, the
    # weighted input (h each), gate_up (2f), SiLU and product (f each), its score row in bf16,
    # and the router's fp32 sigmoid column
    assert f8 - f4 == 2 * 4 * 256 * (2 * (2 * 256 + 4 * 128 + 1) + 4)
    with pytest.raises(
        UnmodelledFamily, match="chunked attention with --seq-len 2048 > attention_chunk_size"
    ):
        estimate(dict(LLAMA4), **dict(kw, seq_len=2048))


def test_layers_beyond_the_config_carry_on_repeating_patterns():
    """--layers past the config's count: Llama 4's NoPE and dense-layer patterns go on as its
    config class builds them for that count; DeepSeek's first-k dense layers stay the first k."""
    small = dict(LLAMA4, no_rope_layers=[])
    grown = arch_from_hf_config(small, "l4").with_layers(12)
    direct = arch_from_hf_config(dict(small, num_hidden_layers=12), "l4")
    assert (grown.nope_layers, grown.dense_layers) == (direct.nope_layers, direct.dense_layers)
    assert grown.nope_layers == (3, 7, 11) and grown.dense_layers == (0, 2, 4, 6, 8, 10)
    assert arch_from_hf_config(small, "l4").with_layers(2).dense_layers == (0,)
    listed = arch_from_hf_config(LLAMA4, "l4").with_layers(8)  # its per-layer list, repeated
    assert listed.nope_layers == (3, 7)
    ds = dict(TINY["deepseek_v3"], first_k_dense_replace=2, num_hidden_layers=5)
    assert arch_from_hf_config(ds, "ds").with_layers(11).dense_layers == (0, 1)


def test_olmoe_clip_qkv_refused_by_name():
    with pytest.raises(UnmodelledFamily, match="clip_qkv.*--mode traced"):
        arch_from_hf_config(dict(OLMOE, clip_qkv=8.0), "o")


@pytest.mark.parametrize(
    "change,what",
    [
        (dict(seq_len=4096), "--seq-len 4096 >= their window"),
        (dict(flash_attn=False), "eager attention"),
        (dict(convention="megatron"), "--convention megatron"),
    ],
)
def test_gemma3_template_refuses_what_it_does_not_hold(change, what):
    from pipemem import estimate

    kw = dict(dict(seq_len=128, convention="hf", flash_attn=True), **change)
    with pytest.raises(UnmodelledFamily, match=what) as e:
        estimate(dict(GEMMA3), **kw)
    assert "--mode traced" in str(e.value)


def test_replication_past_dense_first_layers_is_exact():
    """7 layers, the first dense: K layers are traced from the first MoE layer on; the result is
    the full 7-layer trace's, byte for byte."""
    _known("glm4_moe")
    import pipemem.traced.replicate as rep
    from pipemem import estimate

    cfg = dict(TINY["glm4_moe"], num_hidden_layers=7)
    got = estimate(dict(cfg), mode="traced", **PLAN).ranks[0]
    full = rep._replication
    try:
        rep._replication = lambda c, m, n: {"traced_layers": n}
        ref = estimate(dict(cfg), mode="traced", **PLAN).ranks[0]
    finally:
        rep._replication = full
    assert (got.peak_allocated_bytes, got.static.total, got.jobs["F"].net_bytes) == (
        ref.peak_allocated_bytes,
        ref.static.total,
        ref.jobs["F"].net_bytes,
    )


def test_replication_plan_follows_layer_kinds():
    _known("deepseek_v3")
    import torch

    from pipemem.traced.hf import build_model, make_config
    from pipemem.traced.replicate import _replication

    def plan(**kw):
        cfg = make_config(dict(TINY["deepseek_v3"], **kw))
        return _replication(cfg, build_model(cfg, torch.bfloat16), cfg.num_hidden_layers)

    assert plan(num_hidden_layers=12, first_k_dense_replace=3) == {"traced_layers": 7, "template": 5}
    assert plan(num_hidden_layers=12, first_k_dense_replace=0) == {}
    assert plan(num_hidden_layers=6, first_k_dense_replace=3) == {"traced_layers": 6}
    gemma = make_config(
        dict(TINY["gemma3_text"], num_hidden_layers=8, layer_types=None, sliding_window_pattern=2)
    )
    assert _replication(gemma, build_model(gemma, torch.bfloat16), 8) == {"traced_layers": 8}


def test_multimodal_config_estimates_its_text_model():
    _known("gemma3")
    from pipemem import estimate

    cfg = {"model_type": "gemma3", "text_config": dict(TINY["gemma3_text"]), "vision_config": {}}
    est = estimate(cfg, mode="traced", **PLAN)
    assert est.arch.model_type == "gemma3_text"
    assert any("vision encoder" in w for w in est.warnings)


def test_unknown_model_type_named_by_its_architecture():
    """Kimi-K2's config.json: model_type kimi_k2 (custom code), architectures DeepseekV3ForCausalLM:
    traced mode builds DeepseekV3; templates read it as DeepSeek-V3 (the same parameters)."""
    _known("deepseek_v3")
    from pipemem import estimate

    cfg = dict(TINY["deepseek_v3"], model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    traced = estimate(dict(cfg), mode="traced", **PLAN)
    templ = estimate(dict(cfg), convention="hf", **PLAN)
    assert traced.arch.experts == templ.arch.experts == 8
    assert templ.ranks[0].static.params == traced.ranks[0].static.params


BAD = [
    ("deepseek_v3", {"qk_rope_head_dim": None}, "qk_rope_head_dim"),
    ("deepseek_v3", {"n_group": 3}, "n_group"),
    ("deepseek_v3", {"topk_group": 3}, "topk_group"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("glm4_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("gemma3_text", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ("llama4_text", {"no_rope_layers": [1]}, "no_rope_layers"),
    ("deepseek_v3", {"first_k_dense_replace": 5}, "first_k_dense_replace"),
]


@pytest.mark.parametrize("family,change,key", BAD, ids=[b[2] for b in BAD])
def test_inconsistent_config_names_the_key(family, change, key):
    cfg = {k: v for k, v in dict(TINY[family], **change).items() if v is not None or k == "q_lora_rank"}
    with pytest.raises(UserError, match=rf"\b{key}\b") as e:
        check_config(cfg, "tiny")
    assert "\n" not in str(e.value)


def test_traced_mode_needs_the_family_keys():
    cfg = {k: v for k, v in TINY["deepseek_v3"].items() if k != "kv_lora_rank"}
    with pytest.raises(UserError, match="missing key 'kv_lora_rank'"):
        check_config(cfg, "tiny", family_keys=True)
    check_config(cfg, "tiny")  # template mode reads deepseek_v3 without MLA keys as a GQA model


def test_cli_bad_config_and_unmodelled_family_exit_2(tmp_path, capsys):
    from pipemem.cli.main import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(TINY["deepseek_v3"], n_group=3)))
    assert main(["estimate", "--model", str(bad), "--mode", "traced", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "n_group=3" in err and len(err.splitlines()) == 1
    ok = tmp_path / "gemma.json"
    ok.write_text(json.dumps(TINY["gemma3_text"]))
    assert main(["estimate", "--model", str(ok), "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--mode traced" in err and "sliding-window" in err and len(err.splitlines()) == 1


# one preset per family (the CLI test below runs deepseek-v3; every preset's shape and its
# template refusal are held in test_presets_data.py)
TRACED_PRESETS = ["kimi-k2", "gpt-oss-120b", "gemma3-27b", "llama4-maverick", "glm-4.5-air"]


@pytest.mark.parametrize("name", TRACED_PRESETS)
def test_preset_estimates_in_traced_mode(name):
    """Each preset of a family templates do not model runs in traced mode (4 of its layers, full
    widths); its parameters are those of its layers (replicated to 4)."""
    pytest.importorskip("transformers")
    from pipemem import estimate

    est = estimate(name, mode="traced", layers=4, **PLAN)
    r = est.ranks[0]
    assert est.mode == "traced" and est.arch.layers == 4
    assert r.peak_allocated_bytes > r.static.total > r.static.params > 0


def test_preset_cli_traced_and_template_refusal(capsys):
    pytest.importorskip("transformers")
    from pipemem.cli.main import main

    args = [
        "estimate",
        "--model",
        "deepseek-v3",
        "--seq-len",
        "64",
        "--layers",
        "4",
        "--dtype",
        "bf16",
        "--no-master-weights",
        "--json",
    ]
    # templates model DeepSeek-V3 under --convention hf, megatron and torchtitan (tests/test_mla.py),
    # refuse the others
    assert main(args + ["--convention", "paddle"]) == 2
    assert "multi-head latent attention under --convention paddle" in capsys.readouterr().err
    assert main(args + ["--convention", "hf"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["experts"] == 256
    assert main(args + ["--mode", "traced"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] == "traced" and d["model"]["experts"] == 256
    assert any("num_nextn_predict_layers=1" in w for w in d["warnings"])
    assert any("quantization_config (fp8)" in w for w in d["warnings"])


def test_parallel_traced_plans_refuse_other_layers_by_name():
    """Pipelines and sharded ranks are traced on a slice of the family's own decoder layers: a
    family whose model does more than embedding -> layers -> norm -> head, or a masked sliding
    window, is refused on one line, not built of the wrong layers."""
    pytest.importorskip("torch")
    from pipemem import estimate

    mistral = dict(TINY["gemma3_text"], model_type="mistral", layer_types=None)  # window 32 < seq 64
    for cfg, why in (
        (TINY["gemma3_text"], "model_type 'gemma3_text' is not one of them"),
        (mistral, "sliding window"),
    ):
        for kw in (dict(pp=2), dict(dp=2, fsdp=True)):
            with pytest.raises(UserError, match=why) as e:
                estimate(dict(cfg), mode="traced", step="first", layers=4, **kw, **PLAN)
            assert "\n" not in str(e.value)


def test_stack_builds_the_familys_own_layers():
    """A Qwen3 stage is built of Qwen3 decoder layers (q/k norms), not Llama's."""
    pytest.importorskip("transformers")
    from pipemem.traced.hf import make_config
    from pipemem.traced.stack import DecoderStack

    cfg = make_config(dict(BASE, model_type="qwen3", head_dim=16), "sdpa", 2)
    import torch

    with torch.device("meta"):
        stack = DecoderStack(cfg, [0, 1], True, True, 64)
    names = {n for n, _ in stack.named_parameters()}
    assert type(stack.layers["0"]).__name__ == "Qwen3DecoderLayer"
    assert "layers.1.self_attn.q_norm.weight" in names and "layers.1.self_attn.k_norm.weight" in names


@pytest.mark.parametrize(
    "flag,what",
    [
        ("--multi-latent-attention", "needs a Llama-style model"),
        ("--kv-lora-rank 512", "needs --multi-latent-attention"),
        ("--mtp-num-layers 1", "without --multi-latent-attention"),
    ],
)
def test_megatron_mla_and_mtp_flags_on_a_model_without_them_name_what_is_missing(flag, what):
    import shlex

    from pipemem.configs.megatron import read

    base = "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 128 --micro-batch-size 1 "
    with pytest.raises(UserError, match="^Megatron: " + flag.split()[0] + ".*" + what):
        read(shlex.split(base + "--vocab-size 1000 " + flag))


def test_boolean_sdpa_mask_is_saved_as_an_additive_bias_of_the_query_dtype():
    """HF passes sliding-window layers (Gemma 3, Mistral; seq_len > window) a boolean [B, 1, S, S]
    mask; scaled_dot_product_attention turns it into an additive mask of the query's dtype
    before any kernel (attention.cpp, convert_boolean_attn_mask), and the efficient kernel saves
    that bias for backward: 2 bytes a position in bf16, not the boolean's 1."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipemem.traced.kernel_policy import CudaKernels

    with FakeTensorMode():
        q, k, v = (torch.empty(1, 2, 64, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = CudaKernels._sdpa((q, k, v, torch.ones(1, 1, 64, 64, dtype=torch.bool)), {})
        bias = out.grad_fn._saved_attn_bias
    assert out.grad_fn.name() == "ScaledDotProductEfficientAttentionBackward0"
    assert bias.dtype == torch.bfloat16 and tuple(bias.shape) == (1, 1, 64, 64)


@pytest.mark.parametrize(
    "cfg,key",
    [
        (dict(LLAMA4, moe_layers=[7]), "moe_layers"),
        (dict(LLAMA4, no_rope_layers=[1, 0]), "no_rope_layers"),
        (dict(LLAMA4, interleave_moe_layer_step=0), "interleave_moe_layer_step"),
        (dict(GPT_OSS, num_experts_per_tok=9), "num_experts_per_tok"),
    ],
)
def test_newer_family_readers_name_the_bad_key(cfg, key):
    with pytest.raises(UserError, match=rf"\b{key}\b") as e:
        arch_from_hf_config(cfg, "bad")
    assert "\n" not in str(e.value)
