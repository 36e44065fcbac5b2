"""`pipemem schedule NAME`: per-rank action lists of a pipeline schedule, its bubble and memory."""

from __future__ import annotations

import json

from ..errors import UserError

USAGE_EXAMPLES = """\
examples:
  pipemem schedule 1F1B --pp 4 --microbatches 8
  pipemem schedule ZBVZeroBubble --pp 4 --microbatches 8 --vpp 2 --json
  pipemem schedule auto --pp 4 --microbatches 16 --memory-limit 4
  pipemem schedule ZBH1 --pp 4 --microbatches 8 --csv-out zb.csv
  pipemem schedule csv:zb.csv
"""

# paragraphs, wrapped to the terminal; a no-break space (\xa0) keeps a notation together
NOTATION_TEXT = (
    "F3 forward of microbatch 3; B3 its backward; I3\xa0/\xa0W3 the two halves of a split backward "
    "(input grad, then weight grad). With 2 chunks per rank (--vpp\xa02) UPPER case is the rank's "
    "first chunk and lower case its second (F3\xa0/\xa0f3, B3\xa0/\xa0b3); with more chunks, F3.2 is "
    "microbatch 3 on chunk 2. In `pipemem estimate`, F3@s5 names the virtual stage (s5).",
    "Memory: \"mb\" is one microbatch's activations on a rank (all its chunks): a chunk's F keeps "
    "1/vpp of it, B frees it; a split backward's I frees all but the weight-grad inputs "
    '(w = M_W/M_B, --w-ratio) and W the rest. "in flight" is the most microbatches (in the same '
    "unit) whose forward has run and whose backward has not, as `pipemem estimate` shows it.",
    "Time: T_F = T_I = T_W = 1 unless --times.",
)
IMPORTED_ROWS = """\
  csv:FILE          _load_csv (PyTorch's CSV of actions)
  torch:NAME        PyTorch's own generator, run (needs torch)
"""


def _wrap(text: str, width: int, indent: str = "") -> str:
    """`text` wrapped to `width` columns, each line after `indent`; no-break spaces kept whole."""
    import textwrap

    lines = textwrap.wrap(text, max(20, width - len(indent)), break_on_hyphens=False) or [""]
    return "\n".join(indent + line.replace("\xa0", " ") for line in lines)


def notation(width: int = 124) -> str:
    """The help's notation and name table (one row per registered schedule), within `width`."""
    from ..schedules.registry import notation_rows

    text = "\n".join(_wrap(p, min(width, 92), "  ") for p in NOTATION_TEXT)
    return (
        "notation:\n"
        + text
        + "\n\nnames (case-insensitive; '-' and '_' ignored):\n"
        + "\n".join(notation_rows(min(width, 124)))
        + "\n"
        + IMPORTED_ROWS
    )


HELP = "per-rank actions, bubble and peak of a pipeline schedule"


def DESCRIPTION() -> str:  # noqa: N802 (cli/command.py reads it; a function: the terminal's width)
    from ..report.text import terminal_width

    return _wrap(
        "Generate (or import) a pipeline schedule, check it, replay it per rank with "
        "microbatch-unit jobs and a time model, and print a compact chart.",
        min(terminal_width(), 92),
    )


def EXAMPLE() -> str:  # noqa: N802 (the help's epilog: examples, notation, names)
    from ..report.text import terminal_width

    return USAGE_EXAMPLES + "\n" + notation(terminal_width())


def add_arguments(p) -> None:
    from ..schedules.registry import names_help

    p.add_argument("name", help=f"schedule name (table below): {names_help()}")
    p.add_argument("--pp", type=int, help="pipeline ranks (required unless NAME is csv:FILE)")
    p.add_argument(
        "--microbatches", type=int, help="microbatches per step (required unless NAME is csv:FILE)"
    )
    p.add_argument(
        "--vpp", type=int, default=None, help="model chunks per rank (default 1; 2 for V schedules)"
    )
    p.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        metavar="MICROBATCHES",
        help="per-rank activation limit in microbatch units: runs the memory-limited "
        "zero-bubble scheduler (NAME auto)",
    )
    p.add_argument(
        "--w-ratio",
        type=float,
        default=None,
        metavar="R",
        help="M_W/M_B, the share of a microbatch's activations kept from I until W "
        "(default 32/34, Qi et al. 2024 without the attention-score term)",
    )
    p.add_argument(
        "--times",
        default="1,1,1",
        metavar="F,I,W[,COMM]",
        help="durations of F, I, W (B = I + W) and of a hop between ranks (default 1,1,1,0)",
    )
    p.add_argument("--csv-out", metavar="FILE", help="write the schedule as CSV PyTorch pipelining loads")
    p.add_argument("--full", action="store_true", help="print every action (default: the first 40 per rank)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _parse_times(text: str):
    from ..schedules.check import TimeModel

    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) not in (3, 4) or not all(0 <= v < 1e12 for v in vals) or min(vals[:3]) <= 0:
        raise UserError(f"--times {text!r}: write F,I,W or F,I,W,COMM with positive durations, e.g. 1,1,1")
    return TimeModel(F=vals[0], I=vals[1], W=vals[2], comm=vals[3] if len(vals) == 4 else 0.0)


