"""Per-event cost of the caching-allocator model (pipemem.allocator.simulate), and of the
per-(pool, stream) replay that reserved memory uses (pipemem.allocator.pools.peak_reserved_bytes).

A synthetic training-like stream: per layer forward a few activations of MiB size kept for
backward plus short-lived temporaries (some below 1 MiB), the backward freeing them in reverse,
repeated over microbatches. Prints the median over several runs of the cost per event (wall
and CPU time: on a shared machine the CPU time is the steadier number).

    PYTHONPATH=. python bench/allocator_speed.py [--events N] [--runs R]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from pipemem.allocator import AllocatorConfig, simulate
from pipemem.allocator.pools import peak_reserved_bytes


def stream(n_events: int, seed: int = 0) -> list:
    rnd = random.Random(seed)
    sizes = [
        rnd.choice([4096, 65536, 512 * 1024, 3 << 20, 8 << 20, 16 << 20, 48 << 20, 100 << 20])
        for _ in range(64)
    ]
    ev, key = [], 0
    while len(ev) < n_events:
        kept = []
        for layer in range(32):
            for j in range(4):
                key += 1
                ev.append((sizes[(layer * 4 + j) % 64], 0, key))
                kept.append(key)
            for j in range(3):  # temporaries
                key += 1
                ev.append((sizes[(layer + j * 7) % 64] // 2 + 512, 0, key))
                ev.append((0, 0, key))
        for k in reversed(kept):  # backward
            key += 1
            ev.append((sizes[k % 64], 0, key))
            ev.append((0, 0, key))
            ev.append((0, 0, k))
    return ev[:n_events] if _balanced(ev[:n_events]) else ev


def _balanced(ev) -> bool:
    live = set()
    for size, _, k in ev:
        if size > 0:
            live.add(k)
        elif k not in live:
            return False
        else:
            live.discard(k)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    ev = stream(args.events)
    for conf in ("", "expandable_segments:True", "max_split_size_mb:128"):
        cfg = AllocatorConfig.parse(conf)
        wall, cpu = [], []
        for _ in range(args.runs):
            t0, c0 = time.perf_counter(), time.process_time()
            r = simulate(ev, cfg)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        w, c = statistics.median(wall), statistics.median(cpu)
        print(
            f"{conf or 'defaults':26s} {len(ev):>7d} events  median wall {w * 1e3:7.1f} ms "
            f"({w / len(ev) * 1e6:5.2f} us/event), cpu {c / len(ev) * 1e6:5.2f} us/event  "
            f"(peak reserved {r.peak_reserved_bytes / 2**30:.2f} GiB, "
            f"{len(r.segment_events)} segment events)"
        )
    signed = np.array([size if size > 0 else -1 for size, _, _ in ev], np.int64)
    streams = np.array([stream for _, stream, _ in ev], np.int64)
    handles = np.array([key for _, _, key in ev], np.int64)
    cpu, peak = [], 0
    for _ in range(args.runs):
        c0 = time.process_time()
        peak = peak_reserved_bytes(signed, streams, handles)
        cpu.append(time.process_time() - c0)
    c = statistics.median(cpu)
    print(
        f"{'pools (per part)':26s} {len(ev):>7d} events  median cpu {c * 1e3:7.1f} ms "
        f"({c / len(ev) * 1e6:5.2f} us/event)  (peak reserved {peak / 2**30:.2f} GiB)"
    )


if __name__ == "__main__":
    main()
