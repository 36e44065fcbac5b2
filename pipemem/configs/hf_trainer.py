"""Hugging Face Trainer launch arguments (`TrainingArguments` plus the example scripts' model and
data arguments, e.g. `torchrun --nproc_per_node 8 run_clm.py --model_name_or_path ... --bf16
--deepspeed ds_config.json`) -> pipemem model and plan, under the hf convention.

What the Trainer (transformers 4.4x-5.x) does with each argument that changes device memory:

* `--model_name_or_path` (or `--config_name`): the model, a preset or known hub id (its shapes;
  nothing is downloaded) or a local directory / config.json.
* `--block_size` (run_clm), `--max_seq_length` / `--max_length` (SFT scripts): the sequence.
  Without one the tokenizer sets it, so `--seq-len` must say it.
* `--per_device_train_batch_size` (default 8) is the micro-batch; `--gradient_accumulation_steps`
  runs that many before each optimizer step (the grads live across them).
* `--bf16` / `--fp16`: autocast over the model's parameters; `--torch_dtype bfloat16|float16`
  (run_clm) loads the parameters themselves in that dtype (no fp32 master).
* `--gradient_checkpointing`: every decoder layer recomputed (`--recompute full`).
* `--optim`: the optimizer class and kwargs `Trainer.get_optimizer_cls_and_kwargs` builds:
  adamw_torch (torch.optim.AdamW: foreach on CUDA), adamw_torch_fused (the default of recent
  transformers), torchao's adamw_torch_8bit / 4bit, bitsandbytes' 8-bit AdamW (paged ones said
  so), sgd (a momentum buffer only with `--optim_args momentum=...`); the rest
  (Adafactor, Lion, GaLore, LOMO, schedule-free...) is refused by name.
* `--torch_compile`: the whole model compiled (`--compile all`).
* `--use_liger_kernel`: Liger's fused linear cross-entropy (`--loss fused_linear`); its other
  kernels (RMSNorm, SwiGLU, RoPE) save less than eager and are not modelled (the estimate is
  above for them).
* `--deepspeed ds_config.json`: DeepSpeed's engine (`pipemem.configs.deepspeed`), its "auto"
  values filled in from these arguments as the Trainer does (`fill_deepspeed_autos`); a value
  the config gives that contradicts them is an error, as the Trainer's own check makes it.
* `--fsdp "full_shard auto_wrap"`: PyTorch FSDP full sharding (`--fsdp`); shard_grad_op,
  hybrid_shard and offload are refused.
* the launcher's process count (torchrun `--nproc_per_node x --nnodes`, accelerate
  `--num_processes`, deepspeed `--num_gpus x --num_nodes`) is the data-parallel degree.
* `accelerate launch --use_fsdp / --use_deepspeed / --mixed_precision / --config_file FILE`:
  read by `configs.accelerate` (FSDP1 / FSDP2 settings, its DeepSpeed config, the world size).

Arguments known not to change device memory are accepted; the rest are named in one warning.
"""

from __future__ import annotations

import json

from ..errors import UserError
from .argv import parse
from .tool_config import ToolConfig

TOOL = "Hugging Face Trainer"

# OptimizerNames value -> (pipemem optimizer, implementation, note); None: refused
OPTIMS = {
    "adamw_torch": ("adamw", "foreach", ""),
    "adamw_torch_fused": ("adamw", "fused", ""),
    "adamw_apex_fused": ("adamw", "fused", ""),
    "adamw_hf": ("adamw", "for-loop", ""),
    "adamw_torch_8bit": ("adam8bit", "fused", ""),
    "adamw_torch_4bit": ("adam4bit", "fused", ""),
    "adamw_bnb_8bit": ("adam8bit", "fused", ""),
    "adamw_8bit": ("adam8bit", "fused", ""),
    "paged_adamw_8bit": (
        "adam8bit",
        "fused",
        "bitsandbytes' paged states (unified memory the driver may evict) are counted as resident",
    ),
    "paged_adamw_32bit": (
        "adamw",
        "fused",
        "bitsandbytes' paged states (unified memory the driver may evict) are counted as resident",
    ),
    "sgd": ("sgd", "foreach", ""),  # momentum from --optim_args (the Trainer's default: none, no state)
}
# transformers' default `optim` since torch 2.8-era releases (TrainingArguments.optim)
DEFAULT_OPTIM = "adamw_torch_fused"
DEFAULT_MICRO_BATCH = 8  # TrainingArguments.per_device_train_batch_size

