"""pipemem.frameworks: one object per framework, found by its --convention name, sitting below
the code that asks it, and the only place outside the readers and validation that knows
framework names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pipemem import UserError, frameworks
from pipemem.frameworks.base import Framework
from pipemem.plan import CONVENTIONS, GRADS, OPTIMIZER_IMPLS, default_grads
from pipemem.templates.conventions import CONVENTIONS as CONVENTION_TABLE

ROOT = Path(__file__).resolve().parent.parent / "pipemem"
NAME = r"(megatron|torchtitan|hf|torchtune|deepspeed|paddle)"


def test_registry_is_the_convention_list():
    assert tuple(frameworks.ALL) == frameworks.NAMES == CONVENTIONS
    for name, fw in frameworks.ALL.items():
        assert isinstance(fw, Framework) and fw.name == name
        assert frameworks.get(name) is fw and frameworks.get(name.upper()) is fw
        # the layer convention is the framework's and knows it
        assert fw.convention.name == name and fw.convention.framework is fw
        assert CONVENTION_TABLE[name] is fw.convention


@pytest.mark.parametrize("bad", ["deepspeed", "nemo", "", "megatron-lm"])
def test_unknown_name_is_one_line_naming_the_flag_and_choices(bad):
    with pytest.raises(UserError) as e:
        frameworks.get(bad)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--convention {bad!r}")
    assert all(n in msg for n in frameworks.NAMES)


def test_defaults_are_valid_choices():
    for fw in frameworks.ALL.values():
        assert fw.default_optimizer_impl in OPTIMIZER_IMPLS
        for dp, zero, fsdp in ((1, 0, False), (8, 0, False), (8, 1, False), (8, 3, False), (8, 3, True)):
            assert fw.default_grads(dp, zero, fsdp) in GRADS
            assert default_grads(fw.name, dp, zero, fsdp) == fw.default_grads(dp, zero, fsdp)
        assert fw.runtime in ("torch", "megatron", "paddle")
        assert fw.shardings and all(isinstance(kw, dict) for _, kw in fw.shardings)
        from pipemem.schedules import canonical_name

        assert all(canonical_name(n) == n for n in fw.schedules)  # registry names
        assert fw.readers and all(r.startswith("pipemem.configs.") for r in fw.readers)


def test_readers_named_exist():
    for fw in frameworks.ALL.values():
        for r in fw.readers:
            assert (ROOT / "configs" / (r.rsplit(".", 1)[1] + ".py")).exists(), r


def test_frameworks_import_nothing_above_them():
    """frameworks/ sits below plan.py, templates/, stages.py, runtime.py, planner/, estimate.py:
    it imports only itself and errors.py (function-level imports included)."""
    for path in (ROOT / "frameworks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level == 1:
                    continue  # a sibling in frameworks/
                assert node.level == 2 and node.module == "errors", (
                    f"{path.name}: from {'.' * node.level}{node.module or ''} import ..."
                )
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                assert not (mod or "").startswith("pipemem"), f"{path.name}: imports {mod}"


def test_framework_names_are_compared_only_in_their_place():
    """Outside frameworks/, the readers (configs/) and validation/, at most the CLI's three reader
    fix-ups compare framework names or key tables by them (mode == "paddle", runtime profile
    names and preset name parts are other things)."""
    pat = re.compile(
        rf'(==|!=) ?"{NAME}"|"{NAME}" ?(==|!=)|(in|=) \([^)]*"{NAME}"|^\s*"{NAME}": '
        rf'|\{{"{NAME}": |"{NAME}": [A-Za-z("]'
    )
    other = re.compile(r"mode\b|MODES|RUNTIMES|RuntimeProfile|_VARIANT_PARTS")
    hits = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in ("frameworks", "configs", "validation"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pat.search(line) and not other.search(line):
                hits.append(f"{rel}:{i}: {line.strip()}")
    assert len(hits) <= 3, "\n".join(hits)
