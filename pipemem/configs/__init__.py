"""Other tools' launch configurations -> pipemem's model config and plan.

Each reader takes what the user would pass to that tool (Megatron-LM `pretrain_gpt.py`
arguments, PaddleNLP `run_pretrain*.py` arguments, a torchtitan job TOML) and returns a
`ToolConfig`: the model (an HF-style config dict or a preset name), the plan keyword
arguments (`ParallelPlan` field names) and warnings for the user. Arguments that do not
change memory (learning rate, logging, paths) are accepted silently; arguments a reader
does not know are collected into one warning; contradictory ones raise `UserError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolConfig:
    model: dict | str             # HF-style config dict, or a preset name / config path
    plan: dict                    # ParallelPlan keyword arguments
    warnings: list[str] = field(default_factory=list)
    tool: str = ""
    model_name: str = ""          # display name when `model` is a dict
    dp_unknown: bool = False      # the world size is not in the tool's arguments: pipemem --dp gives it

    def as_tuple(self):
        return self.model, self.plan, self.warnings

    def __iter__(self):
        """`model, plan, warnings = read_megatron(argv)` works too."""
        return iter(self.as_tuple())


def read_megatron(argv: list[str]) -> ToolConfig:
    from .megatron import read
    return read(argv)


def read_paddlenlp(argv: list[str]) -> ToolConfig:
    from .paddlenlp import read
    return read(argv)


def read_torchtitan(path: str) -> ToolConfig:
    from .torchtitan import read
    return read(path)