_READ = {
    "model_name_or_path",
    "config_name",
    "block_size",
    "max_seq_length",
    "max_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "torch_dtype",
    "dtype",
    "gradient_checkpointing",
    "optim",
    "torch_compile",
    "use_liger_kernel",
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "optim_args",
    # TRL's ModelConfig (trl sft / sft.py): PEFT LoRA and bitsandbytes 4-bit loading
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "load_in_4bit",
    "load_in_8bit",
    "bnb_4bit_quant_type",
    "use_bnb_nested_quant",
    "use_dora",
    "lora_modules_to_save",
}
# gradient_checkpointing_kwargs: use_reentrant changes when, not what, is recomputed
_NO_DEVICE_MEMORY = {
    "output_dir",
    "overwrite_output_dir",
    "do_train",
    "do_eval",
    "do_predict",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "warmup_ratio",
    "warmup_steps",
    "logging_dir",
    "logging_steps",
    "logging_strategy",
    "logging_first_step",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "save_only_model",
    "save_safetensors",
    "eval_strategy",
    "evaluation_strategy",
    "eval_steps",
    "per_device_eval_batch_size",
    "eval_accumulation_steps",
    "seed",
    "data_seed",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_drop_last",
    "dataloader_persistent_workers",
    "dataloader_prefetch_factor",
    "report_to",
    "run_name",
    "push_to_hub",
    "hub_model_id",
    "hub_token",
    "hub_strategy",
    "dataset_name",
    "dataset_config_name",
    "train_file",
    "validation_file",
    "preprocessing_num_workers",
    "overwrite_cache",
    "validation_split_percentage",
    "keep_linebreaks",
    "streaming",
    "tokenizer_name",
    "use_fast_tokenizer",
    "cache_dir",
    "trust_remote_code",
    "low_cpu_mem_usage",
    "model_revision",
    "token",
    "use_auth_token",
    "max_train_samples",
    "max_eval_samples",
    "tf32",
    "ddp_timeout",
    "ddp_backend",
    "ddp_find_unused_parameters",
    "remove_unused_columns",
    "label_names",
    "load_best_model_at_end",
    "metric_for_best_model",
    "greater_is_better",
    "disable_tqdm",
    "log_level",
    "log_level_replica",
    "log_on_each_node",
    "bf16_full_eval",
    "fp16_full_eval",
    "group_by_length",
    "length_column_name",
    "ignore_data_skip",
    "resume_from_checkpoint",
    "local_rank",
    "full_determinism",
    "include_num_input_tokens_seen",
    "include_tokens_per_second",
    "prediction_loss_only",
    "skip_memory_metrics",
    "save_on_each_node",
    "hub_private_repo",
    "lr_scheduler_kwargs",
    "optim_target_modules",
    "neftune_noise_alpha",
    "packing",
    "dataset_text_field",
    "text_column",
    "model_type",
    "config_overrides",
    "auto_find_batch_size",
    "max_grad_norm",
    "gradient_checkpointing_kwargs",
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "torch_empty_cache_steps",
    "average_tokens_across_devices",
    "use_cpu",
    "no_cuda",
}