def _label(a, schedule) -> str:
    if schedule.vpp == 1:
        return f"{a.kind}{a.microbatch}"
    chunk = schedule.chunk_of(a.stage)
    if schedule.vpp == 2:
        return f"{a.kind if chunk == 0 else a.kind.lower()}{a.microbatch}"
    return f"{a.kind}{a.microbatch}.{chunk}"


def _mb(x) -> str:
    """Microbatch units as `pipemem estimate` prints them: 5.5 mb, 4 mb, 3.941 mb."""
    return f"{round(float(x), 3):g} mb"


def _legend(sched) -> str:
    kinds = "F forward, B backward" + (
        ", I/W its input-/weight-grad halves when split" if sched.split_backward else ""
    )
    if sched.vpp == 1:
        chunks = ""
    elif sched.vpp == 2:
        chunks = "; UPPER case = first chunk of the rank, lower case = second"
    else:
        chunks = "; F3.2 = microbatch 3 on chunk 2"
    return (
        f"  ({kinds}; the number is the microbatch{chunks}; @sN = virtual stage N; "
        "mb = one microbatch's activations on a rank)"
    )


def _num(x) -> float:
    return round(float(x), 4)


def run(args) -> int:
    from ..schedules.actions import paused_gc

    # A large schedule is 10^5-10^6 small acyclic objects (actions, their labels): collections
    # while they are made and walked would only traverse them (~5 % of the command's time).
    with paused_gc():
        return _run(args)


