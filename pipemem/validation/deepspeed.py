"""`pipemem validate deepspeed`: the hf convention with --zero held against DeepSpeed's own ZeRO
engine training a tiny Hugging Face Llama on the CPU.

Each case is one `deepspeed.initialize` configuration (bf16, ZeRO stage 1, 2 or 3, DeepSpeed's
AdamW as `torch.optim.AdamW`, micro-batch 2 x seq 256, gradient accumulation 1) over a real gloo
process group of `world` processes; the bucket sizes are the ones Hugging Face's Trainer fills in
for "auto" (reduce_bucket_size = hidden^2; ZeRO-3: stage3_prefetch_bucket_size = 0.9 hidden^2,
stage3_param_persistence_threshold = 10 hidden) unless the case names DeepSpeed's own defaults.
Measured: rank 0's CPU allocator during the second step (`deepspeed_trace.py`: PyTorch's profiler
with profile_memory, every allocation and free of the CPU allocator, from before the model is
built). Estimated: `pipemem.estimate(..., convention="hf", zero=N, dtype="bf16",
kernel_policy="cpu")` of the same run. `rel_error` = (estimated - measured) / measured.
"""

from __future__ import annotations

from .case_model import llama_hf_config
from .compare import CaseRow, peak_row, timed_rows

EXAMPLE = """\
examples:
  pipemem validate deepspeed                  # the CI subset
  pipemem validate deepspeed --full --json    # every case
  pipemem validate deepspeed --cases zero1,zero3-ckpt
  pipemem validate deepspeed --list
"""

DEEPSPEED = "0.19.8"
INSTALL = f"pip install --no-deps deepspeed=={DEEPSPEED} hjson py-cpuinfo msgpack ninja psutil einops"
MODEL = {"vocab": 4096, "layers": 2, "heads": 8, "kv_heads": 4, "hidden": 256, "ffn": 768}
SEQ = 256
TRUTH = "measured"  # a real run, bytes from the allocator or profiler (compare.TRUTHS)
TOLERANCE = 0.03
TIMEOUT = 300.0  # seconds per case: the default --timeout


def hf_auto(stage: int, hidden: int) -> dict:
    """The zero_optimization values HF's Trainer fills in for "auto" (transformers' DeepSpeed
    integration: reduce_bucket_size hidden^2; ZeRO-3 prefetch 0.9 hidden^2, persistence 10 hidden)."""
    out = {"reduce_bucket_size": hidden * hidden}
    if stage == 3:
        out.update(
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
            stage3_param_persistence_threshold=10 * hidden,
        )
    return out


def _case(
    name: str, zero: int, world: int = 2, buckets: str = "hf-auto", tied: bool = False, **extra
) -> dict:
    case = {
        "name": name,
        "world": world,
        "zero": zero,
        "seq_len": SEQ,
        "micro_batch": 2,
        "model": dict(MODEL, tied=tied),
        "buckets": buckets,
        "zero_config": hf_auto(zero, MODEL["hidden"]) if buckets == "hf-auto" else {},
    }
    case.update(extra)
    return case


def all_cases() -> list[dict]:
    return [
        _case("zero1", 1),
        _case("zero2", 2),
        _case("zero3", 3),
        _case("zero3-ckpt", 3, gradient_checkpointing=True),
        _case("zero2-ckpt", 2, gradient_checkpointing=True),
        _case("zero2-world4", 2, world=4),
        _case("zero1-ds-defaults", 1, buckets="deepspeed"),
        _case("zero3-ds-defaults", 3, buckets="deepspeed"),
        # a tied word embedding: one parameter, gathered once by ZeRO-3 for the embedding and the head
        _case("zero3-tied", 3, tied=True),
        _case("zero2-tied", 2, tied=True),
        # ZeRO-1/2's overlap_comm double-buffers the reduce bucket (at DeepSpeed's 5e8 elements: 2 GB);
        # without contiguous_gradients there is no bucket (ZeRO-3's resident one at 5e6 elements)
        _case("zero2-overlap-ds", 2, buckets="deepspeed", zero_config={"overlap_comm": True}),
        _case(
            "zero3-noncontig",
            3,
            buckets="custom",
            zero_config={"contiguous_gradients": False, "reduce_bucket_size": 5_000_000},
        ),
    ]


CI_CASES = ("zero2-ckpt", "zero3", "zero3-tied", "zero2-overlap-ds")


def hf_config(case: dict) -> dict:
    """The case's Llama, fp32 as HF builds it (DeepSpeed's bf16 casts it)."""
    return {**llama_hf_config(case), "torch_dtype": "float32"}


