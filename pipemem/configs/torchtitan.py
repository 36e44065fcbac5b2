"""torchtitan job TOML (`train_configs/*.toml`) -> pipemem preset and plan.

Model: `[model] name` + `flavor` name torchtitan's built-in Llama 3 sizes, mapped to our
presets with the same shapes. Batch: with pipeline parallelism torchtitan splits each
rank's `local_batch_size` into microbatches of `pipeline_parallel_microbatch_size`; without
it the local batch is one microbatch (gradient accumulation repeats whole steps, which does
not raise the peak). FSDP2 keeps fp32 sharded parameters and gathers them in
`mixed_precision_param`, so bf16 training here means bf16 compute with fp32 master state.
`[parallelism] tensor_parallel_recompute_allgather = true` (pipemem's key, for a plan whose
column-parallel linears are `pipemem.torch_tp.RegatherColwiseParallel`) is
`--recompute-allgather`.
"""

from __future__ import annotations

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
# torchtitan's small test model (dim 256, 6 layers, 16 heads, ffn from multiple_of 256,
# its test tokenizer's 2,000-token vocabulary).
DEBUG_MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 16,
               "num_key_value_heads": 16, "num_hidden_layers": 6, "vocab_size": 2000,
               "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu"}

_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}
_MULTI_STAGE = {"interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"}

KNOWN_SECTIONS = {"model", "training", "parallelism", "activation_checkpoint", "optimizer"}
IGNORED_SECTIONS = {"job", "profiling", "metrics", "lr_scheduler", "checkpoint", "float8", "mx", "comm",
                    "memory_estimation", "fault_tolerance", "experimental", "validation", "compile"}


