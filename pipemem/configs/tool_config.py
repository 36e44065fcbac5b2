"""What every reader of another tool's configuration returns (see pipemem.configs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolConfig:
    model: dict | str  # HF-style config dict, or a preset name / config path
    plan: dict  # ParallelPlan keyword arguments
    warnings: list[str] = field(default_factory=list)
    tool: str = ""
    model_name: str = ""  # display name when `model` is a dict
    dp_unknown: bool = False  # the world size is not in the tool's arguments: pipemem --dp gives it
    needs: list[str] = field(
        default_factory=list
    )  # plan keys the tool leaves to its caller ("auto"): flags must give them

    def as_tuple(self):
        return self.model, self.plan, self.warnings

    def __iter__(self):
        """`model, plan, warnings = read_megatron(argv)` works too."""
        return iter(self.as_tuple())
