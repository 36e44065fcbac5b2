"""Named schedule generators: PyTorch's orders, in-flight counts and peaks from the literature."""

from __future__ import annotations

from fractions import Fraction

import pytest

from pipemem.errors import UserError
from pipemem.jobs import JobMemory, StageJobs
from pipemem.replay import inflight_counts, replay
from pipemem.schedules import Action, get_schedule
from pipemem.schedules.check import check_schedule
from pipemem.schedules.unit_jobs import unit_jobs

torch_vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")


def _torch_compute(name, pp, m, per_rank=None):
    """PyTorch's own pipeline_order, compute actions only (OVERLAP_F_B flattened)."""
    ops = torch_vis.get_schedule_ops(name, pp, m, num_stages_per_rank=per_rank)
    out = []
    for acts in ops:
        row = []
        for a in acts:
            if a is None:
                continue
            kind = a.computation_type.value
            subs = a.sub_actions if kind == "OVERLAP_F_B" else (a,)
            for b in subs:
                if b.computation_type.value in "FBIW":
                    row.append(Action(b.computation_type.value, b.stage_index, b.microbatch_index))
        out.append(row)
    return out


MULTI = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
SHAPES = [(2, 4), (3, 6), (4, 8), (4, 12), (5, 10)]


@pytest.mark.parametrize("pp,m", SHAPES)
@pytest.mark.parametrize("name", MULTI + ["GPipe"])
def test_orders_match_pytorch(name, pp, m):
    vpps = [1] if name == "GPipe" else ([2] if name in ("ZBVZeroBubble", "DualPipeV") else [2, 3])
    for v in vpps:
        ours = get_schedule(name, pp, m, v)
        theirs = _torch_compute(name, pp, m, None if v == 1 else v)
        assert ours.ranks == theirs
        check_schedule(ours)


@pytest.mark.parametrize("pp,m", SHAPES + [(4, 4)])
def test_1f1b_matches_pytorch_runtime(pp, m):
    """Schedule1F1B.pipeline_order is right on ranks 0..p-2; on the last rank its forward indices
    are shifted by one (1..m instead of 0..m-1, FINDINGS.md §4), which the runtime does not do."""
    ours = get_schedule("1F1B", pp, m)
    theirs = _torch_compute("1F1B", pp, m)
    assert ours.ranks[:-1] == theirs[:-1]
    shifted = [Action(a.kind, a.stage, a.microbatch - 1) if a.kind == "F" else a for a in theirs[-1]]
    if sorted(a.microbatch for a in theirs[-1] if a.kind == "F") == list(range(1, m + 1)):
        assert ours.ranks[-1] == shifted
    else:
        assert ours.ranks[-1] == theirs[-1]


def _torch_inflight(actions):
    """Held forwards counted on PyTorch's own actions: +1 at F, -1 at B or I."""
    n = best = 0
    for a in actions:
        if a.kind == "F":
            n += 1
            best = max(best, n)
        elif a.kind in "BI":
            n -= 1
    return best


@pytest.mark.parametrize("name", MULTI + ["GPipe", "1F1B"])
def test_inflight_counts_of_pytorch_schedules_pp4_m8(name):
    v = None if name in ("GPipe", "1F1B") else 2
    theirs = _torch_compute(name, 4, 8, v)  # 1F1B's last-rank off-by-one leaves the count as is
    ours = get_schedule(name, 4, 8, v or 1)
    res = replay(ours, unit_jobs(ours.num_stages, ours.vpp), None)
    assert [r.max_inflight for r in res.ranks] == [_torch_inflight(t) for t in theirs]
    assert inflight_counts(ours) == [_torch_inflight(t) for t in theirs]


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 1), (4, 2), (4, 8), (8, 3), (8, 64)])
def test_1f1b_inflight_is_min_m_p_minus_r(pp, m):
    res = replay(get_schedule("1F1B", pp, m), unit_jobs(pp), None)
    assert [r.max_inflight for r in res.ranks] == [min(m, pp - r) for r in range(pp)]
    assert [r.peak_allocated_bytes for r in res.ranks] == [min(m, pp - r) for r in range(pp)]


@pytest.mark.parametrize("pp,m", [(1, 3), (4, 8), (6, 5)])
def test_gpipe_holds_all_microbatches(pp, m):
    res = replay(get_schedule("GPipe", pp, m), unit_jobs(pp), None)
    assert all(r.max_inflight == m and r.peak_allocated_bytes == m for r in res.ranks)


