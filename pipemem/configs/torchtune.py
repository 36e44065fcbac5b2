"""torchtune recipe config (YAML, e.g. `recipes/configs/llama3_2/3B_full_single_device.yaml`)
-> pipemem preset and plan, under the torchtune convention (pipemem.templates.conventions).

What torchtune's full-finetune recipes (0.6.1) do with each key that changes device memory:

* `model._component_` names a builder (`torchtune.models.llama3_2.llama3_2_3b`): mapped to the
  preset of the same shape (`BUILDERS`), or, with torchtune installed, read from the builder's
  own source (`builder_config`: Llama 2/3.x, Qwen2/2.5 and Mistral builders). LoRA / QLoRA
  builders (`lora_llama3_1_8b`, `qlora_...`, as lora_finetune_single_device / _distributed run
  them): `lora_attn_modules` and `apply_lora_to_mlp` (w1, w2, w3) -> `lora_targets`, `lora_rank`,
  `lora_dropout`, `qlora` (quantize_base: the targeted linears in NF4); `apply_lora_to_output`
  and `use_dora` are refused; `lora_alpha` moves no memory.
* `batch_size` is the micro-batch; `gradient_accumulation_steps` repeats it before each
  optimizer step (the step's grads live across them); `tokenizer.max_seq_len` is the sequence
  length (null in most configs: the samples' lengths set it, so `--seq-len` must say it;
  `dataset.packed: True` makes every sample exactly max_seq_len).
* `dtype` bf16 or fp32: the model, its grads and optimizer states are in it (no fp32 master).
* `optimizer._component_`: torch.optim.AdamW / Adam / SGD (`fused: True` -> the fused step,
  else PyTorch's foreach path), bitsandbytes (Paged)AdamW8bit and torchao AdamW8bit /
  AdamW4bit (8- / 4-bit states; bitsandbytes' paging is not modelled and is said so).
* `optimizer_in_bwd`, `compile` (bool, or the per-component table of newer configs),
  `enable_activation_checkpointing` (full, per layer), `enable_activation_offloading`,
  `loss._component_` (CEWithChunkedOutputLoss -> chunked, `num_output_chunks` 8 by default).
* distributed recipes (every config not named `*_single_device.yaml`, or with an `fsdp_*` key)
  shard with FSDP2 over the data-parallel ranks: `data_parallel_shard_dim`, or, at its default
  -1 (every rank), `--dp`. `custom_sharded_layers` naming `tok_embeddings` and `output` makes
  them FSDP units of their own; without them (torchtune's default) they and the final norm are
  FSDP2's root unit, gathered again when the backward starts and held until it ends. Naming
  only one of them is refused.

Every other key is either known to change nothing on the device (`_NO_DEVICE_MEMORY`), refused
by name where pipemem would otherwise drop something that changes memory (QAT quantizers, FSDP
CPU offload, tensor / context / replicated parallelism), or reported as unknown in a warning.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import UserError
from .tool_config import ToolConfig

TOOL = "torchtune"

# torchtune model builders -> the preset with the same shapes (torchtune's builders use the
# published HF shapes of each model)
BUILDERS = {
    "llama3_2_1b": "llama3.2-1b",
    "llama3_2_3b": "llama3.2-3b",
    "llama3_8b": "llama3-8b",
    "llama3_1_8b": "llama3-8b",
    "llama3_70b": "llama3-70b",
    "llama3_1_70b": "llama3-70b",
    "llama3_3_70b": "llama3-70b",
    "llama3_1_405b": "llama3.1-405b",
    "llama2_7b": "llama2-7b",
    "llama2_13b": "llama2-13b",
    "llama2_70b": "llama2-70b",
    "mistral_7b": "mistral-7b",
    "qwen2_5_7b_base": "qwen2.5-7b",
    "qwen2_5_7b_instruct": "qwen2.5-7b",
    "qwen2_5_72b_instruct": "qwen2.5-72b",
}

# keys read below
_READ = {
    "model",
    "tokenizer",
    "batch_size",
    "gradient_accumulation_steps",
    "dtype",
    "optimizer",
    "optimizer_in_bwd",
    "loss",
    "compile",
    "enable_activation_checkpointing",
    "ac_mode",
    "enable_activation_offloading",
    "fsdp_cpu_offload",
    "fsdp_reshard_after_forward",
    "tensor_parallel_dim",
    "context_parallel_dim",
    "data_parallel_replicate_dim",
    "data_parallel_shard_dim",
    "quantizer",
    "custom_sharded_layers",
}
# keys that change nothing on the device (logging, checkpoints, data, schedules of the LR...);
# clip_grad_norm's foreach norms are a few scalars per parameter
_NO_DEVICE_MEMORY = {
    "output_dir",
    "checkpointer",
    "resume_from_checkpoint",
    "seed",
    "shuffle",
    "epochs",
    "max_steps_per_epoch",
    "metric_logger",
    "log_every_n_steps",
    "log_peak_memory_stats",
    "log_level",
    "profiler",
    "lr_scheduler",
    "device",
    "clip_grad_norm",
    "save_adapter_weights_only",
    "run_val_every_n_steps",
    "dataset_val",
    "collate_fn",
    "dataset",
    "ac_option",
    "activation_offloading_use_streams",
    "cudnn_deterministic_mode",
    "batch_size_val",
    "keep_last_n_checkpoints",
    "tensor_parallel_plan",
    "low_cpu_ram",
}

# torchtune component builders whose decoders the torchtune convention models (its
# MultiHeadAttention, RMSNorm and SwiGLU FeedForward) -> the HF model type of the same layers
_COMPONENTS = {
    "llama2": "llama",
    "llama3": "llama",
    "llama3_1": "llama",
    "llama3_2": "llama",
    "qwen2": "qwen2",
    "mistral": "mistral",
}


def _literal(node):
    import ast

    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _defaults(fn) -> dict:
    """A function definition's literal parameter defaults."""
    args = fn.args.args[len(fn.args.args) - len(fn.args.defaults) :]
    out = {a.arg: _literal(d) for a, d in zip(args, fn.args.defaults)}
    out.update({a.arg: _literal(d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None})
    return {k: v for k, v in out.items() if v is not None}


def builder_config(builder: str, root: Path | None = None) -> dict | None:
    """The HF-style config of a torchtune model builder (`torchtune.models.qwen2_5.qwen2_5_3b`),
    read from torchtune's own source -- the literal arguments its builder passes to the
    component builder, the component's defaults for the rest -- without importing torchtune
    (its package imports datasets and tokenizers). None when torchtune is not installed or the
    builder is not a plain call of a modelled component builder."""
    import ast
    import importlib.util

    parts = builder.split(".")
    if len(parts) != 4 or parts[:2] != ["torchtune", "models"]:
        return None
    if root is None:
        spec = importlib.util.find_spec("torchtune")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = Path(list(spec.submodule_search_locations)[0])
    family, name = parts[2], parts[3]
    for _ in range(3):  # follow `llama3_3_70b = llama3_1_70b` style aliases
        path = root / "models" / family / "_model_builders.py"
        if not path.is_file():
            return None
        tree = ast.parse(path.read_text())
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        if name in defs:
            break
        alias = next(
            (
                n.value.id
                for n in tree.body
                if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Name)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
            ),
            None,
        )
        source = next(
            (
                n.module
                for n in tree.body
                if isinstance(n, ast.ImportFrom) and n.module and any(a.name == alias for a in n.names)
            ),
            None,
        )
        if alias is None or source is None:
            return None
        family, name = source.split(".")[2], alias
    else:
        return None
    ret = next((n.value for n in ast.walk(defs[name]) if isinstance(n, ast.Return)), None)
    if not isinstance(ret, ast.Call) or not isinstance(ret.func, ast.Name) or ret.func.id not in _COMPONENTS:
        return None
    component = ret.func.id
    own = _defaults(defs[name])  # the builder's own parameters (`tie_word_embeddings=True`)
    kwargs = {}
    for k in ret.keywords:
        v = own.get(k.value.id) if isinstance(k.value, ast.Name) else _literal(k.value)
        if v is not None:
            kwargs[k.arg] = v
    comp_path = root / "models" / component / "_component_builders.py"
    if comp_path.is_file():
        comp = next(
            (
                n
                for n in ast.parse(comp_path.read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == component
            ),
            None,
        )
        if comp is not None:
            for a, d in _defaults(comp).items():
                kwargs.setdefault(a, d)
    need = ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "embed_dim", "intermediate_dim")
    if any(not isinstance(kwargs.get(k), int) for k in need):
        return None
    cfg = {
        "model_type": _COMPONENTS[component],
        "vocab_size": kwargs["vocab_size"],
        "num_hidden_layers": kwargs["num_layers"],
        "num_attention_heads": kwargs["num_heads"],
        "num_key_value_heads": kwargs["num_kv_heads"],
        "hidden_size": kwargs["embed_dim"],
        "intermediate_size": kwargs["intermediate_dim"],
        "tie_word_embeddings": bool(kwargs.get("tie_word_embeddings") or False),
    }
    if isinstance(kwargs.get("head_dim"), int):
        cfg["head_dim"] = kwargs["head_dim"]
    if isinstance(kwargs.get("max_seq_len"), int):
        cfg["max_position_embeddings"] = kwargs["max_seq_len"]
    return cfg


_OPTIMIZERS = {
    "torch.optim.AdamW": ("adamw", None),
    "torch.optim.Adam": ("adam", None),
    "torch.optim.SGD": ("sgd", None),
    "bitsandbytes.optim.AdamW8bit": ("adam8bit", None),
    "bitsandbytes.optim.PagedAdamW8bit": ("adam8bit", "paged"),
    "bitsandbytes.optim.PagedAdamW": ("adamw", "paged"),
    "torchao.optim.AdamW8bit": ("adam8bit", None),
    "torchao.prototype.low_bit_optim.AdamW8bit": ("adam8bit", None),
    "torchao.optim.AdamW4bit": ("adam4bit", None),
    "torchao.prototype.low_bit_optim.AdamW4bit": ("adam4bit", None),
}
_LOSSES = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked",
    "torch.nn.CrossEntropyLoss": "standard",
}


# torchtune's recipes (recipes/*.py, `tune run NAME`): the full fine-tuning ones pipemem models
RECIPES = {
    "full_finetune_single_device": False,
    "full_finetune_distributed": True,
    "lora_finetune_single_device": False,
    "lora_finetune_distributed": True,
}
_RECIPE_WORD = re.compile(r"\b([a-z0-9_]+_(?:single_device|distributed))(?:\.py)?\b")


