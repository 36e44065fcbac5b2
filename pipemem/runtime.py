"""Pipeline runtimes as data: what a runtime holds beyond the stage jobs.

A schedule lists compute actions (F, B, I, W). The runtime that executes it also allocates
receive buffers and keeps tensors alive through its own references (send handles, caches,
the local variables of its loop). A *lowering* adds those as memory actions to every rank's
list, in the spirit of PyTorch's `_add_send_recv` (which adds SEND/RECV actions to a
compute-only schedule): RECV_F / RECV_B allocate the receive buffer of a stage input x /
output grad dy; FREE_X, FREE_Y, FREE_DX, FREE_DY free x, the stage output y (made by F),
the input grad dx (made by B or I) and dy (kinds and bytes: `schedules.actions.MEMORY_KINDS`,
the bytes are the stage's boundary sizes, pipemem.jobs). Replay then walks one list per rank.

A lowering follows the runtime's references by *holders*: a tensor is freed when the last
holder lets go (see `_let_go` for how the holders are kept). One profile per runtime:

* ``torch`` — torch.distributed.pipelining (2.13). Every non-first stage allocates one input
  buffer and every non-last stage one output-grad buffer per microbatch at the first step
  (`_RecvInfo.buffer`); they persist. `fwd_cache` holds y from F to its B (or I; then
  `backward_state` holds it to W, except on the last stage where it holds the loss and the
  output goes at I). Sends keep their tensors: ScheduleGPipe until the step ends,
  Schedule1F1B until its local `fwd_sends` / `bwd_sends` / `send_work` are reassigned, the
  action-list runtime (Interleaved1F1B, ZB, DualPipeV...) in `send_ops` until the step ends.
  Two adjacent stages on one rank (V placement) hand over locally: y replaces the next
  stage's input buffer (`set_local_fwd_input`) and dx the previous stage's grad buffer
  (`set_local_bwd_input`); both stay referenced past the step. Every rank holds the step's
  token ids and labels (torchtitan's training loop loads the batch on every PP rank).
* ``megatron`` — megatron-core 0.16.1 `schedules.py` / `p2p_communication.py`. Non-interleaved
  1F1B (`forward_backward_pipelining_without_interleaving`) follows the loop's variables:
  `recv_forward` allocates x right before a warm-up F, the steady state receives the next x in
  `send_backward_recv_forward` after a B, so the previous x (and its `.grad` = dx, kept by
  `retain_grad`) lives until then; `deallocate_output_tensor` frees y's data right after its
  send (Megatron-LM sets `deallocate_pipeline_outputs`); dy lives in `output_tensor_grad`
  until the next dy is received; dx in `input_tensor_grad` until the next backward returns;
  whatever the loop still references goes when it returns. Interleaved 1F1B (VPP,
  `forward_backward_pipelining_with_interleaving` without p2p overlap) likewise: the next
  input and output grad are received right after the current step, a steady step sends its
  forward's output only after its backward, dx lives until the next backward returns. Other
  orders (zero bubble) use the per-action rule: x received before its F, y freed after its
  send, dy received before its B / I, dx freed after its send, x and dy after the backward.
* ``paddle`` — PaddleNLP's PipelineParallel: receives before use, `_release_output` after a
  send, buffers popped by the backward: the per-action rule.

`pipemem estimate --runtime` picks the profile; the default follows `--convention`
(megatron -> megatron, paddle -> paddle, torchtitan / hf -> torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import frameworks
from .errors import UserError
from .schedules.actions import Action, Schedule, paused_gc

RUNTIMES = ("torch", "megatron", "paddle")


def default_runtime(convention: str) -> str:
    """The runtime a convention's framework pipelines with (`Framework.runtime`); torch's otherwise."""
    fw = frameworks.ALL.get(convention)
    return fw.runtime if fw is not None else "torch"


# The lowerings run once per rank over every action (10^5-10^6 of them for a large schedule),
# so they keep the references in plain variables: a loop variable that references one tensor
# or none is a variable holding its key (or None); a tensor with several holders has a bit
# mask of them (`_let_go`); a tensor with one holder is a member of a set. Where each
# reference goes is the loop's own order, so the FREE actions come out in the order the
# runtime lets go. tests/test_runtime_lowering_reference.py checks every lowering against a
# reference that keeps a set of holder names per tensor. Memory actions are made by
# tuple.__new__, not Action(...): the same tuple without the call of the generated __new__.

_new = tuple.__new__
_FREE = {"x": "FREE_X", "y": "FREE_Y", "dx": "FREE_DX", "dy": "FREE_DY"}


def _let_go(held: dict, key: tuple, bit: int, emit) -> None:
    """The holder `bit` lets go of tensor `key` = (what, stage, microbatch), whose holders
    are the bit mask held[key]: emit its FREE action when it was the last one."""
    mask = held.get(key, 0)
    if mask & bit:
        if mask == bit:
            del held[key]
            emit(_new(Action, (_FREE[key[0]], key[1], key[2])))
        else:
            held[key] = mask ^ bit


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    lower_rank: Callable  # (schedule, rank) -> list[Action] with memory actions
    batch_on_every_rank: bool = False
    doc: str = ""


def lower(schedule: Schedule, runtime: str) -> Schedule:
    """The schedule with the runtime's memory actions added to every rank's list (cached on
    the schedule: lowering depends only on the actions and the placement)."""
    profile = get_runtime(runtime)
    cache = schedule.cache
    key = ("lowered", profile.name)
    if key not in cache:
        with paused_gc():  # 10^5-10^6 new tuples, no cycles (see paused_gc)
            ranks = [profile.lower_rank(schedule, r) for r in range(schedule.pp)]
        cache[key] = schedule.with_ranks(ranks)
    return cache[key]


def get_runtime(name: str) -> RuntimeProfile:
    p = PROFILES.get(str(name).lower())
    if p is None:
        raise UserError(f"--runtime {name!r}: use one of {', '.join(RUNTIMES)}")
    return p


# ---------------------------------------------------------------- torch.distributed.pipelining

# holders of a y or dx in the torch lowerings (bit masks, see _let_go): fwd_cache,
# backward_state, a list of sends kept to the step's end (ScheduleGPipe's fwd_sends_to_wait,
# the action runtime's send_ops), a local handover (set_local_fwd_input), Schedule1F1B's
# variables fwd_sends, bwd_sends and send_work
_FWD_CACHE, _BACKWARD_STATE, _SEND, _LOCAL, _FWD_SENDS, _BWD_SENDS, _SEND_WORK = 1, 2, 4, 8, 16, 32, 64


def _torch_rank(schedule: Schedule, rank: int) -> list[Action]:
    S, M = schedule.num_stages, schedule.microbatches
    local = schedule.stages_of_rank(rank)
    out: list[Action] = []
    # _prepare_forward_infra then _prepare_backward_infra of every local stage, at the first step
    for s in local:
        if s:
            out += [_new(Action, ("RECV_F", s, m)) for m in range(M)]
    for s in local:
        if s < S - 1:
            out += [_new(Action, ("RECV_B", s, m)) for m in range(M)]
    acts = schedule.ranks[rank]
    if schedule.vpp == 1 and _torch_class(schedule) == "gpipe":
        _torch_gpipe(acts, out, S)
    elif schedule.vpp == 1 and _torch_class(schedule) == "1f1b":
        _torch_1f1b(acts, out, S, M)
    else:
        _torch_action_runtime(acts, out, S, M, set(local))
    return out


def _torch_class(schedule: Schedule) -> str:
    """'gpipe', '1f1b' or 'actions': the runtime PyTorch runs the schedule's order with."""
    from .schedules.registry import torch_runtime

    return torch_runtime(schedule.name)


