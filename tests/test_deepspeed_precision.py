"""--convention hf with --zero is DeepSpeed's ZeRO: the engine runs the model itself in bf16 /
fp16 (no autocast), its ZeRO optimizer keeps fp32 master partitions beside the optimizer states
and casts the rank's grad partition to fp32 for the step. --fsdp under hf stays PyTorch FSDP
with autocast over fp32 parameters."""

import pytest

import pipemem
from pipemem.model import arch_from_hf_config
from pipemem.plan import ParallelPlan, validate_plan
from pipemem.templates.conventions import convention_for
from pipemem.templates.static import optimizer_step_scratch, rank_param_counts

DP = 4


# untied (a tied word embedding's grad shard is counted twice under ZeRO-3: docs/ACCURACY.md)
MODEL = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
         "num_key_value_heads": 4, "num_hidden_layers": 8, "vocab_size": 32000, "tie_word_embeddings": False}


def arch_from_preset(_name):
    return arch_from_hf_config(MODEL, "llama-small")


def _params(plan_kw):
    arch = arch_from_preset("")
    plan = validate_plan(arch, ParallelPlan(convention="hf", dp=DP, seq_len=512, **plan_kw))
    conv = convention_for(plan)
    layers = {0: range(arch.layers)}
    dense, _ = rank_param_counts(arch, plan, conv, layers, [0])
    return arch, plan, conv, layers, dense


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_keeps_a_half_model_and_fp32_master_partitions(zero):
    arch, plan, conv, layers, n = _params({"zero": zero, "dtype": "bf16"})
    assert plan.deepspeed_mixed_precision and plan.main_grad_dtype == "bf16"
    st = pipemem.estimate(MODEL, convention="hf", zero=zero, dp=DP, dtype="bf16", seq_len=512).ranks[0].static
    shard = -(-n // DP)
    assert st.params == pytest.approx(2 * (shard if zero == 3 else n), rel=1e-3)
    assert st.grads + st.grads_in_step == pytest.approx(2 * (shard if zero >= 2 else n), rel=1e-3)
    assert st.optimizer == pytest.approx((4 + 8) * shard, rel=1e-3)     # fp32 master + Adam moments
    # the step's fp32 copy of the rank's grad partition
    assert optimizer_step_scratch(arch, plan, conv, layers, [0]) == pytest.approx(4 * shard, rel=1e-3)


def test_fsdp_and_plain_ddp_stay_under_autocast():
    for kw in ({"fsdp": True, "dtype": "bf16"}, {"dtype": "bf16"}, {"zero": 2, "dtype": "fp32"},
               {"zero": 2, "dtype": "bf16", "master_weights": False}):
        _, plan, *_ = _params(kw)
        assert not plan.deepspeed_mixed_precision, kw
    st = pipemem.estimate(MODEL, convention="hf", fsdp=True, dp=DP, dtype="bf16", seq_len=512).ranks[0].static
    n = _params({"fsdp": True, "dtype": "bf16"})[-1]
    assert st.params == pytest.approx(4 * -(-n // DP), rel=1e-3)       # fp32 parameter shards


def test_deepspeed_layer_inputs_are_half():
    """What a checkpointed layer keeps is its input: in the model's dtype under DeepSpeed, fp32
    under autocast (the residual stream of fp32 parameters)."""
    kw = dict(convention="hf", dp=DP, dtype="bf16", seq_len=1024, micro_batch=2, recompute="full")
    ds = pipemem.estimate(MODEL, zero=3, **kw).ranks[0].stage_jobs[0]["F"]["net_bytes"]
    fsdp = pipemem.estimate(MODEL, fsdp=True, **kw).ranks[0].stage_jobs[0]["F"]["net_bytes"]
    arch = arch_from_preset("")
    boundary = 1024 * 2 * arch.hidden            # tokens x hidden
    assert fsdp - ds >= 2 * boundary * arch.layers * 0.99     # 4 B vs 2 B per element, every layer