def recipe_in_comments(text: str) -> str | None:
    """The recipe a config's comments name (torchtune's configs start with "Config for ... in
    full_finetune_distributed.py" and a `tune run [--nproc_per_node N] RECIPE --config ...` line,
    which `tune cp` copies with the file)."""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            m = _RECIPE_WORD.search(line)
            if m:
                return m.group(1)
    return None


def _recipe_distributed(recipe: str, where: str) -> bool:
    if recipe not in RECIPES:
        raise UserError(
            f"{where}: recipe {recipe}: not modelled; pipemem models torchtune's full and LoRA "
            f"fine-tuning recipes ({', '.join(RECIPES)})"
        )
    return RECIPES[recipe]


def read(path: str, recipe: str | None = None, overrides: tuple[str, ...] = ()) -> ToolConfig:
    """A torchtune recipe config (YAML) -> preset name and plan keyword arguments. Single device or
    distributed is the recipe's: `recipe` (from a `tune run` line), else the one the config's
    comments name, else an `fsdp_*` / `*_parallel_dim` key, else the file name (a note says so)."""
    try:
        import yaml
    except ImportError:
        raise UserError("--from-torchtune reads YAML: pip install pyyaml") from None
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"--from-torchtune {path}: no such file (give the config file, e.g. one `tune cp` wrote)"
        )
    text = p.read_text()
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"--from-torchtune {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise UserError(f"--from-torchtune {path}: not a torchtune recipe config (no `model:` section)")
    for item in overrides:
        _override(cfg, item, path)
    named = recipe or recipe_in_comments(text)
    notes = []
    if named is not None:
        distributed = _recipe_distributed(named, path)
    elif _distributed_keys(cfg):
        distributed = True
    else:
        distributed = "single_device" not in p.stem
        notes.append(
            f"{TOOL}: {p.name} names no recipe (its `tune run` line); taken as "
            f"{'full_finetune_distributed' if distributed else 'full_finetune_single_device'} "
            "from the "
            "file name: paste the `tune run` line to say which"
        )
    tool = from_dict(cfg, str(path), distributed=distributed)
    tool.warnings[:0] = notes
    return tool


