"""Schedules to and from CSV in the format PyTorch pipelining loads.

PyTorch (`PipelineScheduleMulti._load_csv`, `_PipelineScheduleRuntime._load_csv`, format
"compute_only") reads one row per rank, one action per cell, each cell `_Action.from_str`:
STAGE KIND [MICROBATCH], e.g. `2F0`, `5I3`, `1W7`; an empty cell is a bubble. We write that
format (no bubbles: the runtime adds communication and waits itself) and read it back, plus cells
in our own `F3@s1` form; communication cells (SEND_F, RECV_B, UNSHARD, ...) are skipped and an
overlapped `(1F2;6B0)OVERLAP_F_B` becomes its forward then its backward.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from ..errors import UserError
from .actions import Action, Schedule, loop_stage_map, v_stage_map

_TORCH_CELL = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OUR_CELL = re.compile(r"([FBIW])(\d+)@s(\d+)")


def torch_cell(a: Action) -> str:
    return f"{a.stage}{a.kind}{a.microbatch}"


def to_csv_text(schedule: Schedule) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for acts in schedule.ranks:
        writer.writerow([torch_cell(a) for a in acts])
    return buf.getvalue()


def write_csv(schedule: Schedule, path: str | Path) -> None:
    """One row per rank, cells like `2F0`: loadable by PyTorch's `_load_csv(path)`."""
    try:
        Path(path).write_text(to_csv_text(schedule))
    except OSError as e:
        raise UserError(f"--csv-out {path}: cannot write ({e.strerror})") from None


def _parse_cell(cell: str, where: str) -> list[Action]:
    cell = cell.strip()
    if not cell:
        return []
    if cell.startswith("("):
        close = cell.find(")")
        if close < 0:
            raise UserError(f"{where}: cannot read {cell!r} (unclosed overlap group)")
        out = []
        for part in cell[1:close].split(";"):
            out += _parse_cell(part, where)
        return out
    m = _OUR_CELL.fullmatch(cell)
    if m:
        return [Action(m.group(1), int(m.group(3)), int(m.group(2)))]
    m = _TORCH_CELL.fullmatch(cell)
    if not m:
        raise UserError(
            f"{where}: cannot read {cell!r}; write STAGE KIND MICROBATCH like 2F0 (PyTorch) or F0@s2"
        )
    stage, kind, mb = m.groups()
    if kind not in "FBIW" or len(kind) != 1:
        return []  # communication / sharding action: not a compute job
    if not mb:
        raise UserError(f"{where}: {cell!r} has no microbatch index")
    return [Action(kind, int(stage), int(mb))]


def from_csv_text(text: str, name: str = "csv", source: str = "CSV") -> Schedule:
    """Read per-rank rows; infer pp (rows), stages and placement (which row runs each stage),
    and microbatches; then check the schedule (UserError naming the first violation)."""
    from .check import check_schedule

    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    if not rows:
        raise UserError(f"{source}: no rows (expected one row of actions per pipeline rank)")
    ranks = []
    stage_rank: dict[int, int] = {}
    for r, row in enumerate(rows):
        acts = []
        for c, cell in enumerate(row):
            for a in _parse_cell(cell, f"{source} row {r + 1} column {c + 1}"):
                prev = stage_rank.setdefault(a.stage, r)
                if prev != r:
                    raise UserError(
                        f"{source} row {r + 1} column {c + 1}: {cell.strip()!r} runs stage {a.stage}, "
                        f"which row {prev + 1} also runs (a stage lives on one rank)"
                    )
                acts.append(a)
        ranks.append(acts)
    pp = len(ranks)
    if not stage_rank:
        raise UserError(f"{source}: no compute actions (F, B, I, W) found")
    num_stages = max(stage_rank) + 1
    missing = [s for s in range(num_stages) if s not in stage_rank]
    if missing:
        raise UserError(f"{source}: stage {missing[0]} never runs (stages 0..{num_stages - 1} expected)")
    if num_stages % pp:
        raise UserError(
            f"{source}: {num_stages} stages over {pp} ranks: every rank needs the same number of stages"
        )
    vpp = num_stages // pp
    smap = [stage_rank[s] for s in range(num_stages)]
    placement = (
        "loop" if smap == loop_stage_map(pp, vpp) else "v" if smap == v_stage_map(pp, vpp) else "custom"
    )
    m = 1 + max(a.microbatch for acts in ranks for a in acts)
    sched = Schedule(name, pp, vpp, m, ranks, stage_rank=smap, placement=placement)
    check_schedule(sched)
    return sched


def read_csv(path: str | Path, name: str | None = None) -> Schedule:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(
            f"csv:{path}: cannot read ({e.strerror}); give a CSV with one row of actions per rank"
        ) from None
    return from_csv_text(text, name or f"csv:{path}", f"csv:{path}")
