"""Generators of per-rank action lists for the named pipeline schedules.

Each generator returns a `Schedule`; ranks' lists hold only compute actions (no bubbles, no
communication): the order is what matters for memory, and the time model (simulate.py) puts
the bubbles back. Orders that PyTorch's pipelining also defines follow the order its schedule
classes build (torch 2.13; tests compare against `get_schedule_ops`), with PyTorch's
`Schedule1F1B` taken as executed by its runtime (its `pipeline_order` is off by one on the last
rank, FINDINGS.md §4).
"""

from __future__ import annotations

from ..errors import UserError
from .actions import Action, Schedule

F, B, I, W = "F", "B", "I", "W"


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


def _check_basic(name: str, pp: int, m: int, vpp: int) -> None:
    _need(pp >= 1, f"{name}: --pp must be at least 1 (got {pp})")
    _need(m >= 1, f"{name}: --microbatches must be at least 1 (got {m})")
    _need(vpp >= 1, f"{name}: --vpp must be at least 1 (got {vpp})")


def _single_chunk(name: str, vpp: int) -> None:
    _need(vpp == 1, f"{name} runs one model chunk per rank: drop --vpp (got --vpp {vpp}); "
                    f"for several chunks per rank use Interleaved1F1B, LoopedBFS or VPP")


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
    _need(m >= 2 * pp - 1, f"{name} needs --microbatches >= 2*pp-1 = {2 * pp - 1} (got {m}), as Paddle requires")
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
        for _ in range(r):                      # split backwards whose W waits for the tail
            acts += [Action(I, r, nb), Action(F, r, nf)]
            nb += 1
            nf += 1
        for _ in range(m - pp):                 # steady 1F1B with fused backwards
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


def zb_h2(pp: int, m: int, vpp: int = 1, name: str = "ZBH2") -> Schedule:
    """ZB-H2 (Qi et al. 2024): 2(p - r) - 1 warm-up forwards, then I, W, F triples; no bubble in
    the steady state when T_F = T_I = T_W, at (2p-1)·M_B on rank 0."""
    _check_basic(name, pp, m, vpp)
    _single_chunk(name, vpp)
    ranks = []
    for r in range(pp):
        warm = min(m, 2 * (pp - r) - 1)
        acts = [Action(F, r, i) for i in range(warm)]
        for b in range(m):
            acts += [Action(I, r, b), Action(W, r, b)]
            if warm + b < m:
                acts.append(Action(F, r, warm + b))
        ranks.append(acts)
    return Schedule(name, pp, 1, m, ranks)


# ---------------------------------------------------------------- looped placement, v chunks

def _multi_chunk(name: str, vpp: int, exact: int | None = None) -> None:
    if exact is not None:
        _need(vpp == exact, f"{name} runs exactly {exact} model chunks per rank: pass --vpp {exact} (got {vpp})")
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


