"""Speed of the calls users make: `pipemem.estimate(...)` and the `pipemem` command.

    python bench/bench_estimate.py            # everything (a few minutes on 2 cores)
    python bench/bench_estimate.py --quick    # fewer runs and 1,000 distinct plans

Sections (each prints medians of several runs):
1. one warm Llama-3.1-405B plan (tp 8, pp 16, vpp 2, dp 64, 32 microbatches, seq 8192,
   pp_layout [3]+[4]*30+[3]) through `pipemem.estimate` (part analyses cached by an earlier
   call, as in a process that estimates many plans);
2. 10,000 distinct 405B plans through `pipemem.estimate`, from empty caches;
3. the command line in a fresh process: `pipemem schedule Interleaved1F1B --pp 64 --vpp 2
   --microbatches 1024 --json`, `pipemem estimate --model llama3-8b --layers 16384` (the most
   plan.LIMITS accepts: `--layers 100000000` is now refused with exit 2),
   and `pipemem estimate` on large plans (interpreter start-up and imports included).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pipemem  # noqa: E402
from pipemem.stages import clear_caches  # noqa: E402

LAYOUT = (3,) + (4,) * 30 + (3,)
WARM_TARGET_MS = 0.2
PLAN_405B = dict(tp=8, pp=16, vpp=2, dp=64, microbatches=32, seq_len=8192, micro_batch=1, pp_layout=LAYOUT)

CLI = [
    (
        "schedule",
        ["schedule", "Interleaved1F1B", "--pp", "64", "--vpp", "2", "--microbatches", "1024", "--json"],
    ),
    ("16384 layers", ["estimate", "--model", "llama3-8b", "--layers", "16384"]),
    (
        "70b 64 GPUs",
        [
            "estimate",
            "--model",
            "llama3-70b",
            "--gpu",
            "h100-80g",
            "--dp",
            "2",
            "--tp",
            "8",
            "--pp",
            "4",
            "--microbatches",
            "16",
            "--json",
        ],
    ),
    (
        "405b 1152 GPUs",
        [
            "estimate",
            "--model",
            "llama3.1-405b",
            "--gpu",
            "h100-80g",
            "--dp",
            "16",
            "--tp",
            "8",
            "--pp",
            "9",
            "--vpp",
            "2",
            "--microbatches",
            "144",
            "--json",
        ],
    ),
    (
        "mixtral ZB-V",
        [
            "estimate",
            "--model",
            "mixtral-8x22b",
            "--gpu",
            "h100-80g",
            "--dp",
            "8",
            "--tp",
            "4",
            "--ep",
            "8",
            "--pp",
            "4",
            "--microbatches",
            "32",
            "--schedule",
            "ZBVZeroBubble",
            "--json",
        ],
    ),
]


def distinct_plans(n: int, seed: int = 0) -> list[dict]:
    """n different 405B plans (tp, pp, vpp, dp, zero, micro-batch, seq, recompute, optimizer,
    master weights, microbatches)."""
    rng = random.Random(seed)
    seen, out = set(), []
    pps = {1: None, 2: None, 3: None, 6: None, 7: None, 9: None, 14: None, 16: LAYOUT}
    while len(out) < n:
        pp = rng.choice(sorted(pps))
        vpp = rng.choice([1, 2]) if pp in (7, 9) else (2 if pp == 16 else 1)
        key = dict(
            tp=rng.choice([1, 2, 4, 8]),
            pp=pp,
            vpp=vpp,
            dp=rng.choice([1, 2, 4, 8, 16, 32, 64, 128]),
            zero=rng.choice([0, 1, 2, 3]),
            micro_batch=rng.choice([1, 2]),
            seq_len=rng.choice([4096, 8192]),
            recompute=rng.choice(["none", "selective", "full"]),
            optimizer=rng.choice(["adamw", "sgd", "adam8bit"]),
            master_weights=rng.choice([True, False]),
            microbatches=pp * rng.choice([1, 2, 4, 8]),
        )
        if pps[pp] is not None:
            key["pp_layout"] = pps[pp]
        sig = tuple(sorted(key.items()))
        if sig not in seen:
            seen.add(sig)
            out.append(key)
    return out


def warm_405b(runs: int) -> None:
    pipemem.estimate("llama3.1-405b", **PLAN_405B)
    times, cpu = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        pipemem.estimate("llama3.1-405b", **PLAN_405B)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    med = statistics.median(cpu)
    print(
        f"warm 405B plan via pipemem.estimate: median {statistics.median(times) * 1e3:.3f} ms wall, "
        f"{med * 1e3:.3f} ms CPU over {runs} runs "
        f"(wall min {min(times) * 1e3:.3f}, max {max(times) * 1e3:.3f}); target <= {WARM_TARGET_MS} ms CPU: "
        f"{'met' if med * 1e3 <= WARM_TARGET_MS else 'NOT met'}"
    )


def many_plans(n: int, repeats: int) -> None:
    plans = distinct_plans(n)
    runs, cpu = [], []
    for _ in range(repeats):
        clear_caches()
        t, c = time.perf_counter(), time.process_time()
        for p in plans:
            pipemem.estimate("llama3.1-405b", **p)
        runs.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    med = statistics.median(runs)
    print(
        f"{n:,} distinct 405B plans via pipemem.estimate from empty caches: median {med:.2f} s wall, "
        f"{statistics.median(cpu):.2f} s CPU over {repeats} runs ({med / n * 1e3:.2f} ms per plan; "
        f"wall runs {', '.join(f'{r:.2f}' for r in runs)})"
    )


def cli(runs: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for what, args in CLI:
        times, cpu = [], []
        for _ in range(runs):
            t = time.perf_counter()
            before = os.times()
            subprocess.run([sys.executable, "-m", "pipemem", *args], check=True, capture_output=True, env=env)
            after = os.times()
            times.append(time.perf_counter() - t)
            cpu.append(
                (after.children_user - before.children_user)
                + (after.children_system - before.children_system)
            )
        print(
            f"cli {what:16s} median {statistics.median(times):.3f} s wall, "
            f"{statistics.median(cpu):.3f} s CPU "
            f"over {runs} runs (wall min {min(times):.3f}, max {max(times):.3f}): pipemem {' '.join(args)}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warm-only", action="store_true", help="only the warm 405B plan (section 1)")
    a = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    warm_405b(50 if a.quick else 200)
    if a.warm_only:
        return
    many_plans(1000 if a.quick else 10_000, 1 if a.quick else 3)
    cli(3 if a.quick else 5)


if __name__ == "__main__":
    main()
