"""`pipemem plan`: the search lists only valid plans that fit, each re-estimating to the same
bytes with `pipemem estimate` and its flags; the cost model's bubble equals the literature's
closed forms; the pruning it relies on holds; published large runs appear where they ran."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipemem.cli.main import main
from pipemem.errors import UserError
from pipemem.estimate import estimate
from pipemem.plan import ParallelPlan, validate_plan
from pipemem.planner import SpaceOptions, Target, search_plans
from pipemem.planner.cost import layer_flops, pipeline_time
from pipemem.planner.hardware import speeds_for
from pipemem.planner.space import balanced_layout
from pipemem.presets import gpu_info
from pipemem.schedules import get_schedule


def _target(gpus: int, gpu: str = "h100-80g", reserve: int | None = None, per_node: int = 8) -> Target:
    cap = gpu_info(gpu)["bytes"]
    return Target(
        gpus, cap, 0 if reserve is None else reserve, speeds_for(gpu), gpu=gpu, gpus_per_node=per_node
    )


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def small_search():
    """Llama 3.2 1B on 16 24-GiB GPUs in 2 nodes: tight enough that recomputation, pruning and
    every dimension come into play, small enough for CI."""
    return search_plans(
        "llama3.2-1b",
        _target(16, "rtx3090", per_node=8),
        4096,
        64,
        SpaceOptions(micro_batches=(1, 2, 4), max_vpp=4),
    )


# ---------------------------------------------------------------- the cost model's bubble


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_bubble_1f1b_closed_form(p, m):
    # (p-1)/(m+p-1) of the step is idle with equal stages (Narayanan et al. 2021)
    t = pipeline_time(get_schedule("1F1B", p, m), [(1.0, 1.0, 1.0)] * p)
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("name", ["Interleaved1F1B", "VPP"])
@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 4), (8, 16, 2), (8, 32, 4)])
def test_bubble_interleaved_closed_form(name, p, m, v):
    # Megatron's interleaved schedule: bubble time (p-1)/v of a microbatch's F+B, i.e. a share
    # (p-1)/(v m + p-1) of the step (Narayanan et al. 2021, §2.2)
    t = pipeline_time(get_schedule(name, p, m, vpp=v), [(1 / v, 1 / v, 1 / v)] * (p * v))
    assert t.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("tf,ti,tw", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 1.0, 0.8)])
def test_bubble_zb_h1_closed_form(p, m, tf, ti, tw):
    # ZB-H1 (Qi et al. 2024, §3.1): bubble (p-1)(T_F + T_B - T_W) with T_B the input-grad pass
    t = pipeline_time(get_schedule("ZB1P", p, m), [(tf, ti, tw)] * p)
    bubble = (p - 1) * (tf + ti - tw)
    assert t.makespan == pytest.approx(m * (tf + ti + tw) + bubble, rel=1e-12)
    assert t.bubble == pytest.approx(bubble / t.makespan, rel=1e-9)


def test_layer_flops_match_the_zero_bubble_paper():
    # GPT layer (4h FFN, no GQA): F = sb(24h^2 + 4sh), B = sb(24h^2 + 8sh), W = sb(24h^2) per layer
    from pipemem.model import ArchSpec

    h, s = 1024, 2048
    arch = ArchSpec(
        "gpt",
        "gpt2",
        layers=2,
        hidden=h,
        heads=16,
        kv_heads=16,
        head_dim=64,
        ffn=4 * h,
        vocab=1000,
        norm="layernorm",
        activation="gelu",
    )
    f, i, w = layer_flops(arch, 0, s)
    assert (f, i, w) == (24 * h * h + 4 * s * h, 24 * h * h + 8 * s * h, 24 * h * h)
    assert layer_flops(arch, 0, s, "full") == (f, i + f, w)


def test_balanced_layout():
    assert balanced_layout(126, 16) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B's layout
    assert balanced_layout(80, 16) is None
    lay = balanced_layout(81, 8)
    assert sum(lay) == 81 and max(lay) - min(lay) == 1 and lay[0] == lay[-1] == 10


# ---------------------------------------------------------------- the search


def test_listed_plans_are_valid_and_fit(small_search):
    res = small_search
    assert res.plans, "some plan must fit"
    arch = res.arch
    for p in res.plans:
        plan = validate_plan(arch, ParallelPlan(**p.kwargs))  # raises for an invalid plan
        assert plan.world == 16
        assert plan.pp * plan.vpp <= arch.layers
        assert plan.tp <= 8  # tp within a node
        # screened on allocated + outside the allocator: already above the allocated peak alone
        assert p.peak_bytes < p.device_peak_bytes <= res.target.budget_bytes < res.target.capacity_bytes
        assert p.peak_bytes == max(p.rank_peaks)
    # every dimension was searched
    kws = [p.kwargs for p in res.plans]
    for key in ("tp", "pp", "cp", "dp", "micro_batch"):
        assert len({k[key] for k in kws}) > 1, key
    assert any(k.get("vpp", 1) > 1 for k in kws)
    assert any(k.get("recompute", "none") != "none" for k in kws)
    assert res.stats.no_fit + res.stats.pruned_static > 0  # not everything fits


def test_shown_plans_are_fits_by_the_estimates_verdict():
    """The plans shown are judged by pipemem estimate's own verdict, reserved memory included:
    each re-estimates to FITS with the same device peak, and the rest stay unjudged (None)."""
    res = search_plans(
        "llama3.2-1b",
        _target(8, "rtx3090", per_node=8),
        2048,
        32,
        SpaceOptions(micro_batches=(1, 2), max_vpp=2),
    )
    n = len(res.plans)
    dropped = res.verify(3)
    assert len(res.plans) == n - dropped and dropped == res.stats.dropped_on_reserved
    shown = res.plans[:3] + res.pareto[:3] + res.pareto_step_time[-3:]
    for p in shown:
        e = estimate("llama3.2-1b", gpu="rtx3090", **p.kwargs)
        assert p.verdict == "fits" and e.verdict == "fits"
        assert p.device_peak_bytes == e.max_device_peak_bytes >= p.peak_bytes
        assert e.max_peak_reserved_bytes is not None  # reserved was modelled, not assumed
    assert any(p.verdict is None for p in res.plans[3:]) or len(res.plans) <= len(set(map(id, shown)))


def test_listed_plans_reestimate_to_the_same_bytes(small_search):
    """The acceptance check: `pipemem estimate` with a listed plan's flags gives its bytes."""
    rng = random.Random(18)
    plans = small_search.plans
    sample = rng.sample(plans, min(6, len(plans)))
    sample += [p for p in plans if p.kwargs.get("recompute_layers")][:2]
    for p in sample:
        rc, out, err = _cli(["estimate", *p.flags.split(), "--json"])
        assert rc == 0, err
        d = json.loads(out)
        assert d["max_peak_allocated_bytes"] == p.peak_bytes, p.flags
        assert [r["peak_allocated_bytes"] for r in d["ranks"]] == p.rank_peaks


