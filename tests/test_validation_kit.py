"""The pieces the validate targets share: the phase fold over a walked sequence, the workers'
entry point, the case's model as each side reads it."""

import json
from types import SimpleNamespace

import pytest

from pipemem.liveness import sequence_peak, sequence_starts
from pipemem.validation.case_model import llama_hf_config, torchtune_decoder_kwargs
from pipemem.validation.case_worker import run_case_file


def _program(name, net, peak):
    return SimpleNamespace(name=name, net_bytes=net, peak_bytes=peak, peak_op_label=f"op-{name}")


def test_sequence_peak_stands_each_program_on_the_net_bytes_before_it():
    results = [_program("a", 10, 5), _program("b", -5, 20), _program("c", 0, 3)]
    assert sequence_starts(results) == [0, 10, 5]
    # b's peak of 20 above its start of 10 is the highest, though a's own peak is not lower than c's
    assert sequence_peak(results) == (30, "b: op-b")
    # b left out of the peak still moves the count: c starts at 5
    assert sequence_peak(results, lambda name: name != "b") == (8, "c: op-c")
    assert sequence_peak([_program("x", -4, 0)]) == (0, "")


def test_run_case_file_writes_what_the_measure_returns(tmp_path):
    src, out = tmp_path / "case.json", tmp_path / "out.json"
    src.write_text(json.dumps({"name": "c1", "n": 3}))
    assert (
        run_case_file(lambda case: {"case": case["name"], "twice": 2 * case["n"]}, [str(src), str(out)]) == 0
    )
    assert json.loads(out.read_text()) == {"case": "c1", "twice": 6}
    run_case_file(lambda case: {"k": 1}, [str(src), str(out)], indent=1)
    assert out.read_text() == '{\n "k": 1\n}'


def test_the_case_model_reads_the_same_on_every_side():
    case = {
        "seq_len": 128,
        "model": {
            "vocab": 512,
            "layers": 3,
            "heads": 4,
            "kv_heads": 2,
            "hidden": 64,
            "ffn": 96,
            "tied": True,
        },
    }
    hf = llama_hf_config(case)
    assert (hf["vocab_size"], hf["num_hidden_layers"], hf["hidden_size"]) == (512, 3, 64)
    assert hf["tie_word_embeddings"] is True and hf["max_position_embeddings"] == 128
    tt = torchtune_decoder_kwargs(hf, case["seq_len"])
    m = case["model"]
    assert (tt["num_heads"], tt["num_kv_heads"], tt["embed_dim"], tt["intermediate_dim"]) == (
        m["heads"],
        m["kv_heads"],
        m["hidden"],
        m["ffn"],
    )
    assert tt["max_seq_len"] == case["seq_len"]


def test_pick_cases_keeps_the_order_given_and_names_the_known_ones_on_a_typo():
    import pytest

    from pipemem.errors import UserError
    from pipemem.validation.compare import pick_cases

    cases = tuple(SimpleNamespace(name=n) for n in ("a", "b", "c"))
    assert pick_cases("", cases) == cases
    assert [c.name for c in pick_cases(" c, a ", cases)] == ["c", "a"]
    with pytest.raises(UserError, match="unknown case.*zz; known: a, b, c"):
        pick_cases("a,zz", cases)


def test_print_result_prints_the_report_and_returns_the_verdict(capsys):
    from pipemem.validation.compare import CaseRow
    from pipemem.validation.progress import print_result

    rows = [CaseRow("ok", 100, 101), CaseRow("off", 100, 150)]
    assert print_result(rows, True, "t", "measured", 0.05, {"extra": 7}) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["target"] == "t" and out["extra"] == 7 and out["beyond_tolerance"] == ["off"]
    assert print_result(rows[:1], True, "t", "measured", 0.05, {}) == 0


def test_with_ranks_keeps_the_schedule_and_changes_only_its_actions():
    from pipemem.schedules.generators import one_f_one_b

    s = one_f_one_b(2, 4)
    fewer = s.with_ranks([acts[:2] for acts in s.ranks])
    assert (fewer.name, fewer.pp, fewer.vpp, fewer.microbatches, fewer.stage_rank, fewer.placement) == (
        s.name,
        s.pp,
        s.vpp,
        s.microbatches,
        s.stage_rank,
        s.placement,
    )
    assert fewer.ranks == [acts[:2] for acts in s.ranks] and fewer != s
    assert s.with_ranks(s.ranks) == s


