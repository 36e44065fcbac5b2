"""One process of `pipemem validate hf-trainer`: Hugging Face's own `Trainer.train()` on the CPU,
its allocations recorded by PyTorch's profiler.

`python -m pipemem.validation.hf_trainer_trace CASE.json OUT.json`. The case gives the Trainer's
command-line arguments as a user writes them (`argv`: `--model_name_or_path DIR --block_size N
--bf16 ...`). They are parsed by transformers' own `HfArgumentParser` into `TrainingArguments`
and the script's model / data arguments (run_clm.py's: `model_name_or_path`, `block_size`,
`torch_dtype`), with the run's housekeeping appended (`--use_cpu`, `--max_steps 2`, no saving or
logging). As run_clm.py does without weights: `AutoModelForCausalLM.from_config` of DIR's
config.json (in `torch_dtype`), a dataset of `block_size` token blocks with `labels = input_ids`
and an all-ones attention mask, `default_data_collator`, `Trainer(...).train()`.

Measured (`allocations.Timeline`): every allocation and free of the CPU allocator from before the
model is built; a `TrainerCallback` marks each optimizer step (`on_step_begin` .. `on_step_end`:
the micro-batches' forwards and backwards, clipping, the optimizer step, `zero_grad`). The
second step's peak is reported, and the bytes alive when it starts (`static_bytes`), checked
against what the garbage collector reaches then (`check_gc_bytes`).
"""

from __future__ import annotations

import gc
import os
import tempfile
from dataclasses import dataclass, field

from .allocations import MARK, gc_storages, profiled_run
from .case_worker import run_case_file

# appended to every case's arguments: CPU, two optimizer steps, nothing written or logged
HOUSEKEEPING = [
    "--use_cpu",
    "--max_steps",
    "2",
    "--save_strategy",
    "no",
    "--logging_strategy",
    "no",
    "--report_to",
    "none",
    "--disable_tqdm",
    "true",
    "--dataloader_num_workers",
    "0",
    "--lr_scheduler_type",
    "constant",
    "--seed",
    "0",
]


@dataclass
class ScriptArguments:
    """run_clm.py's model and data arguments that shape the run."""

    model_name_or_path: str = ""
    block_size: int = 256
    torch_dtype: str = field(default="float32")


def script_args(argv: list[str]) -> list[str]:
    """The script's arguments of a pasted line: what follows `script.py` (the launcher's part, e.g.
    `torchrun --nproc_per_node 2`, is the harness's to run)."""
    at = next((i for i, t in enumerate(argv) if t.endswith(".py") and not t.startswith("-")), None)
    return list(argv[at + 1 :] if at is not None else argv)


def _deepspeed_comm_ready() -> bool:
    import deepspeed.comm as ds_comm

    return bool(ds_comm.is_initialized())


def _dataset(n: int, block: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, block), generator=g)
    return [
        {
            "input_ids": ids[i],
            "attention_mask": torch.ones(block, dtype=torch.int64),
            "labels": ids[i].clone(),
        }
        for i in range(n)
    ]


def run_case(case: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        HfArgumentParser,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    out: dict = {}

    class StepMarks(TrainerCallback):
        """Each optimizer step inside a profiler range; the storages alive when step 2 starts."""

        def __init__(self):
            self.ctx = None

        def on_step_begin(self, args, state, control, **kw):
            n = state.global_step + 1
            if n == 2:
                gc.collect()
                out["gc_at_step2"] = gc_storages()
            self.ctx = record_function(f"{MARK}step{n}")
            self.ctx.__enter__()

        def on_step_end(self, args, state, control, **kw):
            self.ctx.__exit__(None, None, None)
            self.ctx = None

    with tempfile.TemporaryDirectory() as tmp:
        parser = HfArgumentParser((ScriptArguments, TrainingArguments))
        script, targs = parser.parse_args_into_dataclasses(
            args=script_args(case["argv"]) + ["--output_dir", tmp] + HOUSEKEEPING
        )
        # run_clm.py logs training_args.device before it builds the model: that sets up the process
        # group (and DeepSpeed's), which ZeRO-3's zero.Init inside from_config needs
        _ = targs.device
        if targs.deepspeed and not _deepspeed_comm_ready():
            # on a GPU accelerate's state starts deepspeed.comm too; with --use_cpu it does not, and
            # ZeRO-3's zero.Init would see a world of 1: start it over the same gloo group
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            script.torch_dtype
        ]
        config = AutoConfig.from_pretrained(script.model_name_or_path)
        config._attn_implementation = "sdpa"
        n_rows = targs.per_device_train_batch_size * targs.gradient_accumulation_steps * 2
        marks = StepMarks()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function(MARK + "build"):
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            trainer = Trainer(
                model=model,
                args=targs,
                train_dataset=_dataset(n_rows, script.block_size, config.vocab_size),
                data_collator=default_data_collator,
                callbacks=[marks],
            )
            del model
            result = trainer.train()
            gc.collect()
            end = gc_storages()
        out["loss"] = float(result.training_loss)
        chain, opt = [], trainer.optimizer  # accelerate's wrapper, DeepSpeed's ZeRO optimizer, torch's
        while opt is not None:
            chain.append(f"{type(opt).__module__}.{type(opt).__name__}")
            inner = getattr(opt, "optimizer", None)
            opt = inner if inner is not opt else None
        out["optimizer"] = " > ".join(chain)
        defaults = getattr(trainer.optimizer.optimizer, "defaults", None) or {}
        for o in (trainer.optimizer.optimizer, getattr(trainer.optimizer.optimizer, "optimizer", None)):
            defaults = getattr(o, "defaults", None) or defaults
        out["optimizer_defaults"] = {k: v for k, v in defaults.items() if k in ("fused", "foreach")}
        out["param_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    gcs = out.pop("gc_at_step2")
    out["check_gc_bytes"] = sum(gcs.values())
    out.update(profiled_run(prof, case, gcs, end))
    out["torch"] = torch.__version__
    import transformers

    out["transformers"] = transformers.__version__
    return out


def _measure(case: dict) -> dict:
    if case.get("deepspeed_config"):
        from .deepspeed_trace import skip_shm_comm_op

        skip_shm_comm_op()
    return {"case": case["name"], **run_case(case)}


def main(argv=None) -> int:
    return run_case_file(_measure, argv, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
