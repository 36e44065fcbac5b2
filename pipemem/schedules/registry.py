"""The schedule registry: every named schedule's `ScheduleSpec`, and the questions asked of a name.

Each module in SCHEDULE_MODULES lists its schedules in `SPECS`; adding a schedule is one module
(generator + spec) and its name in SCHEDULE_MODULES, or one spec in an existing module.
Everything that needs to know about schedules asks this module: `get_schedule` (the generator),
the plan's validation (searched or not, meaningful at pp 1), the estimate (default chunks per
rank), the runtime lowering (which PyTorch runtime runs it), the planner (which fit a vpp, their
placement), `pipemem schedule --help` and the README's table (`notation_rows`, `markdown_rows`).
"""

from __future__ import annotations

import textwrap

from ..errors import UserError
from . import generators, v_shape_1f1b, zb_scheduler
from .spec import ScheduleSpec, name_key

# the modules that register schedules, in the order of the tables (the searches last)
SCHEDULE_MODULES = (generators, v_shape_1f1b, zb_scheduler)

SPECS: tuple[ScheduleSpec, ...] = tuple(spec for module in SCHEDULE_MODULES for spec in module.SPECS)
SCHEDULE_NAMES: tuple[str, ...] = tuple(n for s in SPECS for n in s.names)


def _lookup() -> dict[str, tuple[str, ScheduleSpec]]:
    """name key -> (the name a Schedule carries, its spec); aliases carry the spec's name."""
    out: dict[str, tuple[str, ScheduleSpec]] = {}
    for spec in SPECS:
        for n in spec.names:
            out[name_key(n)] = (n, spec)
    for spec in SPECS:
        for a in spec.aliases:
            k = name_key(a)
            if k in out:
                raise AssertionError(f"schedule alias {a!r} of {spec.name} is already {out[k][0]}'s")
            out[k] = (spec.name, spec)
    if len(out) != sum(len(s.names) + len(s.aliases) for s in SPECS):
        raise AssertionError("two schedules share a name")
    return out


_LOOKUP = _lookup()


def find(name: str) -> ScheduleSpec | None:
    """The spec of a name (any spelling), or None (csv:, torch:, unknown)."""
    hit = _LOOKUP.get(name_key(name))
    return None if hit is None else hit[1]


def spec_of(name: str) -> ScheduleSpec:
    spec = find(name)
    if spec is None:
        raise UserError(
            f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}, csv:FILE or torch:NAME"
        )
    return spec


def canonical_name(name: str) -> str:
    """The name a schedule is built and reported under ('auto' -> 'ZBAuto', 'zbv' -> 'ZBV')."""
    spec_of(name)
    return _LOOKUP[name_key(name)][0]


def is_imported(name: str) -> bool:
    """An order read from outside (csv:FILE, torch:NAME) rather than a registered name."""
    return name.strip().lower().startswith(("csv:", "torch:"))


def default_vpp(name: str) -> int:
    """Chunks per rank a schedule needs when the user gave none (V schedules: 2)."""
    return 1 if is_imported(name) else spec_of(name).default_vpp


def is_searched(name: str) -> bool:
    """Whether the name's schedule searches for its order (its size bound is smaller)."""
    spec = None if is_imported(name) else find(name)
    return spec is not None and spec.searched


def runs_at_pp1(name: str) -> bool:
    """A schedule name that still means something with one pipeline stage: 1F1B (what one
    stage runs anyway) or an explicit action list."""
    if is_imported(name):
        return True
    spec = find(name)
    return spec is not None and spec.runs_at_pp1


def torch_runtime(name: str) -> str:
    """Which of PyTorch pipelining's runtimes runs a schedule of this name ('torch:' names too):
    'gpipe', '1f1b' or 'actions' (spec.TORCH_RUNTIMES)."""
    name = name.strip()
    spec = find(name[6:] if name.lower().startswith("torch:") else name)
    return "actions" if spec is None else spec.torch_runtime


def placement_of(name: str) -> str:
    """'v' for V-shaped schedules, else 'loop' (the planner's placement label)."""
    return "v" if spec_of(name).v_shaped else "loop"


# ---------------------------------------------------------------- the name tables

NOTATION_HEADER = ("pipemem", "PyTorch (torch.distributed.pipelining)", "Paddle", "paper / Megatron")
_WIDTHS = (18, 41, 12)


def _shown(spec: ScheduleSpec) -> str:
    return f"{spec.shown} ({spec.name})" if spec.shown else ", ".join(spec.names)


def notation_rows(width: int = 124) -> list[str]:
    """`pipemem schedule --help`'s name table, one row per schedule, within `width` columns: four
    columns (the paper column wrapped), or where they do not fit, the name and then its PyTorch,
    Paddle and paper names as one wrapped text."""
    lead = 2 + sum(_WIDTHS)
    four = width - lead >= 30

    def row(cells):
        if four:
            head, at, text = "".join(c.ljust(w) for c, w in zip(cells[:3], _WIDTHS)), lead, cells[3]
        else:
            head, at, text = cells[0].ljust(_WIDTHS[0]), 2 + _WIDTHS[0], "; ".join(cells[1:])
        wrapped = textwrap.wrap(text, max(20, width - at), break_on_hyphens=False) or [""]
        out = ["  " + head + wrapped[0]]
        out += [" " * at + more for more in wrapped[1:]]
        return [line.rstrip() for line in out]

    lines = row(NOTATION_HEADER)
    for spec in SPECS:
        cells = [_shown(spec), spec.torch or "-", spec.paddle or "-", spec.paper.replace("`", "") or "-"]
        if not four:  # the names a framework has (none: not named)
            cells = [
                cells[0],
                "; ".join(
                    [f"PyTorch {cells[1]}"] * (cells[1] != "-")
                    + [f"Paddle {cells[2]}"] * (cells[2] != "-")
                    + [cells[3]]
                ),
            ]
        if len(cells[0]) >= _WIDTHS[0]:  # a long name gets its own line
            lines.append("  " + cells[0])
            cells[0] = ""
        lines += row(cells)
    return lines


def markdown_rows() -> list[str]:
    """The README's table of schedule names, from the registry (tests/test_readme_links.py
    holds the README to it)."""
    out = [
        "| pipemem | PyTorch (`torch.distributed.pipelining`) | Paddle | paper / Megatron |",
        "|---|---|---|---|",
    ]
    for spec in SPECS:
        names = f"`{spec.shown}` (`{spec.name}`)" if spec.shown else ", ".join(f"`{n}`" for n in spec.names)
        cells = [
            names,
            f"`{spec.torch}`" if spec.torch else "",
            f"`{spec.paddle}`" if spec.paddle else "",
            spec.paper,
        ]
        out.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    out.append("| `csv:FILE`, `torch:NAME` | a CSV of actions; PyTorch's own generator (needs torch) | | |")
    return out


def names_help() -> str:
    """The names, for the argument's help."""
    return ", ".join("/".join(s.table_names()) for s in SPECS) + ", csv:FILE or torch:NAME"
