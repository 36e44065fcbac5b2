"""Other tools' launch configurations -> pipemem's model config and plan.

Each reader takes what the user would pass to that tool (Megatron-LM `pretrain_gpt.py`
arguments, PaddleNLP `run_pretrain*.py` arguments, a torchtitan job TOML, a torchtune recipe
config, Hugging Face Trainer arguments, a DeepSpeed config) and returns a
`ToolConfig`: the model (an HF-style config dict or a preset name), the plan keyword
arguments (`ParallelPlan` field names) and warnings for the user. Arguments that do not
change memory (learning rate, logging, paths) are accepted silently; arguments a reader
does not know are collected into one warning; contradictory ones raise `UserError`.
"""

from __future__ import annotations

from .resolve import read_config
from .tool_config import ToolConfig

__all__ = [
    "ToolConfig",
    "read_config",
    "read_deepspeed",
    "read_megatron",
    "read_paddlenlp",
    "read_torchtitan",
]


def read_deepspeed(source, hidden: int | None = None) -> ToolConfig:
    """A DeepSpeed config (path or dict) -> plan keyword arguments for `pipemem.estimate(model, **plan)`
    (no model: the config names none; `hidden`, the model's, resolves reduce_bucket_size "auto")."""
    from .deepspeed import read

    return read(source, hidden)


def read_megatron(argv: list[str]) -> ToolConfig:
    from .megatron import read

    return read(argv)


def read_paddlenlp(argv: list[str]) -> ToolConfig:
    from .paddlenlp import read

    return read(argv)


def read_torchtitan(path: str) -> ToolConfig:
    from .torchtitan import read

    return read(path)
