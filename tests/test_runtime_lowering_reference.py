"""The runtime lowerings (pipemem.runtime) give exactly what their holder-set form gives.

pipemem.runtime keeps each loop's references in plain variables, bit masks and sets (it runs
over every action of large schedules). The reference below is the form it replaced, kept
verbatim: a set of holder names per tensor key (`_Holders`), a FREE when the last one lets
go. For a broad set of named schedules, and for random action lists in the orders each
lowering recognises (duplicates, foreign stages and microbatches included), every runtime
profile's lowered lists must equal the reference's, action for action.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipemem.errors import UserError
from pipemem.runtime import PROFILES, lower
from pipemem.schedules import SCHEDULE_NAMES, default_vpp, get_schedule
from pipemem.schedules.actions import Action, Schedule

# ------------------------------------ the reference (pipemem 1cc8eb9, the lowering before the rewrite)


class _Holders:
    """References to tensors keyed (what, stage, microbatch); emits a FREE action into `out`
    when the last holder of a tensor lets go."""

    _FREE = {"x": "FREE_X", "y": "FREE_Y", "dx": "FREE_DX", "dy": "FREE_DY"}

    def __init__(self, out: list):
        self.out = out
        self.holders: dict = defaultdict(set)
        self.by_holder: dict = defaultdict(set)
        self.ties: dict = defaultdict(list)  # key -> [(other key, holder)] released when key is freed

    def tie(self, key, holder: str, owner) -> None:
        """`key` held by `holder` for as long as `owner` lives (a tensor's .grad)."""
        if owner in self.holders:
            self.ties[owner].append((key, holder))
        else:
            self.release(key, holder)

    def hold(self, key, holder: str) -> None:
        self.holders[key].add(holder)
        self.by_holder[holder].add(key)

    def release(self, key, holder: str) -> None:
        hs = self.holders.get(key)
        if not hs or holder not in hs:
            return
        hs.discard(holder)
        self.by_holder[holder].discard(key)
        if not hs:
            del self.holders[key]
            what, s, m = key
            self.out.append(Action(self._FREE[what], s, m))
            for other, by in self.ties.pop(key, ()):
                self.release(other, by)

    def _held(self, holder: str) -> list:
        """What `holder` holds, in release order (most variables hold one tensor or none)."""
        held = self.by_holder.get(holder)
        if not held:
            return []
        return list(held) if len(held) == 1 else sorted(held, key=_key_order)

    def release_all(self, holder: str) -> None:
        for key in self._held(holder):
            self.release(key, holder)

    def replace(self, holder: str, keys) -> None:
        """A variable reassigned: it now holds `keys` and drops what it held before."""
        old = self._held(holder)
        for k in keys:
            self.hold(k, holder)
        for k in old:
            if k not in keys:
                self.release(k, holder)


def _key_order(key):
    return (key[2], key[1], key[0])


# ---------------------------------------------------------------- torch.distributed.pipelining


def _torch_rank(schedule: Schedule, rank: int) -> list[Action]:
    S, M = schedule.num_stages, schedule.microbatches
    local = schedule.stages_of_rank(rank)
    out: list[Action] = []
    # _prepare_forward_infra then _prepare_backward_infra of every local stage, at the first step
    for s in local:
        if s:
            out += [Action("RECV_F", s, m) for m in range(M)]
    for s in local:
        if s < S - 1:
            out += [Action("RECV_B", s, m) for m in range(M)]
    h = _Holders(out)
    for s in local:
        for m in range(M):
            if s:
                h.hold(("x", s, m), "recv_info")
            if s < S - 1:
                h.hold(("dy", s, m), "grad_recv_info")
    acts = schedule.ranks[rank]
    if schedule.vpp == 1 and _torch_class(schedule) == "gpipe":
        _torch_gpipe(acts, h, S)
    elif schedule.vpp == 1 and _torch_class(schedule) == "1f1b":
        _torch_1f1b(acts, h, S, M)
    else:
        _torch_action_runtime(acts, h, S, set(local))
    return out


def _torch_class(schedule: Schedule) -> str:
    name = schedule.name.lower().removeprefix("torch:")
    if name in ("gpipe", "fthenb"):
        return "gpipe"
    if name in ("1f1b", "pipedreamflush"):
        return "1f1b"
    return "runtime"


def _y_sends(s: int, m: int, S: int) -> list:
    return [("y", s, m)] if s < S - 1 else []


def _dx_sends(s: int, m: int) -> list:
    return [("dx", s, m)] if s else []


def _made_by_backward(h: _Holders, s: int, m: int) -> None:
    if s:
        h.hold(("dx", s, m), "bwd_cache")


def _torch_gpipe(acts, h: _Holders, S: int) -> None:
    """ScheduleGPipe._step_microbatches: every send kept in a local list to the end."""
    for a in acts:
        kind, s, m = a
        h.out.append(a)
        if kind == "F":
            h.hold(("y", s, m), "fwd_cache")
            for k in _y_sends(s, m, S):
                h.hold(k, "fwd_sends_to_wait")
        else:
            h.release(("y", s, m), "fwd_cache")
            _made_by_backward(h, s, m)
            for k in _dx_sends(s, m):
                h.hold(k, "bwd_sends_to_wait")
                h.release(k, "bwd_cache")
    h.release_all("fwd_sends_to_wait")
    h.release_all("bwd_sends_to_wait")


def _torch_1f1b(acts, h: _Holders, S: int, M: int) -> None:
    """Schedule1F1B._step_microbatches: its local variables fwd_sends, bwd_sends and send_work
    hold the tensors of the sends they reference until reassigned (warm-up forwards but the
    last one set send_work; after the last forward every backward does)."""
    s0 = acts[0][1] if acts else 0
    warmup = min(M, S - s0)
    f = 0
    for a in acts:
        kind, s, m = a
        h.out.append(a)
        if kind == "F":
            h.hold(("y", s, m), "fwd_cache")
            sends = _y_sends(s, m, S)
            h.replace("fwd_sends", sends)
            if f < warmup - 1:
                h.replace("send_work", sends)
            f += 1
        else:
            h.release(("y", s, m), "fwd_cache")
            _made_by_backward(h, s, m)
            sends = _dx_sends(s, m)
            h.replace("bwd_sends", sends)
            for k in sends:
                h.release(k, "bwd_cache")
            if f == M:
                h.replace("send_work", sends)
    for holder in ("fwd_sends", "bwd_sends", "send_work"):
        h.release_all(holder)


def _torch_action_runtime(acts, h: _Holders, S: int, local: set[int]) -> None:
    """_PipelineScheduleRuntime: every send's Work stays in send_ops until the step ends."""
    for a in acts:
        kind, s, m = a
        h.out.append(a)
        if kind == "F":
            h.hold(("y", s, m), "fwd_cache")
            if s + 1 in local:  # set_local_fwd_input: y replaces the next stage's buffer
                h.release(("x", s + 1, m), "recv_info")
                h.hold(("y", s, m), "local_recv_info")
            elif s < S - 1:
                h.hold(("y", s, m), "send_ops")
        elif kind == "W":
            h.release(("y", s, m), "backward_state")
        else:
            if kind == "I" and s < S - 1:  # backward_state keeps y to W (the loss, on the last stage)
                h.hold(("y", s, m), "backward_state")
            h.release(("y", s, m), "fwd_cache")
            _made_by_backward(h, s, m)
            if s and s - 1 in local:  # set_local_bwd_input: dx replaces the previous stage's grad buffer
                h.hold(("dx", s, m), "local_grad_recv_info")
                h.release(("dx", s, m), "bwd_cache")
                h.release(("dy", s - 1, m), "grad_recv_info")
            elif s:
                h.hold(("dx", s, m), "send_ops")
                h.release(("dx", s, m), "bwd_cache")
    h.release_all("send_ops")


# ---------------------------------------------------------------- Megatron, Paddle


def _megatron_rank(schedule: Schedule, rank: int) -> list[Action]:
    acts = schedule.ranks[rank]
    if schedule.vpp == 1 and _is_1f1b_order(acts, schedule.pp - rank, schedule.microbatches):
        return _megatron_1f1b(acts, schedule, rank)
    if schedule.vpp > 1 and _interleaved_warmup(acts) is not None:
        return _megatron_interleaved(acts, schedule)
    return _per_action_rank(schedule, rank)


def _interleaved_warmup(acts) -> int | None:
    """w when the rank runs w forwards, then forward/backward pairs, then w backwards, all
    backwards fused: the order megatron-core's interleaved loop runs (pipemem's VPP schedule)."""
    kinds = "".join(a[0] for a in acts)
    n = kinds.count("F")
    lead = len(kinds) - len(kinds.lstrip("F"))
    for w in (lead - 1, lead):
        if 0 <= w <= n and kinds == "F" * w + "FB" * (n - w) + "B" * w:
            return w
    return None


def _megatron_interleaved(acts, schedule: Schedule) -> list[Action]:
    """forward_backward_pipelining_with_interleaving without p2p overlap (megatron-core's
    default), variable by variable: the input of the next forward (and, from the last warm-up
    step on, the output grad of the next backward) is received right after the current step
    (`send_forward_recv_forward`, `send_forward_backward_recv_forward_backward`,
    `send_backward_recv_backward`) and queued in `input_tensors` / `output_tensor_grads`; a
    steady step runs its forward then its backward and only then sends the forward's output,
    whose data `deallocate_output_tensor` frees after the send; a backward pops its x and dy,
    which go when it returns, and its dx lives in `input_tensor_grad` until the next backward
    returns."""
    S = schedule.num_stages
    fwd = [a for a in acts if a[0] == "F"]
    bwd = [a for a in acts if a[0] != "F"]
    T = len(fwd)
    w = _interleaved_warmup(acts)
    out: list[Action] = []
    h = _Holders(out)

    def recv_x(i):
        if i < T and fwd[i][1]:
            a = fwd[i]
            out.append(Action("RECV_F", a[1], a[2]))
            h.hold(("x", a[1], a[2]), "input_tensors")

    def recv_dy(j):
        if j < T and bwd[j][1] < S - 1:
            a = bwd[j]
            out.append(Action("RECV_B", a[1], a[2]))
            h.hold(("dy", a[1], a[2]), "output_tensor_grads")

    def free_y(i):
        a = fwd[i]
        if a[1] < S - 1:
            out.append(Action("FREE_Y", a[1], a[2]))

    def backward(j):
        kind, st, m = bwd[j]
        out.append(bwd[j])
        if st == S - 1:  # the last stage's output (the loss) is done with
            out.append(Action("FREE_Y", st, m))
        h.release(("x", st, m), "input_tensors")  # backward_step_helper's locals go
        h.release(("dy", st, m), "output_tensor_grads")
        if st:
            h.hold(("dx", st, m), "dx")
        h.replace("input_tensor_grad", [("dx", st, m)] if st else [])
        if st:
            h.release(("dx", st, m), "dx")

    recv_x(0)
    for i in range(w):
        out.append(fwd[i])
        recv_x(i + 1)
        if i == w - 1 and w < T:  # send_forward_backward_recv_forward_backward
            recv_dy(0)
        free_y(i)
    for k in range(T - w):
        out.append(fwd[w + k])
        backward(k)
        recv_x(w + k + 1)
        recv_dy(k + 1)
        free_y(w + k)
    if w == T:  # every microbatch in warm-up: recv_backward first
        recv_dy(0)
    for j in range(T - w, T):
        backward(j)
        recv_dy(j + 1)
    h.release_all("input_tensor_grad")
    return out


def _is_1f1b_order(acts, warmup: int, M: int) -> bool:
    """F0..F(w-1), then B/F pairs, then Bs: the order megatron-core's 1F1B loop runs."""
    w = min(warmup, M)
    kinds = "".join(a[0] for a in acts)
    return kinds == "F" * w + "BF" * (M - w) + "B" * w


def _megatron_1f1b(acts, schedule: Schedule, rank: int) -> list[Action]:
    """forward_backward_pipelining_without_interleaving, variable by variable. Megatron's
    warm-up is pp - rank - 1 forwards; its first steady iteration runs the next forward, so the
    compute order is the schedule's 1F1B order."""
    S, M = schedule.num_stages, schedule.microbatches
    s = rank
    first, last = s == 0, s == S - 1
    out: list[Action] = []
    h = _Holders(out)
    fwd = [a for a in acts if a[0] == "F"]
    bwd = [a for a in acts if a[0] != "F"]
    warm = min(schedule.pp - rank - 1, M)
    rest = M - warm
    queue: list[int] = []  # input_tensors (and output_tensors), in order

    def x(i):
        return [] if first else [("x", s, i)]

    def recv_forward(i):  # input_tensor = recv_forward(...)
        if not first:
            out.append(Action("RECV_F", s, i))
        h.replace("input_tensor", x(i))

    def forward(i):
        out.append(fwd[i])
        if not last:  # send_forward, then deallocate_output_tensor
            out.append(Action("FREE_Y", s, i))

    def recv_backward(j):  # output_tensor_grad = [send_forward_]recv_backward(...)
        if not last:
            out.append(Action("RECV_B", s, j))
            h.replace("output_tensor_grad", [("dy", s, j)])

    def pop():  # input_tensor = input_tensors.pop(0)
        i = queue.pop(0)
        h.replace("input_tensor", x(i))
        for k in x(i):
            h.release(k, "input_tensors")

    def backward(j):  # input_tensor_grad = backward_step(...)
        out.append(bwd[j])
        if last:  # the last stage's output (the loss) is done with
            out.append(Action("FREE_Y", s, j))
        if not first:  # x.retain_grad(): x.grad references dx until x goes
            h.hold(("dx", s, j), "x.grad")
            h.tie(("dx", s, j), "x.grad", ("x", s, j))
        h.replace("input_tensor_grad", [("dx", s, j)] if not first else [])

    def keep(i):  # input_tensors.append(input_tensor)
        queue.append(i)
        for k in x(i):
            h.hold(k, "input_tensors")

    for i in range(warm):
        recv_forward(i)
        forward(i)
        keep(i)
    if rest > 0:
        recv_forward(warm)
    for i in range(rest):
        k = i + warm
        forward(k)
        recv_backward(i)
        keep(k)
        pop()
        backward(i)
        if i == rest - 1:
            h.replace("input_tensor", [])  # input_tensor = None; send_backward(...)
        else:
            recv_forward(k + 1)  # input_tensor = send_backward_recv_forward(...)
    for j in range(rest, M):
        pop()
        recv_backward(j)
        backward(j)
    for holder in ("input_tensor", "output_tensor_grad", "input_tensor_grad"):
        h.release_all(holder)  # the function returns
    return out


def _per_action_rank(schedule: Schedule, rank: int) -> list[Action]:
    """Receive right before use, free y after its send, dx after its send, x and dy when the
    stage's backward of that microbatch is done (after W when the backward is split)."""
    S = schedule.num_stages
    out: list[Action] = []
    split = {(a[1], a[2]) for a in schedule.ranks[rank] if a[0] == "W"}
    for a in schedule.ranks[rank]:
        kind, s, m = a
        if kind == "F":
            if s:
                out.append(Action("RECV_F", s, m))
            out.append(a)
            if s < S - 1:
                out.append(Action("FREE_Y", s, m))
            continue
        if kind in ("B", "I") and s < S - 1:
            out.append(Action("RECV_B", s, m))
        out.append(a)
        if kind in ("B", "I") and s:
            out.append(Action("FREE_DX", s, m))
        if kind in ("B", "I") and s == S - 1:  # the last stage's output (loss) goes with its backward
            out.append(Action("FREE_Y", s, m))
        if kind == "W" or (kind == "B") or (kind == "I" and (s, m) not in split):
            if s:
                out.append(Action("FREE_X", s, m))
            if s < S - 1:
                out.append(Action("FREE_DY", s, m))
    return out


REFERENCE = {"torch": _torch_rank, "megatron": _megatron_rank, "paddle": _per_action_rank}


def _assert_same(sched: Schedule) -> None:
    for runtime in PROFILES:
        got = lower(sched, runtime).ranks
        for r in range(sched.pp):
            want = REFERENCE[runtime](sched, r)
            assert got[r] == want, (sched.name, sched.pp, sched.microbatches, sched.vpp, runtime, r)
            assert all(type(a) is Action for a in got[r])


# ---------------------------------------------------------------- named schedules


def _named_cases():
    names = [n for n in SCHEDULE_NAMES if n not in ("ZBVPP", "ZBAuto")]
    for name in names:
        for pp in (1, 2, 3, 4, 5, 8):
            for m in sorted({1, 2, 3, pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 1, 12}):
                for vpp in sorted({default_vpp(name), 2, 3}):
                    if m >= 1:
                        yield name, pp, m, vpp


def test_named_schedules_lower_as_the_reference():
    compared = 0
    for name, pp, m, vpp in _named_cases():
        try:
            sched = get_schedule(name, pp, m, vpp)
        except UserError:
            continue
        _assert_same(sched)
        compared += 1
    for pp, m in ((2, 4), (3, 6), (4, 3)):  # the memory-limited scheduler's orders
        _assert_same(get_schedule("ZBAuto", pp, m))
        compared += 1
    assert compared > 500


@pytest.mark.parametrize(
    "name,pp,m,vpp",
    [
        ("1F1B", 8, 64, 1),
        ("Interleaved1F1B", 4, 32, 3),
        ("VPP", 4, 16, 2),
        ("GPipe", 4, 16, 1),
        ("ZBVZeroBubble", 4, 16, 2),
        ("InterleavedZeroBubble", 4, 16, 2),
        ("DualPipeV", 4, 16, 2),
    ],
)
def test_larger_schedules_lower_as_the_reference(name, pp, m, vpp):
    _assert_same(get_schedule(name, pp, m, vpp))


# ---------------------------------------------------------------- random action lists


@st.composite
def _random_schedules(draw):
    """A schedule whose ranks run the kind orders the lowerings recognise (1F1B's,
    megatron-core's interleaved one) or any order, over random stages and microbatches
    (repeats and out-of-range microbatches included): the lowerings agree on any input."""
    pp = draw(st.integers(1, 4), "pp")
    vpp = draw(st.integers(1, 3), "vpp")
    M = draw(st.integers(1, 6), "m")
    S = pp * vpp
    name = draw(st.sampled_from(["1F1B", "GPipe", "Interleaved1F1B", "custom"]), "name")
    placement = draw(st.sampled_from(["loop", "v"]), "placement")
    sched = Schedule(name, pp, vpp, M, [[] for _ in range(pp)], placement=placement)
    ranks = []
    for r in range(pp):
        local = sched.stages_of_rank(r)
        order = draw(st.sampled_from(["1f1b", "interleaved", "any"]), "order")
        if order == "1f1b":
            w = min(pp - r, M)
            kinds = "F" * w + "BF" * (M - w) + "B" * w
        elif order == "interleaved":
            n = draw(st.integers(0, 8), "n")
            w = draw(st.integers(0, n), "w")
            kinds = "F" * w + "FB" * (n - w) + "B" * w
        else:
            kinds = "".join(draw(st.lists(st.sampled_from("FBIW"), max_size=12), "kinds"))
        stage = st.sampled_from(local) if draw(st.booleans(), "own stages") else st.integers(0, S - 1)
        ranks.append([Action(k, draw(stage), draw(st.integers(0, M))) for k in kinds])
    return Schedule(name, pp, vpp, M, ranks, stage_rank=sched.stage_rank, placement=placement)


@settings(max_examples=300, deadline=None)
@given(sched=_random_schedules())
def test_random_action_lists_lower_as_the_reference(sched):
    _assert_same(sched)