def read(path: str) -> ToolConfig:
    cfg = _load(path)
    warnings: list[str] = []
    plan: dict = {"convention": "torchtitan"}
    dp_unknown = False

    model_sec = _section(cfg, "model", path)
    name = str(model_sec.get("name", "llama3")).lower()
    flavor = str(model_sec.get("flavor", "")).lower()
    if flavor == "debugmodel":
        model: dict | str = dict(DEBUG_MODEL)
    elif (name, flavor) in FLAVORS:
        model = FLAVORS[(name, flavor)]
    else:
        known = ", ".join(f"{n} {f}" for n, f in FLAVORS) + ", <any> debugmodel"
        raise UserError(f"{path}: [model] name={name!r} flavor={flavor!r} is not known; known: {known}. "
                        "Use --model with an HF config.json instead")
    plan.update(_modern(cfg, model_sec, path))

    tr = _section(cfg, "training", path)
    par = _section(cfg, "parallelism", path)
    ac = _section(cfg, "activation_checkpoint", path)
    opt = _section(cfg, "optimizer", path)

    seq = _pos_int(tr, "seq_len", path, "training")
    if seq is not None:
        plan["seq_len"] = seq
    local = _pos_int(tr, "local_batch_size", path, "training")
    old = _pos_int(tr, "batch_size", path, "training")
    if local is not None and old is not None and local != old:
        raise UserError(f"{path}: [training] local_batch_size {local} and batch_size {old} disagree")
    local = local or old or 8   # torchtitan's default local batch

    tp = _pos_int(par, "tensor_parallel_degree", path, "parallelism") or 1
    pp = _pos_int(par, "pipeline_parallel_degree", path, "parallelism") or 1
    cp = _pos_int(par, "context_parallel_degree", path, "parallelism") or 1
    ep = _pos_int(par, "expert_parallel_degree", path, "parallelism")
    replicate = _pos_int(par, "data_parallel_replicate_degree", path, "parallelism") or 1
    shard = par.get("data_parallel_shard_degree", -1)
    if not isinstance(shard, int) or isinstance(shard, bool) or (shard < 1 and shard != -1):
        raise UserError(f"{path}: [parallelism] data_parallel_shard_degree must be -1 or a positive integer")
    plan.update(tp=tp, pp=pp, cp=cp)
    if ep is not None:
        plan["ep"] = ep
    if shard == -1:
        # -1 = "all remaining ranks": the world size is not in the file. pipemem --dp fills it in.
        dp_unknown = True
        plan["fsdp"] = True
    else:
        plan["dp"] = replicate * shard
        plan["fsdp"] = shard > 1
        if replicate > 1 and shard > 1:
            warnings.append(f"{TOOL}: HSDP (replicate {replicate} x shard {shard}): states are modelled as "
                            f"sharded over all {replicate * shard} data-parallel ranks")
    regather = par.get("tensor_parallel_recompute_allgather", False)
    if not isinstance(regather, bool):
        raise UserError(f"{path}: [parallelism] tensor_parallel_recompute_allgather = {regather!r}: expected "
                        "true or false")
    if regather:
        plan["recompute_allgather"] = True
    reshard = str(par.get("fsdp_reshard_after_forward", "default")).lower()
    if reshard == "never" and plan.get("fsdp"):
        warnings.append(f"{TOOL}: fsdp_reshard_after_forward = never keeps gathered parameters; not modelled")

    if pp > 1:
        sched = str(par.get("pipeline_parallel_schedule", "1F1B"))
        plan["schedule"] = sched
        mbs = _pos_int(par, "pipeline_parallel_microbatch_size", path, "parallelism") or 1
        if local % mbs:
            raise UserError(f"{path}: local_batch_size {local} is not divisible by "
                            f"pipeline_parallel_microbatch_size {mbs}")
        plan["micro_batch"] = mbs
        plan["microbatches"] = local // mbs
        lps = _pos_int(par, "pipeline_parallel_layers_per_stage", path, "parallelism")
        if lps is not None:
            layers = model["num_hidden_layers"] if isinstance(model, dict) else None
            plan["_layers_per_stage"] = lps
            if layers is not None:
                plan["vpp"] = max(1, layers // (pp * lps))
        elif sched.replace("_", "").lower() in _MULTI_STAGE:
            plan["vpp"] = 2
            warnings.append(f"{TOOL}: {sched} without pipeline_parallel_layers_per_stage: "
                            "2 stages per rank assumed")
    else:
        plan["micro_batch"] = local
        plan["microbatches"] = 1

    mp = tr.get("mixed_precision_param", "bfloat16")
    dtype = _DTYPES.get(str(mp).lower())
    if dtype is None:
        raise UserError(f"{path}: [training] mixed_precision_param {mp!r}: expected bfloat16 or float32")
    plan["dtype"] = dtype
    plan["master_weights"] = dtype != "fp32"

    mode = str(ac.get("mode", "selective")).lower()
    if mode == "none":
        plan["recompute"] = "none"
    elif mode == "full":
        plan["recompute"] = "full"
    elif mode == "selective":
        option = str(ac.get("selective_ac_option", "op")).lower()
        if option == "op":
            # under the torchtitan convention, --recompute selective is torchtitan's op-level
            # policy (pipemem/templates/layers.py: matmuls and attention kept, the rest recomputed)
            plan["recompute"] = "selective"
        elif option.isdigit() and int(option) > 0:
            plan["recompute"] = "full"
            plan["_every_nth_layer"] = int(option)
            warnings.append(f"{TOOL}: selective_ac_option {option} (a full checkpoint on one layer in "
                            f"{option}) is modelled with --recompute-layers = layers per stage / {option}")
        else:
            raise UserError(f"{path}: [activation_checkpoint] selective_ac_option {option!r}: expected 'op' "
                            "or a positive integer")
    else:
        raise UserError(f"{path}: [activation_checkpoint] mode {mode!r}: expected none, selective or full")

    oname = str(opt.get("name", "AdamW")).lower()
    if oname not in ("adamw", "adam"):
        raise UserError(f"{path}: [optimizer] name {oname!r}: only Adam/AdamW are modelled")
    plan["optimizer"] = "adamw" if oname == "adamw" else "adam"
    impl = str(opt.get("implementation", "fused")).lower()   # torchtitan's default is fused
    if impl not in ("fused", "foreach", "for-loop", "fused_opt_states_bf16"):
        raise UserError(f"{path}: [optimizer] implementation {impl!r}: expected fused, foreach or for-loop")
    if impl == "fused_opt_states_bf16":
        raise UserError(f"{path}: [optimizer] implementation fused_opt_states_bf16 (bf16 Adam states) is not "
                        "modelled; use fused")
    plan["optimizer_impl"] = impl

    gbs = tr.get("global_batch_size", -1)
    if isinstance(gbs, int) and gbs > 0 and "dp" in plan and gbs % (local * plan["dp"]):
        raise UserError(f"{path}: [training] global_batch_size {gbs} is not a multiple of local_batch_size "
                        f"{local} x data parallel {plan['dp']}")

    unknown = sorted(k for k in cfg if k not in KNOWN_SECTIONS and k not in IGNORED_SECTIONS)
    if unknown:
        warnings.append(f"{TOOL}: not modelled, ignored sections: " + " ".join(f"[{u}]" for u in unknown))
    return ToolConfig(model=model, plan=plan, warnings=warnings, tool=TOOL,
                      model_name=f"torchtitan-{name}-{flavor}", dp_unknown=dp_unknown)


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
        raise UserError(f"{path}: [model] converters {unknown[0]!r} is not modelled (pipemem models torchao "
                        "Float8 tensorwise / rowwise); remove it to estimate the bf16 run")
    if "float8" in [str(c).lower() for c in converters] or f8.get("enable_float8_linear"):
        recipe = str(f8.get("recipe_name") or "tensorwise").lower()
        if recipe not in ("tensorwise", "rowwise"):
            raise UserError(f"{path}: [float8] recipe_name {recipe!r} is not modelled; use tensorwise or rowwise")
        out["fp8"] = recipe
        if f8.get("enable_fsdp_float8_all_gather"):
            out["fp8_param_gather"] = True
    return out


def finish_plan(plan: dict, layers: int) -> dict:
    """Resolve what needs the final dp / layer count (called once pipemem flags are merged)."""
    plan = dict(plan)
    lps = plan.pop("_layers_per_stage", None)
    if lps is not None and "vpp" not in plan:
        plan["vpp"] = max(1, layers // (plan.get("pp", 1) * lps))
    nth = plan.pop("_every_nth_layer", None)
    if nth:
        per_stage = layers // (plan.get("pp", 1) * plan.get("vpp", 1))
        if per_stage // nth:
            plan["recompute_layers"] = per_stage // nth
        else:   # fewer layers per stage than the checkpoint period: nothing is checkpointed
            plan["recompute"] = "none"
    return plan


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
        raise UserError(f"--from-torchtitan {path}: not valid TOML ({e})") from None


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
