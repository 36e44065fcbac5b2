"""Template layer programs against hand-derived op lists (what each autograd function saves),
and the recompute_allgather rule of FINDINGS §1b."""

import pytest

from pipemem.model import arch_from_hf_config
from pipemem.plan import ParallelPlan, validate_plan
from pipemem.templates.conventions import convention_for
from pipemem.templates.layers import layer_options, make_shard
from pipemem.templates.programs import layer_memory

S, B, H, A, KV, F = 128, 2, 256, 8, 2, 512
D = H // A
LLAMA = {
    "model_type": "llama",
    "hidden_size": H,
    "num_attention_heads": A,
    "num_key_value_heads": KV,
    "num_hidden_layers": 4,
    "intermediate_size": F,
    "vocab_size": 1000,
}
QWEN2 = dict(LLAMA, model_type="qwen2")
MIXTRAL = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)


def layer(config, **plan_kw):
    arch = arch_from_hf_config(config, "test")
    kw = dict(seq_len=S, micro_batch=B, dtype="bf16")
    kw.update(plan_kw)
    plan = validate_plan(arch, ParallelPlan(**kw))
    conv = convention_for(plan)
    return layer_memory(arch, make_shard(arch, plan, conv), conv, layer_options(arch, plan, 0, True))


def llama_hand(conv, tp=1, sp=False):
    """Bytes one Llama layer keeps for backward (flash attention, bf16), by hand:
    output (= next input) 2sbh; RMSNorm rstd fp32 per token x2; normed inputs of qkv and fc1;
    q, k after rope; v (a view of the projection output, which it keeps whole); flash out and
    fp32 logsumexp; residual; MLP: fused -> fc1 out [2f] + act [f]; unfused -> gate, silu(gate),
    up, product [f each]."""
    s_sp = S // tp if sp else S
    a, kv, f = A // tp, max(1, KV // tp), F // tp
    tok_sp = s_sp * B
    tok = S * B
    keep = 2 * tok_sp * H  # layer output
    keep += 2 * 4 * tok_sp  # two rstd
    keep += 2 * tok_sp * H  # residual1 (post-attention norm input)
    if conv == "megatron":
        keep += 2 * 2 * tok_sp * H  # qkv and fc1 inputs: sharded norm outputs
        keep += 2 * tok * (a + 2 * kv) * D  # fused qkv output, kept whole by the v view
        keep += 2 * tok * (a + kv) * D  # q, k after rope
        keep += 2 * tok * 2 * f + 2 * tok * f  # fc1 out (fused swiglu input) + act
    else:  # torchtitan: gathered norm outputs, separate projections, unfused swiglu
        keep += 2 * 2 * tok * H
        keep += 2 * tok * kv * D  # v projection output
        keep += 2 * tok * (a + kv) * D
        keep += 4 * 2 * tok * f
    keep += 2 * tok * a * D + 4 * B * a * S  # flash out + lse
    return keep


@pytest.mark.parametrize("conv", ["megatron", "torchtitan"])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, True), (2, False)])
def test_llama_layer_keeps_hand_derived_bytes(conv, tp, sp):
    m = layer(LLAMA, convention=conv, tp=tp, sp=sp)
    assert m.F.net_bytes == llama_hand(conv, tp, sp)
    assert m.B.net_bytes == -m.F.net_bytes
    assert m.I.net_bytes + m.W.net_bytes == m.B.net_bytes


def test_qwen2_bias_adds_no_saved_activation():
    assert layer(QWEN2).F.net_bytes == layer(LLAMA).F.net_bytes


def test_full_recompute_keeps_only_the_input():
    m = layer(LLAMA, recompute="full")
    assert m.F.net_bytes == 2 * S * B * H
    # backward re-runs the forward: its peak holds at least the recomputed saved tensors
    assert m.B.peak_bytes >= llama_hand("megatron") - 2 * S * B * H