def _distributed_keys(cfg: dict) -> bool:
    """Keys only full_finetune_distributed reads (FSDP settings, the device mesh's dimensions)."""
    return any(
        k.startswith("fsdp_") or k.endswith(("_parallel_dim", "_shard_dim")) or k == "custom_sharded_layers"
        for k in cfg
    )


def _override(cfg: dict, item: str, path: str) -> None:
    """A `tune run` command-line override `key.sub=value` (the value read as YAML, as torchtune's
    OmegaConf does for scalars); `~key` deletes."""
    import yaml

    if item.startswith("~"):
        keys = item[1:].split(".")
        node = cfg
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(keys[-1], None)
        return
    key, eq, value = item.partition("=")
    if not eq or not key:
        raise UserError(f"tune run: cannot read {item!r}; write overrides as key=value (e.g. batch_size=2)")
    keys = key.split(".")
    node = cfg
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    try:
        node[keys[-1]] = yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        node[keys[-1]] = value


def read_tune_run(argv: list[str]) -> ToolConfig:
    """A pasted `tune run [--nproc_per_node N] [--nnodes M] RECIPE --config FILE [key=value ...]`
    (or torchrun ... RECIPE.py --config FILE ...): the recipe decides single device or distributed,
    the process count the data-parallel degree of a distributed recipe sharding over every rank."""
    tokens = [t for t in argv if t.strip() not in ("\\", "")]
    if tokens and tokens[0] == "--":
        tokens = tokens[1:]
    if tokens[:2] == ["tune", "run"]:
        tokens = tokens[2:]
    launcher: dict[str, str] = {}
    recipe = config = None
    overrides: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
            if not eq:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
            if name == "config":
                config = value
            else:
                launcher[name.replace("-", "_")] = value
        elif recipe is None and "=" not in tok and tok not in ("torchrun", "python", "-m"):
            recipe = Path(tok).stem if tok.endswith(".py") else tok
        elif "=" in tok:
            overrides.append(tok)
        i += 1
    if recipe is None or config is None:
        raise UserError(
            "--from-torchtune -: paste the `tune run` line, e.g. -- tune run --nproc_per_node 8 "
            "full_finetune_distributed --config ./my_8b.yaml"
        )
    tool = read(config, recipe=recipe, overrides=tuple(overrides))
    try:
        world = int(launcher.get("nproc_per_node", 1)) * int(str(launcher.get("nnodes", 1)).split(":")[-1])
    except ValueError:
        raise UserError(f"tune run: cannot read the process count from {launcher}") from None
    if tool.plan.get("fsdp") and tool.dp_unknown:
        tool.plan["dp"], tool.dp_unknown = world, False
    elif not tool.plan.get("fsdp") and world > 1:
        raise UserError(f"tune run: {recipe} runs on one device; drop --nproc_per_node {world}")
    return tool


def _component(cfg: dict, key: str, path: str) -> tuple[str, dict]:
    sec = cfg.get(key)
    if not isinstance(sec, dict) or not isinstance(sec.get("_component_"), str):
        raise UserError(f"{path}: `{key}._component_` is missing")
    return sec["_component_"], {k: v for k, v in sec.items() if k != "_component_"}


# torchtune's LoRA builders (`lora_llama3_1_8b(lora_attn_modules, apply_lora_to_mlp=False,
# apply_lora_to_output=False, lora_rank=8, lora_alpha=16, lora_dropout=0.0, use_dora=False,
# quantize_base=False)`; `qlora_*` = the same with quantize_base=True)
_LORA_DEFAULTS = {
    "apply_lora_to_mlp": False,
    "apply_lora_to_output": False,
    "lora_rank": 8,
    "lora_dropout": 0.0,
}


