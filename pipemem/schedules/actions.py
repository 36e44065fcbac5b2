"""Schedules as data: an `Action` is one compute job (F, B, I or W) of one virtual stage for one
microbatch; a `Schedule` is the ordered list of actions of every pipeline rank.

`Action` is a tuple (cheap to create and hash: a p=64, v=2, m=1024 schedule has 262,144 of
them). Its text form is `F3@s1` (kind, microbatch, @s stage); PyTorch's `1F3` form is handled
in csv_io.py.
"""

from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from typing import NamedTuple

from ..errors import UserError

KINDS = ("F", "B", "I", "W")
KIND_NAMES = {"F": "forward", "B": "full backward", "I": "input-grad backward", "W": "weight-grad backward"}
# Memory actions a runtime lowering (pipemem.runtime) adds to a schedule: kind -> (the stage
# boundary it moves, +1 allocate / -1 free). Bytes come from the stage (pipemem.jobs.StageJobs).
MEMORY_KINDS = {
    "RECV_F": ("input_bytes", 1),  # receive buffer of the stage input x
    "FREE_X": ("input_bytes", -1),
    "FREE_Y": ("output_bytes", -1),  # the stage output, made by F
    "RECV_B": ("output_grad_bytes", 1),  # receive buffer of the output grad dy
    "FREE_DY": ("output_grad_bytes", -1),
    "FREE_DX": ("input_grad_bytes", -1),  # the input grad, made by B or I
}
ALL_KINDS = KINDS + tuple(MEMORY_KINDS)
_ACTION_RE = re.compile(r"\s*([FBIW])(\d+)@s(\d+)\s*")


class Action(NamedTuple):
    kind: str  # 'F', 'B' (fused backward), 'I' (input grad), 'W' (weight grad)
    stage: int  # virtual stage index, 0 .. num_stages-1
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"

    @staticmethod
    def parse(text: str) -> "Action":
        """'F3@s1' -> Action('F', 1, 3)."""
        m = _ACTION_RE.fullmatch(text)
        if not m:
            raise UserError(
                f"cannot read action {text!r}: write KIND MICROBATCH @s STAGE, e.g. F3@s1 (kinds: F, B, I, W)"
            )
        return Action(m.group(1), int(m.group(3)), int(m.group(2)))


