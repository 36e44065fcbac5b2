"""DeepSpeed config (`ds_config.json`, what Hugging Face's Trainer takes as `--deepspeed` and
Lightning's DeepSpeedStrategy as `config=`) -> pipemem plan keyword arguments, under the hf
convention (a Hugging Face model trained by DeepSpeed's engine: `--convention hf --zero N`).

The config holds no model: `pipemem estimate --model NAME --deepspeed ds_config.json`. What
DeepSpeed 0.19 does with each key that changes device memory, as pipemem models it (held against
DeepSpeed's own engine by `pipemem validate deepspeed`):

* `zero_optimization.stage` 1-3 -> `zero`. Stage 0 (DeepSpeed's BF16_Optimizer / FP16_Optimizer, full
  fp32 grad and master copies) is not modelled: refused.
* `bf16.enabled` / `fp16.enabled` -> `dtype` (the model itself in half, fp32 master partitions).
* `train_micro_batch_size_per_gpu` -> `micro_batch`; with `gradient_accumulation_steps` and
  `train_batch_size` all given, the data-parallel degree is their quotient (`dp`).
* `reduce_bucket_size`, `overlap_comm` (ZeRO-1/2: a second bucket), `contiguous_gradients` (no bucket
  without it) and `stage3_max_reuse_distance` (what ZeRO-3 keeps gathered into the backward) ->
  `extra`, as the templates read them.
* `offload_optimizer.device` cpu / nvme -> `optimizer_offload` 1 (ZeRO-Offload; from DeepSpeed's
  code, not measured: the estimate says so). `offload_param` (ZeRO-Infinity) is refused.
* `optimizer.type` Adam / AdamW -> adamw with DeepSpeed's fused kernel (FusedAdam; DeepSpeedCPUAdam
  on the CPU under offload), or with `params.torch_adam` torch.optim's (foreach on CUDA); another
  type is refused. Without an `optimizer` block the client's optimizer steps (pipemem's hf default).

"auto" is what Hugging Face's Trainer fills in from its own arguments: `reduce_bucket_size` becomes
hidden^2 (the model's hidden size); precision, the micro-batch and the batch sizes come from the
Trainer's arguments, so pipemem's flags must give them (`--dtype`, `--micro-batch`, `--dp`).
Keys that change nothing on the device (logging, the scheduler, the learning rate) are accepted;
keys of features pipemem does not model are refused by name; others are reported in a warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from ..errors import UserError
from .tool_config import ToolConfig

TOOL = "deepspeed"

# top-level keys that change nothing on the device
_NO_DEVICE_MEMORY = {
    "scheduler",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "prescale_gradients",
    "gradient_predivide_factor",
    "dump_state",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "memory_breakdown",
    "seed",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "checkpoint",
    "elasticity",
    "timers",
    "communication_data_type",
    "sparse_gradients",
    "amp",
    "compile",
    "dataloader_drop_last",
    "curriculum_learning",
    "data_efficiency",
}
_READ = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "bf16",
    "bfloat16",
    "fp16",
    "zero_optimization",
    "optimizer",
    "activation_checkpointing",
}
# top-level keys of features that change memory and are not modelled
_REFUSED = {
    "pipeline": "DeepSpeed's pipeline engine (PipelineModule) is not modelled; use --pp with --convention "
    "megatron or torchtitan",
    "tensor_parallel": "DeepSpeed's AutoTP is not modelled; use --tp with --convention megatron "
    "or torchtitan",
    "sequence_parallel_size": "DeepSpeed-Ulysses sequence parallelism is not modelled",
    "data_types": "data_types (grad_accum_dtype) changes the gradients' dtype, which is not modelled",
    "compression_training": "DeepSpeed's compression training is not modelled",
}
# zero_optimization keys read below, accepted as not changing memory, or refused
_ZERO_READ = {
    "stage",
    "reduce_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "stage3_max_reuse_distance",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
}
# ZeRO-3's transient parameter fetches (not counted: the estimate says so)
_ZERO_TRANSIENT = {
    "stage3_prefetch_bucket_size",
    "allgather_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_model_persistence_threshold",
}
_ZERO_NO_DEVICE_MEMORY = {
    "allgather_partitions",
    "reduce_scatter",
    "round_robin_gradients",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "sub_group_size",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "ignore_unused_parameters",
    "legacy_stage1",
    "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings",
    "memory_efficient_linear",
}
_ZERO_REFUSED = {
    "zero_hpz_partition_size": "ZeRO++'s hierarchical partitioning (zero_hpz_partition_size > 1)",
    "zero_quantized_weights": "ZeRO++'s quantized weights",
    "zero_quantized_gradients": "ZeRO++'s quantized gradients",
    "mics_shard_size": "MiCS sharding (mics_shard_size)",
}
_ADAM = {"adam", "adamw", "fusedadam"}


def read(source: str | Mapping, hidden: int | None = None) -> ToolConfig:
    """Read `source`: a DeepSpeed JSON config's path, or the config itself (what
    `deepspeed.initialize(config=...)` takes). `hidden`: the model's hidden size, for
    reduce_bucket_size "auto" (Hugging Face's Trainer fills in hidden^2)."""
    if isinstance(source, Mapping):
        cfg, where = dict(source), "config"
    else:
        cfg = load(source)
        where = "config" if source.lstrip().startswith("{") else Path(source).name
    plan: dict = {"convention": "hf"}
    extra: dict = {}
    warnings: list[str] = []
    unknown: list[str] = []
    needs: list[str] = []

    for key in cfg:
        if key in _REFUSED and _active(cfg[key]):
            raise UserError(
                f"--deepspeed {where}: {key}: {_REFUSED[key]}; remove it from the config to estimate the rest"
            )
        if key not in _READ and key not in _NO_DEVICE_MEMORY and key not in _REFUSED:
            unknown.append(key)

    _precision(cfg, where, plan, needs)
    _batch(cfg, where, plan, needs)
    _zero(cfg.get("zero_optimization") or {}, where, plan, extra, hidden, unknown)
    _optimizer(cfg.get("optimizer"), where, plan)
    ac = cfg.get("activation_checkpointing") or {}
    if any(
        ac.get(k) for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
    ):
        warnings.append(
            f"--deepspeed {where}: activation_checkpointing is read only by models that call "
            "deepspeed.checkpointing (Megatron-DeepSpeed); not modelled here. A Hugging Face model's "
            "gradient_checkpointing is a Trainer argument: pass --recompute full"
        )
    if extra:
        plan["extra"] = extra
    if unknown:
        warnings.append(
            f"--deepspeed {where}: keys not read (assumed not to change device memory): "
            f"{', '.join(sorted(unknown))}"
        )
    return ToolConfig(
        model="", plan=plan, warnings=warnings, tool=TOOL, dp_unknown="dp" not in plan, needs=needs
    )


def load(text: str) -> dict:
    """A DeepSpeed config from its file, or the JSON itself (Hugging Face's TrainingArguments
    accepts both for --deepspeed)."""
    if text.lstrip().startswith("{"):
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--deepspeed: not valid JSON ({e}); fix it") from None
    else:
        p = Path(text).expanduser()
        if not p.is_file():
            raise UserError(
                f"--deepspeed {text}: no such file (give the DeepSpeed JSON config, e.g. ds_config.json)"
            )
        try:
            cfg = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"--deepspeed {text}: not a readable JSON file ({e}); fix the file") from None
    if not isinstance(cfg, dict):
        raise UserError("--deepspeed: the config must be a JSON object of DeepSpeed settings")
    return cfg


