"""The shared progress, quiet-profiler and summary helpers of `pipemem validate`."""

import io
import os
import subprocess
import sys

import pytest

from pipemem.validation.compare import CaseRow
from pipemem.validation.progress import CaseProgress, print_summary, quiet_profiler_chatter


def test_profiler_chatter_is_dropped_other_stderr_kept(capfd):
    with quiet_profiler_chatter():
        os.write(2, b"USDT:2026-12-01 06:34:12 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
        os.write(2, b"USDT:2026-12-01 06:34:12 1:1 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
        print("python stderr too", file=sys.stderr)
    err = capfd.readouterr().err
    assert "USDT" not in err and "a real warning" in err and "python stderr too" in err


def test_log_progress_one_line_per_case():
    buf = io.StringIO()
    with CaseProgress(["a", "b"], "validate x", file=buf) as bar:
        bar.start("a")
        bar.done("a")
        bar.start("b")
        bar.done("b", note="error: boom")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "validate x: 2 cases"
    assert lines[1].startswith("[1/2] a (") and lines[2].startswith("[2/2] b (") and "error: boom" in lines[2]
    assert lines[3].startswith("validate x: 2 of 2 done")


def test_summary_table_rows_and_worst_error():
    buf = io.StringIO()
    rows = [
        CaseRow("c1/peak", 1000, 1010, {"peak_at": "B0@s0"}),
        {
            "name": "c2/peak",
            "measured_bytes": 2048,
            "estimated_bytes": 2048,
            "rel_error": 0.0,
            "peak_at": "F1@s0",
        },
    ]
    worst = print_summary(rows, columns=(("peak_at", "peak at"),), file=buf)
    out = buf.getvalue()
    assert abs(worst - 0.01) < 1e-12
    assert "c1/peak" in out and "+1.00%" in out and "2.00 KiB" in out and "B0@s0" in out
    assert "max |rel_error| = 1.000% over 2 cases" in out


def test_validate_cpu_shows_progress_and_no_usdt():
    env = dict(os.environ, COLUMNS="120")
    r = subprocess.run(
        [sys.executable, "-m", "pipemem", "validate", "cpu", "--cases", "gpt2-fp32-eager"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "USDT" not in r.stderr
    assert "[1/1] gpt2-fp32-eager" in r.stderr
    assert "gpt2-fp32-eager/peak" in r.stdout and "max |rel_error|" in r.stdout


def test_validate_features_shows_progress_and_summary(monkeypatch, capsys):
    # `validate features` ran ~1 min silent, then printed raw byte counts: one line per case
    # while it runs (stderr), the shared summary table at the end
    from pipemem.cli.main import main
    from pipemem.validation import features

    cases = [
        ("compile/x", lambda: [CaseRow("compile/x: saved", 1000, 1001)]),
        ("fp8/y", lambda: [CaseRow("fp8/y: peak", 2048, 2048)]),
    ]
    monkeypatch.setattr(features, "case_list", lambda: cases)
    for mod in ("torch", "transformers", "networkx"):  # what the command checks for first
        pytest.importorskip(mod)
    assert main(["validate", "features"]) == 0
    out, err = capsys.readouterr()
    assert "validate features: 2 cases" in err and "[1/2] compile/x (" in err and "[2/2] fp8/y (" in err
    assert "compile/x: saved" in out and "2.00 KiB" in out and "max |rel_error| = 0.100% over 2 cases" in out


@pytest.mark.parametrize("target", ["cpu", "dist", "torchtitan", "torchtune", "hf-trainer", "deepspeed"])
def test_validate_without_torch_is_one_line(target, monkeypatch, capsys):
    # `pipemem validate cpu` on a base install (no torch) ended in a ModuleNotFoundError traceback
    # from pipemem/traced/hf.py (dist: validation/distributed/models.py, torchtitan:
    # validation/torchtitan_trace.py): one line naming what to install, exit 2
    from pipemem.cli.main import main

    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec("torch") is None, `import torch` fails
    assert main(["validate", target]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipemem: error:") and "needs torch" in err and len(err.splitlines()) == 1