@contextmanager
def paused_gc():
    """Pause the cyclic garbage collector while building or walking 10^5-10^6 small tuples:
    they hold no cycles, and repeated full collections over them would dominate the run time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def loop_stage_map(pp: int, vpp: int) -> list[int]:
    """Stage -> rank for looped placement (Megatron/PyTorch interleaved): stage s on rank s % pp."""
    return [s % pp for s in range(pp * vpp)]


def v_stage_map(pp: int, vpp: int) -> list[int]:
    """Stage -> rank for V placement (ZB-V, DualPipeV): down the ranks, then back up, ..."""
    out = []
    for s in range(pp * vpp):
        chunk, pos = divmod(s, pp)
        out.append(pos if chunk % 2 == 0 else pp - 1 - pos)
    return out


def stage_rank_map(placement, pp: int, vpp: int) -> list[int]:
    """The one stage -> rank map: "loop", "v", or a function (pp, vpp) -> list (a schedule's
    own placement, `ScheduleSpec.placement`)."""
    if callable(placement):
        out = list(placement(pp, vpp))
        if len(out) != pp * vpp or sorted(out) != sorted(r for r in range(pp) for _ in range(vpp)):
            raise UserError(
                f"placement of {pp} ranks x {vpp} chunks: {out} does not give each rank {vpp} stages"
            )
        return out
    return v_stage_map(pp, vpp) if placement == "v" else loop_stage_map(pp, vpp)


class Schedule:
    """Per-rank ordered actions plus the stage placement they assume.

    `stage_rank[s]` is the rank that runs virtual stage `s`; chunk `c` of rank `r` is the c-th
    smallest stage index placed on `r` (so chunk 0 is where a microbatch first enters a rank).
    """

    __slots__ = (
        "name",
        "pp",
        "vpp",
        "microbatches",
        "ranks",
        "stage_rank",
        "placement",
        "notes",
        "_rank_stages",
        "cache",
    )

    def __init__(
        self,
        name: str,
        pp: int,
        vpp: int,
        microbatches: int,
        ranks: list[list[Action]],
        stage_rank: list[int] | None = None,
        placement: str = "loop",
        notes: str = "",
    ):
        self.name = name
        self.pp = pp
        self.vpp = vpp
        self.microbatches = microbatches
        self.ranks = ranks
        if stage_rank is None:
            stage_rank = stage_rank_map(placement, pp, vpp)
        self.stage_rank = list(stage_rank)
        self.placement = placement
        self.notes = notes
        stages: list[list[int]] = [[] for _ in range(pp)]
        for s, r in enumerate(self.stage_rank):
            stages[r].append(s)
        self._rank_stages = stages
        # what is derived from the (never mutated) action lists: replay's index arrays, the
        # runtime lowerings, in-flight counts (pipemem.replay, pipemem.runtime)
        self.cache: dict = {}

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def split_backward(self) -> bool:
        """True when any backward is split into I (input grad) and W (weight grad)."""
        hit = self.cache.get("split_backward")
        if hit is None:
            hit = self.cache["split_backward"] = any(
                a[0] == "I" or a[0] == "W" for acts in self.ranks for a in acts
            )
        return hit

    def first_grad_microbatches(self) -> dict[int, int]:
        """{stage: microbatch} of the action that makes the stage's parameter gradients first in
        the step: its first B, or its first W when the backward is split; never an I.

        This is PyTorch's pipelining runtime (torch 2.13, `PipelineStage`):
        `backward_one_chunk(full_backward=False)` (I) runs `stage_backward_input`, autograd over
        the inputs alone, which touches no `.grad` (on the first stage it runs nothing), and
        `backward_weight_one_chunk` (W) runs `stage_backward_weight`, which accumulates into
        `.grad`; a full B does both. So with gradients set to None the first B or W creates them
        and every later one accumulates. Most split schedules run I and W of a microbatch in the
        same order, where the two rules agree; Paddle's ZB-H1 order (rank r: I0 .. I(r-1), then
        fused B r, ..., the deferred W0 last) is where they differ: the fused B of microbatch r
        makes the gradients, not the early I0 nor W0 at the end. Templates and traced stage jobs
        both key their first-backward jobs here (`jobs.StagePlan.first_backward_overrides`), and
        so does the allocation stream that models reserved memory."""
        hit = self.cache.get("first_grad_microbatches")
        if hit is None:
            hit = {}
            for acts in self.ranks:
                for a in acts:
                    if (a[0] == "B" or a[0] == "W") and a[1] not in hit:
                        hit[a[1]] = a[2]
            self.cache["first_grad_microbatches"] = hit
        return hit

    def with_ranks(self, ranks: list[list[Action]]) -> "Schedule":
        """The same schedule (name, degrees, stage placement, notes) with other actions per rank:
        its compute actions alone, or lowered with a runtime's memory actions. The cache is not
        carried: it belongs to these actions."""
        return Schedule(
            self.name,
            self.pp,
            self.vpp,
            self.microbatches,
            ranks,
            stage_rank=self.stage_rank,
            placement=self.placement,
            notes=self.notes,
        )

    def rank_of_stage(self, stage: int) -> int:
        return self.stage_rank[stage]

    def stages_of_rank(self, rank: int) -> list[int]:
        return list(self._rank_stages[rank])

    def stage_of(self, rank: int, chunk: int) -> int:
        return self._rank_stages[rank][chunk]

    def chunk_of(self, stage: int) -> int:
        return self._rank_stages[self.stage_rank[stage]].index(stage)

    @property
    def num_actions(self) -> int:
        return sum(len(a) for a in self.ranks)

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Schedule)
            and self.pp == other.pp
            and self.vpp == other.vpp
            and self.microbatches == other.microbatches
            and self.stage_rank == other.stage_rank
            and self.ranks == other.ranks
        )

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, pp={self.pp}, vpp={self.vpp}, microbatches={self.microbatches}, "
            f"actions={self.num_actions})"
        )

    def to_dict(self) -> dict:
        return {
            **{k: getattr(self, k) for k in ("name", "pp", "vpp", "microbatches", "num_stages", "placement")},
            "stage_rank": list(self.stage_rank),
            "split_backward": self.split_backward,
            "ranks": [
                {"pp_rank": r, "stages": self.stages_of_rank(r), "actions": [str(a) for a in acts]}
                for r, acts in enumerate(self.ranks)
            ],
        }
