"""`pipemem validate {cpu,dist,paddle,cuda,megatron,features}`: measured vs estimated on real runs and
library traces."""

from __future__ import annotations

import importlib

EXAMPLE = """\
examples:
  pipemem validate cpu --json
  pipemem validate dist
  pipemem validate paddle
  pipemem validate cuda --configs small
  pipemem validate features --json
  pipemem validate megatron --json
"""


HELP = "run real training steps, measure memory, compare with the estimate"
DESCRIPTION = (
    "Run real training steps, measure peak memory and compare with pipemem's estimate of the same runs."
)


def add_arguments(p) -> None:
    from ..validation import NAMED_CASE_TARGETS, TARGETS
    from ..validation.compare import NamedCaseCommand
    from .command import add_command

    targets = p.add_subparsers(dest="target", metavar="TARGET", parser_class=type(p))
    for name in TARGETS:
        try:
            module = importlib.import_module(f"pipemem.validation.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pipemem.validation.{name}":
                raise
            continue
        command = name.replace("_", "-")
        add_command(
            targets, command, NamedCaseCommand(command, module) if name in NAMED_CASE_TARGETS else module
        )
    p.set_defaults(print_validate_help=p.print_help)


def run(args) -> int:
    """`pipemem validate` without a target: its help, exit 2."""
    args.print_validate_help()
    return 2
