"""The slowest plans `pipemem estimate` accepts: one plan at each size bound of `pipemem.plan`
(schedule length, searched schedules, layer count, sequence length), timed as the user runs
it: the whole command in a fresh process, OOM verdict with its engine-checked suggestions
included. Medians of several runs; wall and CPU seconds (the machine is shared).

    python bench/bench_bounds.py
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time

from pipemem.plan import LIMITS, MAX_SEARCHED_STAGE_MICROBATCHES, MAX_STAGE_MICROBATCHES

PLANS = [
    (
        f"1F1B, pp 8 x {MAX_STAGE_MICROBATCHES // 8} microbatches (stage-microbatch bound)",
        f"--model llama3-8b --pp 8 --microbatches {MAX_STAGE_MICROBATCHES // 8}",
    ),
    (
        f"ZBVPP, pp 8 x vpp 2 x {MAX_SEARCHED_STAGE_MICROBATCHES // 16} (searched-schedule bound)",
        f"--model llama3-8b --pp 8 --schedule ZBVPP --microbatches {MAX_SEARCHED_STAGE_MICROBATCHES // 16}",
    ),
    (
        f"auto, pp 4 x {MAX_SEARCHED_STAGE_MICROBATCHES // 4} (searched-schedule bound)",
        f"--model llama3-8b --pp 4 --schedule auto --microbatches {MAX_SEARCHED_STAGE_MICROBATCHES // 4}",
    ),
    (
        f"{LIMITS['layers']} layers, pp 128 x 1024 microbatches (layer bound)",
        f"--model llama3-8b --layers {LIMITS['layers']} --pp 128 --microbatches 1024",
    ),
    (
        f"seq {LIMITS['seq_len']}, tp 8 x cp 1024 (sequence bound)",
        f"--model llama3-8b --seq-len {LIMITS['seq_len']} --tp 8 --cp 1024",
    ),
]
RUNS = 3


def run(args: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pipemem", "estimate", *args.split(), "--gpu", "h100-80g"],
        check=True,
        capture_output=True,
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    print(f"{'plan':64s} {'wall median':>12s} {'cpu median':>11s}")
    for what, args in PLANS:
        times = [run(args) for _ in range(RUNS)]
        wall = statistics.median(t[0] for t in times)
        cpu = statistics.median(t[1] for t in times)
        print(f"{what:64s} {wall:11.2f}s {cpu:10.2f}s")


if __name__ == "__main__":
    main()