def assumed_settings(plan_kw: dict) -> dict:
    """The DeepSpeed settings the plan stands for: the config's, read into `extra`, else pipemem's
    defaults for them (DeepSpeed 0.19's). Set against what the engine reports back
    (`deepspeed_trace.zero_settings`) in every row: a default pipemem assumes wrongly shows there."""
    from ..templates.layers import ZERO3_MAX_REUSE_DISTANCE
    from ..templates.static import DEEPSPEED_REDUCE_BUCKET

    extra = plan_kw.get("extra") or {}
    out = {
        "reduce_bucket_size": int(extra.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET)),
        "contiguous_gradients": bool(extra.get("contiguous_gradients", True)),
    }
    if plan_kw["zero"] in (1, 2):
        out["overlap_comm"] = bool(extra.get("overlap_comm", False))
    else:
        out["max_reuse_distance"] = int(extra.get("stage3_max_reuse_distance", ZERO3_MAX_REUSE_DISTANCE))
    return out


def plan_kwargs(case: dict) -> dict:
    """The plan of the run, read from the very DeepSpeed config the engine is given
    (`deepspeed_trace.ds_config`) by `pipemem.configs.deepspeed` -- what `--deepspeed` reads -- so
    the reader and pipemem's defaults for what the config leaves out (DeepSpeed's own) are held
    against the engine too. Added: the world (dp), the sequence, gradient checkpointing (an HF
    model's switch, not DeepSpeed's) and the for-loop step: torch.optim.AdamW (the config's
    torch_adam) takes it on CPU tensors, the foreach path on CUDA ones."""
    from ..configs.deepspeed import read
    from .deepspeed_trace import ds_config

    kw = dict(read(ds_config(case), hidden=case["model"]["hidden"]).plan)
    kw.update(dp=case["world"], seq_len=case["seq_len"], optimizer_impl="for-loop")
    if case.get("gradient_checkpointing"):
        kw["recompute"] = "full"
    return kw


def trace_case(case: dict, timeout: float) -> dict:
    """Run the case's `world` ranks (one process each, a gloo group on 127.0.0.1); rank 0's
    measurement, with every rank's peak."""
    from .rank_processes import run_ranks

    ranks = run_ranks(
        "pipemem.validation.deepspeed_trace",
        case,
        case["world"],
        timeout,
        {"DS_ACCELERATOR": "cpu"},
        f"DeepSpeed case {case['name']}",
    )
    out = ranks[0]
    out["rank_peaks"] = [x["peak_bytes"] for x in ranks]
    out["rank_static"] = [x["static_bytes"] for x in ranks]
    return out


def compare_case(case: dict, trace: dict) -> CaseRow:
    from ..estimate import estimate

    est = estimate(
        hf_config(case), model_name="deepspeed-llama-small", kernel_policy="cpu", **plan_kwargs(case)
    )
    return peak_row(
        f"{case['name']}/rank0",
        case["name"],
        trace,
        est.ranks[0],
        measured_phase_peaks=trace["phase_peaks"],
        rank_peaks=trace["rank_peaks"],
        breakdown=trace["breakdown"],
        zero_settings=trace["zero_settings"],
        optimizer=trace["optimizer"],
        settings_disagree={
            k: (v, trace["zero_settings"].get(k))
            for k, v in assumed_settings(plan_kwargs(case)).items()
            if trace["zero_settings"].get(k) != v
        },
        reconciled_bytes=trace["reconciled_bytes"],
    )


def run_cases(cases: list[dict], timeout: float = TIMEOUT, progress=None) -> list[CaseRow]:
    return timed_rows(cases, lambda c: compare_case(c, trace_case(c, timeout)), progress)


def available() -> str | None:
    """None when DeepSpeed (its CPU accelerator) and transformers import here, else why not (one line)."""
    from .rank_processes import import_error

    why = import_error(
        "import deepspeed, transformers; from deepspeed.accelerator import get_accelerator; "
        "assert get_accelerator().device_name() == 'cpu'",
        {"DS_ACCELERATOR": "cpu"},
    )
    return why and f"deepspeed is not importable with DS_ACCELERATOR=cpu ({why}); {INSTALL}"


# ---- CLI ---------------------------------------------------------------------------------------


HELP = "DeepSpeed's ZeRO engine training a tiny HF Llama on the CPU vs the estimate"
DESCRIPTION = (
    f"Run DeepSpeed {DEEPSPEED}'s own ZeRO-1/2/3 engine (bf16, AdamW) on a tiny Hugging "
    "Face Llama over a real gloo process group on the CPU, measure rank 0's "
    "allocations during the second step with PyTorch's profiler, and compare the "
    "peak with pipemem's hf-convention --zero estimate (--kernel-policy cpu). "
    f"Needs deepspeed=={DEEPSPEED} ({INSTALL}). Exit 1 if a case is off by more than "
    f"{TOLERANCE:.0%}."
)
FULL_HELP = "every case (ZeRO-1/2/3, gradient checkpointing, world 4, DeepSpeed's default bucket sizes)"


def json_header() -> dict:
    return {"deepspeed": DEEPSPEED, "kernel_policy": "cpu"}