def test_cheapest_recompute_is_listed(small_search):
    """A plan that recomputes is listed only when the same plan without recomputation does not
    fit, and a plan recomputing K layers per stage only when K - 1 does not fit."""
    recomputing = [p for p in small_search.plans if p.kwargs.get("recompute", "none") != "none"]
    partial = [p for p in recomputing if (p.kwargs.get("recompute_layers") or 0) > 1]
    assert recomputing and partial
    for p in recomputing[:3] + partial[:3]:
        kw = {k: v for k, v in p.kwargs.items() if k not in ("recompute", "recompute_layers")}
        e = estimate("llama3.2-1b", gpu="rtx3090", **kw)  # not even screened in without recomputation
        assert (
            max(r.peak_allocated_bytes + r.outside.total_bytes for r in e.ranks)
            > small_search.target.budget_bytes
        )
        k = p.kwargs.get("recompute_layers")
        if k and k > 1:
            fewer = estimate("llama3.2-1b", gpu="rtx3090", **kw, recompute="full", recompute_layers=k - 1)
            assert (
                max(r.peak_allocated_bytes + r.outside.total_bytes for r in fewer.ranks)
                > small_search.target.budget_bytes
            ), p.flags


@pytest.mark.parametrize(
    "conv,shardings",
    [("megatron", ("ddp", "dist-opt", "zero2")), ("paddle", ("zero1", "zero2", "zero3")), ("hf", None)],
)
def test_pruning_changes_nothing_listed(conv, shardings):
    """The static-bytes bound and the settings shared between sharding levels skip estimates,
    never plans: the search without them lists the same plans with the same bytes."""
    args = (
        "llama3.2-3b",
        _target(4, "rtx3090"),
        4096,
        8,
        SpaceOptions(convention=conv, micro_batches=(1, 2), max_vpp=2, shardings=shardings),
    )
    pruned = search_plans(*args)
    full = search_plans(*args, prune=False)
    # (paddle's optimizer step copies the clipped gradients, so zero2 changes its jobs and
    # shares no settings with zero1 here: nothing to derive; settings can still be implied too
    # large by a smaller micro-batch's, so `implied` is only required where levels share)
    shares = conv == "megatron"
    assert pruned.stats.pruned_static > 0 and (pruned.stats.implied > 0 or not shares)
    assert (pruned.stats.derived > 0) == shares and pruned.stats.derivation_mismatch == 0
    assert full.stats.pruned_static == 0 and full.stats.implied == 0
    assert pruned.stats.estimates < full.stats.estimates
    assert [(p.flags, p.rank_peaks) for p in pruned.plans] == [(p.flags, p.rank_peaks) for p in full.plans]


