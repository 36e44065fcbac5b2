"""One path from another tool's configuration to `pipemem.estimate` keyword arguments, for the
CLI's `--from-<tool>` flags and the Python API (`pipemem.read_config`) alike: read the source
with the tool's reader, complete the plan with pipemem's own flags (a flag that contradicts the
configuration is an error), and resolve what needs the final plan (the world size a file does
not give, torchtitan's stage split, a pipeline schedule without pipeline stages)."""

from __future__ import annotations

from ..errors import UserError
from .tool_config import ToolConfig

# tool name -> what its source is (for messages)
TOOLS = {
    "megatron": "Megatron-LM pretrain_gpt.py arguments (an argv list or one string)",
    "paddlenlp": "PaddleNLP / PaddleFormers run_pretrain.py arguments, or their JSON / YAML file",
    "torchtitan": "a torchtitan job TOML path, or torchtitan 0.3 launch arguments (--module, --config ...)",
    "torchtune": "a torchtune recipe config path, or a `tune run ... --config FILE` line",
    "hf-trainer": "Hugging Face Trainer launch arguments (run_clm.py --model_name_or_path ...)",
    "llamafactory": "a LLaMA-Factory train YAML path (llamafactory-cli train FILE.yaml)",
    "deepspeed": "a DeepSpeed config (path, JSON text or dict); its plan needs a model: read_config("
    "'deepspeed', cfg, model=...)",
}


class ReadConfig(tuple):
    """`model, plan = pipemem.read_config(...)`; `.warnings` holds the reader's notes."""

    warnings: list[str]

    def __new__(cls, model, plan: dict, warnings: list[str]):
        self = super().__new__(cls, (model, plan))
        self.warnings = warnings
        return self


def _argv(source) -> list[str]:
    if isinstance(source, str):
        import shlex

        return shlex.split(source)
    return [str(t) for t in source]


def read_tool(tool: str, source, hidden: int | None = None) -> ToolConfig:
    """The tool's reader on `source` (an argv list / string, or a file path as each tool takes it)."""
    key = tool.lower().replace("_", "-")
    if key == "megatron":
        from .megatron import read

        return read(_argv(source))
    if key == "paddlenlp":
        from .paddlenlp import read

        return read(_argv(source))
    if key == "torchtitan":
        from .torchtitan import read, read_args

        if isinstance(source, str) and source.strip().lower().endswith(".toml"):
            return read(source)
        return read_args(_argv(source))
    if key == "torchtune":
        from .torchtune import read, read_tune_run

        if isinstance(source, str) and source.strip().lower().endswith((".yaml", ".yml")):
            return read(source)
        return read_tune_run(_argv(source))
    if key == "hf-trainer":
        from .hf_trainer import read

        return read(_argv(source))
    if key in ("llamafactory", "llama-factory"):
        from .llamafactory import read

        return read(str(source))
    if key == "deepspeed":
        from .deepspeed import read

        return read(source, hidden)
    raise UserError(f"read_config: unknown tool {tool!r}; one of {', '.join(TOOLS)}")