def _torch_gpipe(acts, out: list, S: int) -> None:
    """ScheduleGPipe._step_microbatches: every send kept in a local list to the end. The
    receive buffers persist (nothing here frees them); y is held by `fwd_cache` and, sent,
    by `fwd_sends_to_wait`; dx (not on stage 0) by `bwd_sends_to_wait`."""
    emit = out.append
    held: dict = {}  # ("y", s, m) -> _FWD_CACHE | _SEND
    fwd_sends_to_wait: set = set()  # (m, s) of the ys sent
    bwd_sends_to_wait: set = set()  # (m, s) of the dxs sent
    for a in acts:
        kind, s, m = a
        emit(a)
        if kind == "F":
            y = ("y", s, m)
            if s < S - 1:
                held[y] = held.get(y, 0) | _FWD_CACHE | _SEND
                fwd_sends_to_wait.add((m, s))
            else:
                held[y] = held.get(y, 0) | _FWD_CACHE
        else:
            _let_go(held, ("y", s, m), _FWD_CACHE, emit)
            if s:  # made by the backward, held by its send from then on
                bwd_sends_to_wait.add((m, s))
    # the step ends: the lists go, in microbatch then stage order
    for m, s in sorted(fwd_sends_to_wait):
        _let_go(held, ("y", s, m), _SEND, emit)
    for m, s in sorted(bwd_sends_to_wait):
        emit(_new(Action, ("FREE_DX", s, m)))


