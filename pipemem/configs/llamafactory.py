"""LLaMA-Factory train YAML (`llamafactory-cli train FILE.yaml`) -> pipemem plan keyword
arguments, under the hf convention (LLaMA-Factory trains Hugging Face models with the HF
Trainer and PEFT).

What LLaMA-Factory 0.9 does with each key that changes device memory (its `hparams` argument
dataclasses and `model/adapter.py`, `hparams/parser.py`), as pipemem reads it:

* `model_name_or_path` -> the model (a preset name, or a directory / config.json).
* `finetuning_type`: `full` (every parameter trained, upcast to fp32 unless `pure_bf16`),
  `lora` (-> `lora_rank` (default 8), `lora_target` (default `all`: every linear of the layers),
  `lora_dropout` (default 0); `lora_alpha` moves no memory). The adapters are upcast to fp32
  unless `pure_bf16` (adapter.py `cast_trainable_params_to_fp32`). `freeze` and `oft` are
  refused (not modelled).
* `quantization_bit: 4` with `quantization_method: bitsandbytes` (the default) -> `qlora`
  (NF4 with double quantization, `double_quantization` default true); other bits or methods
  are refused.
* `cutoff_len` (default 2048) -> `seq_len`; `per_device_train_batch_size` -> `micro_batch`;
  `gradient_accumulation_steps` -> `microbatches`.
* `bf16` / `fp16` -> mixed precision (the model loaded in that dtype, the Trainer's autocast);
  `pure_bf16` -> everything in bf16, no autocast.
* gradient checkpointing is on unless `disable_gradient_checkpointing` -> `recompute full`.
* `flash_attn` auto / sdpa / fa2 -> flash attention; `disabled` (eager) -> off.
* `enable_liger_kernel` -> Liger's fused linear cross-entropy (the Trainer's `--use_liger_kernel`).
* `deepspeed` (a config path, relative to the YAML's directory or the working directory) and
  `optim` -> as the Trainer reads them (pipemem.configs.hf_trainer).

The world size is not in the file: `--dp` (the launcher's process count) gives it. Keys of
features not modelled (`use_galore`, `use_badam`, `use_apollo`, `use_dora`, `use_unsloth`,
`packing` / `neat_packing` change nothing here) are refused or reported by name.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .tool_config import ToolConfig

TOOL = "LLaMA-Factory"

# LLaMA-Factory's defaults for the keys read here (its FinetuningArguments / DataArguments
# dataclasses; tests/test_configs_llamafactory.py holds them equal when llamafactory is installed)
DEFAULTS = {
    "stage": "sft",
    "finetuning_type": "lora",
    "lora_rank": 8,
    "lora_target": "all",
    "lora_dropout": 0.0,
    "pure_bf16": False,
    "cutoff_len": 2048,
}
# keys passed on to the Trainer's reader as its own arguments
_TRAINER_KEYS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "optim",
    "optim_args",
    "torch_compile",
)
# keys that change nothing on the device (data, logging, schedule, evaluation, output)
_NO_DEVICE_MEMORY = {
    "trust_remote_code",
    "stage",
    "do_train",
    "do_eval",
    "do_predict",
    "dataset",
    "dataset_dir",
    "eval_dataset",
    "template",
    "max_samples",
    "overwrite_cache",
    "preprocessing_num_workers",
    "dataloader_num_workers",
    "output_dir",
    "logging_steps",
    "save_steps",
    "save_strategy",
    "save_total_limit",
    "save_only_model",
    "plot_loss",
    "overwrite_output_dir",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "warmup_ratio",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "ddp_timeout",
    "val_size",
    "per_device_eval_batch_size",
    "eval_strategy",
    "eval_steps",
    "report_to",
    "run_name",
    "seed",
    "resume_from_checkpoint",
    "lora_alpha",  # scales the adapters' output: no memory
    "quantization_method",
    "double_quantization",
    "packing",
    "neat_packing",
    "mix_strategy",
    "streaming",
    "tokenized_path",
    "image_max_pixels",
    "video_max_pixels",
    "upcast_layernorm",
    "upcast_lmhead_output",
    "gradient_checkpointing",
    "disable_gradient_checkpointing",
    "flash_attn",
    "enable_liger_kernel",
    "deepspeed",
    "finetuning_type",
    "lora_rank",
    "lora_target",
    "lora_dropout",
    "quantization_bit",
    "pure_bf16",
    "model_name_or_path",
    "cutoff_len",
    "adapter_name_or_path",
    "create_new_adapter",
    "use_rslora",
}
_REFUSED = {
    "use_galore": "GaLore's projected optimizer states",
    "use_apollo": "APOLLO's optimizer",
    "use_badam": "BAdam's block-wise updates",
    "use_dora": "DoRA's magnitude vectors and weight norms",
    "use_unsloth": "Unsloth's kernels",
    "use_unsloth_gc": "Unsloth's gradient checkpointing",
    "use_llama_pro": "LLaMA Pro's expanded blocks",
    "pissa_init": "PiSSA's initialisation (it keeps a residual weight)",
    "fsdp": "the Trainer's FSDP from LLaMA-Factory (use --from-hf-trainer)",
    "additional_target": "modules trained whole beside the adapters (PEFT's modules_to_save)",
}


def read(path: str) -> ToolConfig:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--from-llamafactory {path}: no such file (a LLaMA-Factory train YAML)")
    try:
        cfg = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--from-llamafactory {path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"--from-llamafactory {path}: expected a mapping of LLaMA-Factory arguments")
    return read_dict(cfg, base=p.parent, name=path)


def _flag(v) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("true", "1", "yes")
    return bool(v)


def read_dict(cfg: dict, base: Path | None = None, name: str = "the configuration") -> ToolConfig:
    from .hf_trainer import read as read_trainer

    model = cfg.get("model_name_or_path")
    if not model:
        raise UserError(f"{name}: no model_name_or_path (the model LLaMA-Factory trains)")
    for key, what in _REFUSED.items():
        if cfg.get(key) not in (None, False, "", "false"):
            raise UserError(f"{name}: {key} ({what}) is not modelled; drop it to estimate without it")
    if _flag(cfg.get("do_train", True)) is False:
        raise UserError(f"{name}: do_train is false (no training step to estimate)")
    cfg = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    stage = str(cfg["stage"])
    if stage not in ("sft", "pt"):
        raise UserError(
            f"{name}: stage {stage}: only sft and pt are modelled (one model's step; rm / ppo / dpo / "
            "kto hold a reference or reward model beside it)"
        )
    ft = str(cfg["finetuning_type"])
    if ft not in ("lora", "full"):
        raise UserError(f"{name}: finetuning_type {ft} is not modelled; use full or lora")
    pure = _flag(cfg["pure_bf16"])
    argv = ["--model_name_or_path", str(model), "--max_seq_length", str(int(cfg["cutoff_len"]))]
    for k in _TRAINER_KEYS:
        if k in cfg and cfg[k] is not None:
            argv += [f"--{k}", str(cfg[k]).lower() if isinstance(cfg[k], bool) else str(cfg[k])]
    if pure and (_flag(cfg.get("bf16")) or _flag(cfg.get("fp16"))):
        raise UserError(f"{name}: pure_bf16 with bf16 / fp16: give one")
    if not _flag(cfg.get("disable_gradient_checkpointing", False)):
        argv += ["--gradient_checkpointing", "true"]
    if _flag(cfg.get("enable_liger_kernel", False)):
        argv += ["--use_liger_kernel", "true"]
    ds = cfg.get("deepspeed")
    if ds:
        found = next((c for c in (Path(str(ds)), (base or Path(".")) / str(ds)) if c.is_file()), None)
        if found is None and base is not None:
            # the examples name it from the repository root; look beside the file too
            found = next(
                (
                    c
                    for c in (base / Path(str(ds)).name, base / "deepspeed" / Path(str(ds)).name)
                    if c.is_file()
                ),
                None,
            )
        if found is None:
            raise UserError(
                f"{name}: deepspeed {ds}: no such file (relative to the working directory or the YAML)"
            )
        argv += ["--deepspeed", str(found)]
    tool = read_trainer(argv)
    plan = tool.plan
    warnings = [w for w in tool.warnings if not w.startswith("Trainer arguments not read")]
    if pure:
        plan.update(dtype="bf16", master_weights=False)
    flash = str(cfg.get("flash_attn", "auto")).lower()
    if flash in ("disabled", "eager"):
        plan["flash_attn"] = False
    elif flash not in ("auto", "sdpa", "fa2", "fa3", "fa4"):
        raise UserError(f"{name}: flash_attn {flash}: use auto, sdpa, fa2 or disabled")
    qbit = cfg.get("quantization_bit")
    if ft == "lora":
        plan["lora_rank"] = int(cfg["lora_rank"])
        target = cfg["lora_target"]
        plan["lora_targets"] = ",".join(target) if isinstance(target, list) else str(target)
        if cfg.get("lora_dropout"):
            plan["lora_dropout"] = float(cfg["lora_dropout"])
        if pure:
            plan.setdefault("extra", {})["lora_dtype"] = "model"  # trainable params kept in bf16
        if qbit is not None:
            method = str(cfg.get("quantization_method", "bitsandbytes")).lower()
            if int(qbit) != 4 or method not in ("bitsandbytes", "bnb"):
                raise UserError(
                    f"{name}: quantization_bit {qbit} ({method}): only 4-bit bitsandbytes (QLoRA) is modelled"
                )
            if not _flag(cfg.get("double_quantization", True)):
                raise UserError(
                    f"{name}: double_quantization false: QLoRA is modelled with double quantization"
                )
            plan["qlora"] = True
    elif qbit is not None:
        raise UserError(
            f"{name}: quantization_bit with finetuning_type {ft}: LLaMA-Factory trains quantized models "
            "with LoRA only"
        )
    unknown = sorted(
        k for k in cfg if k not in _NO_DEVICE_MEMORY and k not in _TRAINER_KEYS and k not in _REFUSED
    )
    if unknown:
        warnings.append(f"{TOOL} keys not read (assumed not to change device memory): {', '.join(unknown)}")
    return ToolConfig(
        model=str(model), plan=plan, warnings=warnings, tool=TOOL, dp_unknown="dp" not in plan, needs=[]
    )
