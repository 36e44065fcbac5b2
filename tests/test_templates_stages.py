"""Every model family x convention x parallel feature builds, and its jobs balance: what F
keeps, B (or I then W) releases; peaks are at least the net growth."""

import pytest

from pipemem.model import arch_from_hf_config
from pipemem.plan import ParallelPlan, validate_plan
from pipemem.schedules import get_schedule
from pipemem.stages import build_stage_jobs

BASE = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "vocab_size": 1000,
}
CONFIGS = {
    "llama": dict(BASE, model_type="llama"),
    "qwen3": dict(BASE, model_type="qwen3", head_dim=64),
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 256,
        "n_head": 8,
        "n_layer": 4,
        "vocab_size": 1000,
        "n_positions": 256,
    },
    "gpt_neox": {
        "model_type": "gpt_neox",
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "intermediate_size": 1024,
        "vocab_size": 1000,
    },
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        BASE,
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
    ),
    "deepseek": dict(
        BASE,
        model_type="deepseek_v3",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        n_shared_experts=1,
        first_k_dense_replace=1,
    ),
}
FEATURES = [
    dict(),
    dict(tp=2, pp=2),
    dict(tp=2, sp=False, recompute="selective"),
    dict(tp=2, cp=2, pp=2, vpp=2, recompute="full", recompute_layers=1),
    dict(dp=4, zero=3, recompute="full_attn"),
    dict(dp=4, tp=2, ep=2, recompute="core_attn", recompute_allgather=True),
]


@pytest.mark.parametrize("conv", ["megatron", "paddle", "torchtitan", "hf"])
@pytest.mark.parametrize("model", sorted(CONFIGS))
@pytest.mark.parametrize("feat", range(len(FEATURES)))
def test_builds_and_balances(model, conv, feat):
    kw = dict(FEATURES[feat])
    arch = arch_from_hf_config(CONFIGS[model], model)
    if kw.get("ep", 1) > 1 and not arch.is_moe:
        kw["ep"] = 1
    if conv == "hf":  # HF modules run unsharded: no tp / cp / ep
        kw = {k: v for k, v in kw.items() if k not in ("tp", "cp", "ep", "sp")}
    plan = validate_plan(arch, ParallelPlan(seq_len=128, micro_batch=2, convention=conv, **kw))
    sp = build_stage_jobs(arch, plan)
    sched = get_schedule("1F1B" if plan.vpp == 1 else "Interleaved1F1B", plan.pp, plan.microbatches, plan.vpp)
    static = sp.static_per_rank(sched)
    assert len(sp.stages) == plan.pp * plan.vpp and len(static) == plan.pp
    for j in sp.stages.values():
        assert j.F.net_bytes > 0 and j.F.peak_bytes >= j.F.net_bytes
        # what F keeps, B releases, except what crosses the stage boundary (the runtime frees
        # the output F made and the input grad B made)
        assert j.F.net_bytes + j.B.net_bytes == j.output_bytes + j.input_grad_bytes
        assert j.I.net_bytes + j.W.net_bytes == j.B.net_bytes
        assert j.B.peak_bytes >= 0 and j.I.peak_bytes >= 0 and j.W.peak_bytes >= 0
    # gradients: resident (buffer), or created by each stage's first backward (set-to-none)
    assert all(s.params > 0 and (s.grads > 0 or s.grads_in_step > 0) for s in static)
    if plan.grads == "set-to-none":
        for s, j in sp.stages.items():
            f = sp.first_backward[s]
            assert f.F == j.F and f.B.net_bytes > j.B.net_bytes and f.B.peak_bytes >= j.B.peak_bytes
            assert f.I.net_bytes + f.W.net_bytes == f.B.net_bytes
        optimizer = sp.optimizer_per_rank(sched)
        for r, st in enumerate(static):
            made = sum(
                sp.first_backward[s].B.net_bytes - sp.stages[s].B.net_bytes for s in sched.stages_of_rank(r)
            )
            assert st.grads == 0 and st.grads_in_step == made
            assert optimizer[r].net_bytes == -made