def _paper_jobs(pp, vpp=1, s=4096, b=1, h=4096, a=32):
    """Per-layer memory of Qi et al. 2024: M_B = sb(34h + 5as), M_W = 32sbh;
    dM(F) = M_B, dM(I) = M_W - M_B, dM(W) = -M_W (a fused B frees M_B)."""
    mb = s * b * (34 * h + 5 * a * s)
    mw = 32 * s * b * h
    jobs = {
        st: StageJobs(
            st, F=JobMemory(mb, mb), B=JobMemory(-mb, 0), I=JobMemory(mw - mb, 0), W=JobMemory(-mw, 0)
        )
        for st in range(pp * vpp)
    }
    return jobs, mb, mw


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 24)])
def test_zb_h1_peaks(pp, m):
    jobs, mb, mw = _paper_jobs(pp)
    res = replay(get_schedule("ZBH1", pp, m), jobs, None)
    # worker r holds p - r forwards and the r weight-grad inputs it defers
    assert [r.peak_allocated_bytes for r in res.ranks] == [(pp - r) * mb + r * mw for r in range(pp)]
    assert res.max_peak_allocated_bytes == pp * mb


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 24)])
def test_zb_1p_same_memory_as_zb_h1_and_a_third_of_the_bubble(pp, m):
    """The paper's ZB-H1 (all backwards split): worker r peaks at (p-r)·M_B + r·M_W, and with
    T_F = T_I = T_W its bubble is (p-1)(T_F + T_B - T_W) = (p-1), a third of 1F1B's 3(p-1)."""
    from pipemem.schedules.check import TimeModel, simulate

    jobs, mb, mw = _paper_jobs(pp)
    sched = get_schedule("ZB1P", pp, m)
    res = replay(sched, jobs, None)
    assert [r.peak_allocated_bytes for r in res.ranks] == [(pp - r) * mb + r * mw for r in range(pp)]
    equal = TimeModel(F=1, I=1, W=1)
    assert simulate(sched, equal).makespan == 3 * m + (pp - 1)
    assert simulate(get_schedule("1F1B", pp, m), equal).makespan == 3 * m + 3 * (pp - 1)


def test_zb_1p_is_pytorch_zero_bubble_order_with_one_chunk():
    """InterleavedZeroBubble's construction at v=1 (PyTorch needs v >= 2, so compare the rule:
    rank r's first r input-grad passes keep their W pending)."""
    sched = get_schedule("ZB1P", 4, 8)
    for r, acts in enumerate(sched.ranks):
        first_w = next(n for n, a in enumerate(acts) if a.kind == "W")
        assert sum(1 for a in acts[:first_w] if a.kind == "I") == r + 1
        assert [a.microbatch for a in acts if a.kind == "W"] == list(range(8))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 7), (4, 16), (8, 15), (8, 24)])
def test_zb_h2_peaks(pp, m):
    """(2p-1)·M_B on the first worker; worker r holds its 2(p-r)-1 warm-up forwards and, to shift
    its timeline by r in the parallelogram, defers 2r weight passes: (2(p-r)-1)·M_B + 2r·M_W."""
    jobs, mb, mw = _paper_jobs(pp)
    res = replay(get_schedule("ZBH2", pp, m), jobs, None)
    assert [r.peak_allocated_bytes for r in res.ranks] == [
        (2 * (pp - r) - 1) * mb + 2 * r * mw for r in range(pp)
    ]
    assert res.max_peak_allocated_bytes == (2 * pp - 1) * mb
    assert inflight_counts(get_schedule("ZBH2", pp, m)) == [2 * (pp - r) - 1 for r in range(pp)]


