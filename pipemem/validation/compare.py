"""The one comparison row every validation target reports, the one `rel_error`, and what every
target says about its numbers: their truth, its tolerance and the verdict.

A row is one measured number beside the estimate of the same thing (a rank's peak, a
sub-program's net change, a layer's kept bytes). `rel_error` = (estimated - measured) /
|measured|, as every `pipemem validate ... --json` reports it in `cases[]`.

Truth: what the "measured" column is.
* `measured`: a real run; its bytes come from the allocator or the profiler (torch's
  allocation events, Paddle's memory statistics, `torch.cuda.max_memory_allocated`).
* `traced`: the framework's own code run on fake tensors; its bytes are counted by pipemem's
  recorder and kernel policy. A trace of the framework's tensor lifetimes, not a measurement:
  what a kernel allocates inside is the kernel policy's assumption on both sides.

Every target has one `tolerance` (a fraction: the largest |rel_error| a row may have) and exits
1 when any row is beyond it. A row may carry its own `tolerance` (documented where the target
sets it), or a `known_gap` (a reason): a disagreement found and not modelled, shown in the
table with its reason and left out of the verdict (docs/ACCURACY.md names each). A row marked
`unreliable` (a reason: its measurement rests on a repair beyond its bound) always fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def rel_error(estimated: int | None, measured: int | None) -> float | None:
    """(estimated - measured) / |measured|; 0 when both are 0; None when either is missing or
    the measurement is 0 and the estimate is not."""
    if estimated is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if estimated == 0 else None
    return (estimated - measured) / abs(measured)


_CORE = ("name", "measured_bytes", "estimated_bytes", "rel_error")


@dataclass
class CaseRow:
    """One measured-vs-estimated comparison. `extra` holds target-specific fields (rank,
    peak_at, Paddle's own estimate...), flattened into the JSON row."""

    name: str
    measured_bytes: int | None
    estimated_bytes: int | None
    extra: dict = field(default_factory=dict)

    @property
    def rel_error(self) -> float | None:
        return rel_error(self.estimated_bytes, self.measured_bytes)

    def get(self, key: str, default=None):
        """A field by its JSON name, core or extra (as `dict.get` reads the row's JSON)."""
        return getattr(self, key) if key in _CORE else self.extra.get(key, default)

    @classmethod
    def from_dict(cls, d: dict) -> CaseRow:
        """The row a `to_dict` wrote (a worker's JSON), its relative error computed again."""
        extra = {k: v for k, v in d.items() if k not in _CORE}
        return cls(d["name"], d["measured_bytes"], d["estimated_bytes"], extra)

    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "measured_bytes": self.measured_bytes,
            "estimated_bytes": self.estimated_bytes,
            "rel_error": self.rel_error,
        }
        d.update(self.extra)
        return d


def peak_row(name: str, case: str, trace: dict, rank, where: dict | None = None, **more) -> CaseRow:
    """One rank's peak as the framework's own step gave it (`trace`: its `peak_bytes`,
    `static_bytes` and `peak_at`) against the estimate's rank (`rank`: a `RankEstimate`), with
    the static bytes and the moment of the peak on both sides. `where` (rank, pp_rank...) follows
    the case's name in the row; `more` ends it."""
    return CaseRow(
        name,
        trace["peak_bytes"],
        rank.peak_allocated_bytes,
        {
            "case": case,
            **(where or {}),
            "measured_static_bytes": trace["static_bytes"],
            "estimated_static_bytes": rank.static.total,
            "measured_peak_at": trace["peak_at"],
            "estimated_peak_at": rank.peak_at,
            **more,
        },
    )


TRUTHS = {
    "measured": "a real run, bytes from the allocator or profiler",
    "traced": "the framework's own code on fake tensors, bytes counted by pipemem",
}


def row_tolerance(row, tolerance: float) -> float:
    """The row's own tolerance when it has one, else the target's."""
    own = row.get("tolerance")
    return tolerance if own is None else own


def beyond_tolerance(rows, tolerance: float) -> list[str]:
    """Names of the rows whose |rel_error| exceeds their tolerance. A row with no relative error
    fails when it has both numbers (a measured 0 against a non-zero estimate); a `known_gap` row
    is outside the verdict."""
    bad = []
    for r in rows:
        if r.get("unreliable"):  # the measurement itself is in doubt: never a pass
            bad.append(str(r.get("name")))
            continue
        if r.get("known_gap"):
            continue
        err = r.get("rel_error")
        if err is None:
            if r.get("measured_bytes") is not None and r.get("estimated_bytes") is not None:
                bad.append(str(r.get("name")))
        elif abs(err) > row_tolerance(r, tolerance):
            bad.append(str(r.get("name")))
    return bad


