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
holder lets go (`_Holders`). One profile per runtime:

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

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from .errors import UserError
from .schedules.actions import Action, Schedule

RUNTIMES = ("torch", "megatron", "paddle")
_DEFAULT_FOR_CONVENTION = {"megatron": "megatron", "paddle": "paddle", "torchtitan": "torch", "hf": "torch"}


def default_runtime(convention: str) -> str:
    return _DEFAULT_FOR_CONVENTION.get(convention, "torch")


class _Holders:
    """References to tensors keyed (what, stage, microbatch); emits a FREE action into `out`
    when the last holder of a tensor lets go."""

    _FREE = {"x": "FREE_X", "y": "FREE_Y", "dx": "FREE_DX", "dy": "FREE_DY"}

    def __init__(self, out: list):
        self.out = out
        self.holders: dict = defaultdict(set)
        self.by_holder: dict = defaultdict(set)
        self.ties: dict = defaultdict(list)      # key -> [(other key, holder)] released when key is freed

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


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    lower_rank: Callable      # (schedule, rank) -> list[Action] with memory actions
    batch_on_every_rank: bool = False
    doc: str = ""


def lower(schedule: Schedule, runtime: str) -> Schedule:
    """The schedule with the runtime's memory actions added to every rank's list (cached on
    the schedule: lowering depends only on the actions and the placement)."""
    profile = get_runtime(runtime)
    cache = schedule.cache
    key = ("lowered", profile.name)
    if key not in cache:
        ranks = [profile.lower_rank(schedule, r) for r in range(schedule.pp)]
        cache[key] = Schedule(schedule.name, schedule.pp, schedule.vpp, schedule.microbatches, ranks,
                              stage_rank=schedule.stage_rank, placement=schedule.placement,
                              notes=schedule.notes)
    return cache[key]


def get_runtime(name: str) -> RuntimeProfile:
    p = PROFILES.get(str(name).lower())
    if p is None:
        raise UserError(f"--runtime {name!r}: use one of {', '.join(RUNTIMES)}")
    return p


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
            if s + 1 in local:            # set_local_fwd_input: y replaces the next stage's buffer
                h.release(("x", s + 1, m), "recv_info")
                h.hold(("y", s, m), "local_recv_info")
            elif s < S - 1:
                h.hold(("y", s, m), "send_ops")
        elif kind == "W":
            h.release(("y", s, m), "backward_state")
        else:
            if kind == "I" and s < S - 1:     # backward_state keeps y to W (the loss, on the last stage)
                h.hold(("y", s, m), "backward_state")
            h.release(("y", s, m), "fwd_cache")
            _made_by_backward(h, s, m)
            if s and s - 1 in local:       # set_local_bwd_input: dx replaces the previous stage's grad buffer
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
        if st == S - 1:                      # the last stage's output (the loss) is done with
            out.append(Action("FREE_Y", st, m))
        h.release(("x", st, m), "input_tensors")          # backward_step_helper's locals go
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
        if i == w - 1 and w < T:             # send_forward_backward_recv_forward_backward
            recv_dy(0)
        free_y(i)
    for k in range(T - w):
        out.append(fwd[w + k])
        backward(k)
        recv_x(w + k + 1)
        recv_dy(k + 1)
        free_y(w + k)
    if w == T:                               # every microbatch in warm-up: recv_backward first
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
    queue: list[int] = []                    # input_tensors (and output_tensors), in order

    def x(i):
        return [] if first else [("x", s, i)]

    def recv_forward(i):                     # input_tensor = recv_forward(...)
        if not first:
            out.append(Action("RECV_F", s, i))
        h.replace("input_tensor", x(i))

    def forward(i):
        out.append(fwd[i])
        if not last:                         # send_forward, then deallocate_output_tensor
            out.append(Action("FREE_Y", s, i))

    def recv_backward(j):                    # output_tensor_grad = [send_forward_]recv_backward(...)
        if not last:
            out.append(Action("RECV_B", s, j))
            h.replace("output_tensor_grad", [("dy", s, j)])

    def pop():                               # input_tensor = input_tensors.pop(0)
        i = queue.pop(0)
        h.replace("input_tensor", x(i))
        for k in x(i):
            h.release(k, "input_tensors")

    def backward(j):                         # input_tensor_grad = backward_step(...)
        out.append(bwd[j])
        if last:                             # the last stage's output (the loss) is done with
            out.append(Action("FREE_Y", s, j))
        if not first:                        # x.retain_grad(): x.grad references dx until x goes
            h.hold(("dx", s, j), "x.grad")
            h.tie(("dx", s, j), "x.grad", ("x", s, j))
        h.replace("input_tensor_grad", [("dx", s, j)] if not first else [])

    def keep(i):                             # input_tensors.append(input_tensor)
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
            h.replace("input_tensor", [])    # input_tensor = None; send_backward(...)
        else:
            recv_forward(k + 1)              # input_tensor = send_backward_recv_forward(...)
    for j in range(rest, M):
        pop()
        recv_backward(j)
        backward(j)
    for holder in ("input_tensor", "output_tensor_grad", "input_tensor_grad"):
        h.release_all(holder)                # the function returns
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
        if kind in ("B", "I") and s == S - 1:     # the last stage's output (loss) goes with its backward
            out.append(Action("FREE_Y", s, m))
        if kind == "W" or (kind == "B") or (kind == "I" and (s, m) not in split):
            if s:
                out.append(Action("FREE_X", s, m))
            if s < S - 1:
                out.append(Action("FREE_DY", s, m))
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
        out[s] = replace(j, F=f, B=b, I=i, W=w, input_bytes=0, output_bytes=0, input_grad_bytes=0,
                         output_grad_bytes=0)
    return out


PROFILES = {
    "torch": RuntimeProfile("torch", _torch_rank, batch_on_every_rank=True,
                            doc="torch.distributed.pipelining 2.13 (torchtitan)"),
    "megatron": RuntimeProfile("megatron", _megatron_rank, doc="megatron-core 0.16.1 p2p schedules"),
    "paddle": RuntimeProfile("paddle", _per_action_rank, doc="PaddleNLP PipelineParallel"),
}

__all__ = ["RUNTIMES", "RuntimeProfile", "default_runtime", "fold_per_action", "get_runtime", "lower"]
