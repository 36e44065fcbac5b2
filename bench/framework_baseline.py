"""Write (or check) tests/data/framework_baseline.json: `pipemem.estimate` over a broad sample of
plans (every convention x pipeline / tensor / sequence / sharding / recompute / precision /
optimizer / feature variants x a few models), each with its per-rank bytes, warnings, resolved
plan and suggestion levers, or the one-line error a refused plan gets.

    PYTHONPATH=$PWD python bench/framework_baseline.py            # rewrite the JSON
    PYTHONPATH=$PWD python bench/framework_baseline.py --check    # compare against it

tests/test_frameworks_baseline.py holds the current code to every number in the file, so a
refactor that should not change behaviour can prove it did not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "framework_baseline.json"
CONVENTIONS = ("megatron", "paddle", "torchtitan", "hf", "torchtune")

# plan variants tried under every convention (small models, few layers: the rules, not the size)
VARIANTS = [
    {},
    {"dp": 2},
    {"tp": 2},
    {"tp": 4, "sp": False},
    {"tp": 2, "recompute_allgather": True},
    {"pp": 4, "microbatches": 8},
    {"pp": 2, "vpp": 2, "microbatches": 4},
    {"pp": 2, "vpp": 2, "microbatches": 3},
    {"pp": 2, "microbatches": 4, "schedule": "ZBH1"},
    {"pp": 2, "microbatches": 4, "schedule": "Interleaved1F1B", "vpp": 2},
    {"dp": 4, "zero": 1},
    {"dp": 4, "zero": 2},
    {"dp": 4, "zero": 3},
    {"dp": 4, "fsdp": True},
    {"dp": 4, "dist_opt": True},
    {"dp": 2, "grads": "ddp-bucket-view"},
    {"recompute": "selective"},
    {"recompute": "full"},
    {"recompute": "full", "recompute_layers": 2, "pp": 2, "microbatches": 2},
    {"recompute": "core_attn", "tp": 2},
    {"dtype": "fp32"},
    {"dtype": "fp16"},
    {"master_weights": False},
    {"optimizer": "sgd"},
    {"optimizer": "adam8bit"},
    {"optimizer_impl": "for-loop"},
    {"step": "first"},
    {"cp": 2},
    {"flash_attn": False},
    {"loss": "chunked"},
    {"loss": "fused"},
    {"loss": "shifted"},
    {"loss": "fused_linear"},
    {"compile": True},
    {"fp8": "delayed"},
    {"fp8": "tensorwise"},
    {"activation_offload": "all"},
    {"optimizer_offload": 1.0, "dp": 2, "zero": 2},
    {"optimizer_in_backward": True},
    {"dp": 2, "fsdp": True, "extra": {"fsdp_reshard_head": True}},
    {"extra": {"precision_aware_optimizer": True}, "optimizer_state_dtype": "bf16"},
    {"tp": 2, "extra": {"fuse_qkv": True, "fuse_gate_up": True}},
    {"tp": 2, "extra": {"wgrad_fused": False, "grad_clip": False}},
    {"activation_offload": "core_attn,mlp"},
    {"optimizer_offload": 0.5, "dp": 2, "dist_opt": True},
    {"optimizer_offload": 1.0, "dp": 2, "zero": 1},
    {"fp8": "delayed", "fp8_param_gather": True},
    {"fp8": "rowwise", "dp": 2, "fsdp": True, "fp8_param_gather": True},
    {"pp": 2, "microbatches": 4, "runtime": "torch"},
    {"pp": 2, "microbatches": 4, "runtime": "megatron"},
    {"pp": 2, "microbatches": 4, "schedule": "ZBVZeroBubble"},
    {"dp": 2, "grads": "set-to-none", "step": "first", "optimizer_impl": "foreach"},
]

# (model, base kwargs): a dense Llama, GPT-2's Conv1D / GeLU layers, two MoE models
MODELS = [
    ("llama3.2-1b", {"seq_len": 1024, "layers": 8}),
    ("gpt2", {"seq_len": 512, "layers": 4}),
    ("mixtral-8x7b", {"seq_len": 1024, "layers": 4}),
    ("qwen3-30b-a3b", {"seq_len": 512, "layers": 4}),
]
MOE_VARIANTS = [
    {},
    {"dp": 2, "ep": 2},
    {"tp": 2, "dp": 2, "ep": 2},
    {"dp": 4, "ep": 2, "fsdp": True},
    {"recompute": "selective", "dp": 2, "ep": 2},
]


def cases() -> list[dict]:
    out = []
    for conv in CONVENTIONS:
        base_model, base = MODELS[0]
        for v in VARIANTS:
            out.append({"model": base_model, "kwargs": {**base, "convention": conv, **v}})
        gpt_model, gpt = MODELS[1]
        for v in ({}, {"tp": 2}, {"dp": 2, "zero": 3}, {"recompute": "selective"}, {"flash_attn": False}):
            out.append({"model": gpt_model, "kwargs": {**gpt, "convention": conv, **v}})
        for moe_model, moe in MODELS[2:]:
            for v in MOE_VARIANTS:
                out.append({"model": moe_model, "kwargs": {**moe, "convention": conv, **v}})
    for conv in ("HF", "Torchtitan", "deepspeed", "nemo"):  # case, and names that are no convention
        out.append({"model": MODELS[0][0], "kwargs": {**MODELS[0][1], "convention": conv, "dp": 2}})
        out.append(
            {
                "model": MODELS[0][0],
                "kwargs": {**MODELS[0][1], "convention": conv, "pp": 2, "vpp": 2, "microbatches": 4},
            }
        )
    # refusals of the other modes, before anything is traced or built
    for conv, mode in (
        ("torchtune", "traced"),
        ("Torchtune", "traced"),
        ("hf", "paddle"),
        ("megatron", "paddle"),
        ("nemo", "traced"),
    ):
        out.append(
            {
                "model": MODELS[0][0],
                "kwargs": {**MODELS[0][1], "convention": conv, "mode": mode, "dp": 2, "tp": 1},
            }
        )
    out.append(
        {
            "model": "llama3-8b",
            "kwargs": {
                "convention": "megatron",
                "tp": 8,
                "pp": 4,
                "vpp": 2,
                "dp": 2,
                "global_batch": 32,
                "dist_opt": True,
                "gpu": "h100-80g",
            },
        }
    )
    out.append({"model": "llama3-8b", "kwargs": {"convention": "hf", "dp": 8, "zero": 3, "gpu": "a100-40g"}})
    out.append(
        {
            "model": "llama3-8b",
            "kwargs": {
                "convention": "torchtitan",
                "dp": 8,
                "fsdp": True,
                "gpu": "h100-80g",
                "compile": True,
                "loss": "chunked",
            },
        }
    )
    return out


def plan_searches() -> list[dict]:
    """One small `pipemem plan` search per convention (its shardings, schedules and pruning)."""
    return [
        {
            "search": conv,
            "model": "llama3.2-1b",
            "gpus": 8,
            "gpu": "rtx3090",
            "seq_len": 2048,
            "global_batch": 16,
        }
        for conv in CONVENTIONS
    ]


def run_search(case: dict) -> dict:
    from pipemem.planner import SpaceOptions, Target, search_plans
    from pipemem.planner.hardware import speeds_for
    from pipemem.presets import gpu_info

    cap = gpu_info(case["gpu"])["bytes"]
    target = Target(case["gpus"], cap, 0, speeds_for(case["gpu"]), gpu=case["gpu"], gpus_per_node=8)
    res = search_plans(
        case["model"],
        target,
        case["seq_len"],
        case["global_batch"],
        SpaceOptions(convention=case["search"], micro_batches=(1, 2), max_vpp=2),
    )
    st = res.stats
    stats = {
        k: getattr(st, k)
        for k in (
            "proposed",
            "pruned_static",
            "no_fit",
            "implied",
            "derived",
            "derivation_mismatch",
            "estimates",
        )
    }
    stats["invalid"] = sorted((str(k), v) for k, v in st.invalid.items())
    return {"plans": [[p.flags, list(p.rank_peaks)] for p in res.plans], "stats": stats}


def run_case(case: dict) -> dict:
    from pipemem import UserError, estimate
    from pipemem.estimate import _activation_levers, _optimizer_levers, _sharding_levers

    try:
        est = estimate(case["model"], **case["kwargs"])
    except UserError as e:
        return {"error": str(e)}
    d = est.to_dict()
    d.pop("pipemem_version", None)
    p = est.plan
    d["levers"] = {
        "activation": [f for f, _ in _activation_levers(p, case["kwargs"])],
        "sharding": [f for f, _ in _sharding_levers(p)],
        "optimizer": [f for f, _ in _optimizer_levers(p)],
    }
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="compare with the committed file instead of writing it"
    )
    args = ap.parse_args()
    rows = [{**c, "result": json.loads(json.dumps(run_case(c)))} for c in cases()]
    rows += [{**c, "result": json.loads(json.dumps(run_search(c)))} for c in plan_searches()]
    if args.check:
        old = json.loads(OUT.read_text())
        bad = [
            r["model"] + " " + json.dumps(r.get("kwargs") or r["search"]) for r, o in zip(rows, old) if r != o
        ]
        print(f"{len(rows)} plans, {len(bad)} differ")
        for b in bad[:20]:
            print("  ", b)
        return 1 if bad or len(rows) != len(old) else 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    # one plan a line: a change shows as the lines of the plans it moved
    lines = (json.dumps(r, sort_keys=True, separators=(",", ":")) for r in rows)
    OUT.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    ok = sum("error" not in r["result"] for r in rows)
    print(f"wrote {OUT}: {len(rows)} plans, {ok} estimated, {len(rows) - ok} refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
