"""Generators of per-rank action lists for the named pipeline schedules.

Each generator returns a `Schedule`; ranks' lists hold only compute actions (no bubbles, no
communication): the order is what matters for memory, and the time model (check.simulate) puts
the bubbles back. Orders that PyTorch's pipelining also defines follow the order its schedule
classes build (torch 2.13; tests compare against `get_schedule_ops`), with PyTorch's
`Schedule1F1B` taken as executed by its runtime (its `pipeline_order` is off by one on the last
rank, FINDINGS.md §4).
"""

from __future__ import annotations

from itertools import chain, repeat

from ..errors import UserError
from .actions import Action, Schedule
from .spec import ScheduleSpec as S

F, B, I, W = "F", "B", "I", "W"


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


def _check_basic(name: str, pp: int, m: int, vpp: int) -> None:
    _need(pp >= 1, f"{name}: --pp must be at least 1 (got {pp})")
    _need(m >= 1, f"{name}: --microbatches must be at least 1 (got {m})")
    _need(vpp >= 1, f"{name}: --vpp must be at least 1 (got {vpp})")


def _single_chunk(name: str, vpp: int) -> None:
    _need(
        vpp == 1,
        f"{name} runs one model chunk per rank: drop --vpp (got --vpp {vpp}); "
        f"for several chunks per rank use Interleaved1F1B, LoopedBFS or VPP",
    )


def _split_known(schedule: Schedule, split: bool) -> Schedule:
    """Record whether the backwards are split (I/W), which the generator knows: otherwise
    `Schedule.split_backward` scans every action for it (the CLI prints it)."""
    schedule.cache["split_backward"] = split
    return schedule


# ---------------------------------------------------------------- one chunk per rank


def gpipe(pp: int, m: int, vpp: int = 1, name: str = "GPipe") -> Schedule:
    """All forwards, then all backwards (GPipe; Paddle's FThenB)."""
    _check_basic(name, pp, m, vpp)
    _single_chunk(name, vpp)
    ranks = [[Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)] for r in range(pp)]
    return Schedule(name, pp, 1, m, ranks)


def _warmup_then_alternate(pp: int, m: int, warmups: list[int]) -> list[list[Action]]:
    """Rank r: warmups[r] forwards, then backward/forward pairs, then the remaining backwards."""
    ranks = []
    for r in range(pp):
        warm = min(m, warmups[r])
        acts = [Action(F, r, i) for i in range(warm)]
        nf = warm
        for b in range(m):
            acts.append(Action(B, r, b))
            if nf < m:
                acts.append(Action(F, r, nf))
                nf += 1
        ranks.append(acts)
    return ranks


def one_f_one_b(pp: int, m: int, vpp: int = 1, name: str = "1F1B") -> Schedule:
    """1F1B (PipeDream-flush / Megatron non-interleaved): p - r warm-up forwards on rank r."""
    _check_basic(name, pp, m, vpp)
    _single_chunk(name, vpp)
    return Schedule(name, pp, 1, m, _warmup_then_alternate(pp, m, [pp - r for r in range(pp)]))


def eager_1f1b(pp: int, m: int, vpp: int = 1, name: str = "Eager1F1B") -> Schedule:
    """Paddle's Eager1F1B: 2(p - r) - 1 warm-up forwards, so sends overlap the next forward."""
    _check_basic(name, pp, m, vpp)
    _single_chunk(name, vpp)
    _need(
        m >= 2 * pp - 1, f"{name} needs --microbatches >= 2*pp-1 = {2 * pp - 1} (got {m}), as Paddle requires"
    )
    return Schedule(name, pp, 1, m, _warmup_then_alternate(pp, m, [2 * (pp - r) - 1 for r in range(pp)]))


