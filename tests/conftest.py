"""Shared pytest setup: keep hypothesis quick and deterministic on CI's two cores; under
CI=true, a test that skips because something .ci/run installs is missing fails instead."""

import os

import pytest

# Liger-Kernel's triton kernels run on CPU tensors through triton's interpreter
# (tests/test_features_vs_libraries.py): set before anything imports triton
os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers (.ci/run) come up with COLUMNS set (80 on CI's machine), which a serial
# run from a pipe does not have: the reports the tests read are laid out as that run lays them
# out (150 columns, pipemem.report.text.terminal_width), unless a test sets COLUMNS itself
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Skip reasons that mean "a package or interpreter .ci/run installs is missing" (pytest.importorskip
# says "could not import"; the PaddleNLP tests name their interpreter's variable). Under CI=true
# (.ci/run sets it) such a skip is a failure: CI must not go green by skipping what it should run.
MISSING = (
    "could not import",
    "not installed",
    "not importable",
    "PIPEMEM_PADDLENLP_PYTHON",
    "PIPEMEM_PADDLE26_PYTHON",
)


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (_on_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(m in reason for m in MISSING):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, but .ci/run installs what it needs: {reason}"