def _active(value) -> bool:
    """A block counts as switched on unless it is empty, says enabled: false, or sets AutoTP's
    degree to 1 (`tensor_parallel.autotp_size`)."""
    if isinstance(value, dict):
        if "autotp_size" in value:
            return value["autotp_size"] not in (None, 0, 1)
        return bool(value) and value.get("enabled", True) not in (False, "false")
    return value not in (None, False, 0, 1, "none")


def _auto(v) -> bool:
    return isinstance(v, str) and v.lower() == "auto"


def _precision(cfg: dict, where: str, plan: dict, needs: list[str]) -> None:
    bf16 = (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled", False)
    fp16 = (cfg.get("fp16") or {}).get("enabled", False)
    if _auto(bf16) or _auto(fp16):
        needs.append("dtype")  # the Trainer's --bf16 / --fp16
        return
    if bf16 and fp16:
        raise UserError(
            f"--deepspeed {where}: bf16.enabled and fp16.enabled are both true; DeepSpeed runs one"
        )
    plan["dtype"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"


def _int(cfg: dict, key: str, where: str) -> int | None:
    v = cfg.get(key)
    if v is None or _auto(v):
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f'--deepspeed {where}: {key} {v!r} must be a positive integer or "auto"')
    return v


def _batch(cfg: dict, where: str, plan: dict, needs: list[str]) -> None:
    mb = _int(cfg, "train_micro_batch_size_per_gpu", where)
    ga = _int(cfg, "gradient_accumulation_steps", where)
    tb = _int(cfg, "train_batch_size", where)
    if mb is not None:
        plan["micro_batch"] = mb
    elif _auto(cfg.get("train_micro_batch_size_per_gpu")):
        needs.append("micro_batch")  # the Trainer's per_device_train_batch_size
    if tb is not None and mb is not None and ga is not None:
        if tb % (mb * ga):
            raise UserError(
                f"--deepspeed {where}: train_batch_size {tb} is not train_micro_batch_size_per_gpu {mb} "
                f"x gradient_accumulation_steps {ga} x the world size; fix one of them"
            )
        plan["dp"] = tb // (mb * ga)


def _zero(z: dict, where: str, plan: dict, extra: dict, hidden: int | None, unknown: list[str]) -> None:
    if not isinstance(z, dict):
        raise UserError(f"--deepspeed {where}: zero_optimization must be an object")
    stage = z.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise UserError(f"--deepspeed {where}: zero_optimization.stage {stage!r} must be 0, 1, 2 or 3")
    if stage == 0:
        raise UserError(
            f"--deepspeed {where}: zero_optimization.stage 0 (DeepSpeed's engine without ZeRO: its "
            "BF16_Optimizer / FP16_Optimizer) is not modelled; set stage 1-3, or for PyTorch DDP use "
            "--convention hf without --deepspeed"
        )
    plan["zero"] = stage
    for key, what in _ZERO_REFUSED.items():
        v = z.get(key)
        if v not in (None, False, 0, 1, -1):
            raise UserError(
                f"--deepspeed {where}: zero_optimization.{key}: {what} is not modelled; remove it to "
                "estimate the rest"
            )
    for key in z:
        if key not in _ZERO_READ | _ZERO_TRANSIENT | _ZERO_NO_DEVICE_MEMORY | set(_ZERO_REFUSED):
            unknown.append(f"zero_optimization.{key}")
    rbs = z.get("reduce_bucket_size")
    if _auto(rbs):
        if not hidden:
            raise UserError(
                f'--deepspeed {where}: reduce_bucket_size "auto" is hidden^2 (Hugging Face\'s Trainer): '
                "give --model so pipemem knows the hidden size"
            )
        extra["reduce_bucket_size"] = hidden * hidden
    elif rbs is not None:
        extra["reduce_bucket_size"] = _elements(rbs, "reduce_bucket_size", where)
    for key in ("overlap_comm", "contiguous_gradients"):
        if key in z:
            if not isinstance(z[key], bool):
                raise UserError(
                    f"--deepspeed {where}: zero_optimization.{key} {z[key]!r} must be true or false"
                )
            extra[key] = z[key]
    if "stage3_max_reuse_distance" in z and stage == 3:
        extra["stage3_max_reuse_distance"] = _elements(
            z["stage3_max_reuse_distance"], "stage3_max_reuse_distance", where
        )
    if _device(z.get("offload_param"), "offload_param", where) != "none":
        raise UserError(
            f"--deepspeed {where}: zero_optimization.offload_param (ZeRO-Infinity's parameter offload) "
            "is not modelled; remove it to estimate ZeRO-3 with the parameters on the GPU"
        )
    opt_dev = _device(z.get("offload_optimizer"), "offload_optimizer", where)
    if z.get("cpu_offload") is True:  # DeepSpeed's older spelling of offload_optimizer: cpu
        opt_dev = "cpu"
    ratio = (z.get("offload_optimizer") or {}).get("ratio", 1)
    if opt_dev != "none" and ratio != 1:
        raise UserError(
            f"--deepspeed {where}: zero_optimization.offload_optimizer.ratio {ratio!r} (ZeRO-3's partial "
            "optimizer offload) is not modelled; remove it to estimate the whole optimizer offloaded"
        )
    if opt_dev != "none":
        plan["optimizer_offload"] = 1.0


def _elements(v, key: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or int(v) != v:
        raise UserError(
            f"--deepspeed {where}: zero_optimization.{key} {v!r} must be a number of elements "
            '(e.g. 5e8) or "auto"'
        )
    return int(v)


def _device(block, key: str, where: str) -> str:
    if block is None:
        return "none"
    if not isinstance(block, dict):
        raise UserError(f'--deepspeed {where}: zero_optimization.{key} must be an object with a "device"')
    dev = str(block.get("device", "none")).lower()
    if dev not in ("none", "cpu", "nvme"):
        raise UserError(
            f"--deepspeed {where}: zero_optimization.{key}.device {dev!r} must be none, cpu or nvme"
        )
    return dev


def _optimizer(block, where: str, plan: dict) -> None:
    if not block:
        return  # the client's optimizer (the Trainer's own): pipemem's hf default
    kind = str(block.get("type", "")).lower().replace("_", "")
    if kind not in _ADAM:
        raise UserError(
            f"--deepspeed {where}: optimizer.type {block.get('type')!r} is not modelled; pipemem reads "
            "Adam / AdamW (drop the optimizer block to estimate the Trainer's own AdamW)"
        )
    plan["optimizer"] = "adamw"
    # DeepSpeed builds its FusedAdam (DeepSpeedCPUAdam on the CPU under offload); params.torch_adam
    # asks for torch.optim.Adam(W) instead, whose default on CUDA tensors is the foreach path
    params = block.get("params") or {}
    plan["optimizer_impl"] = "foreach" if params.get("torch_adam") is True else "fused"