def zb_h1(pp: int, m: int, vpp: int = 1, name: str = "ZBH1") -> Schedule:
    """ZB-H1 (Qi et al. 2024) in Paddle's order: 1F1B whose first r backwards on rank r are split,
    their W deferred to the end, so rank r holds (p-r)·M_B + r·M_W at most (<= p·M_B)."""
    _check_basic(name, pp, m, vpp)
    _single_chunk(name, vpp)
    _need(m >= pp, f"{name} needs --microbatches >= --pp ({pp}) (got {m})")
    ranks = []
    for r in range(pp):
        acts = [Action(F, r, i) for i in range(pp - r)]
        nf, nb = pp - r, 0
        for _ in range(r):  # split backwards whose W waits for the tail
            acts += [Action(I, r, nb), Action(F, r, nf)]
            nb += 1
            nf += 1
        for _ in range(m - pp):  # steady 1F1B with fused backwards
            acts += [Action(B, r, nb), Action(F, r, nf)]
            nb += 1
            nf += 1
        for _ in range(pp - r - 1):
            acts.append(Action(B, r, nb))
            nb += 1
        if r > 0:
            acts += [Action(I, r, nb), Action(W, r, nb)]
        else:
            acts.append(Action(B, r, nb))
        acts += [Action(W, r, i) for i in range(r)]
        ranks.append(acts)
    return Schedule(name, pp, 1, m, ranks)


def zb_1p(pp: int, m: int, vpp: int = 1, name: str = "ZB1P") -> Schedule:
    """ZB-H1 as the paper draws it (ZB-1p): every backward split; rank r runs p-1-r warm-up
    forwards, then F and I pairs, each followed by the oldest pending W once r of them wait.
    PyTorch's InterleavedZeroBubble order with one chunk. Same memory as ZBH1, (p-r)·M_B +
    r·M_W, but with T_F = T_I = T_W the step takes 3m + p - 1 (m >= p)."""
    _check_basic(name, pp, m, vpp)
    _single_chunk(name, vpp)
    ranks = [_interleaved_rank(pp, m, 1, r, pp - 1 - r, 1, zero_bubble=True, deferred_w=r) for r in range(pp)]
    return _split_known(Schedule(name, pp, 1, m, ranks), True)


def zb_h2(pp: int, m: int, vpp: int = 1, name: str = "ZBH2") -> Schedule:
    """ZB-H2 (Qi et al. 2024 §2.2): extra warm-up forwards fill the bubble before the first
    backward and the tail's W passes are reordered, turning the trapezoid into a parallelogram:
    with T_F = T_I = T_W and m >= 2p - 1 every rank is busy from its first action to its last
    (makespan 3m + p - 1). Built by unit-time list scheduling (I first, then F, W to fill) with
    every rank capped at (2p-1)·M_B counting a W's inputs as a whole M_B, so the peak is
    (2p-1)·M_B for any M_W <= M_B; rank r holds at most (2(p-r)-1)·M_B + 2r·M_W."""
    _check_basic(name, pp, m, vpp)
    _single_chunk(name, vpp)
    from fractions import Fraction

    from .actions import loop_stage_map
    from .check import TimeModel
    from .list_scheduler import job_numbers, list_schedule
    from .unit_jobs import unit_jobs

    nums, _ = job_numbers(unit_jobs(pp, 1, Fraction(1)), pp)  # integer units: scale 1
    tf, tb, ti, tw = TimeModel().per_stage(pp)
    ranks = list_schedule(pp, m, loop_stage_map(pp, 1), nums, (tf, tb, ti, tw, 0.0), [2 * pp - 1] * pp, True)
    return Schedule(name, pp, 1, m, ranks)


# ---------------------------------------------------------------- looped placement, v chunks


def _multi_chunk(name: str, vpp: int, exact: int | None = None) -> None:
    if exact is not None:
        _need(
            vpp == exact, f"{name} runs exactly {exact} model chunks per rank: pass --vpp {exact} (got {vpp})"
        )
    _need(vpp >= 2, f"{name} runs several model chunks per rank: pass --vpp 2 or more (got --vpp {vpp})")


