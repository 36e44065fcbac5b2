"""Replay of one rank of a torch.distributed.pipelining step (PyTorch 2.13), with what the
runtime itself keeps alive modelled explicitly.

Jobs ({net, peak} of F, B, I, W per stage, `pipeline_jobs`) are walked in the rank's real
action order: ``peak = max(peak, current + job.peak); current += job.net``. On top of the
jobs, the runtime holds tensors between actions, and those holds decide when the stage
output `y` and the input gradient `dx` of a microbatch are freed:

- receive buffers: at the first step, every non-first stage allocates one input buffer per
  microbatch and every non-last stage one output-gradient buffer per microbatch; they
  persist (`_RecvInfo.buffer`);
- `fwd_cache` holds `y` from F to its B (or I: then `backward_state` holds it to W; on the
  last stage `backward_state` holds the loss instead, so the logits go at I);
- `bwd_cache` holds `dx` from B/I until its send is built;
- sends: a P2POp and the gloo Work of an isend both reference the tensor. GPipe keeps every
  send until the step ends; 1F1B (Schedule1F1B._step_microbatches) drops them as its local
  variables are reassigned; the action-list runtime (_PipelineScheduleRuntime: Interleaved,
  ZB, DualPipeV...) keeps every send Work in `send_ops` until the step ends;
- V placement, two adjacent stages on one rank: `set_local_fwd_input` replaces the next
  stage's receive buffer by `y` (the buffer is freed, `y` stays referenced after the step),
  `set_local_bwd_input` does the same with `dx` and the previous stage's gradient buffer;
- per microbatch losses stay in `_internal_losses` (inside the last stage's F job).

After the schedule the rank runs `optimizer.step(); zero_grad(set_to_none=True)`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ...jobs import JobMemory
from .pipeline_jobs import TracedStageJobs

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


@dataclass
class RankMemory:
    rank: int
    static_bytes: int
    recv_buffer_bytes: int
    peak_bytes: int
    peak_at: str
    final_bytes: int
    timeline: list = field(default_factory=list, repr=False)   # (action, bytes during, bytes after)


class _Holds:
    """Bytes of runtime-held tensors, freed when their last holder lets go."""

    def __init__(self, sim: "_RankSim"):
        self.sim = sim
        self.holders: dict = defaultdict(set)
        self.size: dict = {}

    def made(self, key, nbytes: int, holder: str) -> None:
        """A tensor a job already counted (y, dx): start tracking who holds it."""
        self.size[key] = nbytes
        self.holders[key].add(holder)

    def alloc(self, key, nbytes: int, holder: str) -> None:
        self.sim.cur += nbytes
        self.sim.bump(f"alloc {key}")
        self.made(key, nbytes, holder)

    def hold(self, key, holder: str) -> None:
        if key in self.size:
            self.holders[key].add(holder)

    def release(self, key, holder: str) -> None:
        hs = self.holders.get(key)
        if hs is None or holder not in hs:
            return
        hs.discard(holder)
        if not hs:
            self.sim.cur -= self.size.pop(key)
            del self.holders[key]

    def release_all(self, holder: str) -> None:
        for key in [k for k, hs in self.holders.items() if holder in hs]:
            self.release(key, holder)

    def replace(self, holder: str, keys) -> None:
        """A variable reassigned: it now holds `keys` and drops what it held before."""
        old = [k for k, hs in self.holders.items() if holder in hs]
        for k in keys:
            self.hold(k, holder)
        for k in old:
            if k not in keys:
                self.release(k, holder)


class _RankSim:
    def __init__(self, static: int, jobs: dict[int, TracedStageJobs]):
        self.cur = static
        self.peak = static
        self.peak_at = "start"
        self.jobs = jobs
        self.holds = _Holds(self)
        self.grads_made: set[int] = set()
        self.timeline: list = []

    def bump(self, label: str) -> None:
        if self.cur > self.peak:
            self.peak, self.peak_at = self.cur, label

    def run(self, label: str, job: JobMemory) -> None:
        during = self.cur + job.peak_bytes
        if during > self.peak:
            self.peak, self.peak_at = during, label
        self.cur += job.net_bytes
        self.bump(label)
        self.timeline.append((label, during, self.cur))

    # compute actions ----------------------------------------------------------------------
    def forward(self, s: int, m: int) -> None:
        j = self.jobs[s]
        self.run(f"F{m}@s{s}", j.F)
        self.holds.made(("y", s, m), j.y_bytes, "fwd_cache")

    def _grad_job(self, s: int, kind: str) -> JobMemory:
        first = s not in self.grads_made
        self.grads_made.add(s)
        return self.jobs[s].job(kind, first)

    def backward(self, s: int, m: int) -> None:
        j = self.jobs[s]
        self.run(f"B{m}@s{s}", self._grad_job(s, "B"))
        self.holds.release(("y", s, m), "fwd_cache")
        if not j.first:
            self.holds.made(("dx", s, m), j.dx_bytes, "bwd_cache")

    def backward_input(self, s: int, m: int) -> None:
        j = self.jobs[s]
        self.run(f"I{m}@s{s}", j.I)
        if j.last:      # backward_state keeps the loss, not the logits
            self.holds.release(("y", s, m), "fwd_cache")
        else:
            self.holds.hold(("y", s, m), "backward_state")
            self.holds.release(("y", s, m), "fwd_cache")
        if not j.first:
            self.holds.made(("dx", s, m), j.dx_bytes, "bwd_cache")

    def backward_weight(self, s: int, m: int) -> None:
        self.run(f"W{m}@s{s}", self._grad_job(s, "W"))
        self.holds.release(("y", s, m), "backward_state")


def rank_static_bytes(jobs: dict[int, TracedStageJobs], stages, inputs_bytes: int, buffer_bytes: int) -> int:
    return sum(jobs[s].param_bytes for s in stages) + inputs_bytes + buffer_bytes


def _alloc_recv_buffers(sim: _RankSim, stages, microbatches: int) -> int:
    """First step: `_prepare_forward_infra` then `_prepare_backward_infra` of every stage."""
    total = 0
    for s in stages:
        j = sim.jobs[s]
        if not j.first:
            for m in range(microbatches):
                sim.holds.alloc(("in_buf", s, m), j.input_bytes, "recv_info")
                total += j.input_bytes
    for s in stages:
        j = sim.jobs[s]
        if not j.last:
            for m in range(microbatches):
                sim.holds.alloc(("grad_buf", s, m), j.output_grad_bytes, "grad_recv_info")
                total += j.output_grad_bytes
    return total


def replay_rank(schedule: str, pp: int, vpp: int, microbatches: int, rank: int, stages: list[int],
                jobs: dict[int, TracedStageJobs], static_bytes: int, optimizer: JobMemory | None) -> RankMemory:
    """Peak of one rank over the schedule's step plus the optimizer step (see module doc)."""
    sim = _RankSim(static_bytes, jobs)
    recv = _alloc_recv_buffers(sim, stages, microbatches)
    name = schedule.lower()
    if name == "gpipe":
        _gpipe(sim, stages[0], microbatches)
    elif name == "1f1b":
        _one_f_one_b(sim, stages[0], pp * vpp, microbatches)
    else:
        _action_runtime(sim, schedule, pp, vpp, microbatches, rank, set(stages))
    if optimizer is not None:
        sim.run("optimizer", optimizer)
    return RankMemory(rank, static_bytes, recv, sim.peak, sim.peak_at, sim.cur, sim.timeline)


