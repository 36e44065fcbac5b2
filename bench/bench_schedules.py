"""Schedule generation, replay and time simulation at p=64, v=2, m=1024 (262,144+ actions).

    python bench/bench_schedules.py            # medians of 5 runs
    python bench/bench_schedules.py --runs 3 --names Interleaved1F1B

Targets (issue #5): replay <= 0.5 s and generation <= 1 s for Interleaved1F1B at this size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pipemem.jobs import JobMemory, StageJobs  # noqa: E402
from pipemem.replay import replay  # noqa: E402
from pipemem.schedules import get_schedule  # noqa: E402
from pipemem.schedules.check import TimeModel, check_schedule, simulate  # noqa: E402
from pipemem.schedules.unit_jobs import unit_jobs  # noqa: E402
from pipemem.schedules.zb_scheduler import memory_limited_schedule  # noqa: E402

NAMES = ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "VHalf"]


def median_time(fn, runs):
    """Median wall time and median CPU time of this process (the machine is shared: CPU time
    shows what the code costs when other work takes the cores)."""
    wall, cpu = [], []
    out = None
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return (statistics.median(wall), statistics.median(cpu)), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--vpp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--names", nargs="*", default=NAMES)
    args = ap.parse_args()
    pp, v, m = args.pp, args.vpp, args.microbatches
    # byte-sized jobs of a mid-size model stage: F keeps 1.5 GiB, I leaves 0.6 GiB for W
    gib = 1 << 30
    jobs = {
        s: StageJobs(
            s,
            F=JobMemory(3 * gib // 2, 2 * gib),
            B=JobMemory(-3 * gib // 2, gib // 3),
            I=JobMemory(-9 * gib // 10, gib // 4),
            W=JobMemory(-6 * gib // 10, gib // 8),
        )
        for s in range(pp * v)
    }
    static = [20 * gib] * pp
    print(
        f"pp={pp} vpp={v} microbatches={m}, median of {args.runs} runs (load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    print("seconds as wall / cpu")
    print(f"{'schedule':<24}{'actions':>9}{'generate':>16}{'replay':>16}{'check+simulate':>18}")
    for name in args.names:
        gen, sched = median_time(lambda name=name: get_schedule(name, pp, m, v), args.runs)
        rep, _ = median_time(lambda sched=sched: replay(sched, jobs, static), args.runs)
        sim, _ = median_time(lambda sched=sched: check_schedule(sched, TimeModel()), max(1, args.runs // 2))
        cols = "".join(f"{f'{w:.3f} / {c:.3f}':>16}" for w, c in (gen, rep))
        print(f"{name:<24}{sched.num_actions:>9}{cols}{f'{sim[0]:.3f} / {sim[1]:.3f}':>18}")
    p2, m2 = 8, 64
    jobs2 = unit_jobs(p2, 1)
    zb, sched = median_time(
        lambda: memory_limited_schedule(p2, m2, jobs2, TimeModel(), p2), max(1, args.runs // 2)
    )
    sim = simulate(sched, TimeModel())
    print(
        f"memory-limited scheduler pp={p2} m={m2} limit={p2} microbatches: {zb[0]:.3f} / {zb[1]:.3f} s "
        f"(bubble {sim.bubble_ratio:.1%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
