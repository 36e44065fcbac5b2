"""The steady-state shortcut of the allocator replay, plan by plan: for each rank, the events the
allocator model replays, whether a repeating stretch was found (`alloc_stream.find_period`), how
many of its windows were skipped because the allocator's state repeated
(`CachingAllocator.run_periodic`), the CPU time of the full replay and of the shortcut, and
whether both give the same result (they must).

    python bench/bench_steady_shortcut.py            # the plans below
    python bench/bench_steady_shortcut.py --quick    # the small ones only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# small plans, then plans `pipemem plan` shows for Llama 3 70B on 64 H100s (seq 4096, batch 512)
PLANS = [
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=128), True),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=128, recompute="full"), True),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, vpp=2, microbatches=64), True),
    ("llama3.2-1b", dict(gpu="rtx3090", pp=4, microbatches=64, dp=2, convention="torchtitan"), True),
    ("llama3-70b", dict(gpu="h100-80g", dp=2, tp=2, pp=8, microbatches=128, dist_opt=True), False),
    ("llama3-70b", dict(gpu="h100-80g", dp=1, tp=2, pp=8, vpp=5, microbatches=256, dist_opt=True), False),
    (
        "llama3-70b",
        dict(gpu="h100-80g", dp=2, tp=4, pp=8, vpp=5, micro_batch=4, microbatches=64, recompute="full"),
        False,
    ),
    ("llama3-70b", dict(gpu="h100-80g", dp=2, tp=8, pp=4, microbatches=64), False),
]


def main() -> None:
    from pipemem.alloc_stream import StreamNotModelled, rank_stream_period
    from pipemem.allocator import simulate
    from pipemem.estimate import estimate
    from pipemem.runtime import lower

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    tot_full = tot_short = 0.0
    print(
        f"{'plan':72s} {'rank':>4s} {'events':>8s} {'windows':>8s} {'skipped':>8s} "
        f"{'full s':>7s} {'short s':>7s}"
    )
    for model, kw, small in PLANS:
        if a.quick and not small:
            continue
        e = estimate(model, **kw)
        sp, sched = e.reserved_inputs
        low = lower(sched, e.runtime)
        first_mb = {s: m for s, m in sp.first_backward_overrides(sched)}
        label = model + " " + " ".join(f"{k}={v}" for k, v in kw.items() if k != "gpu")
        for r in e.ranks:
            try:
                ev, inp, period = rank_stream_period(
                    sp, low, r.pp_rank, r.static, r.source[2], sp.stages, first_mb
                )
            except StreamNotModelled as x:
                print(f"{label:72s} {r.pp_rank:4d} not modelled: {str(x)[:40]}")
                continue
            t = time.process_time()
            full = simulate(inp[:], "")
            t1 = time.process_time()
            short = simulate(inp, "", period=period) if period is not None else full
            t2 = time.process_time()
            if (
                short.peak_reserved_bytes != full.peak_reserved_bytes
                or short.segment_events != full.segment_events
            ):
                raise SystemExit(f"DIFFERS: {label} rank {r.pp_rank}")
            tot_full += t1 - t
            tot_short += (t2 - t1) if period is not None else (t1 - t)
            short_s = t2 - t1 if period is not None else t1 - t
            print(
                f"{label:72s} {r.pp_rank:4d} {len(inp):8d} {period.count if period else '-':>8} "
                f"{short.windows_skipped if period else '-':>8} {t1 - t:7.3f} {short_s:7.3f}"
            )
    print(f"total CPU: full replay {tot_full:.2f} s, with the shortcut {tot_short:.2f} s (same results)")


if __name__ == "__main__":
    main()
