"""Template-mode speed: one Llama-3.1-405B plan, warm, and 10,000 distinct plans.

    python bench/bench_templates.py

Prints medians of several runs. "warm" = build_stage_jobs on a plan whose part analyses are
cached (the shape was seen before); "10,000 plans" starts from empty caches and includes
validate_plan, every liveness analysis of a new shape, stage composition and static bytes.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipemem.model import arch_from_hf_config  # noqa: E402
from pipemem.plan import ParallelPlan, validate_plan  # noqa: E402
from pipemem.stages import build_stage_jobs, clear_caches  # noqa: E402

LLAMA_405B = {"model_type": "llama", "hidden_size": 16384, "num_attention_heads": 128, "num_key_value_heads": 8,
              "num_hidden_layers": 126, "intermediate_size": 53248, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rope_theta": 500000.0}
# 32 virtual stages over 126 layers: one layer fewer on the first and last (embedding, head)
LAYOUT = (3,) + (4,) * 30 + (3,)


def the_plan() -> ParallelPlan:
    return ParallelPlan(tp=8, pp=16, vpp=2, dp=64, seq_len=8192, micro_batch=1, pp_layout=LAYOUT,
                        microbatches=32)


def distinct_plans(n: int, seed: int = 0) -> list[ParallelPlan]:
    rng = random.Random(seed)
    seen, out = set(), []
    pps = {1: [(126,)], 2: [(63, 63)], 3: [(42,) * 3], 6: [(21,) * 6], 7: [(18,) * 7], 9: [(14,) * 9],
           14: [(9,) * 14], 16: [None]}
    while len(out) < n:
        pp = rng.choice(sorted(pps))
        vpp = rng.choice([1, 2]) if pp in (7, 9, 16) else 1
        layout = None
        if pp == 16:
            vpp = 2
            layout = LAYOUT
        elif vpp == 2:
            layout = (126 // (2 * pp),) * (2 * pp)
        key = dict(tp=rng.choice([1, 2, 4, 8]), pp=pp, vpp=vpp, pp_layout=layout,
                   dp=rng.choice([1, 2, 4, 8, 16, 32, 64, 128]), zero=rng.choice([0, 1, 2, 3]),
                   micro_batch=rng.choice([1, 2]), seq_len=rng.choice([4096, 8192]),
                   recompute=rng.choice(["none", "selective", "full"]),
                   optimizer=rng.choice(["adamw", "sgd", "adam8bit"]),
                   master_weights=rng.choice([True, False]))
        key["microbatches"] = pp * rng.choice([1, 2, 4, 8])
        sig = tuple(sorted(key.items()))
        if sig in seen:
            continue
        seen.add(sig)
        out.append(ParallelPlan(**key))
    return out


def main() -> None:
    arch = arch_from_hf_config(LLAMA_405B, "llama3.1-405b")
    plan = the_plan()
    build_stage_jobs(arch, validate_plan(arch, plan))  # warm-up
    warm = []
    for _ in range(50):
        t = time.perf_counter()
        build_stage_jobs(arch, validate_plan(arch, plan))
        warm.append(time.perf_counter() - t)
    print(f"405B plan (tp 8, pp 16, vpp 2, dp 64, seq 8192, mbs 1), warm: median {statistics.median(warm) * 1e3:.2f} ms "
          f"over {len(warm)} runs")
    plans = distinct_plans(10_000)
    runs = []
    for _ in range(3):
        clear_caches()
        t = time.perf_counter()
        for p in plans:
            build_stage_jobs(arch, validate_plan(arch, p))
        runs.append(time.perf_counter() - t)
    print(f"10,000 distinct plans from empty caches: median {statistics.median(runs):.2f} s over {len(runs)} runs "
          f"({statistics.median(runs) / len(plans) * 1e3:.2f} ms per plan)")


if __name__ == "__main__":
    main()
