"""Stock recipes as the frameworks ship them, read as the frameworks read them.

Each input is a file or launch line from the framework's own repository (named per test; the
files are copied under tests/data/)."""

from pathlib import Path

import pytest

import pipemem
from pipemem.cli.main import main
from pipemem.configs import read_paddlenlp
from pipemem.errors import UserError

DATA = Path(__file__).parent / "data"
# PaddlePaddle/PaddleNLP llm/config/llama/pretrain_argument.json (2.8 line; the README launches it as
# `python -u -m paddle.distributed.launch --gpus "0,...,7" run_pretrain.py ./config/llama/pretrain_argument.json`)
PADDLENLP_JSON = str(DATA / "paddlenlp" / "pretrain_argument.json")
# PaddlePaddle/PaddleFormers examples/config/sft/full_tp_pp.yaml (launched `paddleformers-cli train FILE`)
PADDLEFORMERS_YAML = str(DATA / "paddleformers" / "full_tp_pp.yaml")
LAUNCH = ["python", "-u", "-m", "paddle.distributed.launch", "--gpus", "0,1,2,3,4,5,6,7", "run_pretrain.py"]


def test_paddlenlp_json_file_is_read_as_its_arguments():
    tc = read_paddlenlp(LAUNCH + [PADDLENLP_JSON])
    p = tc.plan
    assert tc.model == "meta-llama/Meta-Llama-3-8B" and tc.warnings == []
    assert (p["tp"], p["pp"], p["seq_len"], p["microbatches"], p["dtype"]) == (2, 1, 4096, 16, "bf16")
    # sharding stage2 with sharding_parallel_degree left at -1: all 8 / tp 2 = 4 ranks shard
    assert p["zero"] == 2 and p["dp"] == 4 and p["extra"]["zero_group"] == 4
    # arguments after the file override it (PdArgumentParser.parse_json_file_and_cmd_lines)
    over = read_paddlenlp(LAUNCH + [PADDLENLP_JSON, "--max_seq_length", "2048"])
    assert over.plan["seq_len"] == 2048


def test_paddlenlp_default_sharding_degree_equals_the_explicit_one():
    explicit = read_paddlenlp(LAUNCH + [PADDLENLP_JSON, "--sharding_parallel_degree", "4"])
    implicit = read_paddlenlp(LAUNCH + [PADDLENLP_JSON])
    assert explicit.plan == implicit.plan
    kw = dict(layers=2)
    a = pipemem.estimate("llama3-8b", **{**implicit.plan, **kw})
    b = pipemem.estimate("llama3-8b", **{**explicit.plan, **kw})
    unsharded = pipemem.estimate("llama3-8b", **{**implicit.plan, **kw, "zero": 0})
    assert a.max_peak_allocated_bytes == b.max_peak_allocated_bytes
    assert a.ranks[0].static.optimizer < unsharded.ranks[0].static.optimizer


def test_paddlenlp_sharding_without_world_takes_dp_from_the_flag(capsys):
    tc = read_paddlenlp([PADDLENLP_JSON])
    assert tc.dp_unknown and "dp" not in tc.plan and tc.plan["zero"] == 2
    assert "zero_group" not in tc.plan["extra"]        # over every data-parallel rank --dp gives
    rc = main(["estimate", "--json", "--dp", "4", "--layers", "2", "--from-paddlenlp", "--", PADDLENLP_JSON])
    flag = capsys.readouterr().out
    rc2 = main(["estimate", "--json", "--layers", "2", "--from-paddlenlp", "--"] + LAUNCH + [PADDLENLP_JSON])
    launched = capsys.readouterr().out
    import json
    assert rc == rc2 == 0
    assert json.loads(flag)["max_peak_allocated_bytes"] == json.loads(launched)["max_peak_allocated_bytes"]


def test_paddleformers_yaml_names_are_honoured():
    tc = read_paddlenlp(["CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7", "paddleformers-cli", "train", PADDLEFORMERS_YAML])
    p = tc.plan
    assert tc.model == "Qwen/Qwen3-0.6B-Base"
    assert (p["tp"], p["pp"], p["seq_len"], p["sp"], p["flash_attn"]) == (2, 2, 8192, True, True)
    assert p["recompute"] == "full" and p["zero"] == 1 and p["dp"] == 2 and p["microbatches"] == 4
    # the one key that moves nothing pipemem models is named
    assert tc.warnings == ["PaddleNLP: not modelled, ignored: --moe_token_dispatcher_type"]


def test_paddleformers_names_equal_paddlenlp_names():
    formers = read_paddlenlp(["--model_name_or_path", "llama3-8b", "--tensor_model_parallel_size", "4",
                              "--pipeline_model_parallel_size", "2", "--max_seq_len", "2048", "--sharding", "",
                              "--world_size", "16", "--bf16", "true", "--recompute_granularity", "full"])
    nlp = read_paddlenlp(["--model_name_or_path", "llama3-8b", "--tensor_parallel_degree", "4",
                          "--pipeline_parallel_degree", "2", "--max_seq_length", "2048", "--world_size", "16",
                          "--bf16", "true", "--recompute", "true", "--recompute_granularity", "full"])
    assert formers.plan == nlp.plan and formers.plan["tp"] == 4 and formers.plan["dp"] == 2
    # PaddleFormers shards stage1 by default over every data-parallel rank
    default = read_paddlenlp(["--model_name_or_path", "llama3-8b", "--tensor_model_parallel_size", "4",
                              "--world_size", "16"])
    assert default.plan["zero"] == 1 and default.plan["dp"] == 4


@pytest.mark.parametrize("extra,match", [
    (["--fine_tuning", "lora"], "fine_tuning lora"),
    (["--stage", "DPO"], "stage DPO"),
    (["--tensor_parallel_degree", "2", "--tensor_model_parallel_size", "4"], "contradicts"),
    (["--sharding_parallel_size", "0"], ">= 1"),
])
def test_paddleformers_refusals(extra, match):
    with pytest.raises(UserError, match=match):
        read_paddlenlp(["--model_name_or_path", "llama3-8b", "--max_seq_len", "1024"] + extra)


def test_paddlenlp_argument_file_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_paddlenlp(["run_pretrain.py", str(tmp_path / "missing.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="cannot read argument file"):
        read_paddlenlp(["run_pretrain.py", str(bad)])
