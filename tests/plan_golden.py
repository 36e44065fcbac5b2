"""A sample of `pipemem plan` outputs, to the byte: a few small plan searches, every plan they
list (flags, per-rank allocated peaks, cost, device peak, verdict) once the shown plans are
judged with no time limit, and each judged plan's per-rank peak reserved bytes.

    PYTHONPATH=$PWD python tests/plan_golden.py --write   # regenerate tests/data/plan_golden.json
    PYTHONPATH=$PWD python tests/plan_golden.py           # compare the current code with it

tests/test_plan_golden.py holds the current code to the committed file, so work on the speed of
the search, of the estimate or of the allocator replay cannot change a listed plan, a peak or a
verdict unnoticed. Regenerate only for a change meant to move numbers, and review the diff.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "data" / "plan_golden.json"

# (name, model, gpus, gpu, gpus per node, seq, global batch, convention, micro-batches, max vpp, top)
CASES = (
    ("megatron-1b-16xrtx3090", "llama3.2-1b", 16, "rtx3090", 8, 4096, 64, "megatron", (1, 2, 4), 4, 6),
    ("hf-3b-8xrtx3090", "llama3.2-3b", 8, "rtx3090", 8, 2048, 32, "hf", (1, 2), 2, 6),
    ("torchtitan-1b-8xrtx3090-b256", "llama3.2-1b", 8, "rtx3090", 8, 2048, 256, "torchtitan", (1, 2), 2, 4),
)


def run_case(case, jobs: int = 1) -> dict:
    from pipemem.estimate import estimate
    from pipemem.planner import SpaceOptions, Target, search_plans
    from pipemem.planner.hardware import speeds_for
    from pipemem.presets import gpu_info

    name, model, gpus, gpu, per_node, seq, batch, conv, mbs, max_vpp, top = case
    target = Target(gpus, gpu_info(gpu)["bytes"], 0, speeds_for(gpu), gpu=gpu, gpus_per_node=per_node)
    res = search_plans(
        model, target, seq, batch, SpaceOptions(convention=conv, micro_batches=mbs, max_vpp=max_vpp)
    )
    dropped = res.verify(top, float("inf"), jobs)
    judged = []
    for p in res.plans:
        if p.verdict is None:
            continue
        e = estimate(model, gpu=gpu, **p.kwargs)
        judged.append(
            {"flags": p.flags, "rank_peak_reserved_bytes": [r.peak_reserved_bytes for r in e.ranks]}
        )
    stats = {k: v for k, v in res.stats.to_dict().items() if k != "seconds"}
    return {
        "name": name,
        "dropped": dropped,
        "stats": stats,
        "plans": [p.to_dict() for p in res.plans],
        "pareto": [p.flags for p in res.pareto],
        "pareto_step_time": [p.flags for p in res.pareto_step_time],
        "judged": judged,
    }


def main() -> int:
    got = {c[0]: run_case(c) for c in CASES}
    text = json.dumps(got, indent=1, sort_keys=True) + "\n"
    if "--write" in sys.argv:
        GOLDEN.write_text(text)
        print(f"wrote {GOLDEN} ({len(text):,} bytes)")
        return 0
    want = json.loads(GOLDEN.read_text())
    bad = [k for k in want if want[k] != got.get(k)]
    print("identical" if not bad else f"differs: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