def _torch_1f1b(acts, out: list, S: int, M: int) -> None:
    """Schedule1F1B._step_microbatches: its local variables fwd_sends, bwd_sends and send_work
    hold the tensors of the sends they reference until reassigned (warm-up forwards but the
    last one set send_work; after the last forward every backward does)."""
    emit = out.append
    held: dict = {}  # ("y" | "dx", s, m) -> bit mask of its holders
    fwd_sends = bwd_sends = send_work = None  # the key each variable references, or None
    s0 = acts[0][1] if acts else 0
    warmup = min(M, S - s0)
    f = 0
    for a in acts:
        kind, s, m = a
        emit(a)
        if kind == "F":
            y = ("y", s, m)
            held[y] = held.get(y, 0) | _FWD_CACHE
            sends = y if s < S - 1 else None
            if sends is not None:  # fwd_sends = the new send; the previous one goes
                held[y] |= _FWD_SENDS
            if fwd_sends is not None and fwd_sends != sends:
                _let_go(held, fwd_sends, _FWD_SENDS, emit)
            fwd_sends = sends
            if f < warmup - 1:  # send_work = the same send
                if sends is not None:
                    held[y] |= _SEND_WORK
                if send_work is not None and send_work != sends:
                    _let_go(held, send_work, _SEND_WORK, emit)
                send_work = sends
            f += 1
        else:
            _let_go(held, ("y", s, m), _FWD_CACHE, emit)
            # dx (not on stage 0) goes from bwd_cache to its send: bwd_sends = the new send
            sends = ("dx", s, m) if s else None
            if sends is not None:
                held[sends] = held.get(sends, 0) | _BWD_SENDS
            if bwd_sends is not None and bwd_sends != sends:
                _let_go(held, bwd_sends, _BWD_SENDS, emit)
            bwd_sends = sends
            if f == M:  # send_work = the same send
                if sends is not None:
                    held[sends] |= _SEND_WORK
                if send_work is not None and send_work != sends:
                    _let_go(held, send_work, _SEND_WORK, emit)
                send_work = sends
    # the function returns
    for key, bit in ((fwd_sends, _FWD_SENDS), (bwd_sends, _BWD_SENDS), (send_work, _SEND_WORK)):
        if key is not None:
            _let_go(held, key, bit, emit)


def _torch_action_runtime(acts, out: list, S: int, M: int, local: set[int]) -> None:
    """_PipelineScheduleRuntime: every send's Work stays in send_ops until the step ends."""
    emit = out.append
    # the receive buffers (stage, microbatch) still referenced by the stages' recv_info /
    # grad_recv_info: all of them, until a local handover replaces one
    recv_info = {(s, m) for s in local if s for m in range(M)}
    grad_recv_info = {(s, m) for s in local if s < S - 1 for m in range(M)}
    held: dict = {}  # ("y", s, m) -> bit mask of its holders
    send_ops: set = set()  # (m, s, "y" | "dx") of the sends
    for a in acts:
        kind, s, m = a
        emit(a)
        if kind == "F":
            y = ("y", s, m)
            mask = held.get(y, 0) | _FWD_CACHE
            if s + 1 in local:  # set_local_fwd_input: y replaces the next stage's buffer
                if (s + 1, m) in recv_info:
                    recv_info.discard((s + 1, m))
                    emit(_new(Action, ("FREE_X", s + 1, m)))
                mask |= _LOCAL
            elif s < S - 1:
                mask |= _SEND
                send_ops.add((m, s, "y"))
            held[y] = mask
        elif kind == "W":
            _let_go(held, ("y", s, m), _BACKWARD_STATE, emit)
        else:
            y = ("y", s, m)
            if kind == "I" and s < S - 1:  # backward_state keeps y to W (the loss, on the last stage)
                held[y] = held.get(y, 0) | _BACKWARD_STATE
            _let_go(held, y, _FWD_CACHE, emit)
            # dx (not on stage 0) goes from bwd_cache to where it is sent; it stays there
            if s and s - 1 in local:  # set_local_bwd_input: dx replaces the previous stage's grad buffer
                if (s - 1, m) in grad_recv_info:
                    grad_recv_info.discard((s - 1, m))
                    emit(_new(Action, ("FREE_DY", s - 1, m)))
            elif s:
                send_ops.add((m, s, "dx"))
    # the step ends: send_ops goes, in microbatch then stage order
    for m, s, what in sorted(send_ops):
        if what == "y":
            _let_go(held, ("y", s, m), _SEND, emit)
        else:
            emit(_new(Action, ("FREE_DX", s, m)))


