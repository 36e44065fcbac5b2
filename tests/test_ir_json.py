"""IR JSON round trip and bad-input handling of `pipemem program`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipemem.errors import UserError
from pipemem.ir import Op, Program, Tensor, dtype_bytes, load_programs, save_programs
from pipemem.liveness import analyze_sequence

EXAMPLE = Path(__file__).resolve().parents[1] / "pipemem" / "examples" / "stage_1f1b.json"


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pipemem", *args], capture_output=True, text=True, timeout=120
    )


def test_round_trip_keeps_results(tmp_path):
    progs = load_programs(EXAMPLE)
    out = tmp_path / "copy.json"
    save_programs(progs, out)
    again = load_programs(out)
    assert [(p.name, len(p.ops)) for p in again] == [(p.name, len(p.ops)) for p in progs]
    a = [(r.net_bytes, r.peak_bytes, r.peak_op) for r in analyze_sequence(progs)]
    b = [(r.net_bytes, r.peak_bytes, r.peak_op) for r in analyze_sequence(again)]
    assert a == b
    t = again[0].tensors["w1"]
    assert (t.kind.value, t.persistent, t.dtype) == ("param", True, "bf16")


def test_example_stage_by_hand():
    """The shipped 1F1B stage, derived by hand: [4, 512, 1024] bf16 activations (4 MiB),
    [4, 512, 4096] (16 MiB) FFN activations, 1024x4096 bf16 weights (8 MiB)."""
    MiB = 1 << 20
    fwd, bwd, opt = analyze_sequence(load_programs(EXAMPLE))
    # forward keeps h, a (16 MiB each) and y (4 MiB) and the 4-byte loss for backward
    assert fwd.net_bytes == 36 * MiB + 4 and fwd.peak_bytes == 36 * MiB + 4
    # backward peaks at fc2's weight grad: da (16) + dy (4) + dw2 (8) above the start, less y and loss
    assert bwd.peak_bytes == 16 * MiB + 4 * MiB + 8 * MiB - 4 * MiB - 4
    # and leaves dw1 + dw2 (16 MiB) for the optimizer, having freed x, h, a, y and loss
    assert bwd.net_bytes == 16 * MiB - (4 + 16 + 16 + 4) * MiB - 4
    assert opt.net_bytes == -16 * MiB


def test_dtype_spellings():
    assert dtype_bytes("torch.bfloat16") == 2 and dtype_bytes("paddle.float32") == 4
    assert dtype_bytes("bool") == 1 and dtype_bytes("int64") == 8
    with pytest.raises(UserError, match="unknown dtype"):
        dtype_bytes("float7")


def test_cli_json():
    r = run_cli("program", str(EXAMPLE), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [p["name"] for p in doc["programs"]] == ["forward", "backward", "optimizer"]
    for p in doc["programs"]:
        assert {"net_bytes", "peak_bytes", "peak_op"} <= set(p)


def test_cli_table():
    r = run_cli("program", str(EXAMPLE))
    assert r.returncode == 0 and "fc2.wgrad" in r.stdout and "backward" in r.stdout


BAD_DOCS = {
    "malformed": ("{not json", "malformed JSON"),
    "not_programs": ('{"x": 1}', "not a pipemem programs file"),
    "unknown_dtype": (
        '{"tensors": {"a": {"shape": [2], "dtype": "fp7"}}, "programs": [{"ops": []}]}',
        "unknown dtype",
    ),
    "dangling": (
        '{"tensors": {}, "programs": [{"name": "f", "ops": [{"type": "mm", "inputs": ["ghost"]}]}]}',
        "'ghost'",
    ),
    "unknown_dim": (
        '{"tensors": {"a": {"shape": [null, 4]}}, "programs": [{"ops": [{"type": "f", "outputs": ["a"]}]}]}',
        "unknown dimension",
    ),
    "bad_kind": (
        '{"tensors": {"a": {"shape": [1], "kind": "weights"}}, "programs": [{"ops": []}]}',
        "unknown kind",
    ),
    "bad_op": ('{"programs": [{"ops": [{"inputs": []}]}]}', 'must be an object with a \\"type\\"'),
}


@pytest.mark.parametrize("case", sorted(BAD_DOCS))
def test_cli_bad_input_one_line_exit_2(tmp_path, case):
    text, needle = BAD_DOCS[case]
    f = tmp_path / f"{case}.json"
    f.write_text(text)
    r = run_cli("program", str(f))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert needle.replace("\\", "") in lines[0]


def test_cli_missing_file_and_bad_flag():
    r = run_cli("program", "/nonexistent/programs.json")
    assert r.returncode == 2 and r.stderr.strip().endswith("no such file")
    r = run_cli("program", str(EXAMPLE), "--dim", "batch")
    assert r.returncode == 2 and "--dim" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("program", str(EXAMPLE), "--granularity", "x")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_symbolic_dims_via_cli(tmp_path):
    doc = {
        "tensors": {
            "x": {"shape": ["batch", 8], "dtype": "fp32"},
            "y": {"shape": ["batch", 8], "dtype": "fp32"},
        },
        "programs": [
            {
                "name": "forward",
                "ops": [
                    {"type": "f", "inputs": [], "outputs": ["x"]},
                    {"type": "g", "inputs": ["x"], "outputs": ["y"]},
                ],
            }
        ],
    }
    f = tmp_path / "sym.json"
    f.write_text(json.dumps(doc))
    assert run_cli("program", str(f)).returncode == 2  # batch unbound
    r = run_cli("program", str(f), "--dim", "batch=3", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["programs"][0]["peak_bytes"] == 2 * 3 * 8 * 4


def test_program_api_builds_and_validates():
    p = Program("f")
    p.add_tensor(Tensor("a", (2,), "fp32"))
    p.add_op(Op("f", ("a",), ("b",)))
    with pytest.raises(UserError, match="'b' is not a declared tensor"):
        p.validate()