def _run(args) -> int:
    from ..plan import LIMITS, check_schedule_size
    from ..replay import replay
    from ..schedules import canonical_name, default_vpp, get_schedule, spec_of
    from ..schedules.actions import KINDS
    from ..schedules.check import check_schedule, simulate
    from ..schedules.registry import is_imported
    from ..schedules.unit_jobs import DEFAULT_W_RATIO, integer_unit_jobs

    from_csv = args.name.lower().startswith("csv:")
    if not from_csv and (args.pp is None or args.microbatches is None):
        raise UserError(f"schedule {args.name}: give --pp and --microbatches, e.g. --pp 4 --microbatches 8")
    for flag, v in (("--pp", args.pp), ("--microbatches", args.microbatches), ("--vpp", args.vpp)):
        key = flag[2:]
        if v is not None and not 1 <= v <= LIMITS[key]:
            raise UserError(f"{flag} {v}: give 1 to {LIMITS[key]:,}")
    if args.w_ratio is not None and not 0 <= args.w_ratio <= 1:
        raise UserError(f"--w-ratio {args.w_ratio}: give a share between 0 and 1, e.g. 0.94")
    if args.memory_limit is not None and not 0 < args.memory_limit < 1e12:
        raise UserError(f"--memory-limit {args.memory_limit}: give a positive number of microbatches, e.g. 4")
    times = _parse_times(args.times)
    name = args.name
    imported = is_imported(name)
    spec = None if imported else spec_of(name)
    if args.memory_limit is not None and (spec is None or not spec.searched):
        raise UserError(f"--memory-limit runs the memory-limited scheduler: use NAME auto instead of {name}")
    vpp = args.vpp if args.vpp is not None else default_vpp(name)
    if not imported:
        check_schedule_size(canonical_name(name), args.pp, vpp, args.microbatches)
    w = DEFAULT_W_RATIO if args.w_ratio is None else args.w_ratio
    canon = None if imported else canonical_name(name)
    if spec is not None and spec.searched:
        sched = get_schedule(
            name, args.pp, args.microbatches, vpp, memory_limit=args.memory_limit, w_ratio=w, times=times
        )
    else:
        sched = get_schedule(name, args.pp or 0, args.microbatches or 0, vpp)
    # A file's or PyTorch's order is checked action by action; the built-in generators' orders
    # are held to the same check by the tests (tests/test_schedules_generators.py), so here they
    # only run the time model (which still refuses a deadlock).
    # Only the makespan and the bubbles are printed: no per-action timeline (timeline=False).
    sim = (
        check_schedule(sched, times, timeline=False)
        if canon is None
        else simulate(sched, times, timeline=False)
    )
    # integer units (scale per microbatch): replay stays exact and vectorised
    jobs, scale = integer_unit_jobs(sched.num_stages, sched.vpp, w, (times.F, times.I, times.W))
    res = replay(sched, jobs, None, simulate_time=False)
    res.simulation = sim

    def mb(x) -> float:
        return x / scale

    if args.csv_out:
        from ..schedules.csv_io import write_csv

        write_csv(sched, args.csv_out)
    if args.json:
        # str(Action) is f"{kind}{microbatch}@s{stage}"; from per-(kind, microbatch) and per-stage
        # pieces it is one concatenation per action (10^5-10^6 of them). Every action here is in
        # range: checked above (check_schedule) or made by a generator the tests hold to it.
        labels = {k: [k + str(i) for i in range(sched.microbatches)] for k in KINDS}
        at_stage = [f"@s{s}" for s in range(sched.num_stages)]
        out = {
            "schedule": sched.name,
            "pp": sched.pp,
            "vpp": sched.vpp,
            "microbatches": sched.microbatches,
            "placement": sched.placement,
            "split_backward": sched.split_backward,
            "w_ratio": _num(w),
            "memory_limit": args.memory_limit,
            "times": {"F": times.F, "I": times.I, "W": times.W, "comm": times.comm},
            "makespan": res.makespan,
            "bubble_ratio": res.bubble_ratio,
            "stage_bubble_ratio": res.stage_bubble_ratio,
            "peak_microbatches": _num(mb(max(r.peak_allocated_bytes for r in res.ranks))),
            "ranks": [
                {
                    "pp_rank": r,
                    "stages": sched.stages_of_rank(r),
                    "actions": [labels[k][m] + at_stage[st] for k, st, m in acts],  # str(Action)
                    "max_inflight": rr.max_inflight,
                    "max_inflight_microbatches": _num(rr.max_inflight / sched.vpp),
                    "peak_microbatches": _num(mb(rr.peak_allocated_bytes)),
                    "peak_at": rr.peak_at,
                }
                for r, (acts, rr) in enumerate(zip(sched.ranks, res.ranks))
            ],
        }
        if sched.notes:
            out["notes"] = sched.notes
        # one line per action would be 10^5-10^6 lines (and the pure-Python encoder): large
        # schedules print compact
        print(json.dumps(out, indent=2 if sched.num_actions <= 20000 else None))
        return 0
    from ..report.text import terminal_width

    width = terminal_width()
    print(
        _wrap(
            f"{sched.name}: pp {sched.pp}, vpp {sched.vpp} ({sched.placement} placement), "
            f"{sched.microbatches} microbatches, {sched.num_actions} actions"
            + (", split backward (I/W)" if sched.split_backward else ""),
            width,
        )
    )
    if sched.notes:
        print(_wrap(sched.notes, width, "  "))
    print(_wrap(_legend(sched).strip(), width, "  "))
    for r, (acts, rr) in enumerate(zip(sched.ranks, res.ranks)):
        head = (
            f"rank {r:>2}  peak {_mb(mb(rr.peak_allocated_bytes)):>8} at {rr.peak_at:<9} "
            f"in flight {_mb(rr.max_inflight / sched.vpp):>7} | "
        )
        for line in _action_lines(head, acts, sched, width, args.full):
            print(line)
    bubble = (
        f"bubble {res.bubble_ratio:.1%} of {sched.pp} x makespan {res.makespan:g} "
        f"(T_F={times.F:g} T_I={times.I:g} T_W={times.W:g} comm={times.comm:g}); "
        f"per-rank span bubble (Qi et al.) {res.stage_bubble_ratio:.1%}"
    )
    print(_wrap(bubble, width))
    print(
        _wrap(
            f"peak {_mb(mb(max(r.peak_allocated_bytes for r in res.ranks)))} (microbatches of a rank's "
            f"activations) (w = M_W/M_B = {float(w):.3f})"
            + (f"; wrote {args.csv_out}" if args.csv_out else ""),
            width,
        )
    )
    return 0


# the first actions of a rank shown without --full, when the terminal has room for them
SHOWN_ACTIONS = 40


def _action_lines(head: str, acts, sched, width: int, full: bool) -> list[str]:
    """A rank's line: `head`, then its actions within `width` columns. Without `full`, the first
    SHOWN_ACTIONS or fewer, as many as fit on the line, then `... (+N)`; with `full`, every action,
    wrapped under the first. Where `head` leaves too little room, the actions start on the next
    line, indented."""
    lines = []
    if width - len(head) < 40:
        lines.append(head.rstrip(" |"))
        head = "    "
    room = max(width - len(head), 8)
    if full:
        rows = [""]
        for a in acts:
            label = _label(a, sched)
            if rows[-1] and len(rows[-1]) + 1 + len(label) > room:
                rows.append(label)
            else:
                rows[-1] = f"{rows[-1]} {label}" if rows[-1] else label
        return lines + [(head if i == 0 else " " * len(head)) + row for i, row in enumerate(rows)]
    shown: list[str] = []
    used = 0
    for i, a in enumerate(acts[:SHOWN_ACTIONS]):
        label = _label(a, sched)
        rest = len(acts) - i - 1
        need = used + (1 if shown else 0) + len(label) + (len(f" ... (+{rest})") if rest else 0)
        if shown and need > room:
            break
        used += (1 if shown else 0) + len(label)
        shown.append(label)
    rest = len(acts) - len(shown)
    return lines + [head + " ".join(shown) + (f" ... (+{rest})" if rest else "")]