def exit_code(rows, tolerance: float) -> int:
    """0 when every row is within its tolerance, else 1 (what every validate target returns)."""
    return 1 if beyond_tolerance(rows, tolerance) else 0


def report(target: str, truth: str, tolerance: float, rows, **fields) -> dict:
    """The `--json` object of a validate target: its truth and tolerance, the target's own
    `fields`, the rows (`cases[]`), the worst |rel_error|, the rows beyond tolerance and the
    verdict (`passed`)."""
    if truth not in TRUTHS:
        raise ValueError(f"truth must be one of {', '.join(TRUTHS)}, not {truth!r}")
    bad = beyond_tolerance(rows, tolerance)
    return {
        "target": target,
        "truth": truth,
        "truth_means": TRUTHS[truth],
        "tolerance": tolerance,
        **fields,
        "cases": [r.to_dict() if isinstance(r, CaseRow) else r for r in rows],
        "max_abs_rel_error": max_abs_rel_error(rows),
        "known_gaps": [str(r.get("name")) for r in rows if r.get("known_gap")],
        "beyond_tolerance": bad,
        "passed": not bad,
    }


def header_line(target: str, truth: str, tolerance: float) -> str:
    """The line above a target's table: what its "measured" column is and its tolerance."""
    return f"validate {target}: truth {truth} ({TRUTHS[truth]}); tolerance {tolerance:.2%}"


def verdict_line(rows, tolerance: float) -> str:
    """The lines below a target's table: the verdict over the rows it covers, then each known gap
    and each unreliable measurement with its reason."""
    bad = beyond_tolerance(rows, tolerance)
    own = sorted({row_tolerance(r, tolerance) for r in rows} - {tolerance})
    gaps = [r for r in rows if r.get("known_gap")]
    covered = [r for r in rows if not r.get("known_gap")]
    worst = max_abs_rel_error(covered)
    if bad:
        text = f"FAIL: {len(bad)} of {len(covered)} rows beyond tolerance: {', '.join(bad)}"
    else:
        text = (
            f"pass: every one of {len(covered)} rows within tolerance ({tolerance:.2%}"
            + (f"; some rows their own: {', '.join(f'{t:.2%}' for t in own)}" if own else "")
            + f"), max |rel_error| {'n/a' if worst is None else f'{worst:.2%}'}"
        )
    if gaps:
        text += f"; {len(gaps)} known gap(s) outside the verdict:"
    for r in gaps:
        text += f"\n  known gap: {r.get('name')}: {r.get('known_gap')}"
    for r in rows:
        if r.get("unreliable"):
            text += f"\n  unreliable measurement: {r.get('name')}: {r.get('unreliable')}"
    return text


def max_abs_rel_error(rows) -> float | None:
    """Largest |rel_error| over rows (CaseRow or dicts); None when no row has one."""
    errs = [r.get("rel_error") for r in rows]
    errs = [abs(e) for e in errs if e is not None]
    return max(errs) if errs else None


def add_json_option(p) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object with cases[]")


def add_listed_case_options(p, cases) -> None:
    """--json, and --cases for a target whose every case runs by default (`cases`: each has a
    `name`; the known names are in the help; `pick_cases` reads it)."""
    add_json_option(p)
    names = ", ".join(c.name for c in cases)
    p.add_argument("--cases", default="", help=f"comma-separated case names (default: all); known: {names}")


def pick_cases(text: str, cases) -> tuple:
    """The cases --cases names (comma-separated, in the order given; each case has a `name`), or
    all of `cases` when it names none. An unknown name is one error line naming the known ones."""
    from ..errors import UserError

    wanted = [n.strip() for n in text.split(",") if n.strip()]
    if not wanted:
        return tuple(cases)
    known = {c.name: c for c in cases}
    bad = [w for w in wanted if w not in known]
    if bad:
        raise UserError(f"--cases: unknown case(s) {', '.join(bad)}; known: {', '.join(known)}")
    return tuple(known[w] for w in wanted)


def add_case_options(p, full_help: str, timeout: float, timeout_help: str) -> None:
    """The case-selection options of a validate target that runs named cases:
    --full, --cases, --list, --json, --timeout."""
    p.add_argument("--full", action="store_true", help=full_help)
    p.add_argument("--cases", default="", help="comma-separated case names (see --list)")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    add_json_option(p)
    p.add_argument("--timeout", type=float, default=timeout, help=f"{timeout_help} (default {timeout:g})")


def case_names(text: str, known, target: str) -> list[str]:
    """The names given to --cases (comma-separated), each checked against `known`."""
    from ..errors import UserError

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise UserError(f"--cases: unknown case(s) {', '.join(bad)}; see pipemem validate {target} --list")
    return names


