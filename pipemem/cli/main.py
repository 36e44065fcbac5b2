"""Entry point of the `pipemem` command.

Each subcommand lives in `pipemem/cli/cmd_<name>.py` with its help texts, `add_arguments(parser)`
and `run(args) -> int` (cli/command.py); they are discovered here so commands can be added without
touching this file. Heavy libraries are imported inside `run`, so `pipemem --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from ..errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad input as one line (no usage dump) with exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        import re

        m = re.match(r"argument (--[\w-]+)(?:/\S+)?: expected one argument$", message)
        if m:
            # `--times -1,1,1`: argparse reads a value starting with '-' as the next option
            message += f"; give a value, or write one that starts with '-' as {m.group(1)}=VALUE"
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="pipemem",
        description="Per-rank GPU memory of distributed training, at every moment of the pipeline schedule.",
        epilog="Example: pipemem estimate --model llama3-70b --gpu h100-80g --tp 8 --pp 4 --dp 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pipemem {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    from . import __path__ as cli_path
    from .command import add_command

    for info in sorted(pkgutil.iter_modules(cli_path), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            module = importlib.import_module(f"{__package__}.{info.name}")
            add_command(sub, info.name.removeprefix("cmd_"), module)
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"pipemem: error: {e}", file=sys.stderr)
        return 2
    except (OverflowError, ZeroDivisionError, MemoryError, RecursionError, ValueError) as e:
        # Bad numbers that slipped past the range checks (plan.LIMITS): one line, not a
        # traceback. PIPEMEM_DEBUG=1 shows the traceback for a bug report.
        if os.environ.get("PIPEMEM_DEBUG"):
            raise
        print(
            f"pipemem: error: cannot handle this input ({type(e).__name__}: {_short(e)}); check the numbers "
            "given (set PIPEMEM_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("pipemem: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def _short(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
