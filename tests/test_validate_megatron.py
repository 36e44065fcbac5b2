"""`pipemem validate megatron` in CI: megatron-core's own step (traced on fake tensors) against
`pipemem.estimate` for the CI cases; the full set runs as `pipemem validate megatron`."""

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from pipemem.validation import TARGETS
from pipemem.validation.megatron import CASES, CI_CASES, TOLERANCE, read_case, select

needs_megatron = pytest.mark.skipif(
    find_spec("megatron") is None, reason="megatron-core not installed (pip install -e '.[megatron]')"
)


def test_target_registered_and_cases_are_valid_plans():
    import pipemem

    assert "megatron" in TARGETS
    for case in CASES:  # every case is a plan --from-megatron reads, estimated through the one path
        tc = read_case(case)
        assert tc.warnings == [], (case.name, tc.warnings)
        est = pipemem.estimate(tc.model, **tc.plan)
        assert len(est.ranks) == case.pp
        assert (est.plan.tp, est.plan.pp, est.plan.dp, est.plan.microbatches) == (
            case.tp,
            case.pp,
            case.dp,
            case.microbatches,
        )


@needs_megatron
@pytest.mark.slow
def test_validate_megatron_ci_cases_agree():
    out = subprocess.run(
        [sys.executable, "-m", "pipemem", "validate", "megatron", "--json", "--cases", ",".join(CI_CASES)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    names = {r["name"] for r in d["cases"]}
    # a case with dense first layers also holds its first MoE layer (moe_layer_kept)
    mixed = {c.name for c in CASES if c.name in CI_CASES and c.experts and c.dense_layers}
    assert mixed == {"deepseek-mtp-ep2"}
    assert names == {f"{c}/{q}" for c in CI_CASES for q in ("peak", "layer_kept")} | {
        f"{c}/moe_layer_kept" for c in mixed
    }
    # a trace, not a measurement; the peak rows rest on the flash workspace the templates assume
    assert (d["truth"], d["tolerance"], d["passed"]) == ("traced", TOLERANCE, True)
    assert all(
        r.get("kernel_workspace") == "kernel workspace assumed, not checked"
        for r in d["cases"]
        if r["name"].endswith("/peak")
    )
    for r in d["cases"]:
        assert r["measured_bytes"] > 0 and abs(r["rel_error"]) <= TOLERANCE, r


@needs_megatron
def test_patches_are_undone():
    import torch
    from megatron.core.fusions import fused_cross_entropy as fce
    from megatron.core.optimizer import optimizer_config
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer as HDO
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
    from megatron.core.transformer import multi_latent_attention as mla

    from pipemem.validation.megatron_trace import megatron_on_cpu

    before = (
        mla.apply_rotary_pos_emb,
        mla.HAVE_TE,
        mla.TELinear,
        torch.cuda.current_device,
        torch.cuda.Stream,
        torch.cuda.Event,
        torch.cuda.synchronize,
        torch.Tensor.record_stream,
        fce.calculate_logits_max,
        fgo.ChunkOffloadHandler.offload,
        fgo.ChunkOffloadHandler.bulk_offload,
        HDO.__init__,
        HDO.step,
        HDO.zero_grad,
        optimizer_config.is_te_min_version,
    )
    with megatron_on_cpu():
        assert torch.cuda.current_device() == "cpu"
        assert not hasattr(fce.calculate_logits_max, "_torchdynamo_orig_callable")  # the plain function
    assert (
        mla.apply_rotary_pos_emb,
        mla.HAVE_TE,
        mla.TELinear,
        torch.cuda.current_device,
        torch.cuda.Stream,
        torch.cuda.Event,
        torch.cuda.synchronize,
        torch.Tensor.record_stream,
        fce.calculate_logits_max,
        fgo.ChunkOffloadHandler.offload,
        fgo.ChunkOffloadHandler.bulk_offload,
        HDO.__init__,
        HDO.step,
        HDO.zero_grad,
        optimizer_config.is_te_min_version,
    ) == before
    assert "is_cuda" not in torch.Tensor.__dict__
    assert "fused_weight_gradient_mlp_cuda" not in sys.modules


def test_ce_fusion_cases_are_estimated_with_the_fused_loss():
    fused = [c for c in CASES if c.ce_fusion]
    assert {c.tp for c in fused} >= {1, 2}
    for case in fused:
        assert read_case(case).plan["loss"] == "fused"
    assert all("loss" not in read_case(c).plan for c in CASES if not c.ce_fusion)


def test_unknown_case_is_one_clear_error():
    from pipemem.errors import UserError

    with pytest.raises(UserError, match="unknown case"):
        select("dense-tp2-sp,nope")


@needs_megatron
def test_fine_grained_offloading_runs_megatron_code():
    """megatron's own offloading, traced: each offloaded layer's forward keeps q, k, the fused
    qkv output (v's storage, freed by the forced release) and the attention output less; the
    stage's last layer offloads nothing in the steady-state step (its backward comes next)."""
    from dataclasses import replace

    from pipemem.validation.megatron import trace_in_subprocess

    case = next(c for c in CASES if c.name == "dense-tp1-offload-attn")
    on, off = trace_in_subprocess(case), trace_in_subprocess(replace(case, offload=""))
    s, b, h, heads, kv = case.seq_len, case.micro_batch, case.hidden, case.heads, case.kv_heads
    d = h // heads
    moved = 2 * s * b * (heads * d + kv * d + (heads + 2 * kv) * d + h)  # q, k, qkv, ctx (bf16)
    last = str(case.layers - 1)
    for layer in map(str, range(case.layers - 1)):
        assert off["layer_kept_bytes"][layer] - on["layer_kept_bytes"][layer] == moved
    assert on["layer_kept_bytes"][last] == off["layer_kept_bytes"][last]
    assert on["static_bytes"] == off["static_bytes"]


@needs_megatron
def test_optimizer_offload_runs_megatron_code():
    """megatron's HybridDeviceOptimizer, traced at F = 0.5: the rank's optimizer shards (dist-opt
    ranges, megatron's order: output layer, layer 1's fc2, fc1, qkv, proj, then the norms) are
    offloaded whole while fewer than F x total elements are, so the first three go (76.9 %):
    their fp32 masters and both Adam moments (12 bytes an element) leave the GPU; the step's
    only device transient is the fp32 landing buffer of the largest offloaded shard's
    non-blocking host-to-device copy into the bf16 params."""
    from dataclasses import replace

    from pipemem.validation.megatron import trace_in_subprocess

    case = next(c for c in CASES if c.name == "dense-tp1")
    on, off = trace_in_subprocess(replace(case, optimizer_offload=0.5)), trace_in_subprocess(case)
    vocab = -(-case.vocab // 128) * 128
    shards = [vocab * case.hidden, case.hidden * case.ffn, 2 * case.ffn * case.hidden]  # output, fc2, fc1
    assert off["static_bytes"] - on["static_bytes"] == 12 * sum(shards)
    step = {p["name"]: p for p in on["phases"]}["s2.optimizer"]
    assert step["peak_bytes"] - step["start_bytes"] == 4 * max(shards)


@needs_megatron
@pytest.mark.slow
def test_precision_aware_optimizer_runs_megatron_code():
    """--use-precision-aware-optimizer: megatron's DistributedOptimizer hands its shards to
    Transformer Engine's FusedAdam (a stand-in that allocates what TE's does) and makes no fp32
    masters itself. Per shard element, against the fp32 masters and moments of the plain
    distributed optimizer (12 bytes): bf16 moments with the 16-bit remainders megatron asks
    for (store_param_remainders) keep 2 + 2 + 2, fp16 masters 2 + 4 + 4, so the first saves
    three times what the second does; fp8 moments (data + transpose) cost what bf16 ones do.
    (TE's fp32 scale per non-fp32 state of each parameter, 4 bytes a tensor, is left out of
    both the relation and pipemem.) pipemem.estimate agrees with each trace."""
    from pipemem.validation.megatron import compare, trace_in_subprocess

    by_name = {c.name: c for c in CASES}
    names = (
        "dense-tp1",
        "dense-tp1-precision-aware-bf16-states",
        "dense-tp1-precision-aware-fp16-main",
        "dense-tp1-precision-aware-fp8-states",
    )
    traces = {n: trace_in_subprocess(by_name[n]) for n in names}
    static = {n: t["static_bytes"] for n, t in traces.items()}
    plain, bf16, fp16_main, fp8 = (static[n] for n in names)
    assert plain - bf16 > 0
    assert abs((plain - bf16) - 3 * (plain - fp16_main)) <= 1e-4 * (plain - bf16)
    assert abs(fp8 - bf16) <= 1e-4 * bf16
    for n in names[1:]:
        for row in compare(by_name[n], traces[n]):
            assert abs(row.rel_error) <= TOLERANCE, row
            est, measured = row.extra["estimated_static_bytes"], row.extra["measured_static_bytes"]
            assert abs(est - measured) <= 1e-4 * measured, row


def test_deepseek_cases_cover_mla_moe_and_mtp():
    """The DeepSeek-style cases: MLA alone (with and without the q LoRA, selective and full
    recompute, tp 2 with and without SP), DeepSeek's MoE after a dense layer, MTP of one and two
    depths (at tp 2 with SP, on a last pipeline stage), all three together; each estimated
    with what --from-megatron reads for them."""
    from pipemem.model import arch_from_hf_config

    ds = {c.name: c for c in CASES if c.kind == "deepseek"}
    assert {
        "mla-tp1",
        "mla-tp1-no-q-lora",
        "mla-tp1-full",
        "mla-tp2-sp",
        "deepseek-moe-ep2",
        "mtp-tp1",
        "mtp2-tp1",
        "mtp-tp2-sp",
        "mtp-pp2-last",
    } <= set(ds)
    both = arch_from_hf_config(read_case(ds["deepseek-mtp-ep2"]).model)
    assert both.kv_lora_rank and both.mtp_layers == 1 and both.dense_layers == (0,)
    assert (both.router, both.router_groups, both.shared_experts) == ("sigmoid_group", 4, 1)
    assert arch_from_hf_config(read_case(ds["mla-tp1-no-q-lora"]).model).q_lora_rank == 0