def read(argv: list[str]) -> ToolConfig:
    argv = list(argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv[:2] == ["trl", "sft"]:  # TRL's CLI runs its sft.py script with these arguments
        argv = argv[2:]
    args = parse(argv, TOOL)
    model = args.str("model_name_or_path") or args.str("config_name")
    if not model:
        raise UserError(
            "Trainer arguments: no --model_name_or_path (or --config_name): name the model to train"
        )
    if args.has("fsdp_config"):
        raise UserError(
            "Trainer argument --fsdp_config (FSDP's wrapping, offload and resharding settings) is not "
            "read; drop it to estimate full sharding with FSDP's defaults"
        )
    plan: dict = {"convention": "hf"}
    warnings: list[str] = []
    needs: list[str] = []
    seq = next((args.int(k) for k in ("block_size", "max_seq_length", "max_length") if args.has(k)), None)
    if seq is not None:
        plan["seq_len"] = seq
    else:
        needs.append("seq_len")  # the tokenizer's model_max_length sets it
    from .accelerate import apply_fsdp, deepspeed_source, settings

    acc = settings(args.launcher)  # accelerate launch's flags and --config_file
    world = args.world_size or acc.get("world")
    trainer = {
        "micro_batch": args.int("per_device_train_batch_size") or DEFAULT_MICRO_BATCH,
        "accumulation": args.int("gradient_accumulation_steps") or 1,
        "bf16": bool(args.bool("bf16")),
        "fp16": bool(args.bool("fp16")),
        "world": world,
    }
    if trainer["bf16"] and trainer["fp16"]:
        raise UserError("Trainer arguments --bf16 and --fp16: give one (the Trainer refuses both)")
    if acc.get("mixed_precision") and not (trainer["bf16"] or trainer["fp16"]):
        trainer[acc["mixed_precision"]] = True  # the launcher's ACCELERATE_MIXED_PRECISION
    plan["micro_batch"] = trainer["micro_batch"]
    if trainer["accumulation"] > 1:
        plan["microbatches"] = trainer["accumulation"]
    if world:
        plan["dp"] = world
    _precision(args, trainer, plan)
    if args.bool("gradient_checkpointing"):
        plan["recompute"] = "full"
    if args.bool("torch_compile"):
        plan["compile"] = "all"
    if args.bool("use_liger_kernel"):
        plan["loss"] = "fused_linear"
        warnings.append(
            "--use_liger_kernel: Liger's fused linear cross-entropy is modelled; its RMSNorm, SwiGLU and "
            "RoPE kernels (which save less than eager) are not, so the estimate is above for them"
        )
    ds, fsdp = args.str("deepspeed"), args.str("fsdp")
    if ds and fsdp:
        raise UserError("Trainer arguments --deepspeed and --fsdp: the Trainer runs one of them")
    if acc.get("type") == "deepspeed" and not ds:
        if fsdp:
            raise UserError("accelerate launches DeepSpeed but the Trainer arguments give --fsdp: choose one")
        ds = deepspeed_source(acc["deepspeed"], acc.get("base"))
    if acc.get("type") == "fsdp" and not fsdp:
        if ds:
            raise UserError("accelerate launches FSDP but the Trainer arguments give --deepspeed: choose one")
        apply_fsdp(acc["fsdp"], plan)
        fsdp = "accelerate"
    elif fsdp:
        _fsdp(fsdp, plan)
    if fsdp:
        warnings.append(
            f"{'accelerate FSDP' if fsdp == 'accelerate' else '--fsdp'}: priced as PyTorch FSDP "
            "full sharding under autocast over fp32 shards; the "
            "Trainer's own FSDP (accelerate's wrapping and mixed-precision policy) is not measured "
            "(with --use_cpu it runs DDP, so validate hf-trainer cannot)"
        )
    optim = args.str("optim") or DEFAULT_OPTIM
    optim_args = args.str("optim_args") or ""
    if ds:
        from .deepspeed import load as load_deepspeed

        cfg = fill_deepspeed_autos(load_deepspeed(ds) if isinstance(ds, str) else ds, trainer)
        if "optimizer" not in cfg:  # DeepSpeed wraps the Trainer's own optimizer
            _optim(optim, optim_args, plan, warnings)
        _with_deepspeed(cfg, model, plan, warnings)
    else:
        _optim(optim, optim_args, plan, warnings)
    _peft(args, plan)
    unknown = args.unknown(_READ, _NO_DEVICE_MEMORY)
    if unknown:
        warnings.append(
            f"Trainer arguments not read (assumed not to change device memory): "
            f"{', '.join('--' + u for u in sorted(unknown))}"
        )
    return ToolConfig(
        model=model, plan=plan, warnings=warnings, tool=TOOL, dp_unknown="dp" not in plan, needs=needs
    )


# TRL's ModelConfig defaults (trl/trainer/model_config.py)
TRL_LORA_DEFAULTS = {"lora_r": 16, "lora_dropout": 0.05}


def _peft(args, plan: dict) -> None:
    """TRL's LoRA flags (`trl sft ... --use_peft --lora_r 32 --lora_target_modules q_proj v_proj`,
    `--load_in_4bit`): its ModelConfig builds PEFT's LoraConfig (`get_peft_config`) and
    bitsandbytes' 4-bit loading (`get_quantization_config`: nf4, nested quantization off by
    default). Without --lora_target_modules PEFT takes its default for the model (q_proj, v_proj)."""
    lora_flags = [n for n in ("lora_r", "lora_dropout", "lora_target_modules", "lora_alpha") if args.has(n)]
    if not args.bool("use_peft"):
        for n in lora_flags + [n for n in ("load_in_4bit", "load_in_8bit") if args.bool(n)]:
            raise UserError(
                f"Trainer argument --{n} without --use_peft: TRL applies LoRA (and 4-bit loading is for "
                "QLoRA) only with --use_peft; add it or drop --" + n
            )
        return
    for n, what in (
        ("use_dora", "DoRA's magnitude vectors"),
        ("load_in_8bit", "8-bit base weights"),
        ("lora_modules_to_save", "fully trained modules beside the adapters"),
    ):
        if args.bool(n) if n != "lora_modules_to_save" else args.has(n):
            raise UserError(f"Trainer argument --{n}: {what} not modelled; drop it")
    args.raw("lora_alpha")  # scales the adapters' output: moves no memory
    plan["lora_rank"] = args.int("lora_r") or TRL_LORA_DEFAULTS["lora_r"]
    drop = args.str("lora_dropout")
    try:
        plan["lora_dropout"] = float(drop) if drop is not None else TRL_LORA_DEFAULTS["lora_dropout"]
    except ValueError:
        raise UserError(f"Trainer argument --lora_dropout {drop!r}: expected a probability") from None
    targets = args.str("lora_target_modules")
    if targets:
        plan["lora_targets"] = ",".join(targets.replace(",", " ").split())
    if args.bool("load_in_4bit"):
        qt = (args.str("bnb_4bit_quant_type") or "nf4").lower()
        if qt != "nf4":
            raise UserError(f"Trainer argument --bnb_4bit_quant_type {qt}: QLoRA is modelled with nf4")
        plan["qlora"] = True
        if not args.bool("use_bnb_nested_quant"):
            plan.setdefault("extra", {})["qlora_double_quant"] = False


def _with_deepspeed(cfg: dict, model: str, plan: dict, warnings: list[str]) -> None:
    """Under DeepSpeed the engine decides the precision, the micro-batch and the optimizer: the
    config's plan (read by `configs.deepspeed`, "auto" sizes from the model's hidden size) takes
    their place. The engine keeps fp32 master partitions whatever dtype the model was loaded in."""
    from ..model import arch_from_hf_config
    from ..presets import load_model_config
    from .deepspeed import read as read_deepspeed

    name, mcfg = load_model_config(model, "Trainer --model_name_or_path")
    tool = read_deepspeed(cfg, hidden=arch_from_hf_config(mcfg, name).hidden)
    if tool.needs:  # "auto" the Trainer had nothing to fill with (no --bf16 / --fp16 given: fp32)
        raise UserError(f'--deepspeed: {", ".join(tool.needs)} left "auto" after the Trainer\'s fill-in')
    plan.pop("master_weights", None)
    extra = {**plan.get("extra", {}), **tool.plan.get("extra", {})}
    plan.update(tool.plan)
    if extra:
        plan["extra"] = extra
    warnings.extend(tool.warnings)


def _precision(args, trainer: dict, plan: dict) -> None:
    dt = args.str("torch_dtype") or args.str("dtype")
    loaded = {
        "bfloat16": "bf16",
        "bf16": "bf16",
        "float16": "fp16",
        "fp16": "fp16",
        "half": "fp16",
        "float32": "fp32",
        "fp32": "fp32",
        "auto": None,
        None: None,
    }
    if dt not in loaded:
        raise UserError(f"Trainer argument --torch_dtype {dt!r}: expected bfloat16, float16, float32 or auto")
    amp = "bf16" if trainer["bf16"] else "fp16" if trainer["fp16"] else None
    if loaded[dt] in ("bf16", "fp16"):
        plan["dtype"] = loaded[dt]
        plan["master_weights"] = False  # the parameters themselves are half: no fp32 copy
    else:
        plan["dtype"] = amp or "fp32"


def _fsdp(text: str, plan: dict) -> None:
    opts = set(text.replace(",", " ").split())
    bad = opts & {"shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "offload", "no_shard"}
    if bad:
        raise UserError(
            f"Trainer argument --fsdp {text!r}: {sorted(bad)[0]} is not modelled; pipemem models "
            "full_shard (--fsdp)"
        )
    if "full_shard" not in opts:
        raise UserError(f"Trainer argument --fsdp {text!r}: expected full_shard (with auto_wrap)")
    plan["fsdp"] = True


def _optim(name: str, optim_args: str, plan: dict, warnings: list[str]) -> None:
    key = name.lower()
    if key not in OPTIMS:
        raise UserError(
            f"Trainer argument --optim {name}: not modelled; use one of {', '.join(sorted(OPTIMS))}"
        )
    optimizer, impl, note = OPTIMS[key]
    plan["optimizer"], plan["optimizer_impl"] = optimizer, impl
    if note:
        warnings.append(f"--optim {name}: {note}")
    if optimizer == "sgd":
        # the Trainer builds torch.optim.SGD(lr=...) plus --optim_args "momentum=0.9,...": without a
        # momentum it keeps no state
        kv = dict(p.split("=", 1) for p in optim_args.replace(" ", "").split(",") if "=" in p)
        try:
            momentum = float(kv.get("momentum", 0))
        except ValueError:
            raise UserError(
                f"Trainer argument --optim_args {optim_args!r}: momentum must be a number"
            ) from None
        plan.setdefault("extra", {})["sgd_momentum"] = momentum > 0


def _auto(v) -> bool:
    return isinstance(v, str) and v.lower() == "auto"


def fill_deepspeed_autos(cfg: dict, trainer: dict) -> dict:
    """The DeepSpeed config as the Trainer hands it to DeepSpeed: "auto" replaced by its own
    values (transformers' HfTrainerDeepSpeedConfig.trainer_config_process: the micro-batch, the
    accumulation steps, the batch over the world, bf16 / fp16), and a given value that
    contradicts them refused (the Trainer's mismatch check). The hidden-size keys
    (reduce_bucket_size...) are left to `configs.deepspeed`, which knows the model."""
    cfg = json.loads(json.dumps(cfg))  # a copy, nested too

    def fill(block: dict, key: str, value, what: str, label: str = "") -> None:
        if value is None or key not in block:
            return
        if _auto(block[key]):
            block[key] = value
        elif block[key] != value:
            raise UserError(
                f"--deepspeed: {label or key} = {json.dumps(block[key])} in the config, but the Trainer's "
                f"{what} gives {json.dumps(value)}; make them agree (the Trainer refuses the mismatch)"
            )

    world, mb, ga = trainer.get("world"), trainer["micro_batch"], trainer["accumulation"]
    fill(cfg, "train_micro_batch_size_per_gpu", mb, "--per_device_train_batch_size")
    fill(cfg, "gradient_accumulation_steps", ga, "--gradient_accumulation_steps")
    fill(
        cfg,
        "train_batch_size",
        world * mb * ga if world else None,
        "world size x --per_device_train_batch_size x --gradient_accumulation_steps",
    )
    for key in ("bf16", "fp16"):
        if isinstance(cfg.get(key), dict):
            fill(cfg[key], "enabled", trainer[key], f"--{key}", f"{key}.enabled")
    return cfg
