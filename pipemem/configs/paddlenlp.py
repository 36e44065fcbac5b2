"""PaddleNLP `run_pretrain*.py` arguments (llm/ and auto-parallel trainers) and PaddleFormers'
training configs -> pipemem plan.

Degrees follow PaddleNLP's TrainingArguments (paddlenlp 2.8.1, paddlenlp/trainer/training_args.py):
world = dp * sharding * tp * pp * sep; a degree left at its default -1 means 1, except
`sharding_parallel_degree`, whose -1 with `--sharding stageN` means every rank left after
tp * pp * sep (world // (tp * pp * sep)): all data-parallel ranks shard. `gradient_accumulation_steps`
is the number of microbatches per pipeline when pp > 1.
Precision: `--bf16 1` or `--fp16 1` turn on AMP; with neither, training is fp32 whatever
`--fp16_opt_level` says (the level only applies once AMP is on).

A JSON (or YAML) file of arguments in the script's place of arguments (`run_pretrain.py
./config/llama/pretrain_argument.json`, PaddleNLP's PdArgumentParser.read_json: each key becomes
`--key value`, and arguments after the file override it), and `paddleformers-cli train FILE.yaml`
are read the same way.

PaddleFormers (paddleformers 1.2.0, paddleformers/trainer/training_args.py) renamed the degrees
(`tensor_model_parallel_size`, `pipeline_model_parallel_size`, `sharding_parallel_size`,
`sep_parallel_size`, `context_parallel_size`, `expert_model_parallel_size`), reads the sequence
length as `max_seq_len` (cli/hparams/data_args.py) and recompute Megatron's way
(`recompute_granularity` / `recompute_method` / `recompute_num_layers`); its `sharding` defaults to
stage1 (PaddleNLP's to no sharding).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath

from ..errors import UserError
from .argv import parse
from .tool_config import ToolConfig

TOOL = "PaddleNLP"

# Arguments that change memory and that we read.
KNOWN = {
    "model_name_or_path",
    "model_type",
    "max_seq_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "virtual_pp_degree",
    "sharding_parallel_degree",
    "sharding",
    "data_parallel_degree",
    "sep_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "sequence_parallel",
    "fp16",
    "bf16",
    "fp16_opt_level",
    "recompute",
    "recompute_granularity",
    "pp_recompute_interval",
    "use_flash_attention",
    "pipeline_schedule_mode",
    "num_hidden_layers",
    "global_batch_size",
    "amp_master_grad",
    "optim",
    "world_size",
    "tensor_parallel_config",
    "use_fused_rms_norm",
    "use_fused_rope",
    "fuse_attention_qkv",
    "fuse_attention_ffn",
    "max_grad_norm",
}
# Arguments that do not change the estimate (paths, logging, schedule of the LR, fusions
# whose saved tensors equal the unfused ones' in our model).
IGNORED = {
    "tokenizer_name_or_path",
    "input_dir",
    "output_dir",
    "split",
    "per_device_eval_batch_size",
    "scale_loss",
    "learning_rate",
    "min_learning_rate",
    "max_steps",
    "save_steps",
    "weight_decay",
    "warmup_ratio",
    "warmup_steps",
    "logging_steps",
    "dataloader_num_workers",
    "eval_steps",
    "report_to",
    "disable_tqdm",
    "continue_training",
    "do_train",
    "do_eval",
    "do_predict",
    "device",
    "data_impl",
    "enable_auto_parallel",
    "use_fused_linear",
    "seed",
    "skip_memory_metrics",
    "data_cache",
    "lr_scheduler_type",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "save_total_limit",
    "logging_dir",
    "overwrite_output_dir",
    "num_train_epochs",
    "run_name",
    "to_static",
    "skip_profile_timer",
    "pipeline_parallel_config",
    "sharding_parallel_config",
    "data_parallel_config",
    "recompute_use_reentrant",
    "unified_checkpoint",
    "save_strategy",
    "evaluation_strategy",
    "eval_accumulation_steps",
    "max_evaluate_steps",
    "use_fast_layer_norm",
    "virtual_pipeline_seg_method",
    "distributed_dataloader",
    "sequence_parallel_config",
    "auto_parallel_resume_form_hybrid_parallel",
    "max_position_embeddings",
    "use_fused_dropout_add",
    "tokenizer",
    "fp16_full_eval",
    "ignore_data_skip",
    "dataset_world_size",
    "enable_linear_fused_grad_add",
    "sharding_comm_buffer_size_MB",
    # PaddleFormers' names for the same kinds of arguments (data, checkpoints, logging)
    "train_dataset_type",
    "eval_dataset_type",
    "train_dataset_path",
    "eval_dataset_path",
    "train_dataset_prob",
    "eval_dataset_prob",
    "mix_strategy",
    "template_backend",
    "template",
    "num_samples_each_epoch",
    "save_checkpoint_format",
    "load_checkpoint_format",
    "save_safetensors",
    "convert_from_hf",
    "save_to_hf",
    "overlap_p2p_comm",
    "batch_p2p_comm",
    "moe_router_bias_update_rate",
    "random_shuffle",
}

# PaddleFormers' argument names -> PaddleNLP's (the reader below speaks PaddleNLP's)
PADDLEFORMERS_NAMES = {
    "tensor_model_parallel_size": "tensor_parallel_degree",
    "pipeline_model_parallel_size": "pipeline_parallel_degree",
    "sharding_parallel_size": "sharding_parallel_degree",
    "sep_parallel_size": "sep_parallel_degree",
    "context_parallel_size": "context_parallel_degree",
    "expert_model_parallel_size": "expert_parallel_degree",
    "max_seq_len": "max_seq_length",
}
# PaddleFormers-only arguments read here (besides the renamed ones)
PADDLEFORMERS_KNOWN = {
    "recompute_method",
    "recompute_num_layers",
    "packing",
    "stage",
    "fine_tuning",
    "_attn_implementation",
    "attn_impl",
    "attn_implementation",
    "lora",
    "use_recompute",
}
CONFIG_SUFFIXES = (".json", ".yaml", ".yml")

_SCHEDULES = {
    "1f1b": "1F1B",
    "fthenb": "FThenB",
    "vpp": "VPP",
    "eager1f1b": "Eager1F1B",
    "zbh1": "ZBH1",
    "zbvpp": "ZBVPP",
    "zbv": "ZBVZeroBubble",
}


def cached_config_dirs(model_id: str) -> list[Path]:
    """Where PaddleNLP's `from_pretrained(model_id)` finds a downloaded model's config.json:
    its own cache (``$PPNLP_HOME/models/<id>``, default ``~/.paddlenlp/models/<id>``), then
    the Hugging Face hub cache (``from_hf_hub``: ``$HF_HUB_CACHE`` or ``$HF_HOME/hub``,
    ``models--<org>--<name>/snapshots/<rev>``, newest first)."""
    home = Path(os.environ.get("PPNLP_HOME") or Path.home() / ".paddlenlp").expanduser()
    dirs = [home / "models" / model_id]
    hub = os.environ.get("HF_HUB_CACHE") or str(
        Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"
    )
    snaps = Path(hub).expanduser() / ("models--" + model_id.replace("/", "--")) / "snapshots"
    if snaps.is_dir():
        dirs += sorted(
            (d for d in snaps.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True
        )
    return dirs


def resolve_model_id(model: str) -> str:
    """A model id pipemem has no preset for, but whose config.json PaddleNLP would read from a
    local cache, becomes that config's path; presets, known hub ids and paths stay as given
    (an id found nowhere is left for `--model`'s own error, which lists the presets)."""
    from ..presets import ALIASES, model_names

    key = model.strip().lower()
    if key in model_names() or key in ALIASES or Path(model).expanduser().exists():
        return model
    for d in cached_config_dirs(model.strip()):
        if (d / "config.json").is_file():
            return str(d / "config.json")
    return model


# The auto-parallel trainers and how far each shards the ZeRO states (--sharding stageN).
AUTO_STATIC_SCRIPT = "run_pretrain_auto_static.py"  # fleet.auto.Engine + Strategy (the seed's)
AUTO_TRAINER_SCRIPT = "run_pretrain_auto.py"  # AutoTrainer, dist.shard_optimizer


def _sharding_group(a, sharding_degree: int, dp_degree: int) -> tuple[int | None, str]:
    """(ranks the ZeRO states are sharded over, or None for the whole dp x sharding group; a
    note for the user or ""), by trainer:
    * Fleet's hybrid trainer (run_pretrain.py) and the static auto-parallel script
      (run_pretrain_auto_static.py: TrainingArguments sets `strategy.sharding.degree =
      sharding_parallel_degree`; measured in the legacy programs paddle 2.6 builds for it, a
      dp 2 x sharding 2 card holds half the Adam moments) shard over the sharding group only:
      each of the data_parallel_degree replicas holds a full set.
    * The AutoTrainer (run_pretrain_auto.py, --enable_auto_parallel 1 with dygraph-to-static)
      builds its mesh as [pp, dp x sharding, mp] and shards over that whole "dp" dimension
      (dist.shard_optimizer(opt, ShardingStageN("dp"))), seen in the PIR programs Paddle
      3.3.1 builds for it.
    An auto-parallel line without its script gets the smaller group (more memory per card:
    never a false FITS) and a note."""
    if not a.bool("enable_auto_parallel") or a.script == AUTO_STATIC_SCRIPT or dp_degree == 1:
        return sharding_degree, ""
    if a.script == AUTO_TRAINER_SCRIPT:
        return None, ""
    return sharding_degree, (
        f"{TOOL}: the ZeRO states are taken as sharded over --sharding_parallel_degree "
        f"{sharding_degree} (run_pretrain.py, {AUTO_STATIC_SCRIPT}); {AUTO_TRAINER_SCRIPT} "
        f"shards them over data x sharding = {dp_degree * sharding_degree} ranks: paste the "
        f"script name to choose"
    )


def kernel_switches(a) -> dict:
    """PaddleNLP's own switches (plan.extra), with LlamaConfig's defaults (all off) where the
    arguments `a` do not set them: which kernels run changes what the layer keeps
    (pipemem.templates.conventions, paddle)."""
    extra = {"fuse_qkv": bool(a.bool("fuse_attention_qkv"))}
    # (fuse_attention_ffn only merges the gate and up GEMMs; the activation is Paddle's fused
    # swiglu kernel either way, which keeps both halves and its output: the fused-fc1 picture.)
    a.bool("fuse_attention_ffn")
    extra["fused_norm"] = bool(a.bool("use_fused_rms_norm"))
    extra["fused_rope"] = bool(a.bool("use_fused_rope"))
    clip = a.str("max_grad_norm")
    try:
        extra["grad_clip"] = clip is None or float(clip) > 0  # PaddleNLP's default max_grad_norm is 1.0
    except ValueError:
        raise UserError(f"{TOOL} argument --max_grad_norm {clip!r}: expected a number") from None
    if a.bool("enable_auto_parallel"):
        extra["full_vocab_loss"] = True
    return extra


def default_switches(auto_parallel: bool) -> dict:
    """The switches of a PaddleNLP run whose launch line sets none of them."""
    return kernel_switches(parse(["--enable_auto_parallel", "1"] if auto_parallel else [], TOOL))


def _file_arguments(path: str) -> list[str]:
    """A JSON / YAML file of arguments -> `--key value` tokens, as PaddleNLP's
    PdArgumentParser.read_json writes them (a list gives several values; a null keeps the default)."""
    import json

    f = Path(path).expanduser()
    if not f.is_file():
        raise UserError(
            f"{TOOL}: argument file {path} not found; give the path of the JSON / YAML file the "
            "training script reads"
        )
    try:
        if f.suffix.lower() == ".json":
            data = json.loads(f.read_text())
        else:
            import yaml

            data = yaml.safe_load(f.read_text())
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError: one line naming the file
        raise UserError(f"{TOOL}: cannot read argument file {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{TOOL}: argument file {path}: expected a mapping of argument names to values")
    out: list[str] = []
    for key, value in data.items():
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        out += ["--" + str(key)] + [json.dumps(v) if isinstance(v, dict) else str(v) for v in values]
    return out


def expand_argument_file(tokens: list[str]) -> tuple[list[str], str | None, int | None]:
    """(tokens with an argument file replaced by its arguments, the script name when the line is
    `paddleformers-cli train FILE`, the world size from a CUDA_VISIBLE_DEVICES=... prefix).
    The file is the first argument of the script (`run_pretrain.py FILE.json [--overrides]`), of
    `paddleformers-cli train`, or the first token; later arguments override the file's."""
    tokens = [t for t in tokens if t.strip() not in ("\\", "")]
    if tokens and tokens[0] == "--":
        tokens = tokens[1:]
    world = None
    while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
        name, _, value = tokens.pop(0).partition("=")
        if name == "CUDA_VISIBLE_DEVICES":
            world = len([d for d in value.strip("'\"").split(",") if d.strip()])
    script = None
    if tokens and PurePath(tokens[0]).name == "paddleformers-cli":
        if len(tokens) < 2 or tokens[1] != "train":
            raise UserError(
                f"{TOOL}: `paddleformers-cli {' '.join(tokens[1:2])}` is not a training command; "
                "paste `paddleformers-cli train FILE.yaml`"
            )
        script, tokens = "paddleformers-cli", tokens[2:]
    for i, tok in enumerate(tokens):
        if not tok.lower().endswith(CONFIG_SUFFIXES) or tok.startswith("-"):
            continue
        if i == 0 or tokens[i - 1].endswith(".py"):
            return tokens[:i] + _file_arguments(tok) + tokens[i + 1 :], script, world
        break
    return tokens, script, world


def _paddleformers_names(a, warnings: list[str]) -> bool:
    """Rename PaddleFormers' arguments in `a` to PaddleNLP's; True when any was PaddleFormers'."""
    found = False
    for new, old in PADDLEFORMERS_NAMES.items():
        if new in a.values:
            found = True
            if old in a.values and a.values[old] != a.values[new]:
                raise UserError(
                    f"{TOOL}: --{new} {' '.join(a.values[new])} (PaddleFormers) contradicts "
                    f"--{old} "
                    f"{' '.join(a.values[old])} (PaddleNLP's name): give one"
                )
            a.values[old] = a.values.pop(new)
    return found or any(k in a.values for k in PADDLEFORMERS_KNOWN)


def _degree(a, name: str) -> int | None:
    """A parallel degree; PaddleNLP's default -1 (and an absent argument) is None."""
    if (a.str(name) or "").strip() == "-1":
        return None
    return a.int(name)


def _paddleformers_recompute(a, plan: dict) -> None:
    """PaddleFormers' recompute arguments, Megatron's way: a granularity turns it on; full with
    `recompute_method block` recomputes `recompute_num_layers` layers of each stage, `uniform`
    every layer (in groups of recompute_num_layers)."""
    use = a.bool("use_recompute")
    gran = (a.str("recompute_granularity") or "").lower()
    method = (a.str("recompute_method") or "").lower()
    num = a.int("recompute_num_layers")
    if not gran:
        if use or a.bool("recompute"):
            plan["recompute"] = "full"
        elif method or num:
            raise UserError(
                f"{TOOL}: --recompute_method / --recompute_num_layers need --recompute_granularity"
            )
        return
    if gran == "selective":
        plan["recompute"] = "selective"
        return
    if gran not in ("full", "full_attn", "core_attn"):
        raise UserError(
            f"{TOOL}: --recompute_granularity {gran!r}: expected full, selective, full_attn or core_attn"
        )
    plan["recompute"] = gran
    if method == "block" and num is not None:
        plan["recompute_layers"] = num
    elif method not in ("", "uniform", "block"):
        raise UserError(f"{TOOL}: --recompute_method {method!r}: expected uniform or block")


def _refuse_unmodelled_finetuning(a) -> None:
    """PaddleFormers' fine-tuning kinds pipemem does not model (adapters, preference training)."""
    kind = (a.str("fine_tuning") or "full").lower()
    if kind != "full" or a.bool("lora"):
        raise UserError(
            f"{TOOL}: fine_tuning {kind if kind != 'full' else 'lora'} (adapters): not modelled; "
            "pipemem estimates full fine-tuning only (fine_tuning: full)"
        )
    stage = (a.str("stage") or "sft").lower()
    if stage not in ("sft", "pt", "pretrain"):
        raise UserError(
            f"{TOOL}: stage {a.str('stage')}: not modelled (a {a.str('stage')} step holds more "
            "than one model); pipemem estimates SFT / pre-training steps"
        )


def read(argv: list[str]) -> ToolConfig:
    tokens, cli_script, cli_world = expand_argument_file(list(argv))
    a = parse(tokens, TOOL)
    if cli_script:
        a.script = cli_script
    if a.world_size is None:
        a.world_size = cli_world
    if not a.values:
        raise UserError(
            "--from-paddlenlp: no arguments after `--`; paste the run_pretrain.py arguments, e.g. "
            "pipemem estimate --from-paddlenlp -- --model_name_or_path facebook/llama-7b ..."
        )
    warnings: list[str] = []
    plan: dict = {"convention": "paddle"}
    formers = _paddleformers_names(a, warnings) or cli_script == "paddleformers-cli"
    if formers:
        _refuse_unmodelled_finetuning(a)
        a.bool("packing")

    model = a.str("model_name_or_path")
    if not model:
        raise UserError("--from-paddlenlp: --model_name_or_path is required (a preset, hub id or config dir)")
    model_id, model = model, resolve_model_id(model)
    a.ints_into(
        plan, layers="num_hidden_layers", seq_len="max_seq_length", micro_batch="per_device_train_batch_size"
    )

    tp = _degree(a, "tensor_parallel_degree") or 1
    pp = _degree(a, "pipeline_parallel_degree") or 1
    sep = _degree(a, "sep_parallel_degree") or _degree(a, "context_parallel_degree") or 1
    dp_degree = _degree(a, "data_parallel_degree")
    world = a.int("world_size") or a.world_size
    # PaddleFormers shards stage1 unless told otherwise; PaddleNLP does not shard
    stage = (a.str("sharding") if a.has("sharding") else ("stage1" if formers else "")) or ""
    stage = stage.lower()
    sharding_degree = _degree(a, "sharding_parallel_degree")
    dp_unknown = False
    if sharding_degree is None and stage and dp_degree is None:
        # -1: every rank left after tp * pp * sep shards (TrainingArguments.__post_init__)
        if world is not None:
            if world % (tp * pp * sep):
                raise UserError(
                    f"{TOOL}: {world} devices are not divisible by tensor*pipeline*sep degrees = "
                    f"{tp * pp * sep}"
                )
            sharding_degree, dp_degree = world // (tp * pp * sep), 1
        else:
            sharding_degree, dp_degree, dp_unknown = 1, 1, True
    sharding_degree = sharding_degree or 1
    if dp_degree is None:
        if world is not None:
            model_par = tp * pp * sharding_degree * sep
            if world % model_par:
                raise UserError(
                    f"{TOOL}: {world} devices are not divisible by tensor*pipeline*sharding*sep "
                    f"degrees = {model_par}"
                )
            dp_degree = world // model_par
        else:
            dp_degree = 1
    plan.update(tp=tp, pp=pp, cp=sep)
    if not dp_unknown:  # else pipemem's --dp gives the data-parallel (= sharding) degree
        plan["dp"] = dp_degree * sharding_degree
    a.ints_into(plan, ep="expert_parallel_degree", vpp="virtual_pp_degree")

    if (sharding_degree > 1 or dp_unknown) and stage:
        levels = {int(s[-1]) for s in stage.split() if s.startswith("stage") and s[-1:].isdigit()}
        if not levels:
            raise UserError(f"{TOOL}: --sharding {stage!r}: expected stage1, stage2 or stage3")
        plan["zero"] = max(levels)
        # with the world unknown, the states shard over every data-parallel rank pipemem's --dp gives
        group, note = (None, "") if dp_unknown else _sharding_group(a, sharding_degree, dp_degree)
        if group is not None:
            plan["extra"] = {"zero_group": group}
        if note:
            warnings.append(note)

    # PaddleNLP's TrainingArguments.sequence_parallel defaults to False (pipemem's own default
    # turns sequence parallelism on with tp > 1).
    plan["sp"] = bool(a.bool("sequence_parallel"))
    # Fleet's MpConfig.recompute_allgather (Paddle PR #64244), passed as a tensor_parallel_config word
    tp_config = (a.str("tensor_parallel_config") or "").replace(",", " ").split()
    if any(w in ("recompute_allgather", "enable_recompute_allgather") for w in tp_config):
        plan["recompute_allgather"] = True

    fp16 = a.bool("fp16")
    bf16 = a.bool("bf16")
    if fp16 and bf16:
        raise UserError(f"{TOOL}: --fp16 and --bf16 are both on; choose one")
    if fp16 or bf16:
        plan["dtype"] = "bf16" if bf16 else "fp16"
        level = (a.str("fp16_opt_level") or "O1").upper()
        # O2 keeps fp16/bf16 weights with fp32 master weights; O1 keeps fp32 weights and casts.
        plan["master_weights"] = True
        if level not in ("O1", "O2"):
            raise UserError(f"{TOOL}: --fp16_opt_level {level!r}: expected O1 or O2")
        if level == "O1":
            warnings.append(
                f"{TOOL}: --fp16_opt_level O1 keeps fp32 weights and casts per op; "
                "modelled as O2 (half weights + fp32 master weights)"
            )
    else:
        plan["dtype"] = "fp32"
        plan["master_weights"] = False
    a.str("fp16_opt_level")

    rec = None if formers else a.bool("recompute")
    gran = (a.str("recompute_granularity") or "full").lower()
    if formers:
        _paddleformers_recompute(a, plan)
    elif rec:
        if gran not in ("full", "full_attn", "core_attn"):
            raise UserError(
                f"{TOOL}: --recompute_granularity {gran!r}: expected full, full_attn or core_attn"
            )
        plan["recompute"] = gran
        interval = a.int("pp_recompute_interval", minimum=0)
        if interval and interval > 1:
            warnings.append(
                f"{TOOL}: pp_recompute_interval {interval} (recompute every {interval}th layer) "
                "is modelled as recomputing every layer"
            )
    elif rec is False:
        plan["recompute"] = "none"

    flash = a.bool("use_flash_attention")
    impl_keys = ("_attn_implementation", "attn_impl", "attn_implementation")
    impl = next((a.str(k) for k in impl_keys if a.has(k)), None)
    if impl is not None:
        # PaddleFormers: flashmask / flash_attention run flash kernels (sdpa too, on a GPU); eager does not
        flash = impl.lower() != "eager"
    if flash is not None:
        plan["flash_attn"] = flash

    plan["extra"] = dict(plan.get("extra") or {}, **kernel_switches(a))

    sched = a.str("pipeline_schedule_mode")
    if sched:
        key = sched.replace("-", "").replace("_", "").lower()
        plan["schedule"] = _SCHEDULES.get(key, sched)

    accum = a.int("gradient_accumulation_steps")
    gbs = a.int("global_batch_size")
    if accum is not None and gbs is not None and not dp_unknown:
        mb = plan.get("micro_batch", 1)
        expected = accum * mb * plan["dp"]
        if gbs != expected:
            raise UserError(
                f"{TOOL}: --global_batch_size {gbs} contradicts gradient_accumulation_steps "
                f"{accum} x per_device_train_batch_size {mb} x data parallel {plan['dp']} "
                f"= {expected}"
            )
    if accum is not None:
        plan["microbatches"] = accum
    elif gbs is not None:
        plan["global_batch"] = gbs

    optim = a.str("optim")
    if optim:
        o = optim.lower()
        plan["optimizer"] = "adamw" if o.startswith("adamw") else ("sgd" if o == "sgd" else "adamw")
    a.bool("amp_master_grad")
    a.str("model_type")

    unknown = a.unknown(KNOWN, IGNORED)
    if unknown:
        warnings.append(f"{TOOL}: not modelled, ignored: " + " ".join("--" + u for u in unknown))
    return ToolConfig(
        model=model,
        plan=plan,
        warnings=warnings,
        tool=TOOL,
        dp_unknown=dp_unknown,
        model_name=model_id if model != model_id else "",
    )
