"""The README's examples print what they show: every `$ pipemem ...` line of a ```console block
is run (the CLI in this process, output to a pipe; 120 columns unless the line sets COLUMNS) and
its output compared with the block's text, whitespace folded. Regenerate them all with
`python bench/update_readme_examples.py` (and review the diff)."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def console_examples() -> list[tuple[str, str]]:
    """(command, expected output) of every `$ pipemem` line in the README's console blocks."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        parts = re.split(r"^\$ ", block, flags=re.M)
        for part in parts[1:]:
            command, _, output = part.partition("\n")
            assert re.match(r"(\w+=\S+ )*pipemem ", command), command
            out.append((command, output))
    return out


def fold(text: str) -> str:
    return " ".join(text.split())


def test_the_readme_has_examples():
    assert len(console_examples()) >= 3


@pytest.mark.parametrize("command, expected", console_examples(), ids=[c for c, _ in console_examples()])
def test_readme_example_prints_what_it_shows(command, expected, capsys, monkeypatch):
    import functools
    import importlib

    from pipemem.cli.main import main

    # suggestions stop after a 3 s budget; on a loaded machine that must not shorten the example
    engine = importlib.import_module("pipemem.estimate")
    monkeypatch.setattr(engine, "suggest_fixes", functools.partial(engine.suggest_fixes, budget_s=600.0))
    monkeypatch.setenv("COLUMNS", "120")
    argv = shlex.split(command)
    while "=" in argv[0]:
        name, _, value = argv.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    assert argv[0] == "pipemem"
    assert main(argv[1:]) == 0
    got = capsys.readouterr().out
    assert fold(got) == fold(expected), f"README example changed; its output now:\n{got}"
