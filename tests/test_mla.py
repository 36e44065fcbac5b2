"""DeepSeek-V2 / V3 and Kimi-K2 in template mode (pipemem/templates/mla.py): multi-head latent
attention, DeepSeek's routers and shared experts, held against traced mode (transformers' own
DeepseekV2 / DeepseekV3 modules on fake tensors) under --convention hf; what the templates do
not hold is refused by name; inconsistent configs fail on one line naming the key."""

import json

import pytest

from pipemem.errors import UserError
from pipemem.model import UnmodelledFamily, arch_from_hf_config
from pipemem.validation.steady_cases import FAMILIES

# the DeepSeek-V3 shape of the whole-step cases (validation/steady_cases.py), with a smaller
# vocabulary: the tests below trace it several times
V3 = dict(FAMILIES["deepseek_v3"], vocab_size=1000, tie_word_embeddings=False)
CONFIGS = {
    # value head unlike the query's: SDPA takes the memory-efficient kernel
    "v3": V3,
    # equal head dims: the flash kernel, whose output takes the concatenated query's layout
    "v3-equal-heads": dict(V3, v_head_dim=48),
    # no query LoRA, complex rotary embedding, softmax router (greedy), two shared experts
    "v2-lite": dict(
        V3, model_type="deepseek_v2", q_lora_rank=None, n_group=None, topk_group=None, n_shared_experts=2
    ),
    "v2-grouped": dict(V3, model_type="deepseek_v2", topk_method="group_limited_greedy"),
    # every layer dense: MLA alone, which traced mode runs in fp32 and under autocast too
    "v3-dense": dict(V3, first_k_dense_replace=4),
}
CASES = [
    ("v3", "bf16", False),
    ("v3-equal-heads", "bf16", False),
    ("v2-lite", "bf16", False),
    ("v2-grouped", "bf16", False),
    ("v3-dense", "fp32", True),
    ("v3-dense", "bf16", True),
    # the MoE layers in fp32 and under autocast (HF's grouped_mm experts then run in fp32)
    ("v3", "fp32", True),
    ("v3", "bf16", True),
]