def _lora(name: str, kw: dict, plan: dict, path: str) -> dict:
    """A LoRA / QLoRA builder's arguments -> plan keys (pipemem.lora); returns the arguments
    left unread."""
    kw = {**_LORA_DEFAULTS, **kw}
    if kw.get("use_dora"):
        raise UserError(f"{path}: model.use_dora: DoRA's magnitude vectors and weight norms are not modelled")
    if kw.get("apply_lora_to_output"):
        raise UserError(
            f"{path}: model.apply_lora_to_output: an adapter on the output layer is not modelled; "
            "set it False"
        )
    attn = kw.get("lora_attn_modules")
    if not isinstance(attn, list) or not all(isinstance(m, str) for m in attn):
        raise UserError(
            f"{path}: model.lora_attn_modules: {attn!r}: expected a list such as [q_proj, v_proj]"
        )
    targets = list(attn) + (["w1", "w2", "w3"] if kw.get("apply_lora_to_mlp") else [])
    if not targets:
        raise UserError(f"{path}: model: no LoRA adapters (lora_attn_modules empty, apply_lora_to_mlp False)")
    plan["lora_rank"] = _pos_int(kw.get("lora_rank"), "model.lora_rank", path)
    plan["lora_targets"] = ",".join(targets)
    if kw.get("lora_dropout"):
        plan["lora_dropout"] = float(kw["lora_dropout"])
    if name.startswith("qlora_") or kw.get("quantize_base"):
        plan["qlora"] = True
    read = {
        "lora_attn_modules",
        "apply_lora_to_mlp",
        "apply_lora_to_output",
        "lora_rank",
        "lora_alpha",  # scales the adapters' output: moves no memory
        "lora_dropout",
        "use_dora",
        "quantize_base",
    }
    return {k: v for k, v in kw.items() if k not in read}