def test_mixtral_layer_hand_derived():
    """MoE layer as megatron-core's MoELayer keeps it (alltoall dispatcher, grouped experts),
    ep=1, tp=1: fp32 dense probs and the bool routing map (held by the dispatcher), top-k
    indices and the fp32 softmax over the k scores, the transposed routing map
    (masked_select's mask), the sorted token indices, the tokens and probs sorted by local
    expert (fc1's input; the weighted SwiGLU's probs), fc1 out [N, 2f] and act [N, f]. The
    probs are applied in the activation, so no expert output is kept. N = T x top_k."""
    m = layer(MIXTRAL)
    T, E, K = S * B, 4, 2
    N = T * K
    dense = llama_hand("megatron")
    mlp_dense = 2 * S * B * 2 * F + 2 * S * B * F
    moe = (
        4 * T * E
        + T * E  # fp32 probs, bool routing map
        + 8 * T * K
        + 4 * T * K  # int64 top-k indices, fp32 top-k softmax
        + T * E
        + 8 * N  # transposed routing map, sorted indices
        + 2 * N * H
        + 4 * N  # sorted tokens (fc1 input), sorted fp32 probs
        + 2 * N * 2 * F
        + 2 * N * F
    )  # fc1 out, act
    assert m.F.net_bytes == dense - mlp_dense + moe


@pytest.mark.parametrize("fused", [True, False])
def test_recompute_allgather_paddle_drops_one_gathered_input_per_column_linear(fused):
    extra = {"fuse_qkv": fused, "fuse_gate_up": fused}
    base = layer(LLAMA, convention="paddle", tp=2, sp=True, extra=extra).F.net_bytes
    rag = layer(LLAMA, convention="paddle", tp=2, sp=True, recompute_allgather=True, extra=extra).F.net_bytes
    column_linears = 2 if fused else 5
    assert base - rag == column_linears * S * B * H * 2


def test_recompute_allgather_changes_nothing_under_megatron():
    a = layer(LLAMA, convention="megatron", tp=2, sp=True)
    b = layer(LLAMA, convention="megatron", tp=2, sp=True, recompute_allgather=True)
    assert (a.F, a.B, a.I, a.W) == (b.F, b.B, b.I, b.W)


def test_zero3_gathers_the_layer_parameters_for_forward():
    """ZeRO-3 / FSDP: the layer's tp-shard of parameters (bf16) is all-gathered for the whole
    forward of the layer, so the forward peak rises by exactly those bytes and nothing more is kept."""
    tp = 2
    a, kv, f = A // tp, KV // tp, F // tp
    params = H * (a + 2 * kv) * D + a * D * H + 3 * H * f + 2 * H
    base = layer(LLAMA, tp=tp, dp=4)
    z3 = layer(LLAMA, tp=tp, dp=4, zero=3)
    assert z3.F.net_bytes == base.F.net_bytes
    assert z3.F.peak_bytes == base.F.peak_bytes + 2 * params


def test_paddle_unfused_rope_halves_are_shape_only_reads_of_the_concat_backward():
    # Paddle's concat_grad reads rope's two halves (per q and k) for their shapes only: kept
    # from the forward job, the pipeline's skip_gc rule keeps them and the backward never
    # frees them; recomputed, they die after the concat and nothing is left behind.
    extra = {"fused_rope": False}
    halves = 2 * (S * B * A * D // 2 + S * B * KV * D // 2) * 4
    kept = layer(LLAMA, convention="paddle", dtype="fp32", extra=extra)
    assert kept.F.net_bytes + kept.B.net_bytes == halves
    rc = layer(LLAMA, convention="paddle", dtype="fp32", recompute="full", extra=extra)
    assert rc.F.net_bytes + rc.B.net_bytes == 0


def test_layer_options_take_the_arch_fields_of_their_names():
    """ARCH_FIELDS are copied as they are: each a field of both, and a changed arch value shows."""
    import dataclasses

    from pipemem.templates.layers import ARCH_FIELDS, LayerOptions, layer_options_of

    arch = arch_from_hf_config(dict(MIXTRAL, n_group=4, topk_group=2), "test")
    arch_fields = {f.name for f in dataclasses.fields(arch)}
    option_fields = {f.name for f in dataclasses.fields(LayerOptions)}
    assert set(ARCH_FIELDS) <= arch_fields & option_fields
    changed = dataclasses.replace(arch, router_groups=4, router_topk_groups=2, expert_act="clamped_swiglu")
    opt = layer_options_of(changed, True, True, "none")
    for f in ARCH_FIELDS:
        assert getattr(opt, f) == getattr(changed, f), f
    assert (opt.router_groups, opt.router_topk_groups, opt.expert_act) == (4, 2, "clamped_swiglu")