def finish(tool: ToolConfig, flags: dict, source_name: str = "") -> tuple[object, dict, dict, list[str]]:
    """(model, plan keyword arguments, estimate options the tool sets, warnings): the tool's plan
    completed by pipemem's `flags` and resolved as the CLI's `--from-<tool>` resolves it."""
    plan = merge(tool, flags)
    name = source_name or "the configuration"
    if tool.tool == "torchtune" and not tool.plan.get("fsdp") and plan.get("dp", 1) > 1:
        raise UserError(
            f"--dp {plan['dp']}: {name} is a single-device recipe config (one GPU); drop --dp, or use "
            "the model's distributed config (e.g. 3B_full.yaml)"
        )
    if "seq_len" in tool.needs and "seq_len" not in plan:
        raise UserError(
            "Trainer arguments give no sequence length (--block_size / --max_seq_length; else the "
            "tokenizer's model_max_length): give --seq-len N"
        )
    if tool.tool == "torchtune" and "seq_len" not in plan:
        raise UserError(
            f"{name}: tokenizer.max_seq_len is null (the samples' lengths set the sequence): give "
            "--seq-len N, the longest sample (or max_seq_len with packed: True)"
        )
    if plan.get("pp", 1) == 1 and "schedule" in tool.plan and "schedule" not in flags:
        plan.pop("schedule")  # the tool ignores its pipeline schedule setting without pipeline stages
    opts: dict = {}
    if tool.model_name:
        opts["model_name"] = tool.model_name
    if tool.tool == "PaddleNLP":
        opts["model_flag"] = "PaddleNLP --model_name_or_path"
    if tool.tool == "Hugging Face Trainer":
        opts["model_flag"] = "Trainer --model_name_or_path"
    if tool.tool == "LLaMA-Factory":
        opts["model_flag"] = "LLaMA-Factory model_name_or_path"
    if tool.tool == "torchtitan":
        from .torchtitan import finish_plan

        _, cfg = _model_config(tool.model)
        layers = plan.get("layers") or cfg.get("num_hidden_layers") or cfg.get("n_layer") or 1
        plan = finish_plan(plan, int(layers))
    return tool.model, plan, opts, list(tool.warnings)


def read_config(tool: str, source, model=None, **flags) -> ReadConfig:
    """Another tool's configuration -> `(model, plan)` such that `pipemem.estimate(model, **plan)`
    is what `pipemem estimate --from-<tool>` prints for it (the same reader and resolution).
    `tool`: megatron, paddlenlp, torchtitan, torchtune, hf-trainer, llamafactory or deepspeed; `source`: an
    argv list (or one string) or a file path, as `TOOLS` says; `flags`: pipemem's own plan
    flags given with it (`dp=8`...), merged as the CLI merges them. DeepSpeed configs name no
    model: give `model=`. The reader's notes are in `.warnings`."""
    if tool.lower() == "deepspeed":
        if model is None:
            raise UserError(
                "read_config('deepspeed', ...): a DeepSpeed config names no model; give model=NAME"
            )
        from ..model import arch_from_hf_config

        name, cfg = _model_config(model)
        tc = read_tool(tool, source, hidden=arch_from_hf_config(cfg, name).hidden)
        missing = [k for k in tc.needs if k not in flags]
        if missing:
            raise UserError(
                f"read_config('deepspeed', ...): {', '.join(missing)} \"auto\" in the config: give "
                f"{', '.join(k + '=...' for k in missing)}"
            )
        tc.model = model
    elif model is not None:
        raise UserError(f"read_config({tool!r}, ...): the configuration names its model; drop model=")
    else:
        tc = read_tool(tool, source)
    got_model, plan, opts, warnings = finish(tc, flags)
    return ReadConfig(got_model, {**plan, **opts}, warnings)


def _model_config(model) -> tuple[str, dict]:
    """(name, HF-style config) of a preset name / config path / config dict."""
    if isinstance(model, dict):
        return str(model.get("model_type") or "model"), model
    from ..presets import load_model_config

    return load_model_config(model)


def merge(tool: ToolConfig, flags: dict) -> dict:
    """The tool's plan, completed by pipemem flags; a flag that disagrees with the tool is an error."""
    plan = dict(tool.plan)
    for k, v in flags.items():
        if k in plan and not k.startswith("_") and plan[k] != v and _norm(plan[k]) != _norm(v):
            flag = "--" + k.replace("_", "-")
            raise UserError(
                f"{flag} {_show(v)} contradicts the {tool.tool} configuration ({k} = {_show(plan[k])}); "
                f"drop {flag} or change the configuration"
            )
        plan[k] = v
    if tool.dp_unknown and "dp" not in plan:
        plan["dp"] = 1
        tool.warnings.append(
            f"{tool.tool}: the world size is not in the configuration; assuming --dp 1 "
            "(pass --dp N, the data-parallel degree)"
        )
    return plan


def _norm(v):
    if isinstance(v, str):
        return v.replace("-", "").replace("_", "").lower()
    if isinstance(v, list):
        return tuple(v)
    return v


def _show(v) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, (tuple, list)):
        return ",".join(str(x) for x in v)
    return str(v)