def test_a_named_case_target_lists_and_checks_its_cases_before_running_any(capsys):
    """torchtune, deepspeed, torchtitan and hf-trainer run through compare.run_named_cases, which reads
    the cases, the CI subset and the library check off the target's module."""
    from pipemem.cli.main import main
    from pipemem.validation import deepspeed, torchtitan

    assert main(["validate", "deepspeed", "--list"]) == 0
    assert capsys.readouterr().out.split() == [c["name"] for c in deepspeed.all_cases()]
    assert set(deepspeed.CI_CASES) < {c["name"] for c in deepspeed.all_cases()}
    assert main(["validate", "torchtitan", "--cases", "no-such-case"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cases" in err[0] and "validate torchtitan --list" in err[0]
    assert main(["validate", "hf-trainer", "--timeout", "0"]) == 2
    assert "--timeout" in capsys.readouterr().err
    assert torchtitan.ROWS_ARE == "ranks" and not hasattr(deepspeed, "ROWS_ARE")


def test_every_command_and_target_parser_is_made_from_its_module():
    """cli/command.py builds each parser from the module's HELP, DESCRIPTION and EXAMPLE; the
    description is printed as written."""
    import argparse
    import importlib

    from pipemem.cli.main import build_parser
    from pipemem.validation import TARGETS

    def subparsers(p):
        return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices

    commands = subparsers(build_parser())
    for name, parser in commands.items():
        module = importlib.import_module(f"pipemem.cli.cmd_{name}")
        texts = [t() if callable(t) else t for t in (module.DESCRIPTION, module.EXAMPLE)]
        assert [parser.description, parser.epilog] == texts  # functions: laid out for the terminal
        assert parser.get_default("func") is module.run
    targets = subparsers(commands["validate"])
    assert sorted(targets) == sorted(t.replace("_", "-") for t in TARGETS)
    for name in TARGETS:
        module = importlib.import_module(f"pipemem.validation.{name}")
        assert targets[name.replace("_", "-")].description == module.DESCRIPTION


def test_a_row_reads_back_from_its_json_and_reads_as_its_json_does():
    from pipemem.validation.compare import CaseRow, beyond_tolerance

    row = CaseRow("a/rank0", 200, 210, {"case": "a", "known_gap": ""})
    d = row.to_dict()
    assert d["rel_error"] == 0.05 and CaseRow.from_dict(d) == row
    assert [row.get(k) for k in ("name", "rel_error", "case", "missing")] == ["a/rank0", 0.05, "a", None]
    # a row and its JSON give the same verdict
    assert beyond_tolerance([row], 0.01) == beyond_tolerance([d], 0.01) == ["a/rank0"]


def test_peak_row_sets_a_rank_of_the_trace_against_the_estimate_s():
    from pipemem.validation.compare import peak_row

    rank = SimpleNamespace(peak_allocated_bytes=110, static=SimpleNamespace(total=40), peak_at="B0@s0")
    trace = {"peak_bytes": 100, "static_bytes": 41, "peak_at": "backward: add"}
    row = peak_row("c/rank1", "c", trace, rank, {"rank": 1}, extra_field=7)
    assert (row.measured_bytes, row.estimated_bytes) == (100, 110)
    assert list(row.to_dict())[4:] == [
        "case",
        "rank",
        "measured_static_bytes",
        "estimated_static_bytes",
        "measured_peak_at",
        "estimated_peak_at",
        "extra_field",
    ]
    assert (row.get("measured_static_bytes"), row.get("estimated_static_bytes")) == (41, 40)


def test_paddle_rows_keep_their_json_fields_in_order():
    """validate paddle's rows are CaseRows; a Program case's row has the fields (and the order)
    its JSON has always had, Paddle's own error beside pipemem's."""
    from pipemem.validation.paddle_runs.compare import paddle_row, program_row

    d = program_row("mlp/forward/peak", 100, 90, 120, "matmul").to_dict()
    assert list(d) == [
        "name",
        "measured_bytes",
        "estimated_bytes",
        "rel_error",
        "paddle_estimated_bytes",
        "paddle_rel_error",
        "peak_op",
        "collector",
        "trial_peaks",
        "lag_bytes",
    ]
    assert (d["rel_error"], d["paddle_rel_error"]) == (-0.1, 0.2)
    unmeasured = paddle_row("card0/forward/net", None, 90, None, built_with="paddlepaddle 2.6.2").to_dict()
    assert unmeasured["rel_error"] is None and unmeasured["built_with"] == "paddlepaddle 2.6.2"


def test_torchtune_lora_llama_puts_adapters_where_asked_and_freezes_the_base():
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("torchtune") is None:
        pytest.skip("torchtune not installed")
    import torch

    from pipemem.validation.case_model import torchtune_lora_llama
    from pipemem.validation.features import TT_LLAMA, torchtune_packages

    with torchtune_packages(), torch.device("meta"):
        model = torchtune_lora_llama(TT_LLAMA, 64, ["q_proj", "v_proj"], mlp=False, rank=4, alpha=8)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    layers = TT_LLAMA["num_hidden_layers"]
    # lora_a / lora_b on q and v of every layer, nothing else trainable
    assert len(trainable) == layers * 2 * 2
    assert all(".attn.q_proj.lora_" in n or ".attn.v_proj.lora_" in n for n in trainable)
    q = model.layers[0].attn.q_proj
    assert (q.lora_a.weight.shape[0], q.rank, q.alpha) == (4, 4, 8)
    assert not hasattr(model.layers[0].attn.k_proj, "lora_a")
    assert not hasattr(model.layers[0].mlp.w1, "lora_a")