def test_parallel_search_lists_the_same(small_search):
    res = search_plans(
        "llama3.2-1b",
        _target(16, "rtx3090", per_node=8),
        4096,
        64,
        SpaceOptions(micro_batches=(1, 2, 4), max_vpp=4),
        jobs=2,
    )
    assert [(p.flags, p.rank_peaks, p.cost.step_s) for p in res.plans] == [
        (p.flags, p.rank_peaks, p.cost.step_s) for p in small_search.plans
    ]
    a, b = res.stats.to_dict(), small_search.stats.to_dict()
    assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}


def test_pareto_sets_are_not_dominated(small_search):
    for front, second, pipeline_only in (
        (small_search.pareto, lambda p: p.cost.bubble, True),
        (small_search.pareto_step_time, lambda p: p.cost.step_s, False),
    ):
        assert front
        assert not pipeline_only or all(p.kwargs["pp"] > 1 for p in front)
        for a in front:
            for b in small_search.plans:
                if b is a or (pipeline_only and b.kwargs["pp"] == 1):
                    continue
                assert not (b.peak_bytes <= a.peak_bytes and second(b) < second(a) - 1e-12), (
                    a.flags,
                    b.flags,
                )


def test_plans_that_cannot_run_never_appear():
    """tp not dividing the heads / KV heads (as validate_plan rules) and pp beyond the layers."""
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 6,
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_key_value_heads": 3,
        "intermediate_size": 4096,
        "vocab_size": 32000,
    }
    from pipemem.model import arch_from_hf_config

    arch = arch_from_hf_config(cfg, "odd")
    res = search_plans(cfg, _target(16, "rtx3090"), 1024, 32, SpaceOptions(micro_batches=(1,), max_vpp=2))
    assert res.plans
    seen_tp = {p.kwargs["tp"] for p in res.plans}
    for tp in (1, 2, 4, 8, 16):
        try:
            validate_plan(arch, ParallelPlan(tp=tp))
        except UserError:
            assert tp not in seen_tp
    assert all(p.kwargs["pp"] * p.kwargs.get("vpp", 1) <= 6 for p in res.plans)
    assert res.stats.invalid  # some proposals were refused