@pytest.mark.parametrize("pp,m", [(2, 3), (4, 7), (4, 16), (8, 15), (8, 40)])
def test_zb_h2_is_a_parallelogram_with_zero_bubble(pp, m):
    from pipemem.schedules.check import TimeModel, simulate

    sim = simulate(get_schedule("ZBH2", pp, m), TimeModel(F=1, I=1, W=1))
    assert sim.stage_bubble_ratio == 0
    assert sim.makespan == 3 * m + pp - 1
    assert [s[0] for s in sim.start] == list(range(pp))


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 6, 7, 8, 9, 12, 16])
def test_v_half_v_min_zb_v_activation_memory(pp):
    """arXiv 2405.15362: activation memory in microbatches (both chunks of a rank), with the
    building blocks' accounting (a chunk's activations are held from F until its W):
    V-Min (p+4)//3, V-Half (p+2)//2, V-ZB (ZB-V) p."""
    m = 3 * pp
    jobs = unit_jobs(2 * pp, 2, w_ratio=1)
    for name, expect in (("VMin", (pp + 4) // 3), ("VHalf", (pp + 2) // 2), ("ZBVZeroBubble", pp)):
        sched = get_schedule(name, pp, m, 2)
        check_schedule(sched)
        assert replay(sched, jobs, None).max_peak_allocated_bytes == expect, name


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 16), (8, 2, 16), (8, 4, 32)])
def test_megatron_interleaved_rank0_penalty(pp, v, m):
    """Rank 0 of Megatron's interleaved 1F1B holds p·(1 + (p-1)/(p·v)) microbatches (FINDINGS §2)."""
    res = replay(get_schedule("VPP", pp, m, v), unit_jobs(pp * v, v), None)
    assert res.ranks[0].peak_allocated_bytes == pp * (1 + Fraction(pp - 1, pp * v))


def test_megatron_vpp_equals_pytorch_interleaved_when_m_multiple_of_p():
    for pp, m, v in [(4, 8, 2), (4, 12, 3), (2, 6, 2)]:
        assert get_schedule("VPP", pp, m, v).ranks == get_schedule("Interleaved1F1B", pp, m, v).ranks


@pytest.mark.parametrize(
    "name,v",
    [
        ("GPipe", 1),
        ("FThenB", 1),
        ("1F1B", 1),
        ("Eager1F1B", 1),
        ("ZBH1", 1),
        ("ZB1P", 1),
        ("ZBH2", 1),
        ("Interleaved1F1B", 2),
        ("VPP", 3),
        ("LoopedBFS", 2),
        ("InterleavedZeroBubble", 2),
        ("ZBV", 2),
        ("DualPipeV", 2),
        ("VHalf", 2),
        ("VMin", 2),
        ("ZBVPP", 2),
        ("auto", 1),
        ("auto", 2),
    ],
)
@pytest.mark.parametrize("pp,m", [(1, 4), (2, 4), (3, 9), (4, 8), (4, 16)])
def test_every_named_schedule_is_valid(name, v, pp, m):
    try:
        sched = get_schedule(name, pp, m, v)
    except UserError as e:  # constraints of the schedule itself (e.g. DualPipeV needs m >= 2p)
        assert "--" in str(e)
        return
    check_schedule(sched)
    assert sched.num_stages == pp * v and len(sched.ranks) == pp
    kinds = {a.kind for acts in sched.ranks for a in acts}
    assert sched.split_backward == bool(kinds & {"I", "W"})


def test_eager_1f1b_warmup():
    sched = get_schedule("Eager1F1B", 4, 8)
    assert inflight_counts(sched) == [7, 5, 3, 1]


def test_names_are_case_and_dash_insensitive():
    assert get_schedule("zb-h1", 4, 8).ranks == get_schedule("ZBH1", 4, 8).ranks
    assert get_schedule("v_half", 4, 8, 2).name == "VHalf"


def test_unknown_name_lists_valid_ones():
    with pytest.raises(UserError, match="Interleaved1F1B.*ZBVZeroBubble"):
        get_schedule("2F2B", 4, 8)


def test_interleaved_with_one_chunk_names_the_flag():
    with pytest.raises(UserError, match="--vpp 2"):
        get_schedule("Interleaved1F1B", 4, 8)
    with pytest.raises(UserError, match="--vpp 2"):
        get_schedule("ZBVZeroBubble", 4, 8, 3)
    with pytest.raises(UserError, match="--vpp"):
        get_schedule("1F1B", 4, 8, 2)


@pytest.mark.parametrize("pp,m", [(4, 16), (4, 32), (8, 32), (8, 64)])
def test_v_half_v_min_bubbles_below_1f1b(pp, m):
    """arXiv 2405.15362 (Table: bubble ~ p/m for 1F1B, ~2p/3m V-Min, ~p/2m V-Half at
    T_F = T_B = T_W): both V schedules idle less than 1F1B on the same model (a V chunk is
    half a stage, so its passes take half as long)."""
    from pipemem.schedules.check import TimeModel, simulate

    base = simulate(get_schedule("1F1B", pp, m), TimeModel(F=1, I=1, W=1)).stage_bubble_ratio
    for name in ("VHalf", "VMin"):
        sim = simulate(get_schedule(name, pp, m, 2), TimeModel(F=0.5, I=0.5, W=0.5))
        assert sim.stage_bubble_ratio < base, name
