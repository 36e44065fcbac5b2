"""One place per training framework: its layer convention, plan rules and defaults, static
bytes rules, layer-program hooks, runtime, fix suggestions, plan space and configuration
readers (`base.Framework` lists them all; one module per framework sets what differs).

    frameworks.get("torchtitan")   the framework object of a --convention name
    frameworks.ALL                 name -> framework, in --convention's order
    frameworks.NAMES               the --convention names

DeepSpeed is not a convention of its own: HF modules under `--zero 1-3` are DeepSpeed's ZeRO
(hf.py, `zero_is_deepspeed`). This package imports nothing of pipemem but errors.py, so every
layer above (plan.py, templates/, stages.py, runtime.py, planner/, estimate.py) can ask it.
"""

from __future__ import annotations

from ..errors import UserError
from . import hf, megatron, paddle, torchtitan, torchtune
from .base import Framework
from .convention import Convention

ALL: dict[str, Framework] = {
    m.FRAMEWORK.name: m.FRAMEWORK for m in (megatron, paddle, torchtitan, hf, torchtune)
}
NAMES: tuple[str, ...] = tuple(ALL)


def get(name: str) -> Framework:
    """The framework of a --convention name (case-insensitive); UserError naming the choices."""
    fw = ALL.get(str(name).lower())
    if fw is None:
        raise UserError(f"--convention {name!r}: use one of {', '.join(NAMES)}")
    return fw


__all__ = ["ALL", "NAMES", "Convention", "Framework", "get"]