def test_pinned_degrees_and_moe():
    res = search_plans(
        "mixtral-8x7b",
        _target(32, "h100-80g"),
        4096,
        64,
        SpaceOptions(micro_batches=(1,), max_vpp=1, fixed={"tp": 2, "pp": 4}),
    )
    assert res.plans
    assert {p.kwargs["tp"] for p in res.plans} == {2} and {p.kwargs["pp"] for p in res.plans} == {4}
    assert len({p.kwargs["ep"] for p in res.plans}) > 1
    assert any(p.kwargs.get("etp") == 1 for p in res.plans)
    assert all(
        p.cost.comm and any(c.group == "ep" for c in p.cost.comm) for p in res.plans if p.kwargs["ep"] > 1
    )
    etp1 = next(p for p in res.plans if p.kwargs.get("etp") == 1 and p.kwargs["ep"] > 1)
    rc, out, err = _cli(["estimate", *etp1.flags.split(), "--json"])
    assert rc == 0, err
    assert "--etp 1" in etp1.flags and json.loads(out)["max_peak_allocated_bytes"] == etp1.peak_bytes


def test_moe_space_is_megatron_cores_expert_rule():
    """megatron-core 0.16.1 parallel_state: expert data parallel = world / (etp x ep x pp), which
    must divide; nothing asks ep to divide dp. The space proposes exactly the (ep, etp = tp or 1)
    pairs that pass it for every tp / cp / pp split (DeepSeek-V3 on 512 GPUs: tp 8, dp 2 with
    etp 1 goes up to ep 16)."""
    from pipemem.model import arch_from_hf_config
    from pipemem.planner.space import divisors, enumerate_bases
    from pipemem.presets import load_model_config

    arch = arch_from_hf_config(load_model_config("deepseek-v3")[1], "deepseek-v3")
    gpus = 512
    seen: dict = {}
    for b in enumerate_bases(arch, gpus, SpaceOptions(convention="megatron", max_vpp=1)):
        etp = b.etp or b.tp
        assert gpus % (etp * b.ep * b.pp) == 0 and arch.experts % b.ep == 0
        seen.setdefault((b.tp, b.cp, b.pp), set()).add((b.ep, etp))
    for (tp, cp, pp), pairs in seen.items():
        want = {(ep, etp) for ep in divisors(arch.experts) for etp in {tp, 1} if gpus % (etp * ep * pp) == 0}
        assert pairs == want, (tp, cp, pp)
    assert (16, 1) in seen[(8, 1, 32)] and (4, 8) not in seen[(8, 1, 32)]


def test_megatron_moe_tp_traffic_follows_its_dispatcher():
    """Megatron's alltoall dispatcher under expert TP gathers the routed tokens (b s / (cp tp) x
    top-k x h a rank) over the etp ranks and reduce-scatters the experts' output: a MoE layer's
    tp traffic is the attention's [b, s, h] collectives plus those; with etp 1 only the
    attention's. Dense layers, and other conventions' MoE layers, keep 4 per pass."""
    from pipemem.model import arch_from_hf_config
    from pipemem.planner.cost import communication
    from pipemem.presets import load_model_config

    arch = arch_from_hf_config(load_model_config("mixtral-8x7b")[1], "mixtral-8x7b")  # no shared expert
    b, s, h, k = 1, 4096, arch.hidden, arch.top_k

    def tp_bytes(convention="megatron", **kw):
        plan = validate_plan(arch, ParallelPlan(seq_len=s, tp=4, dp=2, convention=convention, **kw))
        comm = communication(arch, plan, [0], (1, 1), 8, speeds_for("h100-80g"))
        return plan, sum(c.bytes for c in comm if c.group == "tp")

    plan, etp4 = tp_bytes()
    m, layers, tokens = plan.microbatches, arch.layers, b * s // 4
    attention = m * layers * 2 * 2 * (3 / 4) * b * s * h * 2  # 2 collectives a pass, F and B
    routed = m * layers * 2 * 2 * 3 * tokens * k * h * 2  # (etp - 1) x the rank's routed tokens
    assert etp4 == pytest.approx(attention + routed)
    assert tp_bytes(ep=2, etp=1)[1] == pytest.approx(attention)
    # a recomputed forward repeats its collectives: 3 passes where there were 2
    assert tp_bytes(recompute="full")[1] == pytest.approx(1.5 * (attention + routed))
    # torchtitan splits the experts over tp as a dense MLP: 4 collectives of [b, s, h] a pass
    assert tp_bytes("torchtitan")[1] == pytest.approx(2 * attention)