def _sends(sim: _RankSim, s: int, m: int, kind: str) -> list:
    j = sim.jobs[s]
    if kind == "y":
        return [("y", s, m)] if not j.last else []
    return [("dx", s, m)] if not j.first else []


def _gpipe(sim: _RankSim, s: int, microbatches: int) -> None:
    """ScheduleGPipe._step_microbatches: every send kept in a local list to the end."""
    h = sim.holds
    for m in range(microbatches):
        sim.forward(s, m)
        for k in _sends(sim, s, m, "y"):
            h.hold(k, "fwd_sends_to_wait")
    for m in range(microbatches):
        sim.backward(s, m)
        for k in _sends(sim, s, m, "dx"):
            h.hold(k, "bwd_sends_to_wait")
            h.release(k, "bwd_cache")
    h.release_all("fwd_sends_to_wait")
    h.release_all("bwd_sends_to_wait")


def _one_f_one_b(sim: _RankSim, s: int, num_stages: int, microbatches: int) -> None:
    """Schedule1F1B._step_microbatches, its local variables (fwd_sends, bwd_sends, send_work)
    as holders that let go when reassigned."""
    h = sim.holds
    warmup = min(microbatches, num_stages - s)
    f = b = 0
    for _ in range(warmup):
        sim.forward(s, f)
        h.replace("fwd_sends", _sends(sim, s, f, "y"))
        if f != warmup - 1:
            h.replace("send_work", _sends(sim, s, f, "y"))
        f += 1
    bwd_sends: list = []
    while True:
        sim.backward(s, b)
        bwd_sends = _sends(sim, s, b, "dx")
        h.replace("bwd_sends", bwd_sends)
        for k in bwd_sends:
            h.release(k, "bwd_cache")
        b += 1
        if f == microbatches:
            break
        sim.forward(s, f)
        h.replace("fwd_sends", _sends(sim, s, f, "y"))
        f += 1
    h.replace("send_work", bwd_sends)
    while b < microbatches:
        sim.backward(s, b)
        bwd_sends = _sends(sim, s, b, "dx")
        h.replace("bwd_sends", bwd_sends)
        for k in bwd_sends:
            h.release(k, "bwd_cache")
        h.replace("send_work", bwd_sends)
        b += 1
    for holder in ("fwd_sends", "bwd_sends", "send_work"):
        h.release_all(holder)


