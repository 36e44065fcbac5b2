"""PyTorch pipelining's own orders, without a process group (imports torch; only used on demand).

`torch.distributed.pipelining._schedule_visualizer.get_schedule_ops` builds each schedule class
on mock stages and returns `pipeline_order`. We keep the compute actions (F, B, I, W; an
OVERLAP_F_B becomes its forward then its backward) and drop bubbles and communication.
`Schedule1F1B.pipeline_order` is off by one on the last rank in torch 2.13 (forward indices
1..m instead of 0..m-1, FINDINGS.md §4); we rebuild that rank as the runtime executes it.
"""

from __future__ import annotations

from ..errors import UserError
from .actions import Action, Schedule
from .registry import SPECS

# PyTorch's schedules by the name its get_schedule_class takes (the class name without
# "Schedule"), with the registered spec that generates the same order
_TORCH = {spec.torch.removeprefix("Schedule"): spec for spec in SPECS if spec.torch}
TORCH_NAMES = tuple(_TORCH)


def torch_actions(acts) -> list[Action]:
    """PyTorch `_Action`s (or None) -> our compute actions, overlapped pairs flattened."""
    out = []
    for a in acts:
        if a is None:
            continue
        kind = a.computation_type.value
        if kind == "OVERLAP_F_B":
            out += torch_actions(a.sub_actions or ())
        elif kind in ("F", "B", "I", "W"):
            out.append(Action(kind, a.stage_index, a.microbatch_index))
    return out


def torch_schedule(
    name: str, pp: int, microbatches: int, vpp: int | None = None, fix_1f1b: bool = True
) -> Schedule:
    """PyTorch's order for one of TORCH_NAMES as a Schedule; `fix_1f1b=False` keeps 1F1B's
    pipeline_order as PyTorch reports it (which then fails the validity check)."""
    # the name first: a typo is answered without the seconds importing torch takes
    canon = {n.lower(): n for n in TORCH_NAMES}.get(name.lower())
    if canon is None:
        raise UserError(f"torch:{name}: unknown PyTorch schedule; choose one of {', '.join(TORCH_NAMES)}")
    spec = _TORCH[canon]
    single = spec.chunks == "one"
    if single and vpp not in (None, 1):
        raise UserError(f"torch:{canon} runs one chunk per rank: drop --vpp (got {vpp})")
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError as e:  # pragma: no cover - torch missing
        raise UserError(f"torch:{name} needs PyTorch with torch.distributed.pipelining ({e})") from None
    per_rank = 1 if single else (vpp or 2)
    try:
        ops = get_schedule_ops(canon, pp, microbatches, num_stages_per_rank=None if single else per_rank)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise UserError(
            f"torch:{canon} with --pp {pp} --microbatches {microbatches} --vpp {per_rank}: "
            f"PyTorch refuses: {e}"
        ) from None
    ranks = [torch_actions(acts) for acts in ops]
    if (
        canon == "1F1B"
        and fix_1f1b
        and any(a.kind == "F" and a.microbatch == microbatches for a in ranks[-1])
    ):
        # the last rank's forwards are numbered 1..m in pipeline_order; the runtime runs 0..m-1
        ranks[-1] = [Action("F", a.stage, a.microbatch - 1) if a.kind == "F" else a for a in ranks[-1]]
    placement = "v" if spec.v_shaped else "loop"
    return Schedule(f"torch:{canon}", pp, per_rank, microbatches, ranks, placement=placement)
