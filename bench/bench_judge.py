"""CPU time of `pipemem plan`'s two phases, in one process, serially (`--jobs 1`): the search,
then judging every shown plan with reserved memory (`PlanSearch.verify` with no time limit:
each plan's `pipemem estimate` verdict, every rank's allocation stream through the allocator
model). The whole command runs the search in `--jobs` processes and judges for at most
`--judge-seconds`; this measures the work itself, which the machine's load moves less.

    python bench/bench_judge.py                 # Llama 3 70B on 64 H100s (bench_plan.py's case)
    python bench/bench_judge.py --case 405b
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan import CASES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=sorted(CASES), default="70b")
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    from pipemem.cli.cmd_plan import build_inputs
    from pipemem.cli.main import build_parser
    from pipemem.planner import search_plans

    what, args = CASES[a.case]
    ns = build_parser().parse_args(["plan", *args])
    target, options, extra = build_inputs(ns)
    c0 = time.process_time()
    res = search_plans(ns.model, target, ns.seq_len, ns.global_batch, options, extra=extra)
    c1 = time.process_time()
    dropped = res.verify(a.top, float("inf"), 1)
    c2 = time.process_time()
    judged = [p for p in res.plans if p.verdict is not None]
    digest = hashlib.sha256(
        repr([(p.flags, p.rank_peaks, p.device_peak_bytes, p.verdict) for p in res.plans]).encode()
    ).hexdigest()[:16]
    print(
        f"{what}: search {c1 - c0:.1f} s CPU ({res.stats.estimates:,} estimates, {len(res.plans):,} fit); "
        f"judging the shown plans {c2 - c1:.1f} s CPU ({len(judged)} judged, {dropped} dropped); "
        f"listing sha256 {digest}"
    )


if __name__ == "__main__":
    main()
