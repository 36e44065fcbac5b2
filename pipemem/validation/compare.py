"""The one comparison row every validation target reports, and the one `rel_error`.

A row is one measured number beside the estimate of the same thing (a rank's peak, a
sub-program's net change, a layer's kept bytes). `rel_error` = (estimated - measured) /
|measured|, as every `pipemem validate ... --json` reports it in `cases[]`.
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

    def to_dict(self) -> dict:
        d = {"name": self.name, "measured_bytes": self.measured_bytes, "estimated_bytes": self.estimated_bytes,
             "rel_error": self.rel_error}
        d.update(self.extra)
        return d


def max_abs_rel_error(rows) -> float | None:
    """Largest |rel_error| over rows (CaseRow or dicts); None when no row has one."""
    errs = [r.rel_error if isinstance(r, CaseRow) else r.get("rel_error") for r in rows]
    errs = [abs(e) for e in errs if e is not None]
    return max(errs) if errs else None


def add_case_options(p, full_help: str, timeout: float, timeout_help: str) -> None:
    """The case-selection options of a validate target that runs named cases:
    --full, --cases, --list, --json, --timeout."""
    p.add_argument("--full", action="store_true", help=full_help)
    p.add_argument("--cases", default="", help="comma-separated case names (see --list)")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object with cases[]")
    p.add_argument("--timeout", type=float, default=timeout, help=f"{timeout_help} (default {timeout:g})")


def case_names(text: str, known, target: str) -> list[str]:
    """The names given to --cases (comma-separated), each checked against `known`."""
    from ..errors import UserError
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise UserError(f"--cases: unknown case(s) {', '.join(bad)}; see pipemem validate {target} --list")
    return names