def _pos_int(value, key: str, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{path}: {key}: {value!r} is not a positive integer")
    return value


def from_dict(cfg: dict, path: str, distributed: bool = False) -> ToolConfig:
    warnings = [
        f"{TOOL}: {key} is not known to pipemem; ignored"
        for key in cfg
        if key not in _READ and key not in _NO_DEVICE_MEMORY
    ]
    plan: dict = {"convention": "torchtune"}

    builder, model_kw = _component(cfg, "model", path)
    name = builder.rsplit(".", 1)[-1]
    if name.startswith(("lora_", "qlora_")):
        model_kw = _lora(name, model_kw, plan, path)
        name = name.split("_", 1)[1]
        builder = builder.rsplit(".", 1)[0] + "." + name
    model = BUILDERS.get(name) or builder_config(builder)
    if model is None:
        raise UserError(
            f"{path}: model {builder} is not modelled under the torchtune convention (its builders of "
            f"{', '.join(sorted(_COMPONENTS))} decoders are, read from torchtune's source when it is "
            "installed); give the model's HF config with --model config.json and --convention hf"
        )
    if model_kw:
        warnings.append(
            f"{TOOL}: model arguments {', '.join(sorted(model_kw))} are not read (the preset's shape is used)"
        )

    plan["micro_batch"] = _pos_int(cfg.get("batch_size", 1), "batch_size", path)
    gas = _pos_int(cfg.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", path)
    if gas > 1:
        plan["microbatches"] = gas
    seq = (cfg.get("tokenizer") or {}).get("max_seq_len")
    if seq is not None:
        plan["seq_len"] = _pos_int(seq, "tokenizer.max_seq_len", path)

    dtype = str(cfg.get("dtype", "bf16")).lower()
    if dtype not in ("bf16", "fp32"):
        raise UserError(f"{path}: dtype {dtype}: torchtune trains in bf16 or fp32")
    plan["dtype"] = dtype

    opt, opt_kw = _component(cfg, "optimizer", path)
    if opt not in _OPTIMIZERS:
        raise UserError(f"{path}: optimizer {opt} is not modelled (known: {', '.join(sorted(_OPTIMIZERS))})")
    plan["optimizer"], paged = _OPTIMIZERS[opt]
    if paged:
        warnings.append(
            f"{TOOL}: {opt} pages its states through unified memory; counted as resident device memory "
            "(paging not modelled)"
        )
    if plan["optimizer"] in ("adamw", "adam", "sgd") and not paged and opt.startswith("torch."):
        plan["optimizer_impl"] = "fused" if opt_kw.get("fused") else "foreach"
    if cfg.get("optimizer_in_bwd"):
        plan["optimizer_in_backward"] = True

    if "loss" in cfg:
        loss, loss_kw = _component(cfg, "loss", path)
        if loss not in _LOSSES:
            raise UserError(f"{path}: loss {loss} is not modelled (known: {', '.join(sorted(_LOSSES))})")
        if _LOSSES[loss] == "chunked":
            plan["loss"] = "chunked"
            plan["loss_chunks"] = _pos_int(
                loss_kw.get("num_output_chunks", 8), "loss.num_output_chunks", path
            )

    comp = cfg.get("compile", False)
    if isinstance(comp, dict):  # newer configs: compile: {model: true, loss: true, ...}
        if comp.get("model"):
            plan["compile"] = "all" if comp.get("loss", True) else "layers"
    elif comp:
        plan["compile"] = "all"  # the recipe compiles each layer and the loss

    if cfg.get("enable_activation_checkpointing"):
        mode = str(cfg.get("ac_mode") or "full").lower()
        if mode != "full":
            raise UserError(
                f"{path}: ac_mode {mode}: torchtune's selective checkpointing (every n-th layer) is not "
                "modelled; use enable_activation_checkpointing with the default full mode"
            )
        plan["recompute"] = "full"
    if cfg.get("enable_activation_offloading"):
        plan["activation_offload"] = "all"

    if cfg.get("quantizer") is not None:
        raise UserError(
            f"{path}: quantizer: quantization-aware training (fake-quantised linears) is not modelled"
        )
    if cfg.get("fsdp_cpu_offload"):
        raise UserError(
            f"{path}: fsdp_cpu_offload: FSDP CPU offloading of parameters, gradients and optimizer "
            "states is not modelled"
        )
    for key, what in (
        ("tensor_parallel_dim", "torchtune's tensor parallelism"),
        ("context_parallel_dim", "torchtune's context parallelism"),
        ("data_parallel_replicate_dim", "replicated (HSDP) data parallelism"),
    ):
        v = cfg.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v <= 1):
            raise UserError(f"{path}: {key}: {v}: {what} is not modelled")
    dp_unknown = False
    if distributed or _distributed_keys(cfg):
        plan["fsdp"] = True
        extra = {}
        if cfg.get("fsdp_reshard_after_forward") is False:
            extra["fsdp_reshard_after_forward"] = False
        shard = cfg.get("data_parallel_shard_dim", -1)
        if isinstance(shard, int) and not isinstance(shard, bool) and shard >= 1:
            plan["dp"] = shard
        elif shard != -1:
            raise UserError(f"{path}: data_parallel_shard_dim: {shard!r}: expected -1 or a positive integer")
        else:
            dp_unknown = True  # FSDP2 over every rank: the world size comes from --dp
        # custom_sharded_layers: modules shard_model wraps apart from the decoder layers; without
        # them the embedding, the final norm and the output layer are FSDP2's root unit (held
        # unsharded from the backward's start to its end; templates/layers.py fsdp_root_unit)
        custom = cfg.get("custom_sharded_layers") or []
        if not isinstance(custom, list) or not all(isinstance(c, str) for c in custom):
            raise UserError(f"{path}: custom_sharded_layers: {custom!r}: expected a list of module names")
        ends = {"tok_embeddings", "output"} & set(custom)
        if len(ends) == 1:
            raise UserError(
                f"{path}: custom_sharded_layers names {ends.pop()} but not "
                f"{({'tok_embeddings', 'output'} - set(custom)).pop()}: a root unit holding only one "
                "of the embedding and the output layer is not modelled; name both or neither"
            )
        if ends:
            extra["custom_sharded_layers"] = sorted(ends)
        if extra:
            plan["extra"] = extra
    return ToolConfig(
        model, plan, warnings, TOOL, model_name=name if isinstance(model, dict) else "", dp_unknown=dp_unknown
    )
