"""The program-source protocol (pipemem/sources.py): every mode's source returns a
`jobs.StagePlan`, `estimate()` validates the plan once and replays it the same way; and the one
first-backward rule (`Schedule.first_grad_microbatches`) that templates, traced stage plans and
the allocation stream share."""

from __future__ import annotations

import importlib

import pytest

import pipemem.plan
import pipemem.sources
from pipemem import estimate
from pipemem.estimate import MODES
from pipemem.jobs import StagePlan
from pipemem.schedules import get_schedule
from pipemem.sources import SOURCES, schedule_of
from pipemem.stages import StagePlan as TemplateStagePlan
from pipemem.stages import build_stage_jobs

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def _first(schedule, kinds) -> dict[int, int]:
    out: dict[int, int] = {}
    for acts in schedule.ranks:
        for kind, s, m in acts:
            if kind in kinds and s not in out:
                out[s] = m
    return out


def test_every_mode_has_a_source_and_every_source_returns_the_one_stage_plan_type():
    assert set(SOURCES) == set(MODES)
    from pipemem.paddle.paddlenlp_programs import PaddleStages
    from pipemem.traced.parallel import TracedStagePlan

    for cls in (TemplateStagePlan, TracedStagePlan, PaddleStages):
        assert issubclass(cls, StagePlan)
        # the first-backward rule is the base's, not a copy that can drift
        assert cls.first_backward_overrides is StagePlan.first_backward_overrides
        assert "first_backward_overrides" not in vars(cls) and "first_grad_overrides" not in vars(cls)


def test_first_grad_microbatch_is_the_first_b_or_w_never_an_i():
    """Paddle's ZB-H1 order: rank r splits its first r backwards (I now, W deferred to the end)
    and runs the rest fused. PyTorch's I (stage_backward_input) touches no .grad; the first fused
    B makes the stage's gradients, so the rule must not pick the early I's microbatch."""
    s = get_schedule("ZBH1", 3, 5)
    got = s.first_grad_microbatches()
    assert got == _first(s, ("B", "W"))
    first_i = _first(s, ("I",))
    for stage, mb in got.items():
        kinds = {k for k, st, m in s.ranks[s.rank_of_stage(stage)] if st == stage and m == mb}
        assert "B" in kinds or "W" in kinds
        if stage > 0:  # ranks > 0 split their first backwards: their first I is another microbatch
            assert first_i[stage] != mb
    # where I and W run in the same order (ZB-1P, ZB-V), the first W is the first I's microbatch
    for name, vpp in (("ZB1P", 1), ("ZBVZeroBubble", 2)):
        s = get_schedule(name, 4, 8, vpp=vpp)
        assert s.first_grad_microbatches() == _first(s, ("I",)) == _first(s, ("W",))


def test_templates_make_the_gradients_in_the_first_b_or_w():
    """--grads set-to-none under ZB-H1: rank 1's fused B1 makes its stage's gradients (its net
    change is the steady B's plus the gradients); the deferred W0 at the end accumulates (its net
    change is the steady W's); the gradients count as made at the peak after B1."""
    kw = dict(convention="hf", layers=8, microbatches=4, pp=2, schedule="ZBH1", seq_len=256)
    e = estimate("llama3.2-1b", **kw)
    sp = build_stage_jobs(e.arch, e.plan)
    sched = schedule_of(e.plan)
    made = sp.first_backward[1].B.net_bytes - sp.stages[1].B.net_bytes
    assert made > 0 and e.ranks[1].static.grads_in_step == made
    first_mb = sched.first_grad_microbatches()[1]
    points = {p.label: p for p in e.ranks[1].timeline}
    b = points[f"B{first_mb}@s1"]
    assert b.after - b.before == sp.stages[1].B.net_bytes + made
    w0 = points["W0@s1"]
    assert w0.after - w0.before == sp.stages[1].W.net_bytes
    # the rank peaks after B1 (a later fused B): the gradients B1 made are resident there, counted
    # as gradients, not activations
    labels = [p.label for p in e.ranks[1].timeline]
    assert labels.index(e.ranks[1].peak_at) > labels.index(f"B{first_mb}@s1")
    assert e.ranks[1].grads_at_peak_bytes == made


def _count_validations(monkeypatch) -> list:
    # a repeated estimate reads its validated plan back (estimate._FAST, sources._VALIDATED): start
    # from none, so the count does not depend on what an earlier test in this process estimated
    monkeypatch.setattr(importlib.import_module("pipemem.estimate"), "_FAST", {})
    monkeypatch.setattr(pipemem.sources, "_VALIDATED", {})
    calls = []
    real = pipemem.plan.validate_plan

    def counted(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(pipemem.sources, "validate_plan", counted)
    return calls


@pytest.mark.parametrize(
    "kw",
    (
        dict(pp=4, microbatches=8, seq_len=1024, layers=8),
        dict(pp=2, vpp=2, microbatches=4, seq_len=1024, layers=8, schedule="Interleaved1F1B"),
        dict(tp=2, dp=2, seq_len=1024, layers=4, grads="set-to-none"),
    ),
)
def test_templates_validate_the_plan_once(monkeypatch, kw):
    calls = _count_validations(monkeypatch)
    e = estimate("llama3.2-1b", **kw)
    e.to_dict()
    assert len(calls) == 1


def test_traced_modes_validate_the_plan_once(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    calls = _count_validations(monkeypatch)
    one = estimate(dict(TINY), mode="traced", seq_len=32, kernel_policy="cpu")
    assert len(calls) == 1 and one.schedule == "one step (pp 1)"
    pipe = estimate(
        dict(TINY),
        mode="traced",
        pp=2,
        dtype="fp32",
        seq_len=32,
        microbatches=2,
        kernel_policy="cpu",
        step="first",
    )
    assert len(calls) == 2 and len(pipe.ranks) == 2 and pipe.runtime == "torch"
    assert any("--step first" in w for w in pipe.warnings)
