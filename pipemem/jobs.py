"""What the stage-job layer hands to schedules and replay (layer 4 of DESIGN.md's flow).

A *job* is one action of one pipeline stage for one microbatch (F, B, I, W) or the optimizer
step; its memory is `{net, peak}` from liveness, relative to the bytes in use when it starts.
Templates, traced programs and Paddle programs all produce these, so replay never needs to
know where the numbers came from.

`compose(parts)` is the one walk that turns a sequence of `{net, peak}` into one: every
module that strings programs, parts or phases together calls it (the replay of a schedule
is the same walk, vectorised over every action of every rank: pipemem.replay).

Stage boundaries (what a pipeline runtime hands between stages) are bytes on the stage:
`input_bytes` (the received activation x), `output_bytes` (the output y the stage sends),
`input_grad_bytes` (dx, sent back) and `output_grad_bytes` (dy, received). A stage job owns
what it makes (F leaves y allocated, B and I leave dx allocated) and never frees what the
runtime handed it (x, dy): the runtime profile's lowering (pipemem.runtime) says when each of
the four is allocated and freed.

`StagePlan` is what every program source (pipemem.sources: templates, traced, Paddle) hands
the estimate: the stage jobs, the first-backward jobs keyed by the one first-backward rule
(`Schedule.first_grad_microbatches`), and each rank's static bytes and optimizer job.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

JOB_KINDS = ("F", "B", "I", "W", "optimizer")


@dataclass(frozen=True, slots=True)
class JobMemory:
    net_bytes: int
    peak_bytes: int
    seconds: float = 0.0  # modelled duration, for the schedule time model (0 = unknown)

    def to_dict(self) -> dict:
        return {"net_bytes": self.net_bytes, "peak_bytes": self.peak_bytes}

    def repeated(self, n: int) -> "JobMemory":
        """The job run `n` times in a row, in closed form (what `compose([self] * n)` gives,
        at O(1) cost: the peak is on the first copy when the job frees memory, else the last)."""
        if n <= 0:
            return JobMemory(0, 0)
        net, pk = self.net_bytes, self.peak_bytes
        return JobMemory(n * net, max(0, pk + (n - 1) * max(net, 0)), n * self.seconds)


ZERO = JobMemory(0, 0)


def compose(parts: Iterable, start: int = 0) -> JobMemory:
    """Walk parts in order from `start` bytes (above the job's start):
    ``peak = max(peak, current + part.peak); current += part.net``.
    A part is a JobMemory, an object with `net_bytes`/`peak_bytes`, or a `(net, peak)` pair.
    The result is relative to the job's start, so `start` bytes allocated first (a receive)
    count in both; the peak is never below 0 (or below `start`)."""
    return compose_at(parts, start)[0]


def compose_at(parts: Iterable, start: int = 0) -> tuple[JobMemory, int]:
    """`compose`, and the index of the part at the peak (-1 when no part rises above the start)."""
    cur = start
    peak = max(0, start)
    at = -1
    secs = 0.0
    for i, p in enumerate(parts):
        if isinstance(p, tuple):
            net, pk = p
        else:
            net, pk = p.net_bytes, p.peak_bytes
            secs += getattr(p, "seconds", 0.0)
        if cur + pk > peak:
            peak = cur + pk
            at = i
        cur += net
    return JobMemory(cur, peak, secs), at


@dataclass(frozen=True, slots=True)
class StaticBytes:
    """Bytes a rank holds when the reported step starts, before any microbatch (`total`), and
    what the step itself creates and frees again (not in `total`):

    grads_in_step: gradients set to None by the previous step's zero_grad, created by the
        first backward of this step and freed after its optimizer step (--grads set-to-none,
        ddp-bucket);
    optimizer_in_step: optimizer states the first step creates in its optimizer step
        (--step first)."""

    params: int = 0
    grads: int = 0  # resident gradient storage: fp32 main-grad buffers, DDP buckets
    optimizer: int = 0  # optimizer states incl. fp32 master weights
    other: int = 0  # buffers, CUDA context, comm buffers that persist...
    grads_in_step: int = 0
    optimizer_in_step: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.other

    # the `static_bytes` object of --json, in this order
    JSON_FIELDS = ("params", "grads", "optimizer", "other", "total", "grads_in_step", "optimizer_in_step")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.JSON_FIELDS}

    def plus(self, other: int = 0) -> "StaticBytes":
        """The same state with `other` more bytes held for the whole step."""
        return replace(self, other=self.other + other)


@dataclass(slots=True)
class StageJobs:
    """The jobs of one (virtual) pipeline stage. `I`/`W` are the split backward (input grad,
    weight grad); `B` is the fused backward (= I then W). `layers` is the range of decoder
    layer indices on the stage (a `range`, so a stage of 10^8 identical layers costs nothing).
    The boundary bytes are explained in the module docstring."""

    stage: int
    F: JobMemory
    B: JobMemory
    I: JobMemory | None = None
    W: JobMemory | None = None
    layers: range | tuple = ()
    notes: dict = field(default_factory=dict)
    input_bytes: int = 0  # x, received from the previous stage (0 on the first)
    output_bytes: int = 0  # y, sent to the next stage (on the last: what the runtime keeps)
    input_grad_bytes: int = 0  # dx, sent back (0 on the first)
    output_grad_bytes: int = 0  # dy, received from the next stage (0 on the last)

    def job(self, kind: str) -> JobMemory:
        j = getattr(self, kind, None)
        if j is None:
            raise KeyError(f"stage {self.stage} has no {kind} job (split backward not built)")
        return j

    def fused_backward(self) -> JobMemory | None:
        """B, or I then W when only the split backward was built."""
        if self.B is not None:
            return self.B
        if self.I is not None and self.W is not None:
            return compose((self.I, self.W))
        return None


class StreamNotModelled(Exception):
    """A plan's allocation stream (pipemem.alloc_stream) cannot be built: the message says what.
    Reserved memory is then reported as not modelled, never guessed."""


@dataclass(frozen=True, slots=True)
class StageAllocs:
    """One virtual stage's jobs as the allocations and frees behind their {net, peak}, for a
    source that records them (traced programs; templates' are rebuilt from their programs by
    pipemem.alloc_stream). Per job kind, rows `(sign, bytes, handle)` in execution order (+1
    an allocation of the bytes a kernel asked for, -1 its free). Handles are local to one
    (stage, microbatch): 0-3 are the boundary the runtime owns (x, y, dy, dx: F allocates y,
    a backward dx; no job allocates or frees x or dy), the others the jobs' own; `width` is
    the number of handles one microbatch uses. An allocation on another allocator stream than
    the compute stream (0) has the stream fourth: `(sign, bytes, handle, stream)` (1 FSDP's
    all-gather stream, 2 its reduce-scatter stream: pipemem.alloc_stream's numbers)."""

    F: tuple
    B: tuple | None = None
    I: tuple | None = None
    W: tuple | None = None
    width: int = 4


class StagePlan:
    """What every program source hands the estimate (templates: `stages.StagePlan`; traced:
    `traced.parallel.TracedStagePlan` and the one-rank plans of `traced`; Paddle's programs:
    `paddle.paddlenlp_programs.PaddleStages`): the jobs of each virtual stage, the jobs of a
    stage's first gradient-making backward, and each rank's static bytes and optimizer job.
    `pipemem.estimate` builds the per-rank inputs of the replay from it, the same way for all.

    A subclass provides `stages` ({virtual stage: StageJobs}), `first_backward` ({virtual
    stage: StageJobs}, empty when no backward differs: gradients resident across steps), and
    either `rank_static` / `rank_optimizer` (by the stages a rank holds) or `static_per_rank` /
    `optimizer_per_rank` (by rank). The class attributes below say how the plan is replayed;
    a source sets those that differ."""

    # the source's own schedule (Paddle's job lists) when not the plan's (None)
    schedule = None
    # False: the programs hold the pipeline's transfers themselves, no runtime profile adds them
    lowered = True
    # Estimate.schedule when not the schedule's name (e.g. "one step (pp 1)")
    label = None
    # what the source models less surely for this plan, said beside the numbers
    warnings: tuple | list = ()
    # how pipemem.alloc_stream gets each rank's allocation stream (reserved memory): "templates"
    # (rebuilt from the template programs), "recorded" (the source's own rows: `stage_allocs`,
    # `rank_static_allocs`, `rank_optimizer_allocs`) or None (not modelled)
    allocs: str | None = None

    def stage_allocs(self, stage: int) -> tuple[StageAllocs, StageAllocs | None]:
        """("recorded") The stage's jobs as allocations: (every microbatch's, the step's first
        gradient-making backward's or None when no backward differs); its F is the same in both.
        Raises StreamNotModelled where the source cannot say."""
        raise StreamNotModelled("the program source records no allocations")

    def rank_static_allocs(self, rank: int, stage_ids) -> list[int]:
        """("recorded") The bytes of each tensor of the rank's static state, in allocation order
        (summing to its StaticBytes.total)."""
        raise StreamNotModelled("the program source records no allocations")

    def rank_optimizer_allocs(self, rank: int, stage_ids) -> tuple:
        """("recorded") The optimizer step as rows `(sign, bytes, ref)`: `ref` an int is a handle
        of the step's own; `(stage, handle)` is a handle of that stage's microbatch whose
        backward made the gradients (the gradients and anything else the step frees)."""
        raise StreamNotModelled("the program source records no allocations")

    def rank_static(self, stage_ids) -> StaticBytes:
        raise NotImplementedError

    def rank_optimizer(self, stage_ids) -> JobMemory | None:
        raise NotImplementedError

    def static_per_rank(self, schedule) -> list[StaticBytes]:
        return [self.rank_static(schedule.stages_of_rank(r)) for r in range(schedule.pp)]

    def optimizer_per_rank(self, schedule) -> list[JobMemory | None]:
        """Per rank its optimizer-step job; None for a source whose step has none to replay."""
        return [self.rank_optimizer(schedule.stages_of_rank(r)) for r in range(schedule.pp)]

    def first_backward_overrides(self, schedule=None) -> dict:
        """{(stage, microbatch): first-backward jobs}, keyed as `replay` takes them: the
        microbatch whose B or W makes the stage's gradients first (`Schedule.first_grad_microbatches`,
        the one rule; microbatch 0 without a schedule)."""
        if not self.first_backward:
            return {}
        first = schedule.first_grad_microbatches() if schedule is not None else {}
        return {(s, first.get(s, 0)): j for s, j in self.first_backward.items()}

    def replay_jobs(self, schedule=None) -> dict:
        """`stages`, with the per-microbatch jobs `replay` takes keyed (stage, microbatch)."""
        jobs: dict = dict(self.stages)
        jobs.update(self.first_backward_overrides(schedule))
        return jobs

    def grads_made(self, stage_ids) -> dict[int, int] | None:
        """{stage: gradient bytes its first backward creates} for these stages (the first B
        over a later one); None when no backward creates them."""
        if not self.first_backward:
            return None
        fb = self.first_backward
        return {s: int(fb[s].B.net_bytes - self.stages[s].B.net_bytes) if s in fb else 0 for s in stage_ids}

    def peak_name(self, peak_at: str, peak_bytes: int) -> str | None:
        """The rank's peak named down to the op, where the source knows it (traced programs)."""
        return None


@dataclass
class RankPlan(StagePlan):
    """A stage plan whose static bytes and optimizer job are known per rank rather than per set
    of stages: one traced rank's step (its whole model as stage 0, under a schedule of its own)."""

    stages: dict
    statics: list  # per rank StaticBytes
    optimizers: list  # per rank JobMemory, or None where the step has no optimizer job to replay
    schedule: object = None
    label: str | None = None
    warnings: list = field(default_factory=list)
    first_backward: dict = field(default_factory=dict)
    # (peak_at, peak_bytes) -> the peak named down to the op, or None
    namer: object = field(default=None, repr=False)
    # the one rank's recorded allocations, (stage 0's StageAllocs, optimizer rows, static tensor
    # sizes), or why there are none (a str), or a function giving either when first needed
    # (reserved is computed only when read); None: the source records none
    recorded: object = field(default=None, repr=False)

    @property
    def allocs(self) -> str | None:
        return "recorded" if self.recorded is not None else None

    def _recorded(self) -> tuple:
        if callable(self.recorded):
            self.recorded = self.recorded()
        if isinstance(self.recorded, str):
            raise StreamNotModelled(self.recorded)
        return self.recorded

    def stage_allocs(self, stage: int) -> tuple[StageAllocs, StageAllocs | None]:
        return self._recorded()[0], None

    def rank_static_allocs(self, rank: int, stage_ids) -> list[int]:
        return list(self._recorded()[2])

    def rank_optimizer_allocs(self, rank: int, stage_ids) -> tuple:
        return self._recorded()[1]

    def static_per_rank(self, schedule) -> list[StaticBytes]:
        return list(self.statics)

    def optimizer_per_rank(self, schedule) -> list[JobMemory | None]:
        return list(self.optimizers)

    def peak_name(self, peak_at: str, peak_bytes: int) -> str | None:
        return self.namer(peak_at, peak_bytes) if self.namer is not None else None