def looped_bfs(pp: int, m: int, vpp: int = 2, name: str = "LoopedBFS") -> Schedule:
    """Breadth-first (Lamy-Poirier 2022): every microbatch through chunk 0, then chunk 1, ...;
    backwards in reverse (PyTorch's ScheduleLoopedBFS order)."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp)
    ranks = []
    for r in range(pp):
        stages = [c * pp + r for c in range(vpp)]
        acts = [Action(F, s, i) for s in stages for i in range(m)]
        acts += [Action(B, s, i) for s in reversed(stages) for i in reversed(range(m))]
        ranks.append(acts)
    return Schedule(name, pp, vpp, m, ranks)


def _interleaved_rank(
    pp: int, m: int, vpp: int, r: int, warmup: int, group: int, zero_bubble: bool = False, deferred_w: int = 0
) -> list[Action]:
    """Depth-first interleaved order of rank r: the k-th forward runs chunk (k // group) % v, the
    k-th backward chunk v-1 - (k // group) % v, each chunk's microbatches in order; `warmup`
    forwards, then forward/backward pairs, then the remaining backwards. With `zero_bubble`,
    backwards are I and each I after the first `deferred_w` ones is followed by the oldest
    pending W (Ws run in the order of their Is); leftover Ws end the list."""
    total = m * vpp
    warmup = min(warmup, total)
    bkind = I if zero_bubble else B

    def block(kind, stage, first, n):
        # Action(kind, stage, i) for i in first .. first+n-1, made in C (map/zip, no Python
        # frame per action): a p=64, v=2, m=1024 schedule has 262,144 of them
        return map(tuple.__new__, repeat(Action), zip(repeat(kind), repeat(stage), range(first, first + n)))

    def in_order(kind, reverse_chunks):
        # the k-th action's chunk changes every `group` actions: a block of one chunk's next
        # microbatches at a time
        seen = [0] * vpp
        out = []
        for b, k0 in enumerate(range(0, total, group)):
            c = b % vpp
            if reverse_chunks:
                c = vpp - 1 - c
            n = min(group, total - k0)
            out += block(kind, c * pp + r, seen[c], n)
            seen[c] += n
        return out

    fwd = in_order(F, False)
    bwd = in_order(bkind, True)
    steady = total - warmup
    acts = fwd[:warmup]
    if not zero_bubble:
        acts += chain.from_iterable(zip(fwd[warmup:], bwd))  # F, B pairs (steady state)
        acts += bwd[steady:]
        return acts
    wts = [Action(W, a[1], a[2]) for a in bwd]
    append = acts.append
    nw = 0
    for k in range(total):
        if k < steady:
            append(fwd[warmup + k])
        append(bwd[k])
        if k >= deferred_w:
            append(wts[nw])
            nw += 1
    acts += wts[nw:]
    return acts


def _torch_rounds(name: str, pp: int, m: int) -> int:
    rounds = max(1, m // pp)
    _need(
        m % rounds == 0,
        f"{name} needs --microbatches to be a multiple of max(1, m // pp) = {rounds} "
        f"(PyTorch's rule); e.g. use {rounds * (m // rounds)} or a multiple of --pp {pp}",
    )
    return m // rounds


def interleaved_1f1b(pp: int, m: int, vpp: int = 2, name: str = "Interleaved1F1B") -> Schedule:
    """PyTorch's ScheduleInterleaved1F1B: depth-first over rounds of m // max(1, m // p) microbatches,
    warm-up (v-1)·round + 2(p-1-r) forwards."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp)
    per_round = _torch_rounds(name, pp, m)
    ranks = [
        _interleaved_rank(pp, m, vpp, r, (vpp - 1) * per_round + 2 * (pp - 1 - r), per_round)
        for r in range(pp)
    ]
    return _split_known(Schedule(name, pp, vpp, m, ranks), False)


def interleaved_zero_bubble(pp: int, m: int, vpp: int = 2, name: str = "InterleavedZeroBubble") -> Schedule:
    """PyTorch's ScheduleInterleavedZeroBubble (ZB1P over looped chunks): warm-up (v-1)·round +
    (p-1-r), split backwards, rank r defers its first r weight passes."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp)
    per_round = _torch_rounds(name, pp, m)
    ranks = [
        _interleaved_rank(
            pp, m, vpp, r, (vpp - 1) * per_round + (pp - 1 - r), per_round, zero_bubble=True, deferred_w=r
        )
        for r in range(pp)
    ]
    return _split_known(Schedule(name, pp, vpp, m, ranks), True)


def megatron_vpp(pp: int, m: int, vpp: int = 2, name: str = "VPP") -> Schedule:
    """Megatron-LM's interleaved 1F1B (virtual pipeline): groups of p microbatches per chunk,
    warm-up 2(p-1-r) + (v-1)·p forwards, or everything when m == p."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp)
    _need(
        m % pp == 0,
        f"{name} (Megatron's interleaved order) needs --microbatches to be a multiple of "
        f"--pp {pp} (got {m}); Interleaved1F1B accepts other counts",
    )
    ranks = []
    for r in range(pp):
        warm = m * vpp if m == pp else 2 * (pp - 1 - r) + (vpp - 1) * pp
        ranks.append(_interleaved_rank(pp, m, vpp, r, warm, pp))
    return _split_known(Schedule(name, pp, vpp, m, ranks), False)


# ---------------------------------------------------------------- V placement, 2 chunks


def zb_v(pp: int, m: int, vpp: int = 2, name: str = "ZBVZeroBubble") -> Schedule:
    """ZB-V (Qi et al. 2024 §6) in the order of PyTorch's ScheduleZBVZeroBubble. Chunk 0 of rank r
    is stage r, chunk 1 is stage 2p-1-r. Built for max(m, 2p-1) microbatches, then the extra
    ones are dropped (as PyTorch does)."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp, exact=2)
    n = max(2 * pp - 1, m)
    ranks = []
    for r in range(pp):
        acts = _zb_v_rank(pp, r, n)
        ranks.append(acts if n == m else [a for a in acts if a[2] < m])
    return Schedule(name, pp, 2, m, ranks, placement="v")


def _zb_v_rank(pp: int, r: int, n: int) -> list[Action]:
    """Rank r's actions of zb_v for n microbatches."""
    stage = (r, 2 * pp - 1 - r)
    # next microbatch per (kind, chunk): F0 F1 I0 I1 W0 W1
    cnt = [0, 0, 0, 0, 0, 0]
    acts: list[Action] = []
    append = acts.append

    def add(slot, kind, chunk):
        append(Action(kind, stage[chunk], cnt[slot]))
        cnt[slot] += 1

    for _ in range(2 * (pp - r) - 1):
        add(0, F, 0)
    for _ in range(r):
        add(1, F, 1), add(0, F, 0)
    for _ in range(pp - r):
        add(1, F, 1), add(3, I, 1), add(5, W, 1)
    while cnt[1] < cnt[0] or cnt[0] < n:
        if cnt[0] < n:
            add(0, F, 0)
        add(2, I, 0), add(4, W, 0)
        add(1, F, 1), add(3, I, 1), add(5, W, 1)
    for _ in range(r):
        add(2, I, 0), add(3, I, 1)
    for _ in range(pp - r):
        add(2, I, 0), add(4, W, 0)
    while cnt[5] < cnt[3]:
        add(5, W, 1)
    while cnt[4] < cnt[2]:
        add(4, W, 0)
    return acts


def dualpipe_v(pp: int, m: int, vpp: int = 2, name: str = "DualPipeV") -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half) in the order of PyTorch's ScheduleDualPipeV.
    An overlapped forward+backward pair is listed as the forward then the full backward; memory
    is replayed in that order (the overlap itself runs them on two streams)."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp, exact=2)
    _need(m >= 2 * pp, f"{name} needs --microbatches >= 2*pp = {2 * pp} (got {m}), as PyTorch requires")
    ranks = [_dualpipe_v_rank(pp, m, r) for r in range(pp)]
    return Schedule(name, pp, 2, m, ranks, placement="v")


def _dualpipe_v_rank(pp: int, m: int, r: int) -> list[Action]:
    """Rank r's actions of dualpipe_v."""
    s0, s1 = r, 2 * pp - 1 - r
    nf = {s0: 0, s1: 0}
    nb = {s0: 0, s1: 0}  # backwards (full or input) started per stage
    pending_w: list[tuple[int, int]] = []  # split backwards whose W has not run yet
    acts: list[Action] = []

    def fwd(s):
        acts.append(Action(F, s, nf[s]))
        nf[s] += 1

    def bwd(s, split=False):
        acts.append(Action(I if split else B, s, nb[s]))
        if split:
            pending_w.append((s, nb[s]))
        nb[s] += 1

    def weight():
        if pending_w:
            s, i = pending_w.pop(0)
            acts.append(Action(W, s, i))

    for _ in range(2 * (pp - r - 1)):
        fwd(s0)
    for _ in range(r + 1):
        fwd(s0), fwd(s1)
    for _ in range(pp - r - 1):
        bwd(s1, split=True), weight(), fwd(s1)
    for _ in range(m - 2 * pp + r + 1):
        fwd(s0), bwd(s1)  # overlapped pair (plain pair on the last rank's first)
        fwd(s1), bwd(s0)
    for _ in range(pp - r - 1):
        bwd(s1)
        fwd(s1), bwd(s0)
    split = False
    half = (r + 1) // 2
    for i in range(r + 1):
        if i == half and r % 2 == 1:
            split = True
        bwd(s1, split)
        if i == half and r % 2 == 0:
            split = True
        bwd(s0, split)
    for _ in range(pp - r - 1):
        weight()
        bwd(s0, split)
    for _ in range(r + 1):
        weight()
    return acts


def _v_block_schedule(pp: int, m: int, offsets: list[list[int]], name: str) -> Schedule:
    """Repeat a V-shape building block (Qi et al. 2024b, arXiv 2405.15362): on rank r, microbatch i
    runs F(chunk 0), F(chunk 1), I(chunk 1), I(chunk 0) at offsets[r][k] + 6i; each W then takes the
    first free slot after its I, oldest I first. The per-rank order is the slot order."""
    ranks = []
    for r in range(pp):
        s0, s1 = r, 2 * pp - 1 - r
        slots: dict[int, Action] = {}
        for i in range(m):
            for (kind, s), t in zip(((F, s0), (F, s1), (I, s1), (I, s0)), offsets[r]):
                t += 6 * i
                if t in slots:
                    raise AssertionError(f"{name}: building block slots collide at rank {r}")
                slots[t] = Action(kind, s, i)
        acts: list[Action] = []
        pending: list[Action] = []
        t, end = 0, max(slots)
        while t <= end or pending:
            a = slots.get(t)
            if a is not None:
                acts.append(a)
                if a.kind == I:
                    pending.append(Action(W, a.stage, a.microbatch))
            elif pending:
                acts.append(pending.pop(0))
            t += 1
        ranks.append(acts)
    return Schedule(name, pp, 2, m, ranks, placement="v")


def v_half(pp: int, m: int, vpp: int = 2, name: str = "VHalf") -> Schedule:
    """V-Half (arXiv 2405.15362): about half of 1F1B's activation memory, (p+2)/2 microbatches."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp, exact=2)
    gap = 3 if pp % 2 == 0 else 0
    offsets = [[2 * r, 3 * pp - r - 2, 3 * pp + gap + 2 * r - 1, 6 * pp + gap - r - 2] for r in range(pp)]
    return _v_block_schedule(pp, m, offsets, name)


def v_min(pp: int, m: int, vpp: int = 2, name: str = "VMin") -> Schedule:
    """V-Min (arXiv 2405.15362): about a third of 1F1B's activation memory, (p+4)/3 microbatches."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp, exact=2)
    gap = 2 if pp % 3 == 0 else 0
    offsets = [[r, 2 * pp - r - 1, 2 * pp + gap + r, 4 * pp + gap - r - 1] for r in range(pp)]
    return _v_block_schedule(pp, m, offsets, name)


# ---------------------------------------------------------------- registration (schedules.registry)

SPECS = (
    S(
        "GPipe",
        gpipe,
        synonyms=("FThenB",),
        torch="ScheduleGPipe",
        paddle="FThenB",
        paper="GPipe (Huang et al. 2019)",
        torch_runtime="gpipe",
        candidate=4,
    ),
    S(
        "1F1B",
        one_f_one_b,
        aliases=("pipedreamflush",),
        torch="Schedule1F1B",
        paddle="1F1B",
        paper="PipeDream-flush, Megatron's 1F1B",
        torch_runtime="1f1b",
        runs_at_pp1=True,
        candidate=0,
    ),
    S(
        "Eager1F1B",
        eager_1f1b,
        paddle="Eager1F1B",
        paper="1F1B with 2(p-r)-1 warm-up forwards (sends overlap the next forward)",
    ),
    S(
        "Interleaved1F1B",
        interleaved_1f1b,
        chunks="several",
        aliases=("interleaved",),
        torch="ScheduleInterleaved1F1B",
        paper="interleaved 1F1B (Narayanan et al. 2021)",
        candidate=0,
    ),
    S(
        "VPP",
        megatron_vpp,
        chunks="several",
        paddle="VPP",
        paper="Megatron's interleaved (virtual pipeline) schedule",
    ),
    S(
        "LoopedBFS",
        looped_bfs,
        chunks="several",
        torch="ScheduleLoopedBFS",
        paper="breadth-first (Lamy-Poirier 2022)",
        candidate=2,
    ),
    S(
        "InterleavedZeroBubble",
        interleaved_zero_bubble,
        chunks="several",
        split_backward=True,
        torch="ScheduleInterleavedZeroBubble",
        paper="ZB-1p over looped chunks",
        candidate=1,
    ),
    S(
        "ZBH1",
        zb_h1,
        split_backward=True,
        paddle="ZBH1",
        paper="ZB-H1 in Paddle's order: only the first r backwards of rank r are split",
        candidate=1,
    ),
    S(
        "ZB1P",
        zb_1p,
        split_backward=True,
        paper='ZB-H1 as the paper (Qi et al. 2024) draws it, "ZB-1p": every backward split',
        candidate=2,
    ),
    S("ZBH2", zb_h2, split_backward=True, aliases=("zb2p",), paper="ZB-H2 (Qi et al. 2024)", candidate=3),
    S(
        "ZBVZeroBubble",
        zb_v,
        placement="v",
        chunks="two",
        split_backward=True,
        synonyms=("ZBV",),
        torch="ScheduleZBVZeroBubble",
        paper="ZB-V (Qi et al. 2024)",
        candidate=0,
    ),
    S(
        "DualPipeV",
        dualpipe_v,
        placement="v",
        chunks="two",
        split_backward=True,
        torch="ScheduleDualPipeV",
        paper="DualPipeV (DeepSeek-V3's DualPipe, halved)",
        candidate=3,
    ),
    S(
        "VHalf",
        v_half,
        placement="v",
        chunks="two",
        split_backward=True,
        paper="V-Half (Qi et al. 2024b): about half of 1F1B's activations",
        candidate=1,
    ),
    S(
        "VMin",
        v_min,
        placement="v",
        chunks="two",
        split_backward=True,
        paper="V-Min (Qi et al. 2024b): about a third of 1F1B's activations",
        candidate=2,
    ),
)
