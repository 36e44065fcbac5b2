"""Pipeline schedules as data (DESIGN.md's flow, "Schedules are data"): named generators, PyTorch
and CSV import/export, validity check and time model, and a memory-limited zero-bubble scheduler.

    get_schedule("ZBVZeroBubble", pp=4, microbatches=8, vpp=2) -> Schedule

Names are case-insensitive and ignore '-' and '_'; every named schedule is a `ScheduleSpec` in
the registry (registry.py; `pipemem schedule --help` prints the table). `csv:FILE` and
`torch:NAME` (PyTorch's own order, needs torch) import an order.
"""

from __future__ import annotations

from ..errors import UserError
from .actions import Action, Schedule, paused_gc
from .registry import SCHEDULE_NAMES, SPECS, canonical_name, default_vpp, spec_of


def get_schedule(
    name: str, pp: int, microbatches: int, vpp: int = 1, memory_limit=None, w_ratio=None, times=None
) -> Schedule:
    """The named schedule's per-rank action lists. `memory_limit` (microbatch units, per rank)
    applies to the searched schedules (ZBAuto/ZBVPP); `w_ratio` = M_W/M_B and `times` (a
    check.TimeModel) time their unit jobs."""
    if name.lower().startswith("csv:"):
        from .csv_io import read_csv

        sched = read_csv(name[4:])
        if (pp and pp != sched.pp) or (microbatches and microbatches != sched.microbatches):
            raise UserError(
                f"{name}: the file has {sched.pp} ranks and {sched.microbatches} microbatches, "
                f"but --pp {pp} --microbatches {microbatches} were given; make them agree"
            )
        return sched
    if name.lower().startswith("torch:"):
        from .torch_import import torch_schedule

        return torch_schedule(name[6:], pp, microbatches, vpp if vpp != 1 else None)
    spec = spec_of(name)
    canon = canonical_name(name)
    if spec.searched:
        return spec.build(
            pp,
            microbatches,
            vpp,
            name=canon,
            memory_limit=memory_limit,
            w_ratio=w_ratio,
            times=times,
            named=SPECS,
        )
    if memory_limit is not None:
        raise UserError(
            f"--memory-limit applies to the memory-limited scheduler: use schedule 'auto' "
            f"(or ZBVPP) instead of {canon}"
        )
    with paused_gc():
        return spec.build(pp, microbatches, vpp, name=canon)


__all__ = [
    "Action",
    "Schedule",
    "get_schedule",
    "canonical_name",
    "default_vpp",
    "spec_of",
    "SCHEDULE_NAMES",
    "SPECS",
]
