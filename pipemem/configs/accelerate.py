"""`accelerate launch` settings for a Hugging Face Trainer run: the launcher's flags and its
config YAML (`--config_file`, what `accelerate config` writes), read as accelerate (1.x,
accelerate/commands/launch.py) hands them to the Trainer through the environment.

What moves device memory:

* `distributed_type`: MULTI_GPU (DDP), FSDP, DEEPSPEED (or the flags `--multi_gpu`, `--use_fsdp`,
  `--use_deepspeed`); `num_processes` (every process over all machines) is the world size.
* `mixed_precision` no / bf16 / fp16: the Trainer's --bf16 / --fp16 when it gives neither (its
  own flag, when given, sets ACCELERATE_MIXED_PRECISION over the launcher's); fp8 is refused.
* `fsdp_config` (or `--fsdp_*` flags): `fsdp_version` 1 or 2, `fsdp_sharding_strategy`
  FULL_SHARD (or 1) for FSDP1, `fsdp_reshard_after_forward` for FSDP2 (true: full sharding;
  false keeps each unit gathered from its forward to its backward), `fsdp_offload_params` (refused),
  `fsdp_activation_checkpointing` (every wrapped layer recomputed).
* `deepspeed_config`: `deepspeed_config_file` (read as the Trainer's --deepspeed), or its inline
  `zero_stage`, `offload_optimizer_device`, `offload_param_device` (a DeepSpeed config with the
  Trainer's "auto" values).

Keys that change nothing on the device (machine rank, rendezvous, state-dict type, wrapping
policy, prefetch...) are accepted.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

TOOL = "accelerate"
_TYPES = {"MULTI_GPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed", "NO": "single", "MULTI_CPU": "ddp"}
# FSDP1's ShardingStrategy names and their accelerate numbers
_FULL_SHARD = {"FULL_SHARD", "1"}


def load_config_file(path: str) -> dict:
    """An accelerate config YAML (or JSON: accelerate reads both) -> its mapping."""
    f = Path(path).expanduser()
    if not f.is_file():
        raise UserError(f"accelerate --config_file {path}: not found")
    try:
        import yaml

        data = yaml.safe_load(f.read_text())
    except Exception as e:  # yaml.YAMLError, a decode error: one line naming the file
        raise UserError(f"accelerate --config_file {path}: cannot read ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(
            f"accelerate --config_file {path}: expected a mapping (distributed_type, num_processes, ...)"
        )
    return data


def settings(launcher: dict[str, list[str]]) -> dict:
    """The accelerate settings of a pasted `accelerate launch [flags] script.py ...` line: the
    config file's keys, the flags over them (accelerate's precedence). Returns {} for another
    launcher. Keys: type (ddp / fsdp / deepspeed / single / None), world, mixed_precision, fsdp
    (its settings), deepspeed (a config file path or dict), base (the config file's folder)."""

    def flag(*names):
        for n in names:
            for spelling in (n, n.replace("_", "-")):
                if spelling in launcher:
                    v = launcher[spelling]
                    return " ".join(v).strip("'\"") if v else "true"
        return None

    path = flag("config_file")
    cfg = load_config_file(path) if path else {}
    if not cfg and not any(k.replace("-", "_") in _FLAGS for k in launcher):
        return {}
    out: dict = {"base": str(Path(path).expanduser().parent) if path else None}
    kind = str(cfg.get("distributed_type", "") or "").upper()
    out["type"] = _TYPES.get(kind) if kind else None
    if kind and kind not in _TYPES:
        raise UserError(
            f"accelerate distributed_type {kind}: not modelled; pipemem models MULTI_GPU (DDP), FSDP and "
            "DEEPSPEED"
        )
    for name, kind_ in (("use_fsdp", "fsdp"), ("use_deepspeed", "deepspeed"), ("multi_gpu", "ddp")):
        if _true(flag(name)):
            out["type"] = kind_
    world = flag("num_processes")
    world = world if world is not None else cfg.get("num_processes")
    try:
        out["world"] = int(world) if world is not None else None
    except ValueError:
        raise UserError(f"accelerate num_processes {world!r}: expected an integer") from None
    mp = flag("mixed_precision") or cfg.get("mixed_precision")
    mp = None if mp is None else str(mp).lower()
    if mp not in (None, "no", "bf16", "fp16"):
        raise UserError(
            f"accelerate mixed_precision {mp}: not modelled for the Trainer; use no, bf16 or fp16"
        )
    out["mixed_precision"] = None if mp in (None, "no") else mp

    def section(name: str, keys) -> dict:
        """The config file's `name` section with the launch line's flags for `keys` over it."""
        merged = dict(cfg.get(name) or {})
        for key in keys:
            v = flag(key)
            if v is not None:
                merged[key] = v
        return merged

    out["fsdp"] = section("fsdp_config", _FSDP_FLAGS)
    out["deepspeed"] = section("deepspeed_config", _DS_FLAGS)
    return out


_FSDP_FLAGS = (
    "fsdp_version",
    "fsdp_sharding_strategy",
    "fsdp_reshard_after_forward",
    "fsdp_offload_params",
    "fsdp_activation_checkpointing",
)
_DS_FLAGS = ("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device")
_FLAGS = {
    "config_file",
    "use_fsdp",
    "use_deepspeed",
    "multi_gpu",
    "mixed_precision",
    *_FSDP_FLAGS,
    *_DS_FLAGS,
}


def _true(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


def apply_fsdp(fsdp: dict, plan: dict) -> None:
    """accelerate's FSDP settings -> the plan (FSDP1 and FSDP2 under the Trainer)."""
    if _true(fsdp.get("fsdp_offload_params", False)):
        raise UserError(
            "accelerate fsdp_offload_params: FSDP's CPU offload of parameters and gradients is not "
            "modelled; set it false"
        )
    version = str(fsdp.get("fsdp_version", 1))
    if version not in ("1", "2"):
        raise UserError(f"accelerate fsdp_version {version}: expected 1 or 2")
    extra = dict(plan.get("extra") or {})
    if version == "1":
        strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
        if strategy not in _FULL_SHARD:
            raise UserError(
                f"accelerate fsdp_sharding_strategy {strategy}: not modelled; pipemem models FULL_SHARD"
            )
    elif not _true(fsdp.get("fsdp_reshard_after_forward", True)):
        extra["fsdp_reshard_after_forward"] = False  # FSDP2: the unit stays gathered into its backward
    plan["fsdp"] = True
    if extra:
        plan["extra"] = extra
    if _true(fsdp.get("fsdp_activation_checkpointing", False)):
        plan["recompute"] = "full"


def deepspeed_source(ds: dict, base: str | None):
    """accelerate's deepspeed_config -> what the Trainer's --deepspeed would be: the config file's
    path (relative ones from the working directory, else the accelerate config's folder), or the
    inline settings as a DeepSpeed config with the Trainer's "auto" values."""
    path = ds.get("deepspeed_config_file")
    if path and str(path).lower() != "none":
        p = Path(str(path)).expanduser()
        if not p.is_file() and base and (Path(base) / p).is_file():
            p = Path(base) / p
        return str(p)
    zero = {"stage": int(ds.get("zero_stage", 2))}
    for key, name in (
        ("offload_optimizer_device", "offload_optimizer"),
        ("offload_param_device", "offload_param"),
    ):
        device = str(ds.get(key, "none") or "none").lower()
        if device != "none":
            zero[name] = {"device": device}
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }
