"""torchtitan job TOML (`train_configs/*.toml`) -> pipemem preset and plan.

Two inputs: a job TOML (the tables of torchtitan 0.3's `Trainer.Config.to_dict()`, or an older
job file), or torchtitan 0.3's own launch arguments (`--module llama3 --config llama3_8b
--parallelism.tensor_parallel_degree 8`, resolved by torchtitan's ConfigManager when it is
installed). Every memory-relevant key is honoured or refused by name (`_KEYS`; torch.compile and
Float8 linears are read by `_modern`, MX is refused). Model: `[model] name` + `flavor` (or
`model_spec`) name torchtitan's built-in Llama 3 sizes, mapped to our presets with the same
shapes; launch arguments build torchtitan's own model on the meta device. Batch: with pipeline
parallelism torchtitan splits each rank's `local_batch_size` into microbatches of
`pipeline_parallel_microbatch_size`; without it the local batch is one microbatch (gradient
accumulation repeats whole steps, which does not raise the peak). FSDP2 keeps fp32 sharded
parameters and gathers them in `mixed_precision_param`, so bf16 training here means bf16 compute
with fp32 master state. `[parallelism] tensor_parallel_recompute_allgather = true` (pipemem's
key, for a plan whose column-parallel linears are `pipemem.torch_tp.RegatherColwiseParallel`) is
`--recompute-allgather`.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from ..errors import UserError
from .tool_config import ToolConfig

TOOL = "torchtitan"

# (model name, flavor) -> preset with the same shapes. torchtitan's llama3 8B/70B/405B use
# dim/n_layers/n_heads/n_kv_heads/ffn multipliers that give exactly these HF shapes.
FLAVORS = {
    ("llama3", "8b"): "llama3-8b",
    ("llama3", "70b"): "llama3-70b",
    ("llama3", "405b"): "llama3.1-405b",
    ("llama2", "7b"): "llama2-7b",
    ("llama2", "13b"): "llama2-13b",
    ("llama2", "70b"): "llama2-70b",
}
# torchtitan's small test model (0.3's llama3 "debugmodel": dim 256, 6 layers, 16 heads, ffn from
# multiple_of 256, a 2,048-token vocabulary).
DEBUG_MODEL = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 6,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

_DTYPES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "float32": "fp32",
    "fp32": "fp32",
}
_MULTI_STAGE = {"interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"}

# Tables of torchtitan's job config (Trainer.Config.to_dict(), or an older job TOML) whose keys
# change memory; every key of them is honoured or refused by name (_KEYS below). The other
# tables (logging, data, checkpoints, tokenizer...) change nothing on the device.
KNOWN_SECTIONS = {
    "model",
    "model_spec",
    "training",
    "parallelism",
    "activation_checkpoint",
    "optimizer",
    "compile",
    "loss",
    "float8",
    "mx",
}
IGNORED_SECTIONS = {
    "job",
    "profiling",
    "profiler",
    "metrics",
    "lr_scheduler",
    "checkpoint",
    "comm",
    "memory_estimation",
    "fault_tolerance",
    "experimental",
    "validation",
    "validator",
    "debug",
    "dataloader",
    "tokenizer",
    "override",
    "hf_assets_path",
    "dump_folder",
}

# key -> what pipemem does with it: "plan" (honoured), "none" (no device memory), or a refusal text
_KEYS = {
    "training": {
        "local_batch_size": "plan",
        "batch_size": "plan",
        "global_batch_size": "plan",
        "seq_len": "plan",
        "dtype": "plan",
        "mixed_precision_param": "plan",
        "mixed_precision_reduce": "plan",
        "disable_cuda_graphs": "plan",
        "compile": "plan",  # older configs' torch.compile switch (_modern)
        "max_norm": "none",
        "steps": "none",
        "gc_freq": "none",
        "gc_debug": "none",
        "warmup_steps": "none",
        "seed": "none",
        "deterministic": "none",
        "dataset": "none",
        "dataset_path": "none",
        "enable_cpu_offload": "CPU offloading of parameters, gradients and optimizer states "
        "is not modelled yet",
    },
    "parallelism": {
        "data_parallel_replicate_degree": "plan",
        "data_parallel_shard_degree": "plan",
        "fsdp_reshard_after_forward": "plan",
        "tensor_parallel_degree": "plan",
        "enable_sequence_parallel": "plan",
        "pipeline_parallel_degree": "plan",
        "pipeline_parallel_first_stage_less_layers": "plan",
        "pipeline_parallel_last_stage_less_layers": "plan",
        "pipeline_parallel_layers_per_stage": "plan",
        "pipeline_parallel_schedule": "plan",
        "pipeline_parallel_schedule_csv": "plan",
        "pipeline_parallel_microbatch_size": "plan",
        "context_parallel_degree": "plan",
        "expert_parallel_degree": "plan",
        "tensor_parallel_recompute_allgather": "plan",
        "spmd_backend": "none",
        "context_parallel_load_balancer": "none",
        "context_parallel_ptrr_mask_key": "none",
        "context_parallel_rotate_method": "none",
        "disable_loss_parallel": "none",
        "enable_compiled_autograd": "compiled autograd is not modelled",
        "enable_async_tensor_parallel": "async tensor parallelism (needs torch.compile) is not modelled yet",
        "enable_fsdp_symm_mem": "FSDP symmetric-memory buffers are not modelled",
        "module_fqns_per_model_part": "a hand-written split of modules into pipeline stages is not modelled; "
        "use pipeline_parallel_layers_per_stage or --pp-layout",
        "expert_tensor_parallel_degree": "plan",
    },
    "activation_checkpoint": {
        "mode": "plan",
        "selective_ac_option": "plan",
        "preserve_rng_state": "none",
        "determinism_check": "none",
        "debug": "none",
        "force_recompute_mm_shapes_by_fqns": "none",
        "per_op_sac_force_recompute_mm_shapes_by_fqns": "none",
        "memory_budget": "plan",
        "visualize_memory_budget_pareto": "none",
        "early_stop": "none",
    },
    "compile": {
        "enable": "plan",
        "components": "none",
        "backend": "none",
        "enable_async_tensor_parallel": "plan",
    },
    "optimizer": {
        "name": "plan",
        "param_groups": "plan",
        "implementation": "plan",
        "lr": "none",
        "eps": "none",
        "beta1": "none",
        "beta2": "none",
        "weight_decay": "none",
        "early_step_in_backward": "plan",
        "optimizer_factory_kwargs_by_name": "none",
    },
    "loss": {"num_chunks": "plan", "loss_fn": "none"},
}
_NOT_MODELLED_16 = "(pipemem refuses rather than estimate without it)"


def read(path: str) -> ToolConfig:
    """A torchtitan job TOML: the tables of `Trainer.Config.to_dict()` (torchtitan 0.3) or an
    older job file ([model] name/flavor, [activation_checkpoint] mode...)."""
    return from_tables(_load(path), path)


def read_args(argv: list[str]) -> ToolConfig:
    """torchtitan 0.3's own launch arguments (`--module llama3 --config llama3_8b
    --parallelism.tensor_parallel_degree 8 ...`), resolved by torchtitan's ConfigManager (its
    config_registry function, then the overrides); needs torchtitan installed."""
    from ..traced.torchtitan_model import import_stubs

    try:
        with import_stubs():
            from torchtitan.config.manager import ConfigManager
    except ImportError as e:
        raise UserError(
            f"--from-torchtitan with launch arguments needs torchtitan==0.3.0 ({e}); "
            "pip install 'pipemem[torchtitan]', or give a job TOML"
        ) from None
    try:
        # config_registry modules import torchtitan's models
        with import_stubs(), _target_gpu_capability():
            cfg = ConfigManager().parse_args(list(argv))
    except SystemExit:
        raise UserError(
            "--from-torchtitan: torchtitan could not parse these arguments (see its message above); "
            "e.g. -- --module llama3 --config llama3_8b --parallelism.tensor_parallel_degree 8"
        ) from None
    except (ImportError, ValueError, AttributeError) as e:
        raise UserError(f"--from-torchtitan: {e}") from None
    return from_trainer_config(cfg)


def from_trainer_config(cfg, model: dict | None = None) -> ToolConfig:
    """The plan of a torchtitan 0.3 `Trainer.Config` (what `read_args` resolves, or a config built
    in code); `model`, when given, stands for the HF-style config of its model spec."""
    tables = cfg.to_dict()
    tables.update(_converter_tables(cfg.model_spec))
    ac = cfg.activation_checkpoint
    tables["activation_checkpoint"] = dict(tables.get("activation_checkpoint") or {})
    tables["activation_checkpoint"]["mode"] = (
        "none"
        if ac is None
        else type(ac)
        .__qualname__.split(".")[0]
        .replace("AC", "")
        .lower()
        .replace("memorybudget", "memory_budget")
    )
    name = cfg.model_spec.name if cfg.model_spec is not None else "model"
    flavor = cfg.model_spec.flavor if cfg.model_spec is not None else ""
    if model is None:
        model = _model_from_spec(cfg.model_spec)
    return from_tables(tables, f"torchtitan {name} {flavor}", model=model)


@contextmanager
def _target_gpu_capability():
    """torchtitan's Float8 / MX / NVFP4 converters check the GPU of the process that builds them
    (components/quantization/*.py: has_cuda_capability(8, 9)...) and refuse on an older or absent
    one. pipemem only reads their settings for the GPUs the job will run on, so the check is
    answered "capable" while the configuration is built."""
    import importlib

    patched = []
    for name in ("float8", "mx", "nvfp4"):
        try:
            mod = importlib.import_module(f"torchtitan.components.quantization.{name}")
        except Exception:  # a converter module that does not import here is not used
            continue
        if hasattr(mod, "has_cuda_capability"):
            patched.append((mod, mod.has_cuda_capability))
            mod.has_cuda_capability = lambda *a, **k: True
    try:
        yield
    finally:
        for mod, fn in patched:
            mod.has_cuda_capability = fn


def _model_from_spec(spec) -> dict:
    """An HF-style config dict of torchtitan's model, read off its config tree
    (`traced.torchtitan_model.hf_config`: llama3, qwen3 and its MoE, deepseek_v3)."""
    from ..traced.torchtitan_model import hf_config

    return hf_config(spec.model)


def from_job_config(cfg, path: str, model: dict | str | None = None) -> ToolConfig:
    """The plan of a torchtitan JobConfig dataclass from before 0.3 (0.2.2's ConfigManager builds
    one): its sections as the job file's tables, each with the keys this reader knows (the rest
    are that release's defaults, which pipemem does not read)."""
    import dataclasses

    tables = {
        name: {k: v for k, v in section.items() if k in _KEYS[name]}
        for name, section in dataclasses.asdict(cfg).items()
        if name in _KEYS and isinstance(section, dict)
    }
    return from_tables(tables, path, model=model)


def from_tables(cfg: dict, path: str, model: dict | str | None = None) -> ToolConfig:
    """The plan of torchtitan job-config tables (see `read`); `model` when the caller resolved it."""
    warnings: list[str] = []
    plan: dict = {"convention": "torchtitan", "fsdp": True}
    extra: dict = {}
    dp_unknown = False
    for name in cfg:
        if name in _KEYS and isinstance(cfg[name], dict):
            for key in cfg[name]:
                what = _KEYS[name].get(key)
                if what is None:
                    warnings.append(f"{TOOL}: [{name}] {key} is not known to pipemem; ignored")
                elif what not in ("plan", "none") and _enabled(cfg[name][key]):
                    raise UserError(f"{path}: [{name}] {key}: {what}")

    if model is None:
        model = _model(cfg, path)

    tr = _section(cfg, "training", path)
    par = _section(cfg, "parallelism", path)
    ac = _section(cfg, "activation_checkpoint", path)
    opt = _section(cfg, "optimizer", path)
    comp = _section(cfg, "compile", path)
    if cfg.get("mx"):
        raise UserError(
            f"{path}: [mx]: MX (microscaling) training is not modelled; pipemem models torchao "
            "Float8 tensorwise / rowwise"
        )
    if comp.get("enable_async_tensor_parallel"):
        raise UserError(
            f"{path}: [compile] enable_async_tensor_parallel: async tensor parallelism is not modelled"
        )
    # torch.compile and float8 linears (pipemem.features)
    plan.update(_modern(cfg, _section(cfg, "model", path), path))
    if par.get("enable_async_tensor_parallel"):
        raise UserError(
            f"{path}: [parallelism] enable_async_tensor_parallel: async TP (torch.compile) is not "
            f"modelled yet {_NOT_MODELLED_16}"
        )

    seq = _pos_int(tr, "seq_len", path, "training")
    if seq is not None:
        plan["seq_len"] = seq
    local = _pos_int(tr, "local_batch_size", path, "training")
    old = _pos_int(tr, "batch_size", path, "training")
    if local is not None and old is not None and local != old:
        raise UserError(f"{path}: [training] local_batch_size {local} and batch_size {old} disagree")
    local = local or old or 8  # torchtitan's default local batch

    tp = _pos_int(par, "tensor_parallel_degree", path, "parallelism") or 1
    pp = _pos_int(par, "pipeline_parallel_degree", path, "parallelism") or 1
    cp = _pos_int(par, "context_parallel_degree", path, "parallelism") or 1
    ep = _pos_int(par, "expert_parallel_degree", path, "parallelism")
    etp = _pos_int(par, "expert_tensor_parallel_degree", path, "parallelism")
    replicate = _pos_int(par, "data_parallel_replicate_degree", path, "parallelism") or 1
    shard = par.get("data_parallel_shard_degree", -1)
    if not isinstance(shard, int) or isinstance(shard, bool) or (shard < 1 and shard != -1):
        raise UserError(f"{path}: [parallelism] data_parallel_shard_degree must be -1 or a positive integer")
    if replicate > 1:
        raise UserError(
            f"{path}: [parallelism] data_parallel_replicate_degree {replicate}: replicated data "
            "parallelism (HSDP / replicate) is not modelled: pipemem shards model states over every "
            "data-parallel rank; use data_parallel_shard_degree"
        )
    plan.update(tp=tp, pp=pp, cp=cp)
    if ep is not None:
        plan["ep"] = ep
    if etp is not None:
        plan["etp"] = etp
    if "enable_sequence_parallel" in par:
        plan["sp"] = bool(par["enable_sequence_parallel"]) and tp > 1
    if shard == -1:
        # -1 = "all remaining ranks": the world size is not in the file. pipemem --dp fills it in.
        dp_unknown = True
    else:
        plan["dp"] = shard
    regather = par.get("tensor_parallel_recompute_allgather", False)
    if not isinstance(regather, bool):
        raise UserError(
            f"{path}: [parallelism] tensor_parallel_recompute_allgather = {regather!r}: expected "
            "true or false"
        )
    if regather:
        plan["recompute_allgather"] = True
    reshard = str(par.get("fsdp_reshard_after_forward", "default")).lower()
    if reshard not in ("default", "always", "never"):
        raise UserError(
            f"{path}: [parallelism] fsdp_reshard_after_forward {reshard!r}: expected default, always or never"
        )
    # torchtitan: blocks reshard after forward unless "never", or "default" with pipeline parallelism
    if reshard == "never" or (reshard == "default" and pp > 1):
        extra["fsdp_reshard_after_forward"] = False
    # ... and the [norm, output] unit only with "always" (distributed/fsdp.py: the last layers stay
    # unsharded after the forward, which the backward needs first)
    if reshard == "always":
        extra["fsdp_reshard_head"] = True

    if pp > 1:
        csv = str(par.get("pipeline_parallel_schedule_csv", "") or "")
        sched = f"csv:{csv}" if csv else str(par.get("pipeline_parallel_schedule", "1F1B"))
        plan["schedule"] = sched
        mbs = _pos_int(par, "pipeline_parallel_microbatch_size", path, "parallelism") or 1
        if local % mbs:
            raise UserError(
                f"{path}: local_batch_size {local} is not divisible by "
                f"pipeline_parallel_microbatch_size {mbs}"
            )
        plan["micro_batch"] = mbs
        plan["microbatches"] = local // mbs
        lps = _pos_int(par, "pipeline_parallel_layers_per_stage", path, "parallelism")
        if lps is not None:
            plan["_layers_per_stage"] = lps
        elif not csv and sched.replace("_", "").lower() in _MULTI_STAGE:
            plan["vpp"] = 2
            warnings.append(
                f"{TOOL}: {sched} without pipeline_parallel_layers_per_stage: 2 stages per rank assumed"
            )
        # torchtitan gives the first and last stages fewer layers (embedding / output) by default
        for key, side in (
            ("pipeline_parallel_first_stage_less_layers", "_first_less"),
            ("pipeline_parallel_last_stage_less_layers", "_last_less"),
        ):
            # 1 by default since torchtitan renamed [training] batch_size to local_batch_size;
            # job files older than that split the layers evenly
            v = par.get(key, 0 if "batch_size" in tr and "local_batch_size" not in tr else 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UserError(f"{path}: [parallelism] {key} = {v!r}: expected a non-negative integer")
            if v:
                plan[side] = v
    else:
        plan["micro_batch"] = local
        plan["microbatches"] = 1

    # precision: params kept in training.dtype (fp32 default: the FSDP2 sharded copy is the master),
    # computed in mixed_precision_param, gradients reduced in mixed_precision_reduce
    store = _DTYPES.get(str(tr.get("dtype", "float32")).lower())
    mp = _DTYPES.get(str(tr.get("mixed_precision_param", "bfloat16")).lower())
    reduce_ = _DTYPES.get(str(tr.get("mixed_precision_reduce", "float32")).lower())
    for key, v in (("dtype", store), ("mixed_precision_param", mp), ("mixed_precision_reduce", reduce_)):
        if v is None:
            raise UserError(f"{path}: [training] {key} {tr.get(key)!r}: expected bfloat16 or float32")
    if store != "fp32":
        plan["dtype"], plan["master_weights"] = store, False  # parameters stored in low precision
    else:
        plan["dtype"], plan["master_weights"] = mp, mp != "fp32"
    plan["main_grad_dtype"] = reduce_ if store == "fp32" and mp != "fp32" else plan["dtype"]
    if tr.get("disable_cuda_graphs") is not None:
        plan["grads"] = "set-to-none" if tr.get("disable_cuda_graphs") else "buffer"

    if "model_spec" in cfg and "activation_checkpoint" not in cfg:
        warnings.append(
            f"{TOOL}: no [activation_checkpoint] table: torchtitan 0.3's default SelectiveAC assumed "
            "(Trainer.Config.to_dict() of activation_checkpoint=None leaves the table out; write "
            'mode = "none" there)'
        )
    mode = str(ac.get("mode") or _ac_mode(ac, "model_spec" in cfg)).lower()
    if mode == "none":
        plan["recompute"] = "none"
    elif mode == "full":
        plan["recompute"] = "full"
    elif mode == "memory_budget":
        raise UserError(
            f"{path}: [activation_checkpoint] memory_budget: the compiler's min-cut checkpointing "
            f"(needs torch.compile) is not modelled yet {_NOT_MODELLED_16}"
        )
    elif mode == "selective":
        option = str(ac.get("selective_ac_option", "op")).lower()
        if option == "op":
            # under the torchtitan convention, --recompute selective is torchtitan's op-level
            # policy (pipemem/templates/layers.py: matmuls and attention kept, the rest recomputed)
            plan["recompute"] = "selective"
        elif option.isdigit() and int(option) > 0:
            plan["recompute"] = "full"
            plan["_every_nth_layer"] = int(option)
            warnings.append(
                f"{TOOL}: selective_ac_option {option} (a full checkpoint on one layer in "
                f"{option}) is modelled with --recompute-layers = layers per stage / {option}"
            )
        else:
            raise UserError(
                f"{path}: [activation_checkpoint] selective_ac_option {option!r}: expected 'op' "
                "or a positive integer"
            )
    else:
        raise UserError(f"{path}: [activation_checkpoint] mode {mode!r}: expected none, selective or full")

    names = [
        str(g.get("optimizer_name", "AdamW")) for g in (opt.get("param_groups") or []) if isinstance(g, dict)
    ]
    names = names or [str(opt.get("name", "AdamW"))]
    bad = sorted({n for n in names if n.lower() not in ("adamw", "adam")})
    if bad:
        raise UserError(f"{path}: [optimizer] {', '.join(bad)}: only Adam/AdamW are modelled")
    plan["optimizer"] = "adamw" if names[0].lower() == "adamw" else "adam"
    impl = str(opt.get("implementation", "fused")).lower()  # torchtitan's default is fused
    if impl not in ("fused", "foreach", "for-loop", "fused_opt_states_bf16"):
        raise UserError(f"{path}: [optimizer] implementation {impl!r}: expected fused, foreach or for-loop")
    if impl == "fused_opt_states_bf16":
        raise UserError(
            f"{path}: [optimizer] implementation fused_opt_states_bf16 (bf16 Adam states) is not "
            "modelled; use fused"
        )
    plan["optimizer_impl"] = impl
    if opt.get("early_step_in_backward"):
        raise UserError(
            f"{path}: [optimizer] early_step_in_backward: the optimizer step inside the backward "
            "is not modelled"
        )

    # ChunkedLossWrapper (0.3's default loss): the head runs per sequence chunk (templates/chunked_loss.py)
    loss = _section(cfg, "loss", path)
    chunks = loss.get("num_chunks", 8 if "model_spec" in cfg else 1)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise UserError(f"{path}: [loss] num_chunks = {chunks!r}: expected a positive integer")
    extra["loss_chunks"] = chunks
    if "model_spec" not in cfg:
        # an older job file: torchtitan before 0.3 kept one RoPE buffer (freqs_cis) on the model,
        # 0.3 one per attention (frameworks/torchtitan.py layer_buffer_bytes)
        extra["rope_cache"] = "model"

    if isinstance(model, dict) and model.get("torchtitan_release") == "0.2.2":
        # llama4 runs in torchtitan 0.2.2 (0.3 ships none): its Trainer starts each step with
        # `optimizers.zero_grad()` (set_to_none), keeps one model-level RoPE buffer and computes one
        # whole-sequence cross entropy (held against its step by `pipemem validate torchtitan`)
        if tr.get("disable_cuda_graphs") is None:
            plan["grads"] = "set-to-none"
        extra["rope_cache"] = "model"
        extra["loss_chunks"] = 1

    gbs = tr.get("global_batch_size", -1)
    if isinstance(gbs, int) and gbs > 0 and "dp" in plan and gbs % (local * plan["dp"]):
        raise UserError(
            f"{path}: [training] global_batch_size {gbs} is not a multiple of local_batch_size "
            f"{local} x data parallel {plan['dp']}"
        )
    plan["extra"] = extra

    unknown = sorted(k for k in cfg if k not in KNOWN_SECTIONS and k not in IGNORED_SECTIONS)
    if unknown:
        warnings.append(f"{TOOL}: not modelled, ignored sections: " + " ".join(f"[{u}]" for u in unknown))
    name = str(
        _section(cfg, "model", path).get("name") or (cfg.get("model_spec") or {}).get("name") or "model"
    )
    flavor = str(
        _section(cfg, "model", path).get("flavor") or (cfg.get("model_spec") or {}).get("flavor") or ""
    )
    return ToolConfig(
        model=model,
        plan=plan,
        warnings=warnings,
        tool=TOOL,
        model_name=f"torchtitan-{name.lower()}-{flavor.lower()}",
        dp_unknown=dp_unknown,
    )


def _modern(cfg: dict, model_sec: dict, path: str) -> dict:
    """torch.compile and float8 (pipemem.features) from the job config. torchtitan 0.3:
    `[compile] enable`, `components` ("model", "loss"); older configs: `[training] compile`
    (the blocks only). Float8: `[model] converters = ["float8"]` (or the older `[float8]
    enable_float8_linear`) with `[float8] recipe_name` (default tensorwise) and
    `enable_fsdp_float8_all_gather`."""
    out: dict = {}
    comp = cfg.get("compile") if isinstance(cfg.get("compile"), dict) else {}
    tr = cfg.get("training") if isinstance(cfg.get("training"), dict) else {}
    if comp.get("enable"):
        components = [str(c).lower() for c in comp.get("components", ["model", "loss"])]
        out["compile"] = "all" if "loss" in components else "layers"
    elif tr.get("compile") is True:
        out["compile"] = "layers"
    converters = model_sec.get("converters") or []
    if isinstance(converters, str):
        converters = [c.strip() for c in converters.split(",") if c.strip()]
    f8 = cfg.get("float8") if isinstance(cfg.get("float8"), dict) else {}
    unknown = [c for c in converters if str(c).lower() not in ("float8",)]
    if unknown:
        raise UserError(
            f"{path}: [model] converters {unknown[0]!r} is not modelled (pipemem models torchao "
            "Float8 tensorwise / rowwise); remove it to estimate the bf16 run"
        )
    if "float8" in [str(c).lower() for c in converters] or f8.get("enable_float8_linear"):
        recipe = str(f8.get("recipe_name") or "tensorwise").lower()
        if recipe not in ("tensorwise", "rowwise"):
            raise UserError(
                f"{path}: [float8] recipe_name {recipe!r} is not modelled; use tensorwise or rowwise"
            )
        out["fp8"] = recipe
        if f8.get("enable_fsdp_float8_all_gather"):
            out["fp8_param_gather"] = True
    return out


def _ac_mode(ac: dict, v03: bool) -> str:
    """The checkpointing policy of an [activation_checkpoint] table without `mode`. Older job
    files defaulted to selective. torchtitan 0.3's Trainer.Config.to_dict() writes the chosen
    policy's config without naming it: MemoryBudgetAC's has memory_budget, SelectiveAC's
    force_recompute_mm_shapes_by_fqns, FullAC's only the base fields (preserve_rng_state,
    determinism_check, debug)."""
    if not v03 or not ac:
        return "selective"
    if "memory_budget" in ac or "visualize_memory_budget_pareto" in ac:
        return "memory_budget"
    if {
        "force_recompute_mm_shapes_by_fqns",
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "selective_ac_option",
    } & set(ac):
        return "selective"
    return "full"


def _converter_tables(spec) -> dict:
    """torchtitan 0.3's model converters (`model_registry(..., converters=[...])`) rewrite the
    model config tree: Float8LinearConverter puts Float8Linear.Config where Linear.Config was
    (its torchao recipe inside), the MXFP8 / NVFP4 / float8 grouped-experts converters their
    own configs. Returns the older tables `_modern` reads ([model] converters, [float8]
    recipe_name) for Float8 linears; refuses the others by name."""
    if spec is None or not hasattr(spec.model, "traverse"):
        return {}
    from torchtitan.config.configurable import Configurable

    seen: dict = {}
    for _fqn, c, _parent, _attr in spec.model.traverse(Configurable.Config, recurse=True):
        seen.setdefault(type(c).__qualname__.split(".")[0], c)
    out: dict = {}
    for name, c in seen.items():
        if name == "Float8Linear":
            recipe = _float8_recipe(getattr(c, "_torchao_config", None))
            if recipe is None:
                raise UserError(
                    "--from-torchtitan: Float8Linear with a torchao recipe other than tensorwise or "
                    "rowwise (e.g. rowwise_with_gw_hp) is not modelled"
                )
            out = {"model": {"converters": ["float8"]}, "float8": {"recipe_name": recipe}}
        elif name.startswith(("Float8", "MXFP8", "NVFP4", "MX")):
            raise UserError(
                f"--from-torchtitan: {name} (a torchtitan model converter) is not modelled; pipemem "
                "models torchao Float8 linears (tensorwise / rowwise)"
            )
    return out


def _float8_recipe(config) -> str | None:
    """'rowwise' / 'tensorwise' when torchao's Float8LinearConfig is that recipe's (emulated or not)."""
    try:
        from dataclasses import replace

        from torchao.float8 import Float8LinearConfig
    except ImportError:
        return None
    if config is None:
        return "tensorwise"
    try:
        config = replace(config, emulate=False)
    except (TypeError, ValueError):
        pass
    for recipe in ("rowwise", "tensorwise"):
        if config == Float8LinearConfig.from_recipe_name(recipe):
            return recipe
    return "tensorwise" if config == Float8LinearConfig() else None


def _enabled(value) -> bool:
    """A refused key only refuses when it asks for the thing (true, a positive number, a list)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value > 0
    if isinstance(value, str):
        return value.lower() not in ("", "false", "none", "0")
    return bool(value)


def _model(cfg: dict, path: str) -> dict | str:
    """[model] name + flavor (older job files) or model_spec {name, flavor} (Trainer.Config.to_dict())."""
    model_sec = _section(cfg, "model", path)
    spec = cfg.get("model_spec") if isinstance(cfg.get("model_spec"), dict) else {}
    name = str(model_sec.get("name") or spec.get("name") or "llama3").lower()
    flavor = str(model_sec.get("flavor") or spec.get("flavor") or "")
    key = "[model] name" if model_sec.get("name") else "model_spec name"
    fkey = "[model] flavor" if model_sec.get("flavor") else "model_spec flavor"
    table = flavor_table()
    if name in table:
        # torchtitan's qwen3 / deepseek_v3 flavors (0.3) and llama4's (0.2.2), as its own flavor
        # functions build them
        flavors = {f.lower(): f for f in table[name]}
        release = "0.2.2" if name == "llama4" else "0.3"
        if flavor.lower() not in flavors:
            raise UserError(
                f"{path}: {fkey} {flavor!r} is not known (torchtitan {release}'s {name} flavors); known: "
                + ", ".join(table[name])
            )
        if name == "llama4" and flavor.lower().endswith("_irope"):
            raise UserError(
                f"{path}: {fkey} {flavor!r}: torchtitan 0.2.2's FlexAttention llama4 flavors (NoPE "
                "layers, chunked attention) hand the whole mask dictionary to flex attention as the "
                "block mask (models/llama4/model/model.py Attention.forward), so they do not run; not "
                "modelled. Use " + ", ".join(f for f in table[name] if not f.endswith("_irope"))
            )
        return dict(table[name][flavors[flavor.lower()]])
    known_names = sorted({n for n, _ in FLAVORS} | set(table))
    if name not in known_names:
        raise UserError(
            f"{path}: {key} {name!r} is not known to pipemem; known: {', '.join(known_names)}"
            + "; or use --model with an HF config.json"
        )
    if flavor.lower() == "debugmodel":
        return dict(DEBUG_MODEL)
    if (name, flavor.lower()) in FLAVORS:
        return FLAVORS[(name, flavor.lower())]
    known = ", ".join(f for n, f in FLAVORS if n == name) + ", debugmodel"
    raise UserError(
        f"{path}: {fkey} {flavor!r} is not known for {name}; known: {known}. Use --model with "
        "an HF config.json, or torchtitan's own launch arguments (--from-torchtitan - -- --module "
        "NAME --config FN ...)"
    )


@lru_cache(maxsize=1)
def flavor_table() -> dict:
    """{model name: {flavor: HF-style config}} of torchtitan 0.3's qwen3 and deepseek_v3 flavors
    (pipemem/presets/torchtitan_flavors.json, written from torchtitan's own flavor functions by
    `python -m pipemem.traced.torchtitan_model`) and torchtitan 0.2.2's llama4 flavors
    (torchtitan_llama4_flavors.json, by `python -m pipemem.traced.torchtitan_llama4`)."""
    import json

    presets = Path(__file__).resolve().parent.parent / "presets"
    out: dict = {}
    # torchtitan 0.3 ships no llama4: its flavors are 0.2.2's (pipemem.traced.torchtitan_llama4)
    for name in ("torchtitan_flavors.json", "torchtitan_llama4_flavors.json"):
        with open(presets / name) as f:
            out.update({k: v for k, v in json.load(f).items() if not k.startswith("_")})
    return out


def finish_plan(plan: dict, layers: int) -> dict:
    """Resolve what needs the final dp / layer count (called once pipemem flags are merged)."""
    plan = dict(plan)
    lps = plan.pop("_layers_per_stage", None)
    first, last = plan.pop("_first_less", 0), plan.pop("_last_less", 0)
    pp = plan.get("pp", 1)
    if lps is not None and pp > 1:
        # torchtitan (distributed/pipeline_parallel.py _get_pipeline_metadata): ceil((layers +
        # first + last) / layers_per_stage) stages, a multiple of pp
        stages = -(-(layers + first + last) // lps)
        if stages % pp:
            raise UserError(
                f"{TOOL}: pipeline_parallel_layers_per_stage {lps} gives {stages} stages for "
                f"{layers} "
                f"layers (+ {first} + {last} for the embedding / output), not a multiple of "
                f"pipeline_parallel_degree {pp} (torchtitan refuses it)"
            )
        plan["vpp"] = stages // pp
    vpp = plan.get("vpp", 1)
    if pp > 1 and "pp_layout" not in plan:
        plan["pp_layout"] = stage_split(layers, pp * vpp, first, last)
    nth = plan.pop("_every_nth_layer", None)
    if nth:
        per_stage = layers // (plan.get("pp", 1) * plan.get("vpp", 1))
        if per_stage // nth:
            plan["recompute_layers"] = per_stage // nth
        else:  # fewer layers per stage than the checkpoint period: nothing is checkpointed
            plan["recompute"] = "none"
    return plan


def stage_split(layers: int, stages: int, first: int, last: int) -> tuple[int, ...]:
    """Decoder layers per stage as torchtitan splits them (distributed/pipeline_parallel.py,
    _generate_llm_fqn_per_model_part, torchtitan 0.3.0): the embedding counts as `first` layers
    of stage 0 and the output as `last` of the last stage; the effective layers are split
    evenly, the first (effective % stages) stages taking one more."""
    total = layers + first + last
    per, extra = divmod(total, stages)
    if per == 0 or first > per or last > per:
        raise UserError(
            f"{TOOL}: {stages} pipeline stages for {layers} layers (+ {first} / {last} for the "
            f"embedding / output): torchtitan refuses this split (each stage needs a layer, and "
            f"the embedding / output weights at most {per}); use fewer stages"
        )
    split = [per + (1 if i < extra else 0) for i in range(stages)]
    split[0] -= first
    split[-1] -= last
    return tuple(split) if stages > 1 else (layers,)


def _load(path: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    p = Path(path)
    try:
        with open(p, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"--from-torchtitan {path}: file not found") from None
    except IsADirectoryError:
        raise UserError(f"--from-torchtitan {path}: is a directory; give the job .toml file") from None
    except OSError as e:
        raise UserError(f"--from-torchtitan {path}: cannot read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        hint = ""
        try:
            if p.suffix.lower() == ".json" or p.read_bytes().lstrip()[:1] == b"{":
                hint = (
                    "; this looks like JSON: a torchtitan job config is TOML ([model], [training] ... tables)"
                )
        except OSError:
            pass
        raise UserError(f"--from-torchtitan {path}: not valid TOML ({e}){hint}") from None


def _section(cfg: dict, name: str, path: str) -> dict:
    sec = cfg.get(name, {})
    if not isinstance(sec, dict):
        raise UserError(f"{path}: [{name}] must be a table")
    return sec


def _pos_int(sec: dict, key: str, path: str, section: str) -> int | None:
    v = sec.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"{path}: [{section}] {key} = {v!r}: expected a positive integer")
    return v