@pytest.mark.parametrize("name,dtype,master", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_template_matches_traced(name, dtype, master):
    """The whole steady-state step (4 layers, micro batch 2, seq 512): the peak and the forward's
    net (the layers' saved activations) within 1 %, the parameters to the byte."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pipemem import estimate

    kw = dict(convention="hf", micro_batch=2, seq_len=512, dtype=dtype, master_weights=master)
    t = estimate(dict(CONFIGS[name]), **kw).ranks[0]
    r = estimate(dict(CONFIGS[name]), mode="traced", **kw).ranks[0]
    assert t.static.params == r.static.params
    assert abs(t.peak_allocated_bytes - r.peak_allocated_bytes) <= 0.01 * r.peak_allocated_bytes
    assert abs(t.jobs["F"].net_bytes - r.jobs["F"].net_bytes) <= 0.01 * r.jobs["F"].net_bytes


def test_saved_tensors_follow_the_kernel():
    """What the attention keeps decides the forward's net: the memory-efficient kernel saves the
    value view (the whole kv_b_proj output); the flash kernel's output is copied for o_proj; eager
    attention saves a contiguous copy of V instead of the kv_b_proj output."""
    from pipemem import estimate

    kw = dict(convention="hf", micro_batch=2, seq_len=512, dtype="bf16", master_weights=False)
    f = {
        (name, flash): estimate(dict(CONFIGS[name]), flash_attn=flash, **kw).ranks[0].jobs["F"].net_bytes
        for name in ("v3", "v3-equal-heads")
        for flash in (True, False)
    }
    s, b, a, layers = 512, 2, 8, 4
    # eager minus SDPA, same model: the scores path added, the kv_b_proj output's no-position
    # half (32 of 64 per head) no longer kept, and the fp32 logsumexp gone
    assert f[("v3", False)] > f[("v3", True)]
    # equal heads: V is 16 wider per head; flash keeps one more [s, b, a, dv] (the output's copy)
    extra = f[("v3-equal-heads", True)] - f[("v3", True)]
    copy = layers * s * b * a * 48 * 2
    assert extra > copy


def test_presets_read_with_published_sizes():
    from pipemem.presets import load_model_config

    ds = arch_from_hf_config(load_model_config("deepseek-v3")[1], "deepseek-v3")
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.head_dim, ds.v_head_dim, ds.qk_rope_head_dim) == (
        1536,
        512,
        192,
        128,
        64,
    )
    assert ds.dense_layers == (0, 1, 2) and ds.router == "sigmoid_group" and ds.router_groups == 8
    assert round(ds.param_count() / 1e9) == 671  # the main model (the MTP module's 14B aside)
    lite = arch_from_hf_config(load_model_config("deepseek-v2-lite")[1], "deepseek-v2-lite")
    assert lite.q_lora_rank == 0 and lite.router == "softmax" and lite.rope_style == "complex"
    assert round(lite.param_count() / 1e8) == 157
    kimi = arch_from_hf_config(load_model_config("kimi-k2")[1], "kimi-k2")
    assert kimi.experts == 384 and kimi.router_groups == 1 and kimi.dense_layers == (0,)


@pytest.mark.parametrize(
    "change,what",
    [
        (dict(convention="megatron", flash_attn=False), "without --flash-attn"),
        (dict(convention="paddle"), "--convention paddle"),
        (dict(convention="torchtitan", compile=True), "--compile"),
        (dict(convention="hf", compile=True), "--compile"),
        (dict(convention="hf", activation_offload="all"), "--activation-offload"),
    ],
)
def test_unchecked_plans_refused_by_name(change, what):
    from pipemem import estimate

    kw = dict(dict(seq_len=128, dtype="bf16", master_weights=False), **change)
    with pytest.raises(UnmodelledFamily, match=what) as e:
        estimate(dict(V3), **kw)
    assert "multi-head latent attention" in str(e.value) and "\n" not in str(e.value)


BAD = [
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"qk_rope_head_dim": None}, "qk_rope_head_dim"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 5}, "topk_group"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"q_lora_rank": "drop"}, "q_lora_rank"),
]


@pytest.mark.parametrize("change,key", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_config_names_the_key(change, key):
    cfg = dict(V3, **change)
    cfg = {k: v for k, v in cfg.items() if v is not None and v != "drop"}
    with pytest.raises(UserError, match=rf"\b{key}\b") as e:
        arch_from_hf_config(cfg, "tiny")
    assert "\n" not in str(e.value)


def test_cli_bad_config_exits_2(tmp_path, capsys):
    from pipemem.cli.main import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(V3, n_group=3)))
    assert main(["estimate", "--model", str(bad), "--convention", "hf", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "n_group=3" in err and len(err.splitlines()) == 1


def test_warnings_say_what_is_left_out():
    """Multi-token prediction layers in the config (HF's module builds none) and the efficient
    kernel's backward workspace are said; an equal-head model without MTP has neither."""
    from pipemem import estimate

    kw = dict(convention="hf", seq_len=128, dtype="bf16", master_weights=False)
    w = estimate(dict(V3, num_nextn_predict_layers=1), **kw).warnings
    assert any("num_nextn_predict_layers=1" in x for x in w)
    assert any("memory-efficient kernel" in x for x in w)
    w = estimate(dict(CONFIGS["v3-equal-heads"]), **kw).warnings
    assert not any("num_nextn" in x or "memory-efficient" in x for x in w)


def test_plan_searches_deepseek_under_hf_and_refuses_other_conventions(capsys):
    """`pipemem plan` on a DeepSeek preset: under --convention hf (and megatron) every listed
    plan's flags re-estimate to the same peak; under a convention the templates do not hold, one
    line."""
    import shlex

    from pipemem import estimate
    from pipemem.cli.main import main

    args = "plan --model deepseek-v2-lite --gpus 8 --gpu h200 --seq-len 4096 --global-batch 64"
    assert main(shlex.split(args + " --convention hf --json")) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and plans[0]["verdict"] == "fits"
    best = plans[0]
    kw = {k: v for k, v in best["plan"].items() if k != "global_batch"}
    est = estimate("deepseek-v2-lite", gpu="h200", global_batch=64, **kw)
    assert est.max_peak_allocated_bytes == best["max_peak_allocated_bytes"]
    assert main(shlex.split(args + " --convention megatron --json")) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and plans[0]["plan"]["convention"] == "megatron"
    kw = {k: v for k, v in plans[0]["plan"].items() if k != "global_batch"}
    est = estimate("deepseek-v2-lite", gpu="h200", global_batch=64, **kw)
    assert est.max_peak_allocated_bytes == plans[0]["max_peak_allocated_bytes"]
    assert main(shlex.split(args + " --convention paddle")) == 2
    err = capsys.readouterr().err.strip()
    assert "multi-head latent attention under --convention paddle" in err and len(err.splitlines()) == 1


def test_glm_mtp_layers_are_said_not_dropped():
    """GLM-4.5's config names an MTP layer (num_nextn_predict_layers) that transformers'
    Glm4MoeForCausalLM does not build: the template estimate says so, as for DeepSeek."""
    from pipemem import estimate

    w = estimate("glm-4.5-air", convention="hf", seq_len=128, layers=3).warnings
    assert any("num_nextn_predict_layers=1" in x and "glm4_moe" in x for x in w)
