"""Pipeline schedules as data (layer 5 of DESIGN.md's flow): named generators, PyTorch and CSV
import/export, validity check and time model, and a memory-limited zero-bubble scheduler.

    get_schedule("ZBVZeroBubble", pp=4, microbatches=8, vpp=2) -> Schedule

Names are case-insensitive and ignore '-' and '_': PyTorch's (GPipe, 1F1B, Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), Paddle's (FThenB, Eager1F1B, VPP,
ZBH1, ZBVPP), ZB1P (the paper's ZB-H1, all backwards split), ZBH2, ZBV, VHalf, VMin, ZBAuto (alias auto: the memory-limited scheduler),
`csv:FILE` and `torch:NAME` (PyTorch's own order, needs torch).
"""

from __future__ import annotations

from ..errors import UserError
from . import generators as _g
from .actions import Action, Schedule, paused_gc

# canonical name -> generator(pp, m, vpp, name=...)
_GENERATORS = {
    "GPipe": _g.gpipe,
    "FThenB": _g.gpipe,
    "1F1B": _g.one_f_one_b,
    "Eager1F1B": _g.eager_1f1b,
    "Interleaved1F1B": _g.interleaved_1f1b,
    "VPP": _g.megatron_vpp,
    "LoopedBFS": _g.looped_bfs,
    "InterleavedZeroBubble": _g.interleaved_zero_bubble,
    "ZBH1": _g.zb_h1,
    "ZB1P": _g.zb_1p,
    "ZBH2": _g.zb_h2,
    "ZBVZeroBubble": _g.zb_v,
    "ZBV": _g.zb_v,
    "DualPipeV": _g.dualpipe_v,
    "VHalf": _g.v_half,
    "VMin": _g.v_min,
}
_SCHEDULERS = ("ZBVPP", "ZBAuto")
_ALIASES = {"auto": "ZBAuto", "memorylimited": "ZBAuto", "zb2p": "ZBH2",
            "pipedreamflush": "1F1B", "interleaved": "Interleaved1F1B"}
SCHEDULE_NAMES = tuple(_GENERATORS) + _SCHEDULERS


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


_LOOKUP = {_key(n): n for n in SCHEDULE_NAMES}
_LOOKUP.update({_key(k): v for k, v in _ALIASES.items()})


def canonical_name(name: str) -> str:
    n = _LOOKUP.get(_key(name))
    if n is None:
        raise UserError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}, "
                        f"csv:FILE or torch:NAME")
    return n


def default_vpp(name: str) -> int:
    """Chunks per rank a schedule needs when the user gave none (V schedules: 2)."""
    if name.lower().startswith(("csv:", "torch:")):
        return 1
    n = canonical_name(name)
    return 2 if n in ("ZBVZeroBubble", "ZBV", "DualPipeV", "VHalf", "VMin", "ZBVPP") else 1


def get_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, memory_limit=None,
                 w_ratio=None) -> Schedule:
    """The named schedule's per-rank action lists. `memory_limit` (microbatch units, per rank)
    applies to ZBAuto/ZBVPP; `w_ratio` = M_W/M_B for their unit jobs."""
    if name.lower().startswith("csv:"):
        from .csv_io import read_csv
        sched = read_csv(name[4:])
        if (pp and pp != sched.pp) or (microbatches and microbatches != sched.microbatches):
            raise UserError(f"{name}: the file has {sched.pp} ranks and {sched.microbatches} microbatches, "
                            f"but --pp {pp} --microbatches {microbatches} were given; make them agree")
        return sched
    if name.lower().startswith("torch:"):
        from .torch_import import torch_schedule
        return torch_schedule(name[6:], pp, microbatches, vpp if vpp != 1 else None)
    canon = canonical_name(name)
    if canon in _SCHEDULERS:
        from .unit_jobs import DEFAULT_W_RATIO
        from .zb_scheduler import memory_limited_schedule
        w = DEFAULT_W_RATIO if w_ratio is None else w_ratio
        if canon == "ZBVPP":
            if vpp != 2:
                raise UserError(f"ZBVPP (Paddle's zero-bubble V schedule) runs 2 chunks per rank: pass --vpp 2 "
                                f"(got {vpp})")
            limit = pp if memory_limit is None else memory_limit   # ZB-V's memory, p microbatches
            return memory_limited_schedule(pp, microbatches, memory_limit=limit, vpp=2, placement="v",
                                           w_ratio=w, name="ZBVPP")
        return memory_limited_schedule(pp, microbatches, memory_limit=memory_limit, vpp=vpp, w_ratio=w,
                                       name="ZBAuto")
    if memory_limit is not None:
        raise UserError(f"--memory-limit applies to the memory-limited scheduler: use schedule 'auto' "
                        f"(or ZBVPP) instead of {canon}")
    with paused_gc():
        return _GENERATORS[canon](pp, microbatches, vpp, name=canon)


__all__ = ["Action", "Schedule", "get_schedule", "canonical_name", "default_vpp", "SCHEDULE_NAMES"]
