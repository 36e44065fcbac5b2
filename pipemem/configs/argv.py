"""Reading a pasted launch command: `[launcher args] script.py --name value --flag ...`.

Users copy the command line they run. We accept it whole: the launcher part
(`torchrun --nproc_per_node 8 --nnodes 2`, `python -m paddle.distributed.launch --gpus
0,1,2,3`, `accelerate launch --num_processes 8`, `deepspeed --num_gpus 8`) gives the world
size, the script part gives the training arguments. Shell line continuations (a lone `\\`)
are dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePath

from ..errors import UserError

_NUMBER = re.compile(r"-?\d+(\.\d*)?([eE][+-]?\d+)?")


@dataclass
class Args:
    """Parsed `--name value...` pairs; `values[name]` is a list of strings (empty for a bare flag)."""

    tool: str
    values: dict[str, list[str]] = field(default_factory=dict)
    world_size: int | None = None  # from the launcher part, when present
    script: str | None = None  # the training script's file name, when pasted
    launcher: dict[str, list[str]] = field(default_factory=dict)  # the launcher's own options
    used: set[str] = field(default_factory=set)

    def has(self, name: str) -> bool:
        return name in self.values

    def raw(self, name: str) -> str | None:
        self.used.add(name)
        v = self.values.get(name)
        if v is None:
            return None
        return " ".join(v) if v else ""

    def int(self, name: str, minimum: int = 1) -> int | None:
        text = self.raw(name)
        if text is None:
            return None
        try:
            value = int(text)
        except ValueError:
            raise UserError(f"{self.tool} argument {self.flag(name)} {text!r}: expected an integer") from None
        if value < minimum:
            raise UserError(f"{self.tool} argument {self.flag(name)} {value}: must be >= {minimum}")
        return value

    def ints_into(self, plan: dict, **names: str) -> None:
        """For each `key=name`, in the order given: plan[key] = the integer `--name` gives (checked
        as `int` checks it); a flag left out sets nothing."""
        for key, name in names.items():
            value = self.int(name)
            if value is not None:
                plan[key] = value

    def bool(self, name: str) -> bool | None:
        """A bare flag is True; `--x 1/0/true/false` as written."""
        text = self.raw(name)
        if text is None:
            return None
        low = text.strip().strip("'\"").lower()
        if low in ("", "1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", "none"):
            return False
        raise UserError(f"{self.tool} argument {self.flag(name)} {text!r}: expected true/false or 1/0")

    def str(self, name: str) -> str | None:
        text = self.raw(name)
        return None if text is None else text.strip().strip("'\"")

    def flag(self, name: str) -> str:
        return "--" + name

    def unknown(self, known: set[str], ignored: set[str]) -> list[str]:
        return [n for n in self.values if n not in known and n not in ignored and n not in self.used]


_LAUNCHER_WORLD = (
    "nproc_per_node",
    "nproc-per-node",
    "nnodes",
    "gpus",
    "devices",
    "world_size",
    "world-size",
    "num_processes",
    "num-processes",
    "num_gpus",
    "num-gpus",
    "num_nodes",
    "num-nodes",
)


def parse(tokens: list[str], tool: str) -> Args:
    """Split `[launcher...] [script.py] --a 1 --b --c x y` into Args (names without dashes)."""
    tokens = [t for t in tokens if t.strip() not in ("\\", "")]
    if tokens and tokens[0] == "--":
        tokens = tokens[1:]
    script_at = next((i for i, t in enumerate(tokens) if t.endswith(".py") and not t.startswith("-")), None)
    launcher: dict[str, list[str]] = {}
    tokens_script = None
    if script_at is not None:
        tokens_script = tokens[script_at]
        launcher = _pairs(tokens[:script_at], tool, strict=False)
        tokens = tokens[script_at + 1 :]
    args = Args(tool=tool, values=_pairs(tokens, tool, strict=True))
    args.world_size = _world_from_launcher(launcher, tool)
    args.launcher = launcher
    if script_at is not None:
        args.script = PurePath(tokens_script).name
    return args


def _pairs(tokens: list[str], tool: str, strict: bool) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    name = None
    for tok in tokens:
        if tok.startswith("--") and len(tok) > 2:
            body = tok[2:]
            name, eq, value = body.partition("=")
            out[name] = [value] if eq else []
            if eq:
                name = None
        elif tok.startswith("-") and len(tok) > 1 and not _NUMBER.fullmatch(tok):
            name = None  # short options (python -u -m): belong to the launcher, never memory-relevant
            if strict:
                raise UserError(f"{tool} arguments: cannot read {tok!r}; write options as --name value")
        elif name is not None:
            out[name].append(tok)
        elif strict:
            raise UserError(
                f"{tool} arguments: value {tok!r} does not follow an option; quote values that contain spaces"
            )
    return out


def _world_from_launcher(launcher: dict[str, list[str]], tool: str) -> int | None:
    def one(*names):
        for n in names:
            if n in launcher and launcher[n]:
                return launcher[n][0]
        return None

    gpus = one("gpus", "devices")
    if gpus is not None:
        return len([g for g in gpus.strip("'\"").split(",") if g.strip()])
    # torchrun --nproc_per_node x --nnodes; the deepspeed launcher --num_gpus x --num_nodes;
    # accelerate launch --num_processes (every process, all machines)
    per_node = one("nproc_per_node", "nproc-per-node", "num_gpus", "num-gpus")
    nodes = one("nnodes", "num_nodes", "num-nodes")
    world = one("world_size", "world-size", "num_processes", "num-processes")
    try:
        if world is not None:
            return int(world)
        if per_node is not None:
            n = int(str(nodes).split(":")[-1]) if nodes is not None else 1
            return int(per_node) * n
    except ValueError:
        raise UserError(f"{tool} launcher: cannot read the process count from {launcher}") from None
    return None
