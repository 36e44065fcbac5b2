"""Static bytes per rank against the per-parameter rules of FINDINGS §2, and stage jobs."""

import pytest

from pipemem.model import arch_from_hf_config
from pipemem.plan import ParallelPlan, validate_plan
from pipemem.stages import build_stage_jobs, format_explain, layer_explain
from pipemem.templates.conventions import convention_for
from pipemem.templates.static import rank_param_counts

LLAMA = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "num_hidden_layers": 8,
    "intermediate_size": 1024,
    "vocab_size": 1024,
}


def setup(**kw):
    arch = arch_from_hf_config(LLAMA, "tiny")
    plan = validate_plan(arch, ParallelPlan(seq_len=128, **kw))
    sp = build_stage_jobs(arch, plan)
    n_dense, n_expert = rank_param_counts(arch, plan, convention_for(plan), sp.stage_layers, [0])
    return _Rank0(sp.rank_static([0])), n_dense


class _Rank0:
    """The static bytes of a rank holding stage 0 only."""

    def __init__(self, st):
        self.static = [st]


def model_states(st) -> int:
    return st.params + st.grads + st.optimizer


def test_megatron_mixed_precision_is_18_bytes_per_param():
    sp, n = setup()
    st = sp.static[0]
    assert (st.params, st.grads, st.optimizer) == (2 * n, 4 * n, 12 * n)


def test_distributed_optimizer_is_6_plus_12_over_dp():
    sp, n = setup(dp=4, dist_opt=True)
    assert model_states(sp.static[0]) == 6 * n + 12 * n // 4


def test_pure_bf16_is_8_bytes_per_param():
    sp, n = setup(master_weights=False)
    assert model_states(sp.static[0]) == 8 * n


@pytest.mark.parametrize("zero,expect", [(1, 2 + 4 + 12 / 8), (2, 2 + 4 / 8 + 12 / 8), (3, (2 + 4 + 12) / 8)])
def test_zero_stages(zero, expect):
    sp, n = setup(dp=8, zero=zero)
    assert model_states(sp.static[0]) == int(n * expect)


def test_megatron_runtime_buffers_are_other_static_bytes():
    """Transformer Engine's cached dummy wgrads (one per distinct local weight shape, bf16) and
    the cached rotary frequencies (fp32 [seq, head_dim]); checked against megatron-core's own
    step by `pipemem validate megatron`."""
    h, f, v, d = 512, 1024, 1024, 64
    sp, _ = setup(tp=2, sp=True)
    shapes = {
        (3 * h // 2, h),
        (h, h // 2),
        (2 * f // 2, h),
        (h, f // 2),
        (v // 2, h),
    }  # qkv, proj, fc1, fc2, head
    assert sp.static[0].other == 2 * sum(a * b for a, b in shapes) + 128 * d * 4
    eager, _ = setup(tp=2, sp=True, extra={"wgrad_fused": False})  # --no-gradient-accumulation-fusion
    assert eager.static[0].other == 128 * d * 4


def test_pipeline_ranks_hold_their_layers_and_ends():
    from pipemem.schedules import get_schedule

    arch = arch_from_hf_config(LLAMA, "tiny")
    sp = build_stage_jobs(arch, ParallelPlan(seq_len=128, pp=2, vpp=2))
    h, f, v = 512, 1024, 1024
    layer = 4 * h * h + 3 * h * f + 2 * h
    # looped: rank 0: stages 0 and 2 (4 layers) + embedding; rank 1: stages 1 and 3 + final norm +
    # output layer
    static = sp.static_per_rank(get_schedule("Interleaved1F1B", 2, 2, 2))
    assert static[0].params == 2 * (4 * layer + v * h)
    assert static[1].params == 2 * (4 * layer + h + v * h)
    # V placement: rank 0 holds stages 0 and 3, embedding and head
    static = sp.static_per_rank(get_schedule("ZBVZeroBubble", 2, 4, 2))
    assert static[0].params == 2 * (4 * layer + v * h + h + v * h)
    assert static[1].params == 2 * 4 * layer
    assert sorted(sp.stages) == [0, 1, 2, 3]
    assert tuple(sp.stage_layers[3]) == (6, 7)


def test_stage_jobs_balance_and_first_stage_peak():
    arch = arch_from_hf_config(LLAMA, "tiny")
    sp = build_stage_jobs(arch, ParallelPlan(seq_len=128, pp=2))
    for j in sp.stages.values():  # all but the stage output and input grad (the runtime's)
        assert j.F.net_bytes + j.B.net_bytes == j.output_bytes + j.input_grad_bytes
        assert j.F.net_bytes + j.I.net_bytes + j.W.net_bytes == j.output_bytes + j.input_grad_bytes
        assert j.F.peak_bytes >= j.F.net_bytes > 0


def test_layer_explain_rows_sum_to_retained():
    from pipemem.templates.layers import layer_options, make_shard
    from pipemem.templates.programs import layer_memory

    arch = arch_from_hf_config(LLAMA, "tiny")
    plan = validate_plan(arch, ParallelPlan(seq_len=128, tp=2))
    rows = layer_explain(arch, plan)
    kept = sum(r["bytes"] for r in rows if not r["tensor"].startswith("("))
    conv = convention_for(plan)
    assert (
        kept
        == layer_memory(
            arch, make_shard(arch, plan, conv), conv, layer_options(arch, plan, 0, True)
        ).F.net_bytes
    )
    assert "flash_attn_grad" in format_explain(rows)
