"""`pipemem schedule`."""

from __future__ import annotations

import json

from pipemem.cli.main import main


def _json(capsys, *argv):
    assert main(["schedule", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_ranks_actions_and_inflight(capsys):
    out = _json(capsys, "1F1B", "--pp", "4", "--microbatches", "8")
    assert [r["max_inflight"] for r in out["ranks"]] == [4, 3, 2, 1]
    assert out["ranks"][3]["actions"][:4] == ["F0@s3", "B0@s3", "F1@s3", "B1@s3"]
    assert out["peak_microbatches"] == 4
    assert abs(out["bubble_ratio"] - 3 / 11) < 1e-9  # (p-1)/(m+p-1) with T_B = 2 T_F


def test_v_schedule_defaults_to_two_chunks(capsys):
    out = _json(capsys, "zbv", "--pp", "4", "--microbatches", "8")
    assert out["vpp"] == 2 and out["placement"] == "v" and out["split_backward"]
    assert out["ranks"][0]["stages"] == [0, 7]


def test_memory_limit_and_csv_out(capsys, tmp_path):
    path = tmp_path / "zb.csv"
    out = _json(
        capsys, "auto", "--pp", "4", "--microbatches", "8", "--memory-limit", "2", "--csv-out", str(path)
    )
    assert out["schedule"] == "ZBAuto" and out["peak_microbatches"] <= 2
    back = _json(capsys, f"csv:{path}", "--pp", "4", "--microbatches", "8")
    assert [r["actions"] for r in back["ranks"]] == [r["actions"] for r in out["ranks"]]


def test_text_chart(capsys):
    assert main(["schedule", "VHalf", "--pp", "4", "--microbatches", "8"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("VHalf: pp 4, vpp 2") and "rank  3" in text and "bubble" in text


def test_errors_are_one_line_exit_2(capsys):
    assert main(["schedule", "Interleaved1F1B", "--pp", "4", "--microbatches", "8"]) == 2
    err = capsys.readouterr().err
    assert "--vpp 2" in err and err.count("\n") == 1
    assert main(["schedule", "1F1B", "--pp", "4", "--microbatches", "8", "--memory-limit", "2"]) == 2
    assert "auto" in capsys.readouterr().err
    assert main(["schedule", "nope", "--pp", "4", "--microbatches", "8"]) == 2
    assert main(["schedule", "1F1B", "--pp", "4", "--microbatches", "8", "--times", "1,x"]) == 2
    assert main(["schedule", "auto", "--pp", "4", "--microbatches", "8", "--memory-limit", "0.01"]) == 2
    assert "smallest limit" in capsys.readouterr().err


def test_unknown_torch_schedule_is_refused_before_importing_torch():
    # a typo in torch:NAME took the seconds of `import torch` before its one-line error
    import subprocess
    import sys

    code = (
        "import sys; from pipemem.cli.main import main; "
        "rc = main(['schedule', 'torch:Nope', '--pp', '4', '--microbatches', '8']); "
        "print(rc, 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    assert "torch:Nope: unknown PyTorch schedule" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_chart_help_and_presets_keep_to_an_80_column_terminal(monkeypatch, capsys):
    """At COLUMNS=80 `pipemem schedule ZBVZeroBubble --pp 4 --microbatches 8` printed 228-column
    rank lines, `schedule --help` 141 columns and `presets` 103: each now keeps to the terminal's
    width (no name or number cut), and a wide terminal still gets the tables."""
    from pipemem.presets import model_names

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["schedule", "ZBVZeroBubble", "--pp", "4", "--microbatches", "8", "--full"]) == 0
    full = capsys.readouterr().out
    assert main(["schedule", "ZBVZeroBubble", "--pp", "4", "--microbatches", "8"]) == 0
    chart = capsys.readouterr().out
    try:
        main(["schedule", "--help"])
    except SystemExit:
        pass
    helptext = capsys.readouterr().out
    assert main(["presets"]) == 0
    presets = capsys.readouterr().out
    for text in (full, chart, helptext, presets):
        assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    back = _json(capsys, "ZBVZeroBubble", "--pp", "4", "--microbatches", "8")
    # --full: every action of every rank, in order, on the rank's wrapped lines
    blocks = full.split("\nrank ")[1:]
    for r, block in zip(back["ranks"], blocks):
        body = block.split("\nbubble")[0].splitlines()[1:]
        words = " ".join(body).split()
        assert len(words) == len(r["actions"])
    # without --full: a rank's first actions, then how many more
    line = chart.split("rank  0")[1].splitlines()[1].split()
    assert line[-2] == "..." and len(line) - 2 + int(line[-1].strip("(+)")) == len(
        back["ranks"][0]["actions"]
    )
    assert "I3 / W3" in helptext and "ScheduleZBVZeroBubble" in helptext
    for name in model_names():
        assert any(x.startswith(name + " ") for x in presets.splitlines()), name
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["presets"]) == 0
    assert "heads/kv" in capsys.readouterr().out.split("\n")[2]
