"""Numbers beyond what a training run can be: one error line naming the flag and the bound,
exit 2, never a traceback or a run that does not end (plan.LIMITS, the CLI guard)."""

import json
import subprocess
import sys

import pytest

import pipemem
from pipemem.cli.main import main
from pipemem.errors import UserError
from pipemem.plan import LIMITS, MAX_STAGE_MICROBATCHES


def run_cli(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--seq-len", "99999999999999999999"], "--seq-len 99999999999999999999: at most 16,777,216"),
        (["--micro-batch", "100000000000"], "--micro-batch 100000000000: at most 65,536"),
        (["--gpu-memory", "1e400"], "--gpu-memory inf: give .* to 1,048,576 GiB"),
        (["--gpu-memory", "1e-300"], "--gpu-memory 1e-300: give 0.000976562 to"),
        (["--gpu-memory", "nan"], "--gpu-memory nan"),
        (["--layers", "100000000"], "--layers 100000000: at most 16,384"),
        (["--dp", "99999999999999999999999"], "--dp 99999999999999999999999: at most 1,048,576"),
        (["--dp", "8192", "--tp", "8", "--pp", "32", "--layers", "32"], "2,097,152 GPUs: at most 1,048,576"),
        (["--global-batch", "99999999999999999999"], "--global-batch .*at most"),
        (["--microbatches", "10000000000"], "--microbatches 10000000000: at most 65,536"),
        (["--global-batch", "4000000000"], r"= 4,000,000,000 microbatches: at most 65,536"),
        (["--pp", "8", "--microbatches", "60000"], "480,000 stage-microbatches: at most 131,072"),
        (
            ["--pp", "8", "--schedule", "auto", "--microbatches", "1024"],
            "ZBAuto searches for its order, so at most 4,096",
        ),
        (["--seq-len", "16777216", "--micro-batch", "65536"], "tokens per microbatch"),
        (["--seq-len", "16000000", "--no-flash-attn", "--microbatches", "64"], "beyond 64-bit byte counts"),
        (["--pp", "2", "--pp-layout", "99999999999999999999,1"], "--pp-layout entry"),
    ],
)
def test_numbers_out_of_range_are_one_line(argv, match, capsys):
    rc, out, err = run_cli(["estimate", "--model", "llama3-8b", *argv], capsys)
    assert rc == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipemem: error: ")
    import re

    assert re.search(match, lines[0]), lines[0]


def test_bounds_are_what_the_messages_name():
    assert LIMITS["seq_len"] == 16_777_216 and LIMITS["layers"] == 16_384
    assert MAX_STAGE_MICROBATCHES == 131_072


def test_a_plan_at_the_bounds_still_runs():
    # the bounds refuse nonsense, not large real plans: 405B-class pipelines with many microbatches
    e = pipemem.estimate("llama3-70b", tp=8, pp=16, dp=64, microbatches=1024, seq_len=8192, gpu="h100-80g")
    assert e.max_peak_allocated_bytes > 0


def test_python_api_raises_user_error():
    with pytest.raises(UserError, match="--seq-len"):
        pipemem.estimate("llama3-8b", seq_len=10**20)
    with pytest.raises(UserError, match="--gpu-memory"):
        pipemem.estimate("llama3-8b", gpu_memory=float("inf"))
    with pytest.raises(UserError, match="--layers"):
        pipemem.estimate("llama3-8b", layers=10**8)


def test_huge_config_json_sizes(tmp_path, capsys):
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096 * 10**18,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, _, err = run_cli(["estimate", "--model", str(path)], capsys)
    assert rc == 2 and "hidden" in err and "1,048,576" in err and len(err.strip().splitlines()) == 1


def test_schedule_command_ranges(capsys):
    for argv, match in (
        (["1F1B", "--pp", "99999999999", "--microbatches", "8"], "--pp 99999999999"),
        (["auto", "--pp", "8", "--microbatches", "10000"], "searches"),
        (["1F1B", "--pp", "4", "--microbatches", "8", "--times", "nan,1,1"], "--times"),
        (["auto", "--pp", "4", "--microbatches", "8", "--memory-limit", "inf"], "--memory-limit"),
    ):
        rc, _, err = run_cli(["schedule", *argv], capsys)
        assert rc == 2 and match in err and len(err.strip().splitlines()) == 1


def test_unexpected_number_errors_are_one_line(monkeypatch, capsys):
    # the net under the range checks: an overflow deep in the engine is one line, exit 2
    import importlib

    est_mod = importlib.import_module("pipemem.estimate")

    def boom(*a, **k):
        raise OverflowError("Python int too large to convert to C long")

    monkeypatch.setattr(est_mod, "_add_outside_allocator", boom)  # runs on every call, cached or not
    rc, _, err = run_cli(["estimate", "--model", "llama3-8b"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "too large" in err


def test_real_command_prints_no_traceback():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipemem",
            "estimate",
            "--model",
            "llama3-8b",
            "--micro-batch",
            "100000000000",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(schedule=5, pp=2), "--schedule 5: expected a name"),
        (dict(fsdp="no"), "--fsdp 'no': expected True or False"),  # "no" is truthy: never read as FSDP on
        (dict(sp="yes", tp=2), "--sp 'yes'"),
    ],
)
def test_python_api_types(kw, match):
    with pytest.raises(UserError, match=match):
        pipemem.estimate("llama3-8b", **kw)


def test_overlong_model_name_is_one_error():
    with pytest.raises(UserError, match="--model"):
        pipemem.estimate("x" * 300)


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["schedule", "1F1B", "--pp", "4", "--microbatches", "8", "--times", "-1,1,1"], "--times"),
        (["estimate", "--model", "llama3-8b", "--pp", "2", "--pp-layout", "-3,35"], "--pp-layout"),
    ],
)
def test_value_starting_with_dash_says_how_to_write_it(argv, flag, capsys):
    # argparse reads "-1,1,1" as an option: "expected one argument" alone leaves the user guessing
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"write one that starts with '-' as {flag}=VALUE" in err
