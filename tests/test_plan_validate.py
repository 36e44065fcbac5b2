"""validate_plan: every bad combination is one UserError naming the flag and the fix."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipemem.errors import UserError
from pipemem.model import arch_from_hf_config
from pipemem.plan import ParallelPlan, validate_plan
from pipemem.stages import build_stage_jobs

LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
}
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def arch(cfg=LLAMA2_7B, name="llama2-7b"):
    return arch_from_hf_config(cfg, name)


def bad(match, cfg=LLAMA2_7B, **kw):
    with pytest.raises(UserError, match=match):
        validate_plan(arch(cfg), ParallelPlan(**kw))


def test_tp_must_divide_heads_message():
    with pytest.raises(UserError) as e:
        validate_plan(arch(), ParallelPlan(tp=3))
    assert str(e.value) == (
        "--tp 3 does not divide 32 attention heads of llama2-7b: use a divisor of 32 (1, 2, 4, 8, 16, 32)"
    )


def test_kv_heads_fewer_than_tp_are_replicated():
    p = validate_plan(
        arch(MIXTRAL, "mixtral"), ParallelPlan(tp=16, ep=1, dp=1, seq_len=4096, convention="torchtitan")
    )
    assert p.tp == 16


def test_megatron_tp_must_divide_kv_heads():
    # megatron-core all-gathers the whole QKV output when tp > KV heads: refused, not mis-modelled
    with pytest.raises(UserError, match="--tp 16 does not divide the 8 KV heads.*use one of 1, 2, 4, 8"):
        validate_plan(arch(MIXTRAL, "mixtral"), ParallelPlan(tp=16, ep=1, dp=1, seq_len=4096))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(vpp=2), "--vpp 2 needs --pp > 1"),
        (dict(pp=3), "--pp 3 x --vpp 1 = 3 stages does not divide the 32 layers"),
        (dict(pp=8, vpp=8), "exceeds the 32 layers"),
        (dict(pp=0), "--pp 0: must be a positive integer"),
        (dict(micro_batch=-1), "--micro-batch -1: must be a positive integer"),
        (dict(zero=4), "--zero 4: use 0, 1, 2 or 3"),
        (dict(recompute="half"), "--recompute 'half'"),
        (dict(convention="jax"), "--convention 'jax'"),
        (dict(ep=2), "--ep 2: llama2-7b has no experts"),
        (dict(cp=3, seq_len=4096), "--seq-len 4096 is not divisible by 3"),
        (dict(pp=2, pp_layout=(10, 10)), "--pp-layout .* sum to the 32 layers"),
        (dict(pp=2, pp_layout=(32,)), "--pp-layout has 1 entries"),
        (dict(recompute_layers=2), "--recompute-layers needs --recompute"),
        (dict(global_batch=10, dp=4), "--global-batch 10 is not divisible"),
        (dict(fsdp=True, zero=1), "--fsdp shards"),
        (dict(tp=2, convention="hf"), "--tp 2 with --convention hf"),
        (dict(dist_opt=True, zero=2), "--dist-opt"),
    ],
)
def test_bad_plans(kw, match):
    bad(match, **kw)


def test_ep_must_divide_experts():
    bad("--ep 3 does not divide the 8 experts", cfg=MIXTRAL, ep=3, dp=3)


def test_defaults_resolved():
    p = validate_plan(arch(), ParallelPlan(tp=2, pp=4, global_batch=64, micro_batch=2, dp=2))
    assert p.sp is True and p.microbatches == 16 and p.main_grad_dtype == "fp32"
    assert p.pp_layout == (8, 8, 8, 8) and p.layers == 32
    assert validate_plan(arch(), ParallelPlan(layers=8, pp=2)).pp_layout == (4, 4)
    assert validate_plan(arch(), ParallelPlan(pp=2, pp_layout=(15, 17))).pp_layout == (15, 17)


def test_stage_placements():
    from pipemem.schedules.actions import loop_stage_map, v_stage_map

    assert loop_stage_map(4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert v_stage_map(4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]


def test_arch_errors_name_the_key():
    with pytest.raises(UserError, match="'num_hidden_layers'"):
        arch_from_hf_config({k: v for k, v in LLAMA2_7B.items() if k != "num_hidden_layers"})
    with pytest.raises(UserError, match="model_type 'bert'"):
        arch_from_hf_config({"model_type": "bert"})
    with pytest.raises(UserError, match="'model_type'"):
        arch_from_hf_config({"hidden_size": 8})


def test_llama2_7b_param_count():
    # 32 layers x (4h^2 attention + 3*h*f MLP + 2h norms) + 2 x vocab x h + h
    h, f, v = 4096, 11008, 32000
    assert arch().param_count() == 32 * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h


def test_ep_must_divide_dp_times_cp():
    bad(r"--ep 4 must divide --dp 2 x --cp 1 = 2", cfg=MIXTRAL, ep=4, dp=2)
    p = validate_plan(arch(MIXTRAL, "mixtral"), ParallelPlan(ep=4, dp=2, tp=2, etp=1, seq_len=4096))
    assert p.ep == 4 and p.etp == 1
    # megatron-core: expert data parallel = world / (etp x ep x pp); with etp = tp the ranks of one
    # stage hold ep only as far as dp x cp does, and the message says how to decouple expert TP
    with pytest.raises(
        UserError,
        match=r"--ep 4 must divide .* with --etp 1 \(--ep x --etp must divide --dp x --cp x --tp = 4\)$",
    ):
        validate_plan(arch(MIXTRAL, "mixtral"), ParallelPlan(ep=4, dp=2, tp=2, seq_len=4096))
    with pytest.raises(
        UserError, match=r"= 2 \(expert-parallel groups are carved from the data/context-parallel ranks\)$"
    ):
        validate_plan(arch(MIXTRAL, "mixtral"), ParallelPlan(ep=8, dp=2, tp=2, seq_len=4096))


def test_cp_needs_flash_attention():
    bad("--cp 2 needs --flash-attn", cp=2, flash_attn=False)


DEEPSEEK = {
    "model_type": "deepseek_v3",
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_hidden_layers": 6,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 2,
    "first_k_dense_replace": 2,
    "vocab_size": 1000,
}


def test_arch_families():
    ds = arch_from_hf_config(DEEPSEEK, "ds")
    assert (ds.experts, ds.top_k, ds.expert_ffn, ds.shared_experts, ds.shared_ffn) == (16, 4, 256, 2, 256)
    assert ds.dense_layers == (0, 1) and not ds.is_moe_layer(1) and ds.is_moe_layer(2)
    # multi-head latent attention (templates/mla.py) needs its head dims: the missing one named
    with pytest.raises(UserError, match="qk_rope_head_dim"):
        arch_from_hf_config(dict(DEEPSEEK, kv_lora_rank=512), "ds")
    q3 = arch_from_hf_config(dict(LLAMA2_7B, model_type="qwen3", head_dim=128, num_key_value_heads=8))
    assert q3.qk_norm and q3.head_dim == 128
    qm = arch_from_hf_config(
        dict(
            LLAMA2_7B,
            model_type="qwen2_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
        )
    )
    assert (qm.experts, qm.shared_experts, qm.shared_ffn, qm.qkv_bias) == (8, 1, 5632, True)
    neox = arch_from_hf_config(
        {
            "model_type": "gpt_neox",
            "hidden_size": 512,
            "num_attention_heads": 8,
            "num_hidden_layers": 2,
            "intermediate_size": 2048,
            "vocab_size": 1000,
        }
    )
    assert neox.parallel_residual and neox.norm == "layernorm" and neox.position == "rope"
    mi = arch_from_hf_config(dict(LLAMA2_7B, model_type="mistral", num_key_value_heads=8))
    assert mi.kv_heads == 8 and mi.activation == "swiglu"


def test_validate_is_idempotent():
    for kw in (
        dict(tp=2, pp=4, global_batch=64, micro_batch=2, dp=2),
        dict(fsdp=True, dp=8),
        dict(pp=2, vpp=2),
    ):
        p = validate_plan(arch(), ParallelPlan(**kw))
        assert validate_plan(arch(), p) == p
    m = validate_plan(arch(MIXTRAL, "mixtral"), ParallelPlan(tp=2, ep=2, dp=2))
    assert validate_plan(arch(MIXTRAL, "mixtral"), m) == m


def test_named_schedules_place_stages_looped_or_v():
    from pipemem.schedules import get_schedule
    from pipemem.schedules.actions import loop_stage_map, v_stage_map

    assert get_schedule("ZBVZeroBubble", 4, 8, 2).stage_rank == v_stage_map(4, 2)
    assert get_schedule("Interleaved1F1B", 4, 8, 2).stage_rank == loop_stage_map(4, 2)


TINY = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "vocab_size": 100,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
small = st.sampled_from([-1, 0, 1, 2, 3, 4, 8])


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "tp": small,
            "pp": small,
            "vpp": small,
            "cp": small,
            "ep": small,
            "dp": small,
            "micro_batch": small,
            "seq_len": st.sampled_from([0, 7, 64, 96]),
            "zero": st.sampled_from([-1, 0, 1, 2, 3, 4]),
            "recompute": st.sampled_from(["none", "full", "selective", "bogus"]),
            "recompute_layers": st.sampled_from([None, 0, 1, 5]),
            "layers": st.sampled_from([None, 2, 4, 6]),
            "convention": st.sampled_from(["megatron", "paddle", "torchtitan", "hf"]),
            "pp_layout": st.sampled_from([None, (2, 2), (4, 0), (1, 1, 1, 1)]),
            "fsdp": st.booleans(),
            "dist_opt": st.booleans(),
            "flash_attn": st.booleans(),
        }
    )
)
def test_any_plan_is_valid_or_one_user_error(kw):
    """Random flags (many invalid): validate_plan returns a plan the engine builds, or raises
    UserError naming a flag -- never another exception."""
    a = arch_from_hf_config(TINY, "tiny-moe")
    try:
        plan = validate_plan(a, ParallelPlan(**kw))
    except UserError as e:
        assert str(e).startswith("--") or "--" in str(e)
        return
    sp = build_stage_jobs(a, plan)
    assert len(sp.stages) == plan.pp * plan.vpp
