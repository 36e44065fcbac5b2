"""Speed of `pipemem estimate` (templates mode) on large plans: median of several runs of the
Python API (model -> stage jobs -> schedule -> replay -> Estimate), and of the whole command
in a fresh process (interpreter start-up and imports included).

    python bench/bench_estimate.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

PLANS = [
    ("llama3-70b", dict(dp=2, tp=8, pp=4, microbatches=16), "64 GPUs, 1F1B"),
    ("llama3.1-405b", dict(dp=16, tp=8, pp=9, vpp=2, microbatches=144), "1152 GPUs, VPP"),
    ("llama3-70b", dict(dp=16, tp=8, pp=8, microbatches=1024), "1024 GPUs, 1024 microbatches"),
    ("mixtral-8x22b", dict(dp=8, tp=4, ep=8, pp=4, microbatches=32, schedule="ZBVZeroBubble"), "128 GPUs, ZB-V"),
]
RUNS = 5


def main() -> None:
    from pipemem.estimate import estimate

    print(f"{'model':15s} {'plan':32s} {'api median':>11s} {'cli median':>11s}")
    for model, plan, what in PLANS:
        api = []
        for _ in range(RUNS):
            t = time.perf_counter()
            estimate(model, gpu="h100-80g", **plan)
            api.append(time.perf_counter() - t)
        args = [sys.executable, "-m", "pipemem", "estimate", "--model", model, "--gpu", "h100-80g", "--json"]
        for k, v in plan.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        cli = []
        for _ in range(RUNS):
            t = time.perf_counter()
            subprocess.run(args, check=True, capture_output=True)
            cli.append(time.perf_counter() - t)
        print(f"{model:15s} {what:32s} {statistics.median(api):10.3f}s {statistics.median(cli):10.3f}s")


if __name__ == "__main__":
    main()
