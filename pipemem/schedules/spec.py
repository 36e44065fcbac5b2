"""`ScheduleSpec`: everything pipemem knows about one named pipeline schedule, in one place.

A module that defines schedules lists them in a module-level `SPECS` tuple; `registry.py`
collects those tuples and answers every question about a name (generator, placement, chunks
per rank, searched or not, PyTorch / Paddle names, the help table). Nothing else keeps a list
of schedule names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# chunks (model chunks per pipeline rank) a schedule runs:
#   one      exactly one (--vpp 1)
#   several  two or more, looped placement (interleaved schedules)
#   two      exactly two (V-shaped schedules)
#   any      whatever --vpp says (the memory-limited scheduler)
CHUNKS = ("one", "several", "two", "any")
# which of PyTorch pipelining's runtimes executes the order (pipemem.runtime lowers each):
# ScheduleGPipe's loop, Schedule1F1B's loop, or the action-list runtime of the others
TORCH_RUNTIMES = ("gpipe", "1f1b", "actions")


def name_key(name: str) -> str:
    """Names compare case-insensitively and ignore '-' and '_'."""
    return name.strip().lower().replace("-", "").replace("_", "")


@dataclass(frozen=True)
class ScheduleSpec:
    """One named schedule.

    `build(pp, microbatches, vpp, name=...)` returns its `Schedule`; a searched schedule's
    build also takes `memory_limit`, `w_ratio`, `times` and `named` (the specs whose orders the
    search may return). `placement` says which rank runs each virtual stage: "loop" (stage s
    on rank s % pp), "v" (down the ranks, then back up), or a function (pp, vpp) -> stage_rank;
    `schedules.actions.stage_rank_map` turns it into the list.
    """

    name: str  # canonical name: the Schedule's name, the table's first
    build: Callable
    placement: str | Callable = "loop"
    chunks: str = "one"
    searched: bool = False  # searches for its order: a smaller size bound applies
    split_backward: bool = False  # its order uses split backwards (I and W)
    synonyms: tuple[str, ...] = ()  # other names, kept as written (Paddle's FThenB for GPipe)
    aliases: tuple[str, ...] = ()  # other spellings, resolved to `name`
    shown: str | None = None  # how the tables name it, when not by `name` (auto)
    torch: str = ""  # torch.distributed.pipelining class
    paddle: str = ""  # Paddle's name (PipelineParallel schedule mode)
    paper: str = ""  # the literature / Megatron, one line of help
    torch_runtime: str = "actions"  # TORCH_RUNTIMES
    runs_at_pp1: bool = False  # still means something with one pipeline stage (1F1B)
    candidate: int | None = None  # the memory-limited search tries it, in this order

    def __post_init__(self):
        if self.chunks not in CHUNKS or self.torch_runtime not in TORCH_RUNTIMES:
            raise ValueError(
                f"schedule spec {self.name}: chunks {self.chunks!r} / torch_runtime {self.torch_runtime!r}"
            )
        if not callable(self.placement) and self.placement not in ("loop", "v"):
            raise ValueError(f"schedule spec {self.name}: placement {self.placement!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a Schedule of this spec can carry."""
        return (self.name,) + self.synonyms

    @property
    def default_vpp(self) -> int:
        """Chunks per rank when the user gives none: two for V-shaped schedules, else one (a
        schedule of several looped chunks then asks for --vpp)."""
        return 2 if self.chunks == "two" else 1

    @property
    def multi_chunk(self) -> bool:
        return self.chunks != "one"

    def fits(self, vpp: int) -> bool:
        """Whether it runs `vpp` chunks per rank."""
        return {"one": vpp == 1, "several": vpp >= 2, "two": vpp == 2, "any": True}[self.chunks]

    @property
    def v_shaped(self) -> bool:
        return self.placement == "v"

    def table_names(self) -> list[str]:
        """The first column of the name tables."""
        return [self.shown] if self.shown else list(self.names)