def _interleaved_rank(pp: int, m: int, vpp: int, r: int, warmup: int, group: int,
                      zero_bubble: bool = False, deferred_w: int = 0) -> list[Action]:
    """Depth-first interleaved order of rank r: the k-th forward runs chunk (k // group) % v, the
    k-th backward chunk v-1 - (k // group) % v; `warmup` forwards, then forward/backward pairs,
    then the remaining backwards. With `zero_bubble`, backwards are I and each I after the first
    `deferred_w` ones is followed by the oldest pending W; leftover Ws end the list."""
    total = m * vpp
    warmup = min(warmup, total)
    nxt_f = [0] * vpp
    nxt_b = [0] * vpp
    nxt_w = [0] * vpp
    back_chunks: list[int] = []
    acts: list[Action] = []
    bkind = I if zero_bubble else B

    def forward(k):
        c = (k // group) % vpp
        acts.append(Action(F, c * pp + r, nxt_f[c]))
        nxt_f[c] += 1

    def backward(k):
        c = vpp - 1 - (k // group) % vpp
        acts.append(Action(bkind, c * pp + r, nxt_b[c]))
        nxt_b[c] += 1
        back_chunks.append(c)
        if zero_bubble and k >= deferred_w:
            weight()

    def weight():
        c = back_chunks[sum(nxt_w)]
        acts.append(Action(W, c * pp + r, nxt_w[c]))
        nxt_w[c] += 1

    for k in range(warmup):
        forward(k)
    for k in range(warmup, total):
        forward(k)
        backward(k - warmup)
    for k in range(total - warmup, total):
        backward(k)
    while zero_bubble and sum(nxt_w) < total:
        weight()
    return acts


def _torch_rounds(name: str, pp: int, m: int) -> int:
    rounds = max(1, m // pp)
    _need(m % rounds == 0, f"{name} needs --microbatches to be a multiple of max(1, m // pp) = {rounds} "
                           f"(PyTorch's rule); e.g. use {rounds * (m // rounds)} or a multiple of --pp {pp}")
    return m // rounds


def interleaved_1f1b(pp: int, m: int, vpp: int = 2, name: str = "Interleaved1F1B") -> Schedule:
    """PyTorch's ScheduleInterleaved1F1B: depth-first over rounds of m // max(1, m // p) microbatches,
    warm-up (v-1)·round + 2(p-1-r) forwards."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp)
    per_round = _torch_rounds(name, pp, m)
    ranks = [_interleaved_rank(pp, m, vpp, r, (vpp - 1) * per_round + 2 * (pp - 1 - r), per_round)
             for r in range(pp)]
    return Schedule(name, pp, vpp, m, ranks)


def interleaved_zero_bubble(pp: int, m: int, vpp: int = 2, name: str = "InterleavedZeroBubble") -> Schedule:
    """PyTorch's ScheduleInterleavedZeroBubble (ZB1P over looped chunks): warm-up (v-1)·round +
    (p-1-r), split backwards, rank r defers its first r weight passes."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp)
    per_round = _torch_rounds(name, pp, m)
    ranks = [_interleaved_rank(pp, m, vpp, r, (vpp - 1) * per_round + (pp - 1 - r), per_round,
                               zero_bubble=True, deferred_w=r) for r in range(pp)]
    return Schedule(name, pp, vpp, m, ranks)


def megatron_vpp(pp: int, m: int, vpp: int = 2, name: str = "VPP") -> Schedule:
    """Megatron-LM's interleaved 1F1B (virtual pipeline): groups of p microbatches per chunk,
    warm-up 2(p-1-r) + (v-1)·p forwards, or everything when m == p."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp)
    _need(m % pp == 0, f"{name} (Megatron's interleaved order) needs --microbatches to be a multiple of "
                       f"--pp {pp} (got {m}); Interleaved1F1B accepts other counts")
    ranks = []
    for r in range(pp):
        warm = m * vpp if m == pp else 2 * (pp - 1 - r) + (vpp - 1) * pp
        ranks.append(_interleaved_rank(pp, m, vpp, r, warm, pp))
    return Schedule(name, pp, vpp, m, ranks)


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
        s0, s1 = r, 2 * pp - 1 - r
        cnt = {(F, 0): 0, (F, 1): 0, (I, 0): 0, (I, 1): 0, (W, 0): 0, (W, 1): 0}
        acts: list[Action] = []

        def add(kind, chunk):
            acts.append(Action(kind, s0 if chunk == 0 else s1, cnt[kind, chunk]))
            cnt[kind, chunk] += 1

        for _ in range(2 * (pp - r) - 1):
            add(F, 0)
        for _ in range(r):
            add(F, 1)
            add(F, 0)
        for _ in range(pp - r):
            add(F, 1), add(I, 1), add(W, 1)
        while cnt[F, 1] < cnt[F, 0] or cnt[F, 0] < n:
            if cnt[F, 0] < n:
                add(F, 0)
            add(I, 0), add(W, 0)
            add(F, 1), add(I, 1), add(W, 1)
        for _ in range(r):
            add(I, 0), add(I, 1)
        for _ in range(pp - r):
            add(I, 0), add(W, 0)
        while cnt[W, 1] < cnt[I, 1]:
            add(W, 1)
        while cnt[W, 0] < cnt[I, 0]:
            add(W, 0)
        ranks.append([a for a in acts if a.microbatch < m])
    return Schedule(name, pp, 2, m, ranks, placement="v")


def dualpipe_v(pp: int, m: int, vpp: int = 2, name: str = "DualPipeV") -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half) in the order of PyTorch's ScheduleDualPipeV.
    An overlapped forward+backward pair is listed as the forward then the full backward; memory
    is replayed in that order (the overlap itself runs them on two streams)."""
    _check_basic(name, pp, m, vpp)
    _multi_chunk(name, vpp, exact=2)
    _need(m >= 2 * pp, f"{name} needs --microbatches >= 2*pp = {2 * pp} (got {m}), as PyTorch requires")
    ranks = []
    for r in range(pp):
        s0, s1 = r, 2 * pp - 1 - r
        nf = {s0: 0, s1: 0}
        nb = {s0: 0, s1: 0}                    # backwards (full or input) started per stage
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
        for i in range(m - 2 * pp + r + 1):
            fwd(s0), bwd(s1)                   # overlapped pair (plain pair on the last rank's first)
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
        ranks.append(acts)
    return Schedule(name, pp, 2, m, ranks, placement="v")


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
