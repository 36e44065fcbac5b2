"""`pipemem snapshot FILE`: replay a CUDA memory snapshot through the caching-allocator model."""

from __future__ import annotations

EXAMPLE = """examples:
  # in your training script:
  #   torch.cuda.memory._record_memory_history(max_entries=100000)
  #   ... the steps ...
  #   torch.cuda.memory._dump_snapshot("snap.pickle")
  pipemem snapshot snap.pickle
  pipemem snapshot snap.pickle --alloc-conf expandable_segments:True     # what if?
  pipemem snapshot snap.pickle --alloc-conf max_split_size_mb:256 --json
  pipemem snapshot bench/data/allocator_snapshots/MercuryB1__SQAttn__cuda_memory_snapshot.json.gz

The file is read without running anything in it: a pickle that needs any class or function
is refused. The JSON form (.json, .json.gz) with the same keys is read too."""


HELP = "replay a torch.cuda.memory._dump_snapshot file through the allocator model"
DESCRIPTION = (
    "Replay the allocations and frees that a CUDA memory snapshot recorded through "
    "pipemem's model of PyTorch's caching allocator, with the snapshot's own settings, and "
    "show per device the recorded and the modelled peak reserved, segment events, final "
    "segments and fragmentation (reserved minus allocated at the reserved peak). With "
    "--alloc-conf, replay the same requests under other settings: the peak reserved they "
    "would have given, and whether a recorded out-of-memory would have happened."
)


def add_arguments(p) -> None:
    p.add_argument("file", metavar="FILE", help="a _dump_snapshot pickle, or its JSON (.json / .json.gz)")
    p.add_argument("--device", type=int, default=None, metavar="N", help="only device N")
    p.add_argument(
        "--alloc-conf",
        default=None,
        metavar="CONF",
        help="what-if allocator settings, PYTORCH_CUDA_ALLOC_CONF syntax "
        "(e.g. expandable_segments:True,max_split_size_mb:256)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    import json

    from ..allocator import AllocatorConfig
    from ..allocator import snapshot as S
    from ..errors import UserError

    what_if = AllocatorConfig.parse(args.alloc_conf) if args.alloc_conf is not None else None
    snap = S.load(args.file)
    devs = S.devices(snap)
    if args.device is not None:
        if args.device not in devs:
            raise UserError(
                f"--device: {args.device} has no trace or segments in {args.file} "
                f"(devices: {', '.join(map(str, devs)) or 'none'})"
            )
        devs = [args.device]
    if not devs:
        raise UserError(f"snapshot {args.file}: no device has a trace or segments")
    out = {"file": args.file, "allocator_settings": S.snapshot_config(snap).describe(), "devices": []}
    for d in devs:
        out["devices"].append(_device(snap, d, what_if))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        _print(out)
    return 0


def _device(snap, d, what_if) -> dict:
    from ..allocator import snapshot as S

    rec = S.recorded(snap, d)
    mod = S.replay_device(snap, d)
    entry = {
        "device": d,
        "start": "empty" if rec.from_empty else "mid-run (state at the start reconstructed)",
        "recorded": {
            "peak_reserved_bytes": rec.peak_reserved_bytes,
            "final_reserved_bytes": rec.final_reserved_bytes,
            "start_reserved_bytes": rec.start_reserved_bytes,
            "final_segments": rec.n_final_segments,
            "ooms": rec.ooms,
            "segment_events": [list(e) for e in rec.segment_events],
        },
        "modelled": _modelled(mod),
        "segment_events_match": rec.segment_events == mod.segment_events,
    }
    if what_if is not None:
        cap = S.oom_capacity(snap, d)
        w = S.replay_device(snap, d, config=what_if, capacity_bytes=cap)
        entry["what_if"] = {
            "alloc_conf": what_if.describe(),
            "capacity_bytes": cap,
            **_modelled(w),
            "oom": (w.ooms > 0) if cap is not None else None,
        }
    return entry


def _modelled(m) -> dict:
    return {
        "peak_reserved_bytes": m.peak_reserved_bytes,
        "final_reserved_bytes": m.final_reserved_bytes,
        "allocated_at_peak_bytes": m.allocated_at_peak_bytes,
        "fragmentation_at_peak_bytes": m.peak_reserved_bytes - m.allocated_at_peak_bytes,
        "at_peak": m.at_peak,
        "final_segments": m.n_final_segments,
        "ooms": m.ooms,
        "notes": m.notes,
        "segment_events": [list(e) for e in m.segment_events],
    }


def _print(out: dict) -> None:
    from ..units import fmt_bytes

    print(f"{out['file']}\nallocator settings: {out['allocator_settings']}")
    for e in out["devices"]:
        r, m = e["recorded"], e["modelled"]
        print(f"\ndevice {e['device']}: trace starts {e['start']}")
        print(f"  {'':28s} {'recorded':>12s} {'modelled':>12s}")
        print(
            f"  {'peak reserved':28s} {fmt_bytes(r['peak_reserved_bytes']):>12s} "
            f"{fmt_bytes(m['peak_reserved_bytes']):>12s}"
        )
        print(
            f"  {'final reserved':28s} {fmt_bytes(r['final_reserved_bytes']):>12s} "
            f"{fmt_bytes(m['final_reserved_bytes']):>12s}"
        )
        print(
            f"  {'segment events':28s} {len(r['segment_events']):>12d} {len(m['segment_events']):>12d}"
            f"  {'same sizes, same order' if e['segment_events_match'] else 'they differ'}"
        )
        print(f"  {'final segments':28s} {r['final_segments']:>12d} {m['final_segments']:>12d}")
        print(f"  {'out of memory':28s} {r['ooms']:>12d} {m['ooms']:>12d}")
        frag, at = m["fragmentation_at_peak_bytes"], m["at_peak"]
        print(
            f"  at the modelled peak: {fmt_bytes(m['allocated_at_peak_bytes'])} allocated, "
            f"{fmt_bytes(frag)} reserved but unallocated"
        )
        if at:
            big = at["large"]
            print(
                f"    cached in the large pool {fmt_bytes(big['free_bytes'])} in "
                f"{big['free_blocks']} blocks (largest {fmt_bytes(big['largest_free_block'])}), "
                f"small pool {fmt_bytes(at['small']['free_bytes'])} in {at['small']['free_blocks']} blocks"
                + (
                    f", waiting on other streams {fmt_bytes(at['pending_free_bytes'])}"
                    if at["pending_free_bytes"]
                    else ""
                )
            )
        for note in m["notes"]:
            print(f"  note: {note}")
        w = e.get("what_if")
        if w:
            cap = w["capacity_bytes"]
            print(
                f"  what if {w['alloc_conf']}: peak reserved {fmt_bytes(w['peak_reserved_bytes'])} "
                f"({fmt_bytes(w['peak_reserved_bytes'] - m['peak_reserved_bytes'], signed=True)}), "
                f"{len(w['segment_events'])} segment events"
                + (
                    f"; with the {fmt_bytes(cap)} the recorded OOM shows the allocator had: "
                    + ("out of memory" if w["oom"] else "no out of memory")
                    if cap is not None
                    else "; no OOM recorded, capacity unknown: unlimited"
                )
            )
