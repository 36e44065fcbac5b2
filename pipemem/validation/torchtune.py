"""`pipemem validate torchtune`: the torchtune convention with --fsdp held against torchtune's
own distributed full fine-tune step.

Each case is a `full_finetune_distributed` configuration at a small shape (torchtune's Llama 3.2
decoder, world 2 or 4, bf16): with or without `custom_sharded_layers`, chunked or plain cross
entropy, tied embeddings, `fsdp_reshard_after_forward`, activation checkpointing. Measured:
rank 0 of torchtune's own model, `shard_model` and step, traced on fake tensors with the fake
process group (`torchtune_trace.py`, second step). Estimated: the case's recipe config
(`recipe_config`) read by `pipemem.read_config("torchtune", ...)` (what `--from-torchtune`
reads), estimated with the case's model. `rel_error` = (estimated - measured) / measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .case_model import llama_hf_config
from .compare import CaseRow, peak_row, timed_rows

EXAMPLE = """\
examples:
  pipemem validate torchtune                  # the CI subset
  pipemem validate torchtune --full --json    # every case
  pipemem validate torchtune --cases fsdp2-root,fsdp2-custom
  pipemem validate torchtune --list
"""

MODEL = {"vocab": 4096, "layers": 2, "heads": 8, "kv_heads": 4, "hidden": 256, "ffn": 768}
SEQ = 256
TRUTH = "traced"  # the framework's code on fake tensors, bytes counted by pipemem (compare.TRUTHS)
TOLERANCE = 0.02
TIMEOUT = 600.0  # seconds per case: the default --timeout
# torchtune's Llama 3 configs shard these apart from the root (`custom_sharded_layers`)
CUSTOM = ["tok_embeddings", "output"]
# torchtune's recipes/configs/llama3_1/8B_lora.yaml: lora_attn_modules [q_proj, v_proj, output_proj],
# apply_lora_to_mlp, lora_rank 8 (alpha 16, no dropout)
LORA = {"attn_modules": ["q_proj", "v_proj", "output_proj"], "mlp": True, "rank": 8}


def _case(name: str, world: int = 2, **extra) -> dict:
    case = {"name": name, "world": world, "seq_len": SEQ, "micro_batch": 2, "model": dict(MODEL)}
    case.update(extra)
    return case


def all_cases() -> list[dict]:
    return [
        _case("fsdp2-root"),
        _case("fsdp2-custom", custom_sharded_layers=CUSTOM),
        _case("fsdp2-root-chunked", loss_chunks=8),
        _case("fsdp2-custom-chunked", custom_sharded_layers=CUSTOM, loss_chunks=8),
        _case("fsdp2-root-tied", model=dict(MODEL, tied=True)),
        _case("fsdp2-no-reshard", reshard_after_forward=False),
        _case("fsdp4-root-chunked", world=4, loss_chunks=8),
        _case("fsdp2-root-ac", activation_checkpointing=True, loss_chunks=8),
        _case("fsdp2-custom-ac", activation_checkpointing=True, loss_chunks=8, custom_sharded_layers=CUSTOM),
        # lora_finetune_distributed with recipes/configs/llama3_1/8B_lora.yaml's adapters
        _case("fsdp2-lora-chunked", lora=LORA, loss_chunks=8),
        _case(
            "fsdp2-lora-custom-ac",
            lora=LORA,
            loss_chunks=8,
            activation_checkpointing=True,
            custom_sharded_layers=CUSTOM,
        ),
    ]


CI_CASES = ("fsdp2-root-chunked", "fsdp2-custom")


hf_config = llama_hf_config  # the case's model as the estimate reads it


def recipe_config(case: dict) -> dict:
    """The `full_finetune_distributed` recipe config the case runs (what `torchtune_trace` builds
    and steps). Its model is the case's small Llama 3.2, which no builder names: the config names
    the 1B builder, and only the plan is read from it."""
    cfg = {
        "model": {"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        "tokenizer": {
            "_component_": "torchtune.models.llama3.llama3_tokenizer",
            "max_seq_len": case["seq_len"],
        },
        "batch_size": case["micro_batch"],
        "dtype": "bf16",
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
        "loss": {"_component_": "torch.nn.CrossEntropyLoss"},
        "enable_activation_checkpointing": bool(case.get("activation_checkpointing")),
        "data_parallel_shard_dim": case["world"],
        "fsdp_reshard_after_forward": case.get("reshard_after_forward", True),
    }
    if case.get("loss_chunks", 1) > 1:
        cfg["loss"] = {
            "_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss",
            "num_output_chunks": case["loss_chunks"],
        }
    if case.get("custom_sharded_layers"):
        cfg["custom_sharded_layers"] = list(case["custom_sharded_layers"])
    if case.get("lora"):  # lora_finetune_distributed's model: the 1B builder's LoRA form
        lora = case["lora"]
        cfg["model"] = {
            "_component_": "torchtune.models.llama3_2.lora_llama3_2_1b",
            "lora_attn_modules": list(lora["attn_modules"]),
            "apply_lora_to_mlp": lora["mlp"],
            "lora_rank": lora["rank"],
            "lora_alpha": 2 * lora["rank"],
        }
    return cfg


def plan_kwargs(case: dict) -> dict:
    """The plan of the case's recipe config as `pipemem estimate --from-torchtune` reads it
    (`pipemem.read_config`)."""
    import yaml

    from ..configs.resolve import read_config

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "recipe.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(recipe_config(case), f)
        _, plan = read_config("torchtune", path)
    return plan


def trace_case(case: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "case.json"), os.path.join(d, "out.json")
        with open(src, "w") as f:
            json.dump(case, f)
        proc = subprocess.run(
            [sys.executable, "-m", "pipemem.validation.torchtune_trace", src, out],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
            raise RuntimeError(f"tracing torchtune for case {case['name']} failed:\n{tail}")
        with open(out) as f:
            return json.load(f)


def compare_case(case: dict, trace: dict) -> CaseRow:
    from ..estimate import estimate

    est = estimate(hf_config(case), model_name="torchtune-llama3_2-small", **plan_kwargs(case))
    return peak_row(f"{case['name']}/rank0", case["name"], trace, est.ranks[0])


def run_cases(cases: list[dict], timeout: float = TIMEOUT, progress=None) -> list[CaseRow]:
    return timed_rows(cases, lambda c: compare_case(c, trace_case(c, timeout)), progress)


def available() -> str | None:
    """None when torchtune's model and training code import here, else why not (one line)."""
    try:
        from .torchtune_trace import torchtune_training

        with torchtune_training():
            import torchtune.training._distributed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return (
            f"torchtune is not importable ({type(e).__name__}: {e}); pip install --no-deps torchtune==0.6.1"
        )
    return None


# ---- CLI ---------------------------------------------------------------------------------------


HELP = "torchtune's distributed full fine-tune step (fake tensors) vs the estimate"
DESCRIPTION = (
    "Trace torchtune 0.6.1's own model, shard_model (FSDP2) and the "
    "full_finetune_distributed step for rank 0 on fake tensors with the fake "
    "process group, second step, and compare its peak with pipemem's "
    "torchtune-convention estimate. Needs torchtune==0.6.1 "
    "(pip install --no-deps torchtune==0.6.1, as .ci/run does). Exit 1 if a case is off by more than "
    f"{TOLERANCE:.0%}."
)
FULL_HELP = (
    "every case (root unit or custom_sharded_layers, chunked CE, tied, no reshard, "
    "dp 4, activation checkpointing)"
)


def json_header() -> dict:
    return {"torchtune": "0.6.1", "kernel_policy": "cuda"}