def runtime_actions(schedule: str, pp: int, vpp: int, microbatches: int, rank: int) -> list:
    """The rank's lowered action list (compute + SEND/RECV) as _PipelineScheduleRuntime runs it,
    OVERLAP_F_B flattened into its sub-actions."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _ComputationType as CT
    ops = get_schedule_ops(schedule, pp, microbatches, num_stages_per_rank=vpp, with_comms=True)[rank]
    out = []
    for a in ops:
        if a is None:
            continue
        if a.computation_type == CT.OVERLAP_F_B:
            out.extend(a.sub_actions)
        else:
            out.append(a)
    return out


def _action_runtime(sim: _RankSim, schedule: str, pp: int, vpp: int, microbatches: int, rank: int,
                    local: set[int]) -> None:
    from torch.distributed.pipelining.schedules import _ComputationType as CT
    h = sim.holds
    for a in runtime_actions(schedule, pp, vpp, microbatches, rank):
        ct, s, m = a.computation_type, a.stage_index, a.microbatch_index
        if ct == CT.FORWARD:
            sim.forward(s, m)
            if s + 1 in local:     # set_local_fwd_input: y replaces the next stage's buffer
                h.release(("in_buf", s + 1, m), "recv_info")
                h.hold(("y", s, m), "local_recv_info")
        elif ct == CT.FULL_BACKWARD:
            sim.backward(s, m)
            _local_bwd(sim, s, m, local)
        elif ct == CT.BACKWARD_INPUT:
            sim.backward_input(s, m)
            _local_bwd(sim, s, m, local)
        elif ct == CT.BACKWARD_WEIGHT:
            sim.backward_weight(s, m)
        elif ct == CT.SEND_F:
            for k in _sends(sim, s, m, "y"):
                h.hold(k, "send_ops")
        elif ct == CT.SEND_B:
            for k in _sends(sim, s, m, "dx"):
                h.hold(k, "send_ops")
                h.release(k, "bwd_cache")
    h.release_all("send_ops")


def _local_bwd(sim: _RankSim, s: int, m: int, local: set[int]) -> None:
    """set_local_bwd_input(get_local_bwd_output(m)): dx replaces the previous stage's buffer."""
    if s - 1 in local and not sim.jobs[s].first:
        h = sim.holds
        h.hold(("dx", s, m), "local_grad_recv_info")
        h.release(("dx", s, m), "bwd_cache")
        h.release(("grad_buf", s - 1, m), "grad_recv_info")
