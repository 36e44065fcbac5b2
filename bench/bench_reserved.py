"""Speed of reserved memory per rank (pipemem.reserved): what reading `peak_reserved_bytes`
of every rank adds to `pipemem.estimate`, for the 405B plan of bench_estimate.py.

    python bench/bench_reserved.py [--runs 20]

Three numbers, medians of wall (and CPU) time:
1. warm: the same plan estimated again and every rank's reserved read (what a repeated or
   interactive estimate pays; the per-plan cache answers);
2. cold streams: the allocation streams of every rank built from empty stream caches (the
   stage jobs warm), without the allocator;
3. cold: streams and the allocator model over every rank's stream, from empty caches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_estimate import PLAN_405B  # noqa: E402

import pipemem  # noqa: E402
from pipemem import alloc_stream, reserved  # noqa: E402


def timed(fn, runs: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def estimate_only():
    pipemem.estimate("llama3.1-405b", **PLAN_405B)


def estimate_and_reserved():
    e = pipemem.estimate("llama3.1-405b", **PLAN_405B)
    return e.max_peak_reserved_bytes


def clear_streams():
    alloc_stream.clear_caches()
    reserved.clear_cache()


def streams_only():
    clear_streams()
    e = pipemem.estimate("llama3.1-405b", **PLAN_405B)
    stage_plan, schedule = e.reserved_inputs
    from pipemem.runtime import lower

    low = lower(schedule, e.runtime)
    first = {s: m for s, m in stage_plan.first_backward_overrides(schedule)}
    return sum(
        len(
            alloc_stream.rank_stream(
                stage_plan, low, r.pp_rank, r.static, r.source[2], stage_plan.stages, first
            )
        )
        for r in e.ranks
    )


def cold():
    clear_streams()
    return estimate_and_reserved()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    n_events = streams_only()
    estimate_and_reserved()
    w0, c0 = timed(estimate_only, a.runs * 5)
    w1, c1 = timed(estimate_and_reserved, a.runs * 5)
    print(
        f"warm 405B estimate: {w0 * 1e3:.3f} ms wall ({c0 * 1e3:.3f} CPU); with every rank's reserved read: "
        f"{w1 * 1e3:.3f} ms wall ({c1 * 1e3:.3f} CPU): +{(w1 - w0) * 1e3:.3f} ms"
    )
    w, c = timed(streams_only, max(3, a.runs // 4))
    print(
        f"cold allocation streams, 16 ranks, {n_events:,} events: {w * 1e3:.1f} ms wall ({c * 1e3:.1f} CPU)"
    )
    w, c = timed(cold, max(3, a.runs // 4))
    print(f"cold streams + allocator model, 16 ranks: {w * 1e3:.1f} ms wall ({c * 1e3:.1f} CPU)")


if __name__ == "__main__":
    main()