# ---------------------------------------------------------------- Megatron, Paddle


def _megatron_rank(schedule: Schedule, rank: int) -> list[Action]:
    acts = schedule.ranks[rank]
    if schedule.vpp == 1 and _is_1f1b_order(acts, schedule.pp - rank, schedule.microbatches):
        return _megatron_1f1b(acts, schedule, rank)
    if schedule.vpp > 1:
        w = _interleaved_warmup(acts)
        if w is not None:
            return _megatron_interleaved(acts, schedule, w)
    return _per_action_rank(schedule, rank)


def _interleaved_warmup(acts) -> int | None:
    """w when the rank runs w forwards, then forward/backward pairs, then w backwards, all
    backwards fused: the order megatron-core's interleaved loop runs (pipemem's VPP schedule)."""
    kinds = "".join([a[0] for a in acts])
    n = kinds.count("F")
    lead = len(kinds) - len(kinds.lstrip("F"))
    for w in (lead - 1, lead):
        if 0 <= w <= n and kinds == "F" * w + "FB" * (n - w) + "B" * w:
            return w
    return None


def _megatron_interleaved(acts, schedule: Schedule, w: int | None = None) -> list[Action]:
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
    last = S - 1
    fwd = [a for a in acts if a[0] == "F"]
    bwd = [a for a in acts if a[0] != "F"]
    T = len(fwd)
    if w is None:
        w = _interleaved_warmup(acts)
    out: list[Action] = []
    emit = out.append
    # (stage, microbatch) of the tensors each queue references; x and dy have no other
    # reference, so a backward's pop frees them (when they were received at all)
    input_tensors: set = set()
    output_tensor_grads: set = set()
    input_tensor_grad = None  # (stage, microbatch) of the dx it references, or None

    def recv_x(i):
        if i < T:
            _, st, m = fwd[i]
            if st:
                emit(_new(Action, ("RECV_F", st, m)))
                input_tensors.add((st, m))

    def recv_dy(j):
        if j < T:
            _, st, m = bwd[j]
            if st < last:
                emit(_new(Action, ("RECV_B", st, m)))
                output_tensor_grads.add((st, m))

    def free_y(i):
        _, st, m = fwd[i]
        if st < last:
            emit(_new(Action, ("FREE_Y", st, m)))

    def backward(j):
        nonlocal input_tensor_grad
        a = bwd[j]
        _, st, m = a
        emit(a)
        if st == last:  # the last stage's output (the loss) is done with
            emit(_new(Action, ("FREE_Y", st, m)))
        key = (st, m)  # backward_step_helper's locals go
        if key in input_tensors:
            input_tensors.discard(key)
            emit(_new(Action, ("FREE_X", st, m)))
        if key in output_tensor_grads:
            output_tensor_grads.discard(key)
            emit(_new(Action, ("FREE_DY", st, m)))
        # input_tensor_grad = the new dx (none on stage 0): the previous dx goes
        old, input_tensor_grad = input_tensor_grad, (key if st else None)
        if old is not None and old != input_tensor_grad:
            emit(_new(Action, ("FREE_DX",) + old))

    recv_x(0)
    for i in range(w):
        emit(fwd[i])
        recv_x(i + 1)
        if i == w - 1 and w < T:  # send_forward_backward_recv_forward_backward
            recv_dy(0)
        free_y(i)
    for k in range(T - w):
        emit(fwd[w + k])
        backward(k)
        recv_x(w + k + 1)
        recv_dy(k + 1)
        free_y(w + k)
    if w == T:  # every microbatch in warm-up: recv_backward first
        recv_dy(0)
    for j in range(T - w, T):
        backward(j)
        recv_dy(j + 1)
    if input_tensor_grad is not None:  # the function returns
        emit(_new(Action, ("FREE_DX",) + input_tensor_grad))
    return out


