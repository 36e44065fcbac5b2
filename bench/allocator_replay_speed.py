"""CPU time per trace event of replaying every bundled GPU snapshot
(`pipemem.allocator.snapshot.replay_device`), median of several runs.

    PYTHONPATH=. python bench/allocator_replay_speed.py [--runs R]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pipemem.allocator import snapshot as S

DATA = Path(__file__).resolve().parent / "data" / "allocator_snapshots"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    snaps = [S.load(str(p)) for p in sorted(DATA.glob("*.json.gz"))]
    n = sum(len(t) for s in snaps for t in s["device_traces"])
    cpu = []
    for _ in range(args.runs):
        c0 = time.process_time()
        for s in snaps:
            for d in S.devices(s):
                S.replay_device(s, d)
        cpu.append(time.process_time() - c0)
    c = statistics.median(cpu)
    print(
        f"{len(snaps)} files, {n} trace events, replay_device cpu median {c:.2f} s, "
        f"{c / n * 1e6:.2f} us/event "
        "(each replay runs the trace twice: the peak state)"
    )


if __name__ == "__main__":
    main()
