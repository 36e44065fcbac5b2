"""Template mode vs PaddleNLP's own programs, per card, at the seed's full size.

    PIPEMEM_PADDLENLP_PYTHON=~/venvs/paddlenlp/bin/python python bench/paddlenlp_templates.py \\
        [--json] [--more]

The seed's three runs (Paddle PR #63402: PaddleNLP Llama, llama-7b width, 4 layers, seq 2048,
fp32, no flash attention, 1F1B, gradient accumulation 8, run_pretrain_auto_static.py):
pp 4 batch 1 with full recompute, pp 4 batch 1 without, pp 2 x mp 2 batch 2 without. For
each, the same `--from-paddlenlp` line is estimated twice through `pipemem.estimate`:
with the paddle templates (no Paddle needed) and with `--exact` (PaddleNLP's own
programs, built by Paddle 3.3.1's passes for the first card of each stage; shapes only,
cached after the first run). Per pipeline rank: the forward step's net change and peak, the
backward step's peak (a step with its transfers: what `--exact` reports, and what the seed
measured per program), the optimizer's peak (each relative to the step's start), and the
rank's static bytes and replayed peak.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASE = (
    "--model_name_or_path facebook/llama-7b --max_seq_length 2048 --gradient_accumulation_steps 8 "
    "--use_flash_attention 0 --use_fused_rms_norm 0 --fp16 0 --num_hidden_layers 4 --enable_auto_parallel 1 "
    "--pipeline_schedule_mode 1F1B"
)
RUNS = {
    "pp4 b1 recompute full": "--pipeline_parallel_degree 4 --per_device_train_batch_size 1 --recompute 1 "
    "--recompute_granularity full --world_size 4",
    "pp4 b1": "--pipeline_parallel_degree 4 --per_device_train_batch_size 1 --recompute 0 --world_size 4",
    "pp2 x mp2 b2": "--pipeline_parallel_degree 2 --tensor_parallel_degree 2 --per_device_train_batch_size 2 "
    "--recompute 0 --world_size 4",
}
# Beyond the seed's runs (`--more`): the other switches the paddle templates model.
MORE = {
    "pp4 b1 full_attn": "--pipeline_parallel_degree 4 --per_device_train_batch_size 1 --recompute 1 "
    "--recompute_granularity full_attn --world_size 4",
    "pp4 b1 core_attn": "--pipeline_parallel_degree 4 --per_device_train_batch_size 1 --recompute 1 "
    "--recompute_granularity core_attn --world_size 4",
    "pp4 b1 flash": "--pipeline_parallel_degree 4 --per_device_train_batch_size 1 --recompute 0 "
    "--use_flash_attention 1 --world_size 4",
    "pp2 x mp2 b2 sp": "--pipeline_parallel_degree 2 --tensor_parallel_degree 2 "
    "--per_device_train_batch_size 2 --recompute 0 --sequence_parallel 1 --world_size 4",
}
QUANTITIES = (
    ("F", "net_bytes", "F net"),
    ("F", "peak_bytes", "F peak"),
    ("B", "peak_bytes", "B peak"),
    ("optimizer", "peak_bytes", "opt peak"),
)


def estimates(argv: str):
    from pipemem import estimate
    from pipemem.configs import read_paddlenlp

    tc = read_paddlenlp(shlex.split(BASE + " " + argv))
    ours = estimate(tc.model, **tc.plan)
    exact = estimate(tc.model, mode="paddle", **tc.plan)
    return ours, exact


def template_steps(est) -> dict:
    """The templates' stage jobs as steps, the way `--exact` reports Paddle's jobs: the
    received input allocated at the start of F and the sent output freed at its end, the
    received output grad at the start of B and the sent input grad freed at its end
    (`pipemem.runtime.fold_per_action`, Paddle's per-action runtime rule)."""
    from pipemem.runtime import fold_per_action
    from pipemem.stages import build_stage_jobs

    return fold_per_action(build_stage_jobs(est.arch, est.plan).stages)


def rows(name: str, ours, exact) -> list[dict]:
    out = []
    steps = template_steps(ours)
    for a, b in zip(ours.ranks, exact.ranks):
        for kind, key, label in QUANTITIES:
            t = a.jobs.get(kind) if kind == "optimizer" else getattr(steps[a.pp_rank], kind)
            e = b.jobs.get(kind)
            tv = getattr(t, key) if t else None
            ev = getattr(e, key) if e else None
            out.append(
                {
                    "run": name,
                    "pp_rank": a.pp_rank,
                    "quantity": label,
                    "templates": tv,
                    "programs": ev,
                    "rel_diff": None if not ev or tv is None else (tv - ev) / abs(ev),
                }
            )
        for label, tv, ev in (
            ("static", a.static.total, b.static.total),
            ("rank peak", a.peak_allocated_bytes, b.peak_allocated_bytes),
        ):
            out.append(
                {
                    "run": name,
                    "pp_rank": a.pp_rank,
                    "quantity": label,
                    "templates": tv,
                    "programs": ev,
                    "rel_diff": None if not ev else (tv - ev) / abs(ev),
                }
            )
    return out


def main() -> None:
    table = []
    runs = dict(RUNS, **(MORE if "--more" in sys.argv else {}))
    for name, argv in runs.items():
        ours, exact = estimates(argv)
        table += rows(name, ours, exact)
    if "--json" in sys.argv:
        print(json.dumps(table, indent=1))
        return
    mib = 1 << 20
    print(
        f"{'run':24s} {'rank':>4s} {'quantity':10s} {'templates MiB':>14s} {'programs MiB':>13s} {'diff':>8s}"
    )
    for r in table:
        fmt = lambda v: "-" if v is None else f"{v / mib:.1f}"  # noqa: E731
        d = "-" if r["rel_diff"] is None else f"{r['rel_diff'] * 100:+.1f}%"
        print(
            f"{r['run']:24s} {r['pp_rank']:>4d} {r['quantity']:10s} {fmt(r['templates']):>14s} "
            f"{fmt(r['programs']):>13s} {d:>8s}"
        )
    worst = max((abs(r["rel_diff"]) for r in table if r["rel_diff"] is not None), default=0)
    print(f"worst |diff| {worst * 100:.1f}%")


if __name__ == "__main__":
    main()
