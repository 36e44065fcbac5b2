"""Built-in model shapes and GPU capacities, shipped with the package (no downloads).

Models are Hugging Face style `config.json` dicts in `presets/models/<name>.json`, copied
from the published configs (each file names its source in `_pipemem_source`), so a preset
and a user's own `config.json` go through the same code. GPUs are in `presets/gpus.json`:
total device memory as the driver reports it (see that file's `_about`).
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from pathlib import Path

from ..errors import UserError

_HERE = Path(__file__).resolve().parent
_MODELS = _HERE / "models"

# Names other tools use for the same published shapes (PaddleNLP / Hugging Face hub ids).
# LLaMA-1 7B ("facebook/llama-7b" in PaddleNLP) has Llama-2-7B's shapes; only its context
# length (2048) differs, which does not change memory at a given --seq-len.
ALIASES = {
    "facebook/llama-7b": "llama2-7b",
    "facebook/llama-13b": "llama2-13b",
    "meta-llama/llama-2-7b": "llama2-7b",
    "meta-llama/llama-2-7b-hf": "llama2-7b",
    "meta-llama/llama-2-13b": "llama2-13b",
    "meta-llama/llama-2-13b-hf": "llama2-13b",
    "meta-llama/llama-2-70b": "llama2-70b",
    "meta-llama/llama-2-70b-hf": "llama2-70b",
    "meta-llama/meta-llama-3-8b": "llama3-8b",
    "meta-llama/meta-llama-3-70b": "llama3-70b",
    "meta-llama/llama-3.1-8b": "llama3-8b",
    "meta-llama/llama-3.1-70b": "llama3-70b",
    "meta-llama/llama-3.1-405b": "llama3.1-405b",
    "meta-llama/meta-llama-3.1-405b": "llama3.1-405b",
    "meta-llama/llama-3.2-1b": "llama3.2-1b",
    "meta-llama/llama-3.2-3b": "llama3.2-3b",
    "mistralai/mistral-7b-v0.1": "mistral-7b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x22b-v0.1": "mixtral-8x22b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-72b": "qwen2.5-72b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen/qwen3-235b-a22b": "qwen3-235b-a22b",
    "deepseek-ai/deepseek-v3": "deepseek-v3",
    "deepseek-ai/deepseek-v3-base": "deepseek-v3",
    "deepseek-ai/deepseek-r1": "deepseek-v3",
    "deepseek-ai/deepseek-v2-lite": "deepseek-v2-lite",
    "moonshotai/kimi-k2-instruct": "kimi-k2",
    "moonshotai/kimi-k2-base": "kimi-k2",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "openai/gpt-oss-120b": "gpt-oss-120b",
    "google/gemma-3-4b-pt": "gemma3-4b",
    "google/gemma-3-4b": "gemma3-4b",
    "google/gemma-3-12b-pt": "gemma3-12b",
    "google/gemma-3-12b": "gemma3-12b",
    "google/gemma-3-27b-pt": "gemma3-27b",
    "google/gemma-3-27b": "gemma3-27b",
    "meta-llama/llama-4-scout-17b-16e": "llama4-scout",
    "meta-llama/llama-4-maverick-17b-128e": "llama4-maverick",
    "zai-org/glm-4.5": "glm-4.5",
    "zai-org/glm-4.5-air": "glm-4.5-air",
    "openai-community/gpt2": "gpt2",
    "openai-community/gpt2-medium": "gpt2-medium",
    "openai-community/gpt2-large": "gpt2-large",
    "openai-community/gpt2-xl": "gpt2-xl",
    "gpt2-medium-en": "gpt2-medium",
    "gpt2-en": "gpt2",
    "gpt3": "gpt3-175b",
    "llama3.1-8b": "llama3-8b",
    "llama3.1-70b": "llama3-70b",
}

# Only names that mean one device: "a100" or "h100" alone could be either memory size, and
# are an error listing the candidates (see `_candidates`).
GPU_ALIASES = {
    "a100-40gb": "a100-40g",
    "a100-80gb": "a100-80g",
    "h100-80gb": "h100-80g",
    "h100-sxm": "h100-80g",
    "h100-nvl": "h100-94g",
    "h100-94gb": "h100-94g",
    "h200-141g": "h200",
    "3090": "rtx3090",
    "1080ti": "gtx1080ti",
}


def model_names() -> list[str]:
    return list(_model_names())


@lru_cache(maxsize=1)
def _model_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _MODELS.glob("*.json")))


@lru_cache(maxsize=None)
def _preset_json(key: str) -> dict:
    with open(_MODELS / f"{key}.json", encoding="utf-8") as f:
        return json.load(f)


@lru_cache(maxsize=None)
def _gpu_table() -> dict:
    with open(_HERE / "gpus.json", encoding="utf-8") as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def gpu_names() -> list[str]:
    return list(_gpu_table())


def gpu_info(name: str) -> dict:
    """The gpus.json entry of a GPU preset (name, mib, bytes, source)."""
    table = _gpu_table()
    key = str(name).strip().lower()
    key = GPU_ALIASES.get(key, key)
    if key not in table:
        # separators are not part of the name: gtx-1080-ti, RTX 3090, a100_80g
        flat = {_flat(k): v for k, v in GPU_ALIASES.items()} | {_flat(k): k for k in table}
        key = flat.get(_flat(key), key)
    if key not in table:
        cands = _candidates(key, table) or _candidates(_flat(key), table)
        if len(cands) > 1:
            listed = ", ".join(f"{k} ({table[k]['name']}, {table[k]['mib']} MiB)" for k in cands)
            raise UserError(f"--gpu {name!r} is ambiguous: {listed}; give one of them")
        raise UserError(
            f"--gpu {name!r}: unknown GPU{_close(key, list(table) + list(GPU_ALIASES))}; "
            f"known: {', '.join(table)} (or give --gpu-memory GIB)"
        )
    return dict(table[key], key=key)


def gpu_memory_bytes(name: str) -> int:
    return int(gpu_info(name)["bytes"])


def preset_source(name: str) -> str:
    return load_model_config(name)[1].get("_pipemem_source", "")


def load_model_config(name_or_path: str, flag: str = "--model") -> tuple[str, dict]:
    """A preset name, a known hub id, a config.json path or a directory holding one ->
    (display name, HF-style config dict). `flag` names the input in error messages."""
    text = str(name_or_path).strip()
    if not text:
        raise UserError(f"{flag}: empty; give a preset name (pipemem presets) or a path to a config.json")
    if len(text) > 4096:
        raise UserError(f"{flag} {text[:40]}...: {len(text)} characters; give a preset name or a path")
    path = Path(text).expanduser()
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError:  # a name the file system cannot hold (too long a component...)
        is_dir = is_file = False
    if is_dir:
        path = path / "config.json"
        if not path.is_file():
            raise UserError(f"{flag} {text}: directory has no config.json")
        is_file = True
    if is_file:
        return path.parent.name if path.name == "config.json" else path.stem, read_config_file(path, flag)
    key = text.lower()
    key = ALIASES.get(key, key)
    if key in _model_names():
        return key, dict(_preset_json(key))  # a copy: callers may change their config
    base = base_model_id(key)
    if base is not None:
        cfg = dict(_preset_json(base))
        cfg["_pipemem_note"] = (
            f"{flag} {text}: not a preset; estimated with the shapes of its base model {base} "
            "(instruction / chat fine-tunes and -hf conversions keep the base model's shapes)"
        )
        return base, cfg
    if text.endswith(".json") or text.startswith((".", "/", "~")):
        raise UserError(f"{flag} {text}: file not found")
    cands = _candidates(key, model_names())
    if len(cands) > 1:
        raise UserError(
            f"{flag} {text!r} is ambiguous: {', '.join(cands)}; give one of them "
            "(pipemem presets lists their shapes)"
        )
    raise UserError(
        f"{flag} {text!r}: not a preset, known hub id or file"
        f"{_close(key, model_names() + list(ALIASES))}; see `pipemem presets` for the list, "
        f"or pass a path to a config.json (nothing is downloaded)"
    )


# Name parts of fine-tuned or converted checkpoints that keep the base model's shapes.
_VARIANT_PARTS = ("instruct", "chat", "hf", "it")


def base_model_id(key: str) -> str | None:
    """The preset of a fine-tune / conversion named after its base model
    ('meta-llama/Meta-Llama-3-8B-Instruct' -> llama3-8b, 'Llama-2-7b-chat-hf' -> llama2-7b,
    'Mistral-7B-Instruct-v0.1' -> mistral-7b), else None. Only the name parts that keep the
    shapes are dropped; what remains must be a known preset or hub id."""
    key = key.strip().lower()
    org, _, name = key.rpartition("/")
    parts = name.split("-")
    kept = [p for p in parts if p not in _VARIANT_PARTS]
    if len(kept) == len(parts) or not kept:
        return None
    stripped = "-".join(kept)
    for cand in (f"{org}/{stripped}" if org else stripped, stripped):
        cand = ALIASES.get(cand, cand)
        if cand in _model_names():
            return cand
    return None


def read_config_file(path: str | Path, flag: str = "--model") -> dict:
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {path}: not valid JSON ({e}); expected a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise UserError(
            f"{flag} {path}: expected a JSON object (a Hugging Face config.json), got {type(cfg).__name__}"
        )
    return cfg


def _flat(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch not in "-_ ")


def _candidates(key: str, names) -> list[str]:
    """Names that `key` abbreviates: those starting with it (a100 -> a100-40g, a100-80g)."""
    key = key.strip().lower()
    return sorted(n for n in names if len(key) >= 2 and n.startswith(key) and n != key)


def _close(word: str, candidates: list[str]) -> str:
    near = difflib.get_close_matches(word, candidates, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(near)}?)" if near else ""
