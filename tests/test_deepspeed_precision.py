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


# untied, so every parameter count below is the model's own (validate deepspeed's zero3-tied case
# holds the tied one)
MODEL = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_hidden_layers": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


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
    assert st.optimizer == pytest.approx((4 + 8) * shard, rel=1e-3)  # fp32 master + Adam moments
    # the step's fp32 copy of the rank's grad partition
    assert optimizer_step_scratch(arch, plan, conv, layers, [0]) == pytest.approx(4 * shard, rel=1e-3)


def test_fsdp_and_plain_ddp_stay_under_autocast():
    for kw in (
        {"fsdp": True, "dtype": "bf16"},
        {"dtype": "bf16"},
        {"zero": 2, "dtype": "fp32"},
        {"zero": 2, "dtype": "bf16", "master_weights": False},
    ):
        _, plan, *_ = _params(kw)
        assert not plan.deepspeed_mixed_precision, kw
    st = pipemem.estimate(MODEL, convention="hf", fsdp=True, dp=DP, dtype="bf16", seq_len=512).ranks[0].static
    n = _params({"fsdp": True, "dtype": "bf16"})[-1]
    assert st.params == pytest.approx(4 * -(-n // DP), rel=1e-3)  # fp32 parameter shards


def test_deepspeed_layer_inputs_are_half():
    """What a checkpointed layer keeps is its input: in the model's dtype under DeepSpeed, fp32
    under autocast (the residual stream of fp32 parameters)."""
    kw = dict(convention="hf", dp=DP, dtype="bf16", seq_len=1024, micro_batch=2, recompute="full")
    ds = pipemem.estimate(MODEL, zero=2, **kw).ranks[0].stage_jobs[0]["F"]["net_bytes"]
    fsdp = pipemem.estimate(MODEL, fsdp=True, **kw).ranks[0].stage_jobs[0]["F"]["net_bytes"]
    arch = arch_from_preset("")
    boundary = 1024 * 2 * arch.hidden  # tokens x hidden
    assert fsdp - ds >= 2 * boundary * arch.layers * 0.99  # 4 B vs 2 B per element, every layer


def test_zero3_reuse_window_keeps_the_last_layers_gathered():
    """DeepSpeed ZeRO-3 keeps a layer gathered from its forward into its backward when the
    elements visited in between are within stage3_max_reuse_distance: the whole small model at
    the default, none at 0; the layers kept grow with the window and shrink under checkpointing
    (the recomputed forwards are visited too)."""
    from pipemem.templates.layers import zero3_reuse

    arch = arch_from_preset("")
    conv = convention_for(validate_plan(arch, ParallelPlan(convention="hf", zero=3, dp=DP, seq_len=512)))

    def kept(window, recompute="none"):
        plan = validate_plan(
            arch,
            ParallelPlan(
                convention="hf",
                zero=3,
                dp=DP,
                seq_len=512,
                recompute=recompute,
                extra={"stage3_max_reuse_distance": window},
            ),
        )
        return zero3_reuse(arch, plan, conv)

    assert kept(10**9).layers == arch.layers and kept(10**9).embedding
    assert kept(0).layers == 0 and not kept(0).head and not kept(0).embedding
    counts = [kept(w).layers for w in (10**7, 10**8, 3 * 10**8)]
    assert counts == sorted(counts) and 0 < counts[1] < arch.layers
    assert kept(2 * 10**8, "full").layers < kept(2 * 10**8).layers
    # what it keeps is counted: the backward starts with those parameters still gathered
    kw = dict(convention="hf", zero=3, dp=DP, seq_len=512)
    wide = pipemem.estimate(MODEL, extra={"stage3_max_reuse_distance": 10**9}, **kw).ranks[0]
    none = pipemem.estimate(MODEL, extra={"stage3_max_reuse_distance": 0}, **kw).ranks[0]
    assert wide.peak_allocated_bytes > none.peak_allocated_bytes


def test_reduce_bucket_is_counted_where_deepspeed_holds_it():
    """ZeRO-1/2: reduce_bucket_size elements of grads alive through the backward (not at the
    optimizer step); ZeRO-3: resident (static)."""
    kw = dict(convention="hf", dp=DP, dtype="bf16", seq_len=512)
    small, big = {"reduce_bucket_size": 1}, {"reduce_bucket_size": 10**8}
    # a small vocabulary: the layers' backward, not the loss's, is where the bucket shows
    model = dict(MODEL, vocab_size=1024)
    for zero in (1, 2):
        runs = [
            pipemem.estimate(
                model, zero=zero, extra={"reduce_bucket_size": n}, micro_batch=4, optimizer_impl="fused", **kw
            ).ranks[0]
            for n in (10**9, 10**9 + 10**8)
        ]
        assert runs[1].static == runs[0].static
        assert runs[1].peak_allocated_bytes - runs[0].peak_allocated_bytes == 2 * 10**8
    a = pipemem.estimate(MODEL, zero=3, extra=small, **kw).ranks[0]
    b = pipemem.estimate(MODEL, zero=3, extra=big, **kw).ranks[0]
    assert b.static.other - a.static.other == 2 * (10**8 - 1)


def test_zero3_tied_head_reads_the_embeddings_gathered_weight():
    """A tied word embedding is one parameter: ZeRO-3 keeps it gathered from the embedding's forward
    (the head reuses it within stage3_max_reuse_distance), so the head gathers nothing more for it.
    Above the static state, the untied model's peak (the loss backward) holds exactly one gathered
    [vocab, hidden] weight more: its output layer's (it was equal when the tied weight was gathered
    twice). A window shorter than a layer keeps nothing gathered (every layer's weights released)."""
    tied = dict(MODEL, tie_word_embeddings=True)
    v, h = MODEL["vocab_size"], MODEL["hidden_size"]
    kw = dict(convention="hf", zero=3, dp=DP, dtype="bf16", seq_len=512)
    above = lambda r: r.peak_allocated_bytes - r.static.total  # noqa: E731
    kept = pipemem.estimate(tied, **kw).ranks[0]
    untied = pipemem.estimate(MODEL, **kw).ranks[0]
    short = pipemem.estimate(tied, extra={"stage3_max_reuse_distance": 1}, **kw).ranks[0]
    assert kept.peak_at == untied.peak_at
    assert above(untied) - above(kept) == 2 * v * h
    assert above(short) < above(kept)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_offload_moves_what_deepspeeds_code_places_on_the_cpu(zero):
    """ZeRO-Offload (offload_optimizer, read from DeepSpeed 0.19's code; not measurable on its CPU
    accelerator): the fp32 master, the Adam states and the step's fp32 grad partition are on the
    CPU; ZeRO-3's flat grad partition too; ZeRO-1/2 add a GPU staging buffer of the largest
    parameter (here the word embedding, vocab x hidden) in the model's dtype."""
    arch, plan, conv, layers, n = _params({"zero": zero, "dtype": "bf16", "optimizer_offload": 1.0})
    kw = dict(
        convention="hf", zero=zero, dp=DP, dtype="bf16", seq_len=512, extra={"reduce_bucket_size": 4096}
    )
    on = pipemem.estimate(MODEL, **kw).ranks[0].static
    off = pipemem.estimate(MODEL, optimizer_offload=1.0, **kw).ranks[0].static
    assert off.optimizer == 0 and on.optimizer > 0
    assert optimizer_step_scratch(arch, plan, conv, layers, [0]) == 0
    assert off.params == on.params
    if zero == 3:
        assert off.grads == 0 < on.grads and off.other == on.other
    else:
        assert off.grads == on.grads
        assert off.other - on.other == MODEL["vocab_size"] * MODEL["hidden_size"] * 2
