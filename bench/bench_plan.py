"""Speed of `pipemem plan`: the whole command in a fresh process (interpreter start-up and
imports included), median of several runs, wall and CPU seconds (the development machine's
cores are shared, so wall time moves with the load; CPU time much less).

    python bench/bench_plan.py            # both cases, 3 runs each
    python bench/bench_plan.py --runs 5 --case 70b
    python bench/bench_plan.py --runs 1 --check 30   # also re-estimate 30 listed plans per case
                                                     # with `pipemem estimate <flags>`
    python bench/bench_plan.py --case 70b --no-prune # in process, without the static bound and the
                                                     # shared ladder: estimate calls and CPU

Targets (wall, median): 70B on 64 GPUs <= 2 s; 405B on 16,384 GPUs <= 3 s (`TARGETS`); each line
says whether it was met, and how many listed plans were judged with reserved memory (the rest
screened).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

TARGETS = {"70b": 2.0, "405b": 3.0}  # seconds of wall time, median
CASES = {
    "70b": (
        "llama3-70b on 64 x h100-80g, seq 4096, batch 512",
        [
            "--model",
            "llama3-70b",
            "--gpus",
            "64",
            "--gpu",
            "h100-80g",
            "--seq-len",
            "4096",
            "--global-batch",
            "512",
        ],
    ),
    "405b": (
        "llama3.1-405b on 16384 x h100-80g, seq 8192, batch 2048",
        [
            "--model",
            "llama3.1-405b",
            "--gpus",
            "16384",
            "--gpu",
            "h100-80g",
            "--seq-len",
            "8192",
            "--global-batch",
            "2048",
        ],
    ),
}


def run_once(args: list[str]) -> tuple[float, float, dict]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "pipemem", "plan", *args, "--json", "--no-progress"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    ap.add_argument(
        "--no-prune",
        action="store_true",
        help="run the search with and without pruning (one process each); print calls and CPU",
    )
    ap.add_argument("--one-search", choices=("prune", "no-prune"), help=argparse.SUPPRESS)
    ap.add_argument("plan_args", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument(
        "--check",
        type=int,
        default=0,
        metavar="N",
        help="re-estimate N random listed plans with `pipemem estimate FLAGS --json`",
    )
    a = ap.parse_args()
    if a.one_search:
        one_search(a.one_search, a.plan_args)
        return
    for key in a.case or list(CASES):
        what, args = CASES[key]
        if a.no_prune:
            compare_pruning(what, args)
            continue
        walls, cpus = [], []
        for _ in range(a.runs):
            wall, cpu, d = run_once(args)
            walls.append(wall)
            cpus.append(cpu)
        s = d["search"]
        print(
            f"{what}: median {statistics.median(walls):.1f} s wall / {statistics.median(cpus):.1f} s CPU "
            f"over {a.runs} runs (wall {min(walls):.1f}-{max(walls):.1f}); {s['proposed']:,} proposed, "
            f"{sum(s['invalid'].values()):,} invalid, {s['pruned_by_static_bound']:,} pruned by static "
            f"bytes, {s['estimate_calls']:,} estimates, {len(d['plans']):,} fit, "
            f"{sum(p['verdict'] is not None for p in d['plans'])} judged with reserved; target "
            f"<= {TARGETS[key]:g} s: {'met' if statistics.median(walls) <= TARGETS[key] else 'NOT met'}"
        )
        sys.stdout.flush()
        if a.check:
            check(d["plans"], a.check)


def compare_pruning(what: str, args: list[str]) -> None:
    """The same search with and without the exact pruning (search_plans(prune=False)), each in
    a fresh process so that neither inherits the other's caches."""
    runs = {}
    for prune in ("prune", "no-prune"):
        out = subprocess.run(
            [sys.executable, __file__, "--one-search", prune, "--", *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        runs[prune] = json.loads(out)
    a, b = runs["prune"], runs["no-prune"]
    print(
        f"{what}: pruned {a['calls']:,} estimate calls, {a['cpu']:.1f} s CPU; without pruning "
        f"{b['calls']:,} calls, {b['cpu']:.1f} s CPU; {a['plans']:,} plans, listings identical: "
        f"{a['listing'] == b['listing']}"
    )


def one_search(mode: str, args: list[str]) -> None:
    import hashlib

    from pipemem.cli.cmd_plan import build_inputs
    from pipemem.cli.main import build_parser
    from pipemem.planner import search_plans

    ns = build_parser().parse_args(["plan", *args])
    target, options, extra = build_inputs(ns)
    c = time.process_time()
    res = search_plans(
        ns.model, target, ns.seq_len, ns.global_batch, options, extra=extra, prune=mode == "prune"
    )
    cpu = time.process_time() - c
    listing = hashlib.sha256(repr([(p.flags, p.rank_peaks) for p in res.plans]).encode()).hexdigest()
    print(json.dumps({"cpu": cpu, "calls": res.stats.estimates, "plans": len(res.plans), "listing": listing}))


def check(plans: list[dict], n: int) -> None:
    """The acceptance check at scale: each sampled plan's flags, run through `pipemem estimate`,
    give the bytes the planner listed."""
    import random
    import shlex

    sample = random.Random(18).sample(plans, min(n, len(plans)))
    same = 0
    for p in sample:
        out = subprocess.run(
            [sys.executable, "-m", "pipemem", "estimate", *shlex.split(p["flags"]), "--json"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        got = json.loads(out)
        ok = (
            got["max_peak_allocated_bytes"] == p["max_peak_allocated_bytes"]
            and [r["peak_allocated_bytes"] for r in got["ranks"]] == p["rank_peak_allocated_bytes"]
        )
        same += ok
        if not ok:
            print(
                f"  DIFFERS: {p['flags']}: plan {p['max_peak_allocated_bytes']}, estimate "
                f"{got['max_peak_allocated_bytes']}"
            )
    print(
        f"  re-estimated {len(sample)} listed plans with their flags: {same} give "
        "the same bytes on every rank"
    )


if __name__ == "__main__":
    main()
