"""Rewrite the output under every `$ pipemem ...` line of README.md's console blocks with what
the command prints now (120 columns unless the line sets COLUMNS; suggestions without their
time budget), as tests/test_readme_examples.py runs them. Review the diff before committing.

    python bench/update_readme_examples.py
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(command: str) -> str:
    from pipemem.cli.main import main

    engine = importlib.import_module("pipemem.estimate")
    original = engine.suggest_fixes
    engine.suggest_fixes = functools.partial(original, budget_s=600.0)
    argv = shlex.split(command)
    env = {"COLUMNS": "120"}
    while "=" in argv[0]:
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert main(argv[1:]) == 0, command
    finally:
        engine.suggest_fixes = original
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out.getvalue()


def rewrite_block(block: str) -> str:
    parts = re.split(r"^\$ ", block, flags=re.M)
    out = [parts[0]]
    for part in parts[1:]:
        command, _, _ = part.partition("\n")
        printed = "".join(line.rstrip() + "\n" for line in run(command).splitlines())
        out.append(f"{command}\n{printed}")
    return "$ ".join(out)


def main() -> int:
    path = ROOT / "README.md"
    text = path.read_text(encoding="utf-8")
    new = re.sub(
        r"(```console\n)(.*?)(```)",
        lambda m: m.group(1) + rewrite_block(m.group(2)) + m.group(3),
        text,
        flags=re.S,
    )
    path.write_text(new, encoding="utf-8")
    print("README.md examples " + ("rewritten" if new != text else "unchanged"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
