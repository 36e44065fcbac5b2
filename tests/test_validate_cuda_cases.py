"""The case matrix of `pipemem validate cuda` and what each case tells pipemem (no torch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipemem.errors import UserError
from pipemem.validation.cuda_cases import (
    ARCHS,
    ATTENTIONS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTES,
    SCHEDULES,
    Case,
    full_cases,
    get_cases,
    hf_config_dict,
    small_cases,
    to_plan,
)


def test_every_feature_appears_in_the_small_set():
    cases = small_cases()
    for attr, values in (
        ("arch", ARCHS),
        ("precision", PRECISIONS),
        ("attn", ATTENTIONS),
        ("recompute", RECOMPUTES),
        ("optimizer", OPTIMIZERS),
    ):
        assert {getattr(c, attr) for c in cases} == set(values), attr
    assert {c.schedule for c in cases if c.pp > 1} == set(SCHEDULES)


def test_full_set_crosses_every_single_gpu_option():
    cases = full_cases()
    singles = {(c.arch, c.precision, c.attn, c.recompute) for c in cases if c.pp == 1}
    assert len(singles) == len(ARCHS) * len(PRECISIONS) * len(ATTENTIONS) * len(RECOMPUTES)
    assert {(c.pp, c.schedule) for c in cases if c.pp > 1} == {(p, s) for p in (2, 4) for s in SCHEDULES}


@pytest.mark.parametrize("configs", ["small", "full"])
def test_cases_fit_the_issue_sizes_and_have_unique_names(configs):
    cases = get_cases(configs)
    assert len({c.name for c in cases}) == len(cases)
    for c in cases:
        assert 1024 <= c.hidden <= 4096 and 2 <= c.layers <= 8
        assert sum(c.layer_layout()) == c.layers and min(c.layer_layout()) >= 1
        if c.schedule == "ZBVZeroBubble":
            assert c.vpp == 2 and c.placement == "v"


def test_layer_layout_splits_evenly_and_front_loads_the_remainder():
    c = Case(layers=7, pp=2, vpp=2, schedule="Interleaved1F1B")
    assert c.layer_layout() == [2, 2, 2, 1]
    assert [list(c.stage_layers(s)) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6]]


def test_filter_by_name_and_bad_filters():
    assert {c.arch for c in get_cases("small", ["mixtral"])} == {"mixtral"}
    with pytest.raises(UserError, match="--case"):
        get_cases("small", ["no-such-case"])
    with pytest.raises(UserError, match="--configs"):
        get_cases("huge")


@pytest.mark.parametrize(
    "bad",
    [
        dict(precision="fp8"),
        dict(arch="gpt2"),
        dict(pp=2),
        dict(layers=1, pp=2, schedule="1F1B"),
        dict(heads=7),
    ],
)
def test_invalid_cases_are_user_errors(bad):
    with pytest.raises(UserError):
        Case(**bad)


def test_hf_config_is_what_transformers_reads():
    c = Case(arch="mixtral", experts=4, top_k=2, layers=2)
    d = hf_config_dict(c)
    assert d["model_type"] == "mixtral" and d["num_local_experts"] == 4 and d["num_experts_per_tok"] == 2
    assert d["hidden_size"] // d["num_attention_heads"] == d["head_dim"]
    pytest.importorskip("transformers")
    from pipemem.validation.cuda import build_hf_config

    cfg = build_hf_config(c)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_local_experts) == (1024, 2, 4)
    assert cfg._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "precision,dtype,master",
    [("fp32", "fp32", False), ("bf16", "bf16", False), ("bf16_autocast", "bf16", True)],
)
def test_plan_says_the_same_run(precision, dtype, master):
    c = replace(
        Case(layers=8, hidden=2048, intermediate=5632),
        precision=precision,
        pp=2,
        vpp=2,
        schedule="ZBVZeroBubble",
        microbatches=4,
        recompute="full",
    )
    p = to_plan(c)
    assert (p.dtype, p.master_weights) == (dtype, master)
    assert (p.pp, p.vpp, p.microbatches, p.schedule, p.recompute) == (2, 2, 4, "ZBVZeroBubble", "full")
    assert p.pp_layout == (2, 2, 2, 2) and p.seq_len == c.seq_len and p.micro_batch == c.micro_batch
    assert p.extra["autocast"] is (precision == "bf16_autocast")