def _is_1f1b_order(acts, warmup: int, M: int) -> bool:
    """F0..F(w-1), then B/F pairs, then Bs: the order megatron-core's 1F1B loop runs."""
    w = min(warmup, M)
    kinds = "".join([a[0] for a in acts])
    return kinds == "F" * w + "BF" * (M - w) + "B" * w


def _megatron_1f1b(acts, schedule: Schedule, rank: int) -> list[Action]:
    """forward_backward_pipelining_without_interleaving, variable by variable. Megatron's
    warm-up is pp - rank - 1 forwards; its first steady iteration runs the next forward, so the
    compute order is the schedule's 1F1B order.

    The tensors of microbatch i and what references them:
    x_i (received by `recv_forward`) — `input_tensor` and the queue `input_tensors`; popped
    before its backward, it goes when `input_tensor` is next reassigned: by the steady step's
    `send_backward_recv_forward` (right after the next x is received), by `input_tensor =
    None` after the last steady backward, by the next cool-down pop, or when the function
    returns. dx_i — `x_i.grad` (`retain_grad`) and `input_tensor_grad`; x_i is gone by the
    next backward, whose result reassigns `input_tensor_grad` and frees dx_i. dy_i —
    `output_tensor_grad`, until the next dy is received. y_i — its data is freed right after
    its send (`deallocate_output_tensor`); on the last stage the loss goes with its backward."""
    S, M = schedule.num_stages, schedule.microbatches
    s = rank
    recv_x = s != 0  # not the first stage: x received, dx made and sent
    recv_dy = s != S - 1  # not the last stage: y sent, dy received
    fwd = [a for a in acts if a[0] == "F"]
    bwd = [a for a in acts if a[0] != "F"]
    warm = min(schedule.pp - rank - 1, M)
    rest = M - warm
    out: list[Action] = []
    emit = out.append

    for i in range(warm):
        if recv_x:  # input_tensor = recv_forward(...)
            emit(_new(Action, ("RECV_F", s, i)))
        emit(fwd[i])
        if recv_dy:  # send_forward, then deallocate_output_tensor
            emit(_new(Action, ("FREE_Y", s, i)))
        # input_tensors.append(input_tensor): x_i stays queued
    if rest > 0 and recv_x:
        emit(_new(Action, ("RECV_F", s, warm)))
    for i in range(rest):
        k = i + warm
        emit(fwd[k])
        if recv_dy:
            emit(_new(Action, ("FREE_Y", s, k)))
            # output_tensor_grad = send_forward_recv_backward(...): the previous dy goes
            emit(_new(Action, ("RECV_B", s, i)))
            if i:
                emit(_new(Action, ("FREE_DY", s, i - 1)))
        # input_tensors.append(input_tensor); input_tensor = input_tensors.pop(0): x_i
        emit(bwd[i])  # input_tensor_grad = backward_step(...)
        if not recv_dy:  # the last stage's output (the loss) is done with
            emit(_new(Action, ("FREE_Y", s, i)))
        if recv_x:
            if i:  # input_tensor_grad reassigned; x_(i-1) went before
                emit(_new(Action, ("FREE_DX", s, i - 1)))
            if i < rest - 1:  # input_tensor = send_backward_recv_forward(...)
                emit(_new(Action, ("RECV_F", s, k + 1)))
            emit(_new(Action, ("FREE_X", s, i)))  # (or input_tensor = None after the last)
    for j in range(rest, M):
        if recv_x and j > rest:  # input_tensor = input_tensors.pop(0): x_(j-1) goes
            emit(_new(Action, ("FREE_X", s, j - 1)))
        if recv_dy:  # output_tensor_grad = recv_backward(...)
            emit(_new(Action, ("RECV_B", s, j)))
            if j:
                emit(_new(Action, ("FREE_DY", s, j - 1)))
        emit(bwd[j])  # input_tensor_grad = backward_step(...)
        if not recv_dy:
            emit(_new(Action, ("FREE_Y", s, j)))
        if recv_x and j:
            emit(_new(Action, ("FREE_DX", s, j - 1)))
    if M:  # the function returns: input_tensor (still x_(M-1)
        if recv_x and warm:  # when the loop ended in cool-down),
            emit(_new(Action, ("FREE_X", s, M - 1)))
        if recv_dy:  # output_tensor_grad, input_tensor_grad
            emit(_new(Action, ("FREE_DY", s, M - 1)))
        if recv_x:
            emit(_new(Action, ("FREE_DX", s, M - 1)))
    return out


