"""`pipemem validate hf-trainer`: `--from-hf-trainer` and the hf convention held against Hugging
Face's own `Trainer.train()` on the CPU.

Each case is a Trainer command line as a user writes it (run_clm.py's arguments: the model
directory, `--block_size`, `--per_device_train_batch_size`, precision, checkpointing, the
optimizer, accumulation). Measured: `hf_trainer_trace.py` parses it with transformers' own
`HfArgumentParser`, builds the model from the directory's config.json as run_clm.py does without
weights, and runs `Trainer.train()` for two optimizer steps in one process; the CPU allocator's
events of the second step (PyTorch's profiler) give its peak. Estimated: the same command line
read by `pipemem.configs.hf_trainer` (what `pipemem estimate --from-hf-trainer` reads), then
`pipemem.estimate(..., kernel_policy="cpu")`. `rel_error` = (estimated - measured) / measured.
"""

from __future__ import annotations

import json
import os
import tempfile

from .compare import CaseRow, timed_rows

EXAMPLE = """\
examples:
  pipemem validate hf-trainer                  # the CI subset
  pipemem validate hf-trainer --full --json    # every case
  pipemem validate hf-trainer --cases bf16-ckpt,accum2
  pipemem validate hf-trainer --list
"""

INSTALL = "pip install transformers accelerate"
# a tiny Llama (HF config.json), untied; seq 256, micro-batch 2
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 256,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}
TRUTH = "measured"  # a real run, bytes from the allocator or profiler (compare.TRUTHS)
TOLERANCE = 0.03
TIMEOUT = 300.0  # seconds per case: the default --timeout
MODEL_DIR = "{model}"  # replaced by the case's model directory
DS_CONFIG = "{ds_config}"  # replaced by the path of the case's DeepSpeed config
# Hugging Face's example DeepSpeed configs (transformers' DeepSpeed docs), "auto" where the Trainer fills in
_HF_DS_AUTO = {  # what both examples leave to the Trainer
    "bf16": {"enabled": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
HF_DS_ZERO2 = {
    **_HF_DS_AUTO,
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
}
HF_DS_ZERO3 = {
    **_HF_DS_AUTO,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _case(name: str, *args: str, launcher=(), deepspeed_config: dict | None = None) -> dict:
    case = {
        "name": name,
        "argv": [
            *launcher,
            *(["run_clm.py"] if launcher else []),
            "--model_name_or_path",
            MODEL_DIR,
            "--block_size",
            "256",
            "--per_device_train_batch_size",
            "2",
            *args,
        ],
    }
    if deepspeed_config is not None:
        case["argv"] += ["--deepspeed", DS_CONFIG]
        case["deepspeed_config"] = deepspeed_config
    return case


# the deepspeed launcher over 2 processes; gloo for the CPU
DS2 = ("deepspeed", "--num_gpus", "2")


def all_cases() -> list[dict]:
    return [
        _case("fp32"),  # the Trainer's defaults: fp32, adamw_torch_fused
        _case("bf16", "--bf16"),  # autocast over fp32 parameters
        _case("bf16-ckpt", "--bf16", "--gradient_checkpointing"),
        _case("bf16-accum2", "--bf16", "--gradient_accumulation_steps", "2"),
        _case("torch-dtype-bf16", "--torch_dtype", "bfloat16"),  # bf16 parameters, no autocast
        _case("bf16-sgd", "--bf16", "--optim", "sgd"),  # torch.optim.SGD, no momentum: no state
        _case("bf16-sgd-momentum", "--bf16", "--optim", "sgd", "--optim_args", "momentum=0.9"),
        # the Trainer's DeepSpeed integration: HF's example configs, "auto" filled in by the Trainer
        _case(
            "deepspeed-zero2", "--bf16", "--ddp_backend", "gloo", launcher=DS2, deepspeed_config=HF_DS_ZERO2
        ),
        _case(
            "deepspeed-zero2-ckpt",
            "--bf16",
            "--gradient_checkpointing",
            "--ddp_backend",
            "gloo",
            launcher=DS2,
            deepspeed_config=HF_DS_ZERO2,
        ),
        _case(
            "deepspeed-zero3", "--bf16", "--ddp_backend", "gloo", launcher=DS2, deepspeed_config=HF_DS_ZERO3
        ),
    ]


CI_CASES = ("bf16", "bf16-ckpt", "deepspeed-zero2")


def argv_of(case: dict, model_dir: str) -> list[str]:
    """The case's command line with its model directory and DeepSpeed config file in place (the
    config is written next to the model's config.json)."""
    ds = os.path.join(model_dir, f"ds_{case['name']}.json")
    if "deepspeed_config" in case and not os.path.exists(ds):
        with open(ds, "w") as f:
            json.dump(case["deepspeed_config"], f)
    return [model_dir if a == MODEL_DIR else ds if a == DS_CONFIG else a for a in case["argv"]]


def trace_case(case: dict, model_dir: str, timeout: float) -> dict:
    """Run the case's processes (the launcher's count; one without a launcher) as the launcher would,
    on a gloo group at 127.0.0.1; rank 0's measurement, with every rank's peak."""
    from ..configs.argv import parse
    from .rank_processes import run_ranks

    argv = argv_of(case, model_dir)
    ranks = run_ranks(
        "pipemem.validation.hf_trainer_trace",
        dict(case, argv=argv),
        parse(argv, "Trainer").world_size or 1,
        timeout,
        {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"},
        f"the Trainer run of case {case['name']}",
    )
    out = ranks[0]
    out["rank_peaks"] = [x["peak_bytes"] for x in ranks]
    return out


def estimate_case(case: dict, model_dir: str):
    """The case's command line through `--from-hf-trainer`'s reader and `pipemem.estimate`."""
    from ..configs.hf_trainer import read
    from ..estimate import estimate

    tool = read(argv_of(case, model_dir))
    return tool, estimate(tool.model, model_name="hf-trainer-llama-small", kernel_policy="cpu", **tool.plan)


def compare_case(case: dict, trace: dict, model_dir: str) -> CaseRow:
    tool, est = estimate_case(case, model_dir)
    r = est.ranks[0]
    return CaseRow(
        case["name"],
        trace["peak_bytes"],
        r.peak_allocated_bytes,
        {
            "case": case["name"],
            "argv": case["argv"],
            "plan": {k: v for k, v in tool.plan.items()},
            "measured_static_bytes": trace["static_bytes"],
            "estimated_static_bytes": r.static.total,
            "check_gc_bytes": trace["check_gc_bytes"],
            "unseen_reached_bytes": trace["unseen_reached_bytes"],
            "measured_peak_at": trace["peak_at"],
            "estimated_peak_at": r.peak_at,
            "optimizer": trace["optimizer"],
            "optimizer_defaults": trace["optimizer_defaults"],
            "param_dtypes": trace["param_dtypes"],
            "missed_frees": trace["missed_frees"],
            "reconciled_bytes": trace["reconciled_bytes"],
            "rank_peaks": trace["rank_peaks"],
            "events": trace["events"][:40],
        },
    )


def run_cases(cases: list[dict], timeout: float = TIMEOUT, progress=None) -> list[CaseRow]:
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        return timed_rows(
            cases, lambda c: compare_case(c, trace_case(c, model_dir, timeout), model_dir), progress
        )


def available() -> str | None:
    """None when transformers' Trainer imports here (it needs accelerate), else why not (one line)."""
    from .rank_processes import import_error

    why = import_error("import accelerate, transformers; from transformers import Trainer")
    return why and f"transformers' Trainer is not importable ({why}); {INSTALL}"


# ---- CLI ---------------------------------------------------------------------------------------


HELP = "Hugging Face's Trainer.train() on a tiny Llama (CPU) vs --from-hf-trainer"
DESCRIPTION = (
    "Run Hugging Face's own Trainer.train() (transformers' HfArgumentParser, "
    "TrainingArguments, Trainer) on a tiny Llama on the CPU for each case's command "
    "line, measure the second optimizer step's allocations with PyTorch's profiler, "
    "and compare the peak with pipemem's estimate of the same command line read by "
    "--from-hf-trainer (--kernel-policy cpu). Needs transformers and accelerate "
    f"({INSTALL}). Exit 1 if a case is off by more than {TOLERANCE:.0%}."
)
FULL_HELP = (
    "every case (fp32, bf16 autocast, checkpointing, accumulation, bf16 parameters, SGD, "
    "the Trainer's DeepSpeed ZeRO-2 / ZeRO-3 over 2 processes)"
)


def json_header() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tv = version("transformers")
    except PackageNotFoundError:
        tv = None
    return {"transformers": tv, "kernel_policy": "cpu"}
