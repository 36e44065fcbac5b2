"""Under CI=true (.ci/run sets it) a test that skips because a package or interpreter is missing
fails: CI cannot go green by skipping what .ci/run installs. Other skips stay skips."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SAMPLE = """
import pytest

def test_missing_package():
    pytest.importorskip("no_such_package_pipemem_ci_check")

def test_missing_interpreter():
    pytest.skip("needs a paddlenlp interpreter ($PIPEMEM_PADDLENLP_PYTHON)")

def test_other_skip():
    pytest.skip("checks the no-GPU path")
"""


def _run(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "conftest",
        "-rs",
        "-p",
        "no:cacheprovider",
        str(tmp_path / "test_sample.py"),
    ]
    return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def test_skips_for_missing_installs_fail_under_ci(tmp_path):
    got = _run(tmp_path, "true")
    assert got.returncode != 0, got.stdout
    # (a skip in the test body reports as failed, one from a skipif mark as an error)
    assert "2 failed" in got.stdout and "1 skipped" in got.stdout, got.stdout
    assert "checks the no-GPU path" in got.stdout


def test_they_stay_skips_off_ci(tmp_path):
    got = _run(tmp_path, None)
    assert got.returncode == 0 and "3 skipped" in got.stdout, got.stdout
