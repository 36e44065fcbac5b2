"""`pipemem validate {cpu,dist,paddle,cuda,megatron,features}`: measured vs estimated on real runs and
library traces."""

from __future__ import annotations

import argparse
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


def register(sub) -> None:
    from ..validation import TARGETS

    p = sub.add_parser(
        "validate",
        help="run real training steps, measure memory, compare with the estimate",
        description="Run real training steps, measure peak memory and compare with pipemem's "
        "estimate of the same runs.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    targets = p.add_subparsers(dest="target", metavar="TARGET", parser_class=type(p))
    for name in TARGETS:
        try:
            module = importlib.import_module(f"pipemem.validation.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pipemem.validation.{name}":
                raise
            continue
        module.register(targets)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