def _per_action_rank(schedule: Schedule, rank: int) -> list[Action]:
    """Receive right before use, free y after its send, dx after its send, x and dy when the
    stage's backward of that microbatch is done (after W when the backward is split)."""
    last = schedule.num_stages - 1
    acts = schedule.ranks[rank]
    out: list[Action] = []
    emit = out.append
    split = {(a[1], a[2]) for a in acts if a[0] == "W"}
    for a in acts:
        kind, s, m = a
        if kind == "F":
            if s:
                emit(_new(Action, ("RECV_F", s, m)))
            emit(a)
            if s < last:
                emit(_new(Action, ("FREE_Y", s, m)))
        elif kind == "B" or kind == "I":
            if s < last:
                emit(_new(Action, ("RECV_B", s, m)))
            emit(a)
            if s:
                emit(_new(Action, ("FREE_DX", s, m)))
            if s == last:  # the last stage's output (loss) goes with its backward
                emit(_new(Action, ("FREE_Y", s, m)))
            if kind == "B" or (s, m) not in split:  # a split backward's x and dy wait for its W
                if s:
                    emit(_new(Action, ("FREE_X", s, m)))
                if s < last:
                    emit(_new(Action, ("FREE_DY", s, m)))
        elif kind == "W":
            emit(a)
            if s:
                emit(_new(Action, ("FREE_X", s, m)))
            if s < last:
                emit(_new(Action, ("FREE_DY", s, m)))
        else:  # no memory action for any other kind
            emit(a)
    return out


def fold_per_action(stages: dict) -> dict:
    """Stage jobs with the per-action rule folded in (x received at the start of F and y freed
    at its end; dy received at the start of B / I, dx freed at their end, x and dy freed at the
    end of B or W): self-contained jobs whose F and backward balance, for code that schedules
    jobs without a runtime lowering (the memory-limited scheduler)."""
    from dataclasses import replace

    from .jobs import compose

    out = {}
    final = max(s for s in stages if isinstance(s, int))
    for s, j in stages.items():
        x, y, dx, dy = j.input_bytes, j.output_bytes, j.input_grad_bytes, j.output_grad_bytes
        last = s == final
        f = compose([(x, x), j.F, (-y, 0)] if not last else [(x, x), j.F])
        tail = [(-dx, 0)] + ([(-y, 0)] if last else [])
        b = compose([(dy, dy), j.B, *tail, (-x, 0), (-dy, 0)]) if j.B is not None else None
        i = compose([(dy, dy), j.I, *tail]) if j.I is not None else None
        w = compose([j.W, (-x, 0), (-dy, 0)]) if j.W is not None else None
        out[s] = replace(
            j, F=f, B=b, I=i, W=w, input_bytes=0, output_bytes=0, input_grad_bytes=0, output_grad_bytes=0
        )
    return out


PROFILES = {
    "torch": RuntimeProfile(
        "torch", _torch_rank, batch_on_every_rank=True, doc="torch.distributed.pipelining 2.13 (torchtitan)"
    ),
    "megatron": RuntimeProfile("megatron", _megatron_rank, doc="megatron-core 0.16.1 p2p schedules"),
    "paddle": RuntimeProfile("paddle", _per_action_rank, doc="PaddleNLP PipelineParallel"),
}

__all__ = ["RUNTIMES", "RuntimeProfile", "default_runtime", "fold_per_action", "get_runtime", "lower"]