# ---------------------------------------------------------------- published runs


@pytest.mark.parametrize("seq,batch,cp,dp", [(8192, 2048, 1, 128), (131072, 128, 16, 8)])
def test_llama3_405b_published_plans_fit(seq, batch, cp, dp):
    """Llama 3 405B (Llama 3 paper, Table 4): tp 8, pp 16 on 16,384 H100-80GB; cp 1 at 8K, cp 16 at
    128K tokens; 16M tokens per batch; ZeRO-2-like sharding (optimizer states and gradients)."""
    res = search_plans(
        "llama3.1-405b",
        _target(16384),
        seq,
        batch,
        SpaceOptions(micro_batches=(1,), max_vpp=1, fixed={"tp": 8, "pp": 16, "cp": cp}),
    )
    fitting = [p for p in res.plans if p.kwargs["dp"] == dp]
    assert fitting, res.stats.to_dict()
    assert any(p.kwargs.get("zero") == 2 for p in fitting)
    assert all(p.kwargs["pp_layout"] == (7,) + (8,) * 14 + (7,) for p in fitting)


# ---------------------------------------------------------------- recomputation monotonicity


@settings(max_examples=12)
@given(
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 4]),
    mbs=st.sampled_from([1, 2]),
    seq=st.sampled_from([1024, 4096]),
    conv=st.sampled_from(["megatron", "torchtitan", "paddle"]),
    sched=st.sampled_from(["1F1B", "ZBH1", "GPipe"]),
)
def test_recompute_never_raises_the_peak(tp, pp, mbs, seq, conv, sched):
    """What the recomputation bisection assumes: none >= selective >= full, and full on K+1
    layers per stage <= full on K."""
    kw = dict(
        seq_len=seq,
        micro_batch=mbs,
        tp=tp,
        pp=pp,
        dp=1,
        microbatches=2 * pp,
        convention=conv,
        layers=8,
        schedule=sched if pp > 1 else None,
    )

    def peak(**r):
        return estimate("llama3.2-1b", **kw, **r).max_peak_allocated_bytes

    none, sel, full = peak(recompute="none"), peak(recompute="selective"), peak(recompute="full")
    assert none >= sel >= full
    per_stage = 8 // pp
    ks = [peak(recompute="full", recompute_layers=k) for k in range(1, per_stage + 1)]
    assert all(a >= b for a, b in zip(ks, ks[1:])) and ks[-1] == full and none >= ks[0]


@settings(max_examples=12)
@given(
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 4]),
    seq=st.sampled_from([1024, 4096]),
    conv=st.sampled_from(["megatron", "torchtitan", "paddle"]),
    sched=st.sampled_from(["1F1B", "ZBH1", "VPP", "Interleaved1F1B", "ZBVZeroBubble"]),
    rec=st.sampled_from(["none", "selective", "full"]),
)
def test_larger_micro_batch_never_lowers_the_peak(tp, pp, seq, conv, sched, rec):
    """What the search assumes across micro-batch sizes (same global batch, so fewer
    microbatches, but at least 2 x pp of them): a setting that does not fit at
    micro-batch b does not fit at 2b."""
    vpp = 1 if pp == 1 or sched in ("1F1B", "ZBH1") else 2
    peaks = []
    for mbs in (1, 2, 4):
        try:
            e = estimate(
                "llama3.2-1b",
                seq_len=seq,
                micro_batch=mbs,
                global_batch=64,
                tp=tp,
                pp=pp,
                vpp=vpp,
                dp=1,
                convention=conv,
                layers=8,
                schedule=sched if pp > 1 else None,
                recompute=rec,
            )
        except UserError:
            return  # a schedule that cannot run so few microbatches
        peaks.append(e.max_peak_allocated_bytes)
    assert peaks == sorted(peaks)


