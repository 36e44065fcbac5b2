"""How a subcommand's parser is made from its module, the same for every `pipemem` command and
every `pipemem validate` target.

A command module holds `HELP` (the one line in its parent's list), `DESCRIPTION` (above the
options), `EXAMPLE` (below them, kept as written), `add_arguments(parser)` and
`run(args) -> int`.
"""

from __future__ import annotations

import argparse


def add_command(sub, name: str, module) -> argparse.ArgumentParser:
    """The parser of `module`'s command `name` under `sub` (an argparse subparsers object), its
    arguments added and `run` set as what it calls."""
    p = sub.add_parser(
        name,
        help=module.HELP,
        description=module.DESCRIPTION,
        epilog=module.EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(p)
    p.set_defaults(func=module.run)
    return p
