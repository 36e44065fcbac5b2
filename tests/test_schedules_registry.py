"""The schedule registry: every named schedule answers from its ScheduleSpec, the README's and
`--help`'s tables come from it, and VShape1F1B (added as one file) is a valid V-shaped 1F1B whose
memory is ZB-V's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipemem.cli.main import main
from pipemem.errors import UserError
from pipemem.schedules import SCHEDULE_NAMES, SPECS, canonical_name, default_vpp, get_schedule, registry
from pipemem.schedules.actions import Action, loop_stage_map, stage_rank_map, v_stage_map
from pipemem.schedules.check import check_schedule

ROOT = Path(__file__).resolve().parent.parent


def test_readme_table_is_the_registry():
    text = (ROOT / "README.md").read_text()
    rows = registry.markdown_rows()
    start = text.index(rows[0])
    assert text[start:].split("\n\n", 1)[0].splitlines() == rows


def test_help_lists_every_schedule(capsys):
    with pytest.raises(SystemExit):
        main(["schedule", "--help"])
    out = capsys.readouterr().out
    for spec in SPECS:
        assert any(line.strip().startswith(spec.table_names()[0]) for line in out.splitlines()), spec.name


def test_every_name_and_alias_resolves_to_its_spec():
    for spec in SPECS:
        for n in spec.names:
            assert canonical_name(n) == n and canonical_name(n.lower().replace("1", "-1")) == n
            assert registry.spec_of(n) is spec
        for a in spec.aliases:
            assert canonical_name(a) == spec.name
    assert len(SCHEDULE_NAMES) == len(set(SCHEDULE_NAMES))
    with pytest.raises(UserError, match="unknown schedule"):
        canonical_name("NoSuchSchedule")


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.searched], ids=lambda s: s.name)
def test_generated_schedules_follow_their_spec(spec):
    """Chunks per rank, placement and split backwards as the spec says; valid orders. A chunk
    count the spec does not run is refused; one it runs builds for some microbatch count (each
    schedule has its own microbatch rules, e.g. Megatron's multiples of pp)."""
    for vpp in (1, 2, 3):
        built = 0
        for pp in (2, 3, 4):
            for m in (pp, 2 * pp, 3 * pp + 1):
                try:
                    s = get_schedule(spec.name, pp, m, vpp)
                except UserError as e:
                    assert "--vpp" in str(e) or "--microbatches" in str(e)
                    continue
                built += 1
                assert s.vpp == vpp and s.stage_rank == stage_rank_map(spec.placement, pp, vpp)
                # ZBH2's list scheduler splits the backwards it needs to; the others as declared
                assert s.split_backward == spec.split_backward or spec.name == "ZBH2"
                check_schedule(s)
        assert bool(built) == spec.fits(vpp), vpp
    assert default_vpp(spec.name) == (2 if spec.chunks == "two" else 1)


def test_stage_rank_map():
    assert stage_rank_map("loop", 4, 2) == loop_stage_map(4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_rank_map("v", 4, 2) == v_stage_map(4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_rank_map(lambda pp, vpp: [s // vpp for s in range(pp * vpp)], 2, 2) == [0, 0, 1, 1]
    with pytest.raises(UserError, match="each rank 2 stages"):
        stage_rank_map(lambda pp, vpp: [0] * (pp * vpp), 2, 2)


def test_registry_answers_the_plan_and_runtime_questions():
    assert [s.name for s in SPECS if s.searched] == ["ZBVPP", "ZBAuto"]
    assert registry.is_searched("auto") and not registry.is_searched("1F1B")
    assert not registry.is_searched("csv:x.csv") and not registry.is_searched("nonsense")
    assert registry.runs_at_pp1("pipedream-flush") and registry.runs_at_pp1("torch:GPipe")
    assert not registry.runs_at_pp1("GPipe")
    assert [registry.torch_runtime(n) for n in ("FThenB", "torch:1F1B", "ZBV", "csv:a.csv")] == [
        "gpipe",
        "1f1b",
        "actions",
        "actions",
    ]


# ---------------------------------------------------------------- VShape1F1B


def _cli(capsys, *argv):
    assert main(["schedule", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_vshape_1f1b_is_valid_and_fused():
    for pp in range(1, 7):
        for m in range(1, 3 * pp + 2):
            s = get_schedule("VShape1F1B", pp, m, 2)
            check_schedule(s)
            assert s.placement == "v" and not s.split_backward
            for r, acts in enumerate(s.ranks):
                assert sorted(acts) == sorted(
                    Action(k, st, i) for st in (r, 2 * pp - 1 - r) for i in range(m) for k in "FB"
                )


def test_vshape_1f1b_inflight_is_zb_v_warmup(capsys):
    """ZB-V's warm-up (Qi et al. 2024 §6, PyTorch's ScheduleZBVZeroBubble): rank r runs 2p-r-1
    forwards of its first chunk and r+1 of its second before its first backward, and the steady
    state trades one for one, so in flight: min(m, 2p-r-1) + min(m, r+1) chunk-microbatches;
    2p = p microbatches on every rank once m >= 2p-1 (ZB-V's p·M_B, 1F1B's first-rank peak)."""
    for pp in (2, 3, 4, 5):
        for m in (1, pp, 2 * pp - 1, 2 * pp + 3):
            out = _cli(capsys, "vshape-1f1b", "--pp", str(pp), "--microbatches", str(m))
            assert out["vpp"] == 2 and out["placement"] == "v" and not out["split_backward"]
            want = [min(m, 2 * pp - r - 1) + min(m, r + 1) for r in range(pp)]
            assert [r["max_inflight"] for r in out["ranks"]] == want
            # a chunk's F keeps half a microbatch, B frees it: the peak is the in-flight count
            assert [r["peak_microbatches"] for r in out["ranks"]] == [w / 2 for w in want]
            if m >= 2 * pp - 1:
                assert out["peak_microbatches"] == pp


def test_vshape_1f1b_is_torchs_zbv_with_fused_backwards():
    pytest.importorskip("torch.distributed.pipelining")
    for pp, m in ((2, 4), (4, 8), (4, 11)):
        torch_order = get_schedule("torch:ZBVZeroBubble", pp, m, 2)
        fused = [
            [Action("B", a.stage, a.microbatch) if a.kind == "I" else a for a in acts if a.kind != "W"]
            for acts in torch_order.ranks
        ]
        assert get_schedule("VShape1F1B", pp, m, 2).ranks == fused


def test_vshape_1f1b_estimates(capsys):
    """Through `pipemem estimate`: two chunks by default, the V placement's stages per rank."""
    import pipemem

    e = pipemem.estimate("llama3-8b", pp=4, microbatches=8, schedule="VShape1F1B", layers=16)
    assert e.plan.vpp == 2 and [list(r.stages) for r in e.ranks] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_layer_layout_even_and_balanced():
    from pipemem.planner.space import balanced_layout
    from pipemem.schedules.layout import layer_layout

    assert layer_layout(32, 8) == (4,) * 8 and layer_layout(30, 8) is None
    # 126 = 16 x 7 + 14: the 14 extra layers go to stages 14 .. 1; the first and last stay at 7
    assert layer_layout(126, 16, balanced=True) == (7,) + (8,) * 14 + (7,)
    # a remainder of stages-1 reaches the last stage before the first
    assert layer_layout(23, 4, balanced=True) == (5, 6, 6, 6)
    assert balanced_layout(126, 16) == layer_layout(126, 16, balanced=True) and balanced_layout(32, 8) is None
    for layers in range(1, 40):
        for stages in range(1, layers + 1):
            got = layer_layout(layers, stages, balanced=True)
            assert sum(got) == layers and max(got) - min(got) <= 1
    with pytest.raises(UserError, match="stages"):
        layer_layout(4, 5)
