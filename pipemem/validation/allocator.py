"""`pipemem validate allocator`: the caching-allocator model against real GPU memory snapshots.

Each snapshot (bench/data/allocator_snapshots/, recorded on GPUs by
`torch.cuda.memory._record_memory_history` and published; see the README there) is replayed
through `pipemem.allocator` with its own allocator settings, the same call `pipemem snapshot`
makes. Measured: the peak reserved bytes the trace's segment events show; estimated: the
model's. A trace that starts from an empty allocator must reproduce the recorded segment events
(same actions and sizes, same order) and the peak within 1 %; a trace that starts mid-run
(state reconstructed from the final segments) within 2 %. Exit 1 otherwise. Also shown: whether
the final segments agree (each segment's size and the bytes allocated in it at the end).
"""

from __future__ import annotations

from pathlib import Path

from .compare import add_json_option

TRUTH = "measured"  # the allocator's own segment events, recorded on real GPUs (compare.TRUTHS)
TOL_FROM_EMPTY = 0.01
TOL_MID_RUN = 0.02
TOLERANCE = TOL_MID_RUN  # the target's; a trace from an empty allocator carries its own, 1 %
DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "allocator_snapshots"
EXAMPLE = """examples:
  pipemem validate allocator
  pipemem validate allocator --json
  pipemem validate allocator --dir my_snapshots/"""


def snapshot_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith((".json.gz", ".json", ".pickle", ".pkl")))


def case_name(path: Path) -> str:
    """owner/the file's own name (the bundled files are named owner__repo__path)."""
    stem = path.name.split(".json")[0].split(".pickle")[0]
    parts = stem.split("__")
    tail = parts[-1] if len(parts) >= 3 else stem
    return f"{parts[0]}/{tail[-44:]}" if len(parts) >= 3 else stem


def compare_file(path: Path) -> list:
    """One CaseRow per device trace of a snapshot file."""
    from ..allocator import snapshot as S
    from .compare import CaseRow

    snap = S.load(str(path))
    rows = []
    name = case_name(path)
    for dev in S.devices(snap):
        rec = S.recorded(snap, dev)
        mod = S.replay_device(snap, dev)
        match = rec.segment_events == mod.segment_events
        same_final = rec.final_segments == mod.final_segments
        tol = TOL_FROM_EMPTY if rec.from_empty else TOL_MID_RUN
        row = CaseRow(
            f"{name}:{dev}",
            rec.peak_reserved_bytes,
            mod.peak_reserved_bytes,
            {
                "start": "empty" if rec.from_empty else "mid-run",
                "segment_events": f"{len(mod.segment_events)}/{len(rec.segment_events)}",
                "events_match": "yes" if match else "NO",
                "final_segments": "same" if same_final else "differ",
                "tolerance": tol,
            },
        )
        err = row.rel_error
        row.extra["source"] = path.name
        row.extra["ok"] = (err is not None and abs(err) <= tol) and (match or not rec.from_empty)
        rows.append(row)
    return rows


HELP = "the CUDA caching-allocator model vs real GPU memory snapshots"
DESCRIPTION = __doc__.split("\n\n", 1)[1].strip()


def add_arguments(p) -> None:
    p.add_argument("--dir", default=str(DATA), help="directory of snapshots (default: the bundled set)")
    add_json_option(p)


def run(args) -> int:
    import json

    from ..errors import UserError
    from .compare import beyond_tolerance, report
    from .progress import CaseProgress, print_summary, quiet_profiler_chatter

    d = Path(args.dir)
    if not d.is_dir():
        if d == DATA:
            raise UserError(
                "validate allocator: the bundled snapshots are in a checkout of the repository "
                "(bench/data/allocator_snapshots/); run it from one, or give --dir"
            )
        raise UserError(f"--dir: {d} is not a directory")
    files = snapshot_files(d)
    if not files:
        raise UserError(f"--dir: no snapshot files (.json.gz, .json, .pickle) in {d}")
    with (
        quiet_profiler_chatter(),
        CaseProgress([f.name for f in files], "validate allocator", enabled=not args.json) as bar,
    ):
        rows = bar.run(files, lambda f: f.name, compare_file)
    bad = [r for r in rows if not r.extra["ok"]]
    events_differ = [r.name for r in rows if r.extra["start"] == "empty" and r.extra["events_match"] != "yes"]
    if args.json:
        d = report(
            "allocator",
            TRUTH,
            TOLERANCE,
            rows,
            tolerance_from_empty=TOL_FROM_EMPTY,
            from_empty_segment_events="identical",
            segment_events_differ=events_differ,
        )
        d["passed"] = d["passed"] and not events_differ
        print(json.dumps(d, indent=1))
    else:
        print_summary(
            rows,
            title="validate allocator: peak reserved, recorded vs modelled",
            columns=(
                ("start", "start"),
                ("segment_events", "seg events model/rec"),
                ("events_match", "same events"),
                ("final_segments", "final segments"),
            ),
            what="device traces",
        )
        print(
            f"{len(rows) - len(bad)} of {len(rows)} device traces within tolerance "
            f"(from empty: identical segment events and {TOL_FROM_EMPTY:.0%}; mid-run: {TOL_MID_RUN:.0%})"
        )
    return 1 if bad or beyond_tolerance(rows, TOLERANCE) else 0
