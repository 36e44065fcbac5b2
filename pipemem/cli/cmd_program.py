"""`pipemem program FILE.json`: net change, peak and peak op of each program in a saved sequence."""

from __future__ import annotations

import json

from ..errors import UserError

EXAMPLE = """\
example:
  pipemem program pipemem/examples/stage_1f1b.json
  pipemem program my_programs.json --dim batch=8 --dim seq=4096 --json
"""


HELP = "liveness of a saved sequence of programs (JSON)"
DESCRIPTION = (
    "Walk each program of a pipemem.programs/1 JSON file op by op, in order, carrying "
    "what later programs need, and print each program's net change, peak above its "
    "start, and the op at the peak."
)


def add_arguments(p) -> None:
    p.add_argument("file", help="programs file (format pipemem.programs/1)")
    p.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="bind a symbolic dimension used in tensor shapes (repeatable)",
    )
    p.add_argument(
        "--granularity",
        type=int,
        default=1,
        metavar="BYTES",
        help="round every allocation up to a multiple of BYTES (the CUDA allocator uses 512)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


MAX_DIM = 1 << 40


def _parse_dims(items: list[str]) -> dict[str, int]:
    dims = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.isdigit():
            raise UserError(
                f"--dim {item!r}: write NAME=SIZE with a non-negative integer size, e.g. --dim batch=8"
            )
        if int(value) > MAX_DIM:
            raise UserError(f"--dim {item!r}: at most {MAX_DIM:,} (2^40) per dimension")
        dims[name] = int(value)
    return dims


def run(args) -> int:
    from ..ir import load_programs
    from ..liveness import analyze_sequence
    from ..units import fmt_bytes

    if not 1 <= args.granularity <= 1 << 30:
        raise UserError(f"--granularity {args.granularity}: give 1 to 2^30 bytes, e.g. 512")
    programs = load_programs(args.file, dims=_parse_dims(args.dim))
    results = analyze_sequence(programs, granularity=args.granularity)
    if args.json:
        rows = [
            dict(r.to_dict(), type=p.type, ops=len(p.ops), param_bytes=p.param_bytes())
            for p, r in zip(programs, results)
        ]
        print(json.dumps({"file": str(args.file), "programs": rows}, indent=2))
        return 0
    header = ("program", "ops", "params", "net change", "peak", "peak op")
    rows = [
        (
            p.name,
            str(len(p.ops)),
            fmt_bytes(p.param_bytes()),
            fmt_bytes(r.net_bytes, signed=True),
            fmt_bytes(r.peak_bytes),
            r.peak_op_label or "-",
        )
        for p, r in zip(programs, results)
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print(
        "net change and peak are relative to the memory in use when each program starts;"
        " params are static and not included."
    )
    return 0