def timed_rows(cases: list[dict], one, progress=None) -> list[CaseRow]:
    """`one(case)` (a CaseRow, or a list of them: one per rank) for each case in turn, each row
    with the case's wall time (`seconds`); `progress` gets what each case returned."""
    import time

    rows = []
    for c in cases:
        t0 = time.perf_counter()
        got = one(c)
        for r in got if isinstance(got, list) else [got]:
            r.extra["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(r)
        if progress:
            progress(got)
    return rows


def require(target: str, modules=("torch",), install: str = "'pipemem[torch]'") -> None:
    """One UserError line when a module `pipemem validate <target>` runs is not installed, before
    anything imports it (a base install has no torch)."""
    from importlib.util import find_spec

    from ..errors import UserError

    for mod in modules:
        if find_spec(mod) is None:
            raise UserError(f"pipemem validate {target} needs {mod}: pip install {install}")


class NamedCaseCommand:
    """The command of a validate target of named cases (torchtune, deepspeed, torchtitan,
    hf-trainer), made from the target's module (`cases`). Besides what `run_named_cases` reads,
    the module holds the command's `HELP`, `DESCRIPTION` and `EXAMPLE`, `FULL_HELP` (what --full
    runs) and `TIMEOUT` (the default --timeout: seconds per case, or per traced rank)."""

    def __init__(self, name: str, cases):
        self.name, self.cases = name, cases
        self.HELP, self.DESCRIPTION, self.EXAMPLE = cases.HELP, cases.DESCRIPTION, cases.EXAMPLE

    def add_arguments(self, p) -> None:
        per = "traced rank" if _rows_are(self.cases) == "ranks" else "case"
        add_case_options(p, self.cases.FULL_HELP, self.cases.TIMEOUT, f"seconds per {per}")

    def run(self, args) -> int:
        return run_named_cases(args, self.name, self.cases)


def _rows_are(cases) -> str:
    return getattr(cases, "ROWS_ARE", "cases")


def run_named_cases(args, target: str, cases) -> int:
    """The run of a validate target with named cases: --list, the selection (--cases / --full /
    the CI subset), the library check, a progress line per row, the JSON or the summary line;
    exit 1 when a row is off by more than its tolerance.

    `cases` is the target's module, which holds: `all_cases()` (dicts with a "name"), `CI_CASES`
    (the names run by default), `available()` (None, or why the target cannot run here),
    `run_cases(cases, timeout, progress)` (the rows: one per case, or one per rank of each case),
    `TRUTH` (also the label of the measured column), `TOLERANCE`, `json_header()` (the fields the
    JSON object adds) and, when its rows are ranks, `ROWS_ARE = "ranks"`."""
    import json
    import subprocess
    import sys

    from ..errors import UserError
    from ..units import fmt_bytes

    truth, tolerance = cases.TRUTH, cases.TOLERANCE
    rows_are = _rows_are(cases)
    name_width = 32 if rows_are == "ranks" else 28  # room for "<case>/rank<N>"
    if args.list:
        for c in cases.all_cases():
            print(c["name"])
        return 0
    if args.timeout <= 0:
        raise UserError("--timeout: must be a positive number of seconds")
    require(target)
    known = {c["name"]: c for c in cases.all_cases()}
    if args.cases:
        chosen = [known[n] for n in case_names(args.cases, known, target)]
    else:
        chosen = list(known.values()) if args.full else [known[n] for n in cases.CI_CASES]
    # a target whose cases need more than its module does (validate torchtitan's llama4 cases:
    # torchtitan 0.2.2) says so for the chosen ones
    why = cases.available_for(chosen) if hasattr(cases, "available_for") else cases.available()
    if why:
        raise UserError(f"validate {target}: {why}")

    def progress(done):
        for r in done if isinstance(done, list) else [done]:
            if not args.json:
                print(
                    f"{r.name:{name_width}s} {fmt_bytes(r.measured_bytes):>12s} "
                    f"{fmt_bytes(r.estimated_bytes):>12s} "
                    f"{r.rel_error:>+10.2%}  {r.extra['measured_peak_at'][:50]}",
                    flush=True,
                )

    if not args.json:
        print(header_line(target, truth, tolerance))
        print(
            f"{'case / rank':{name_width}s} {truth:>12s} {'estimated':>12s} {'rel_error':>10s}  "
            f"{truth} peak at"
        )
    try:
        rows = cases.run_cases(chosen, args.timeout, progress)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"pipemem: validate {target}: {e}", file=sys.stderr)
        return 1
    worst = max_abs_rel_error(rows) or 0.0
    if args.json:
        print(json.dumps(report(target, truth, tolerance, rows, **cases.json_header()), indent=1))
    else:
        print(f"max |rel_error| = {worst:.2%} over {len(rows)} {rows_are} (tolerance {tolerance:.2%})")
        print(verdict_line(rows, tolerance))
    return exit_code(rows, tolerance)
