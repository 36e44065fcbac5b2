"""VShape1F1B: 1F1B on the V placement, for runtimes that run each backward whole.

Two chunks per rank, placed as a V (rank r runs stages r and 2p-1-r, so a microbatch turns
around on the last rank without a hop). The order is ZB-V's (Qi et al. 2024 §6; PyTorch's
ScheduleZBVZeroBubble) with every backward fused: each input-grad pass I becomes the full
backward B at its place, and the weight-grad passes W go. Fusing moves no action across ranks,
so the order stays deadlock-free; what changes is memory and time:

* memory: a B frees the chunk's activations where ZB-V's I freed all but the weight-grad
  inputs, so the in-flight count is ZB-V's: rank r runs 2p-r-1 chunk-0 forwards and r+1
  chunk-1 forwards before its first backward, 2p chunk-microbatches = p microbatches (1F1B's
  first-rank peak, on every rank) once m >= 2p-1;
* time: with T_B = 2 T_F the W passes no longer fill the bubbles.

The whole schedule (generator and registration) is this file: an example of adding one.
"""

from __future__ import annotations

from .actions import Action, Schedule
from .generators import zb_v
from .spec import ScheduleSpec


def v_shape_1f1b(pp: int, m: int, vpp: int = 2, name: str = "VShape1F1B") -> Schedule:
    """ZB-V's per-rank order with each I fused into B and the W passes dropped."""
    split = zb_v(pp, m, vpp, name=name)  # checks --pp / --microbatches / --vpp 2
    ranks = [
        [Action("B", a[1], a[2]) if a[0] == "I" else a for a in acts if a[0] != "W"] for acts in split.ranks
    ]
    sched = Schedule(name, pp, 2, m, ranks, placement="v")
    sched.cache["split_backward"] = False
    return sched


SPECS = (
    ScheduleSpec(
        "VShape1F1B",
        v_shape_1f1b,
        placement="v",
        chunks="two",
        aliases=("v1f1b",),
        paper="1F1B on the V placement: ZB-V's order with whole backwards",
    ),
)