# ---------------------------------------------------------------- zero bubble


def test_zero_bubble_memory_is_found_and_reestimates(tmp_path):
    from pipemem.planner.zero_bubble import smallest_zero_bubble_memory

    res = search_plans(
        "llama3.2-1b",
        _target(8, "rtx3090"),
        2048,
        32,
        SpaceOptions(micro_batches=(1,), max_vpp=1, fixed={"pp": 4, "tp": 2}),
    )
    best = [p for p in res.plans if p.kwargs["pp"] > 1][0]
    path = tmp_path / "zb.csv"
    zb = smallest_zero_bubble_memory(res, best, csv_path=str(path))
    assert zb.zero_bubble and zb.stage_bubble <= 1e-9
    assert path.read_text() == zb.csv_text
    # the schedule, read back by `pipemem estimate`, peaks where the search said
    rc, out, err = _cli(["estimate", *zb.flags.split(), "--json"])
    assert rc == 0, err
    assert json.loads(out)["max_peak_allocated_bytes"] == zb.peak_bytes
    assert zb.peak_bytes >= zb.memory_bytes - (1 << 20)
    # the JSON view: its fields under their names, the peak and the probes renamed
    d = zb.to_dict()
    assert list(d)[:6] == ["flags", "memory_bytes", "zero_bubble", "stage_bubble", "bubble", "makespan_ratio"]
    assert (d["flags"], d["memory_bytes"], d["makespan_ratio"]) == (
        zb.flags,
        zb.memory_bytes,
        zb.makespan_ratio,
    )
    assert (d["max_peak_allocated_bytes"], d["scheduler_runs"]) == (zb.peak_bytes, zb.probes)
    # below the memory found, the scheduler's schedules are not zero-bubble (within the resolution)
    smaller = smallest_zero_bubble_memory(res, best)
    assert smaller.memory_bytes == zb.memory_bytes


# ---------------------------------------------------------------- the command


