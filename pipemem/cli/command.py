"""How a subcommand's parser is made from its module, the same for every `pipemem` command and
every `pipemem validate` target.

A command module holds `HELP` (the one line in its parent's list), `DESCRIPTION` (above the
options), `EXAMPLE` (below them, kept as written), `add_arguments(parser)` and
`run(args) -> int`. DESCRIPTION and EXAMPLE may be functions returning the text (a help laid out
for the terminal's width, read when the parser is made).
"""

from __future__ import annotations

import argparse


def add_command(sub, name: str, module) -> argparse.ArgumentParser:
    """The parser of `module`'s command `name` under `sub` (an argparse subparsers object), its
    arguments added and `run` set as what it calls."""
    p = sub.add_parser(
        name,
        help=module.HELP,
        description=_text(module.DESCRIPTION),
        epilog=_text(module.EXAMPLE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(p)
    p.set_defaults(func=module.run)
    return p


def _text(value) -> str:
    return value() if callable(value) else value
