"""Every built-in schedule's `pipemem schedule NAME --json` output over a grid of pp / vpp /
microbatches, as one fingerprint per case (and the refusal message where the CLI refuses).

    PYTHONPATH=$PWD python tests/schedules_golden.py --write   # regenerate tests/data/schedules_golden.json
    PYTHONPATH=$PWD python tests/schedules_golden.py           # compare the current code with it

tests/test_schedules_golden.py holds the current code to the committed file, so a refactor of the
schedules (names, placement, generators, the CLI's JSON) cannot change an action list, a peak or
an in-flight count unnoticed. A new schedule adds cases; regenerate and review the diff.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "data" / "schedules_golden.json"

# every canonical name the CLI accepted before the registry, and some aliases
NAMES = (
    "GPipe",
    "FThenB",
    "1F1B",
    "Eager1F1B",
    "Interleaved1F1B",
    "VPP",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBH1",
    "ZB1P",
    "ZBH2",
    "ZBVZeroBubble",
    "ZBV",
    "DualPipeV",
    "VHalf",
    "VMin",
    "ZBVPP",
    "ZBAuto",
    "auto",
    "zb2p",
    "pipedream_flush",
    "interleaved",
)
PPS = (1, 2, 3, 4, 6)
VPPS = (None, 1, 2, 3)


def _microbatches(pp: int) -> tuple[int, ...]:
    return tuple(sorted({1, pp, 2 * pp - 1, 2 * pp, 3 * pp + 1}))


def cases():
    """(case key, argv) for every combination; a few extra flags on the searched schedulers."""
    for name in NAMES:
        for pp in PPS:
            for m in _microbatches(pp):
                for vpp in VPPS:
                    argv = [name, "--pp", str(pp), "--microbatches", str(m)]
                    if vpp is not None:
                        argv += ["--vpp", str(vpp)]
                    yield " ".join(argv), argv
    for extra in (
        ["--memory-limit", "3"],
        ["--memory-limit", "2.5", "--w-ratio", "0.5"],
        ["--times", "1,2,1,0.5"],
    ):
        for name, vpp in (("auto", "1"), ("auto", "2"), ("ZBVPP", "2"), ("ZBH2", "1"), ("ZBV", "2")):
            argv = [name, "--pp", "4", "--microbatches", "8", "--vpp", vpp] + extra
            yield " ".join(argv), argv


_PARSER = []


def run_case(argv: list[str]) -> dict:
    """The CLI's answer: its JSON's fingerprint, or its one-line refusal (exit 2)."""
    from pipemem.cli.main import build_parser
    from pipemem.errors import UserError

    if not _PARSER:  # one parser for all cases (building it imports every command)
        _PARSER.append(build_parser())
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            args = _PARSER[0].parse_args(["schedule", *argv, "--json"])
            args.func(args)
    except UserError as e:
        return {"error": str(e)}
    data = json.loads(out.getvalue())
    text = json.dumps(data, sort_keys=True)
    return {
        "sha256": hashlib.sha256(text.encode()).hexdigest()[:20],
        "peak": [r["peak_microbatches"] for r in data["ranks"]],
        "inflight": [r["max_inflight"] for r in data["ranks"]],
    }


ESTIMATE_NAMES = (
    None,
    "GPipe",
    "1F1B",
    "Eager1F1B",
    "Interleaved1F1B",
    "VPP",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBH1",
    "ZB1P",
    "ZBH2",
    "ZBVZeroBubble",
    "DualPipeV",
    "VHalf",
    "VMin",
    "ZBVPP",
    "auto",
)


def estimate_cases():
    """Each schedule under every pipeline runtime's convention: per-rank peak bytes of an estimate."""
    for name in ESTIMATE_NAMES:
        for conv in ("megatron", "torchtitan", "paddle", "hf"):
            for pp, vpp in ((2, None), (4, None), (4, 2)):
                kw = {"pp": pp, "microbatches": 8, "convention": conv, "layers": 16}
                if name is not None:
                    kw["schedule"] = name
                if vpp is not None:
                    kw["vpp"] = vpp
                yield "estimate llama3-8b " + " ".join(f"{k}={v}" for k, v in kw.items()), kw


def run_estimate(kw: dict) -> dict:
    import pipemem
    from pipemem.errors import UserError

    try:
        e = pipemem.estimate("llama3-8b", **kw)
    except UserError as err:
        return {"error": str(err)}
    return {
        "schedule": e.schedule,
        "vpp": e.plan.vpp,
        "peak": [r.peak_allocated_bytes for r in e.ranks],
        "static": [r.static.total for r in e.ranks],
        "stages": [list(r.stages) for r in e.ranks],
    }


def fingerprints() -> dict:
    out = {key: run_case(argv) for key, argv in cases()}
    out.update((key, run_estimate(kw)) for key, kw in estimate_cases())
    return out


def main() -> int:
    got = fingerprints()
    if sys.argv[1:] == ["--write"]:
        lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(got.items())]
        GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one line per case: readable diffs
        print(f"wrote {len(got)} cases to {GOLDEN}")
        return 0
    want = json.loads(GOLDEN.read_text())
    bad = [k for k in want if got.get(k) != want[k]]
    for k in bad[:20]:
        print(f"{k}:\n  want {want[k]}\n  got  {got.get(k)}")
    print(f"{len(want) - len(bad)} of {len(want)} cases identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