def test_cli_table_and_json(tmp_path):
    argv = [
        "plan",
        "--model",
        "llama3.2-1b",
        "--gpus",
        "8",
        "--gpu",
        "rtx3090",
        "--seq-len",
        "2048",
        "--global-batch",
        "32",
        "--micro-batch",
        "1",
        "--max-vpp",
        "2",
        "--no-progress",
    ]
    rc, out, err = _cli(argv)
    assert rc == 0, err
    assert "BEST: pipemem estimate --model llama3.2-1b" in out and "Pareto" in out
    rc, out, err = _cli(argv + ["--json"])
    assert rc == 0, err
    d = json.loads(out)
    assert d["plans"] and all(p["flags"].startswith("--model llama3.2-1b --gpu rtx3090") for p in d["plans"])
    assert d["reserve_bytes"] == 0  # no flat reserve: plans are judged by the estimate's verdict
    steps = [p["step_seconds"] for p in d["plans"]]
    assert steps == sorted(steps)
    assert set(d["pareto"]) <= {p["flags"] for p in d["plans"]}


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--gpus", "8", "--seq-len", "2048", "--global-batch", "32"], "--gpu"),
        (
            [
                "--gpus",
                "8",
                "--gpu",
                "h100-80g",
                "--seq-len",
                "2048",
                "--global-batch",
                "32",
                "--micro-batch",
                "x",
            ],
            "--micro-batch",
        ),
        (["--gpus", "0", "--gpu", "h100-80g", "--seq-len", "2048", "--global-batch", "32"], "--gpus"),
        (
            [
                "--gpus",
                "8",
                "--gpu",
                "h100-80g",
                "--seq-len",
                "2048",
                "--global-batch",
                "32",
                "--reserve",
                "500",
            ],
            "--reserve",
        ),
        (
            [
                "--gpus",
                "8",
                "--gpu",
                "h100-80g",
                "--seq-len",
                "2048",
                "--global-batch",
                "32",
                "--shardings",
                "zero9",
            ],
            "--shardings",
        ),
        (
            [
                "--gpus",
                "8",
                "--gpu",
                "h100-80g",
                "--seq-len",
                "2048",
                "--global-batch",
                "32",
                "--schedules",
                "csv:x",
            ],
            "--schedules",
        ),
        (
            [
                "--gpus",
                "8",
                "--gpu",
                "h100-80g",
                "--seq-len",
                "2048",
                "--global-batch",
                "32",
                "--schedule-csv",
                "x.csv",
            ],
            "--zero-bubble",
        ),
    ],
)
def test_cli_bad_input_is_one_line(argv, needle):
    rc, out, err = _cli(["plan", "--model", "llama3.2-1b", *argv])
    assert rc == 2
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_torchtitan_8b_fsdp_published_plan_fits():
    """torchtitan's Llama 3.1 8B benchmark (bench/data/published_runs.jsonl: torchtitan-T1-FSDP): FSDP
    over 8 H100
    (96 GB class), seq 8192, local batch 2, selective activation checkpointing; it ran."""
    res = search_plans(
        "llama3-8b",
        _target(8, "h100-94g"),
        8192,
        16,
        SpaceOptions(convention="torchtitan", micro_batches=(2,), fixed={"dp": 8}),
    )
    assert any(p.kwargs.get("fsdp") and p.kwargs["tp"] == 1 and p.kwargs["pp"] == 1 for p in res.plans)


@pytest.mark.parametrize(
    "pins,match",
    [
        (["--tp", "16", "--tp-across-nodes"], "refused: --tp 16 does not divide the 8 KV heads"),
        (["--tp", "16"], "no plan of 64 GPUs has these degrees"),
    ],
)
def test_pinned_degrees_no_plan_can_have_are_one_line(pins, match, capsys):
    """A pinned --tp that breaks a plan rule (megatron: tp divides the KV heads) is refused with
    the rule, exit 2, not "no plan fits, try more GPUs"."""
    rc = main(
        [
            "plan",
            "--model",
            "llama3-70b",
            "--gpus",
            "64",
            "--gpu",
            "h100-80g",
            "--seq-len",
            "4096",
            "--global-batch",
            "256",
            "--no-progress",
            *pins,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1


def test_torchtune_plans_recompute_every_layer_or_none():
    # torchtune checkpoints every layer or none and shards with FSDP2 only: the planner's
    # ladder offers it no selective or partial rungs, and every plan it returns is one
    # torchtune can run (validated, and a torchtune estimate)
    res = search_plans(
        "llama3.2-3b",
        _target(8, "a100-40g"),
        8192,
        64,
        SpaceOptions(micro_batches=(1, 2, 4), convention="torchtune"),
    )
    assert res.plans
    for p in res.plans:
        assert p.kwargs["recompute"] in ("none", "full") and "recompute_layers" not in p.kwargs
        assert p.kwargs.get("fsdp") and p.kwargs["tp"] == p.kwargs["pp"] == 1
    assert any(p.kwargs["recompute"] == "full" for p in res.plans)  # what is at stake at seq 8192 on 40 GB


def test_every_proposed_plan_is_counted_once(small_search):
    # the summary line's counts add up: each proposal is invalid, ruled out by its static bytes,
    # estimated and too large, or fits (a refused recomputation setting is not a plan)
    s = small_search.stats
    assert s.proposed == sum(s.invalid.values()) + s.pruned_static + s.no_fit + len(small_search.plans)
