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
# `python -u -m paddle.distributed.launch --gpus "0,...,7" run_pretrain.py
# ./config/llama/pretrain_argument.json`)
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


def test_paddlenlp_yaml_file_equals_the_json_file():
    """PaddleNLP's llm/config/llama/pretrain_argument.yaml (the same arguments as the JSON)."""
    yaml_plan = read_paddlenlp(LAUNCH + [str(DATA / "paddlenlp" / "pretrain_argument.yaml")]).plan
    assert yaml_plan == read_paddlenlp(LAUNCH + [PADDLENLP_JSON]).plan


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
    assert "zero_group" not in tc.plan["extra"]  # over every data-parallel rank --dp gives
    rc = main(["estimate", "--json", "--dp", "4", "--layers", "2", "--from-paddlenlp", "--", PADDLENLP_JSON])
    flag = capsys.readouterr().out
    rc2 = main(["estimate", "--json", "--layers", "2", "--from-paddlenlp", "--"] + LAUNCH + [PADDLENLP_JSON])
    launched = capsys.readouterr().out
    import json

    assert rc == rc2 == 0
    assert json.loads(flag)["max_peak_allocated_bytes"] == json.loads(launched)["max_peak_allocated_bytes"]


def test_paddleformers_yaml_names_are_honoured():
    tc = read_paddlenlp(
        ["CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7", "paddleformers-cli", "train", PADDLEFORMERS_YAML]
    )
    p = tc.plan
    assert tc.model == "Qwen/Qwen3-0.6B-Base"
    assert (p["tp"], p["pp"], p["seq_len"], p["sp"], p["flash_attn"]) == (2, 2, 8192, True, True)
    assert p["recompute"] == "full" and p["zero"] == 1 and p["dp"] == 2 and p["microbatches"] == 4
    # the one key that moves nothing pipemem models is named
    assert tc.warnings == ["PaddleNLP: not modelled, ignored: --moe_token_dispatcher_type"]


def test_paddleformers_names_equal_paddlenlp_names():
    formers = read_paddlenlp(
        [
            "--model_name_or_path",
            "llama3-8b",
            "--tensor_model_parallel_size",
            "4",
            "--pipeline_model_parallel_size",
            "2",
            "--max_seq_len",
            "2048",
            "--sharding",
            "",
            "--world_size",
            "16",
            "--bf16",
            "true",
            "--recompute_granularity",
            "full",
        ]
    )
    nlp = read_paddlenlp(
        [
            "--model_name_or_path",
            "llama3-8b",
            "--tensor_parallel_degree",
            "4",
            "--pipeline_parallel_degree",
            "2",
            "--max_seq_length",
            "2048",
            "--world_size",
            "16",
            "--bf16",
            "true",
            "--recompute",
            "true",
            "--recompute_granularity",
            "full",
        ]
    )
    assert formers.plan == nlp.plan and formers.plan["tp"] == 4 and formers.plan["dp"] == 2
    # PaddleFormers shards stage1 by default over every data-parallel rank
    default = read_paddlenlp(
        ["--model_name_or_path", "llama3-8b", "--tensor_model_parallel_size", "4", "--world_size", "16"]
    )
    assert default.plan["zero"] == 1 and default.plan["dp"] == 4


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--fine_tuning", "lora"], "fine_tuning lora"),
        (["--stage", "DPO"], "stage DPO"),
        (["--tensor_parallel_degree", "2", "--tensor_model_parallel_size", "4"], "contradicts"),
        (["--sharding_parallel_size", "0"], ">= 1"),
    ],
)
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


# PyTorch/torchtitan torchtitan/models/llama3/train_configs/llama3_405b.toml (the job file before
# torchtitan 0.3 moved its configs into config_registry.py functions), set to the 3D layout of
# torchtitan's benchmarks/llama3_h100_202412_torchtitan.md Table 5 (FSDP 8, TP 8, PP 8, local
# batch 32, 1F1B); async TP off (pipemem refuses it: not modelled).
TITAN_405B = DATA / "torchtitan" / "llama3_405b.toml"


def _titan_405b_pp8(tmp_path, extra: str = "") -> str:
    text = TITAN_405B.read_text()
    for old, new in (
        ("batch_size = 2", "batch_size = 32"),
        ("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 8"),
        ("enable_async_tensor_parallel = true", "enable_async_tensor_parallel = false"),
        (
            "pipeline_parallel_degree = 1",
            'pipeline_parallel_degree = 8\npipeline_parallel_schedule = "1F1B"' + extra,
        ),
    ):
        assert old in text
        text = text.replace(old, new)
    f = tmp_path / "llama3_405b_pp8.toml"
    f.write_text(text)
    return str(f)


@pytest.mark.parametrize(
    "layers,stages,first,last", [(126, 8, 1, 1), (126, 8, 0, 0), (32, 4, 1, 1), (61, 16, 2, 1)]
)
def test_torchtitan_stage_split_is_torchtitans(layers, stages, first, last):
    from pipemem.configs.torchtitan import stage_split

    pp = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    fqns = pp._generate_llm_fqn_per_model_part(stages, layers, input_weight=first, output_weight=last)
    theirs = tuple(sum(m.startswith("layers.") for m in s) for s in fqns)
    assert stage_split(layers, stages, first, last) == theirs and sum(theirs) == layers


def test_torchtitan_405b_126_layers_over_8_stages(tmp_path, capsys):
    import json

    rc = main(["estimate", "--json", "--gpu", "h100-80g", "--from-torchtitan", _titan_405b_pp8(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert sum(out["plan"]["pp_layout"]) == 126 and len(out["plan"]["pp_layout"]) == 8
    # torchtitan's published peak for this layout is 82.5 GiB reserved (allocator cache included)
    assert out["max_peak_allocated_bytes"] < 82.5 * 2**30


def test_torchtitan_fsdp_under_pp_holds_gathered_parameters_once_per_stage(tmp_path):
    """FSDP2 under torch's pipelining (torchtitan's default reshard_after_forward=False with pp,
    and "always"): the stage's gathered parameters and unsharded gradients are held once for the
    step, not per microbatch in flight."""
    from pipemem.configs import read_torchtitan
    from pipemem.configs.torchtitan import finish_plan

    tc = read_torchtitan(_titan_405b_pp8(tmp_path))
    plan = finish_plan(dict(tc.plan), 126)
    assert plan["extra"]["fsdp_reshard_after_forward"] is False
    held = pipemem.estimate(tc.model, **plan)
    unsharded = pipemem.estimate(tc.model, **{**plan, "fsdp": False})  # no FSDP: nothing gathered
    always = pipemem.estimate(
        tc.model, **{**plan, "extra": {**plan["extra"], "fsdp_reshard_after_forward": True}}
    )
    for r_held, r_plain, r_always in zip(held.ranks, unsharded.ranks, always.ranks):
        local = r_plain.static.params // 4  # the stage's fp32 parameters (elements)
        gathered = local * (2 + 4)  # bf16 gathered copy + fp32 unsharded gradients
        assert r_held.static.other - r_plain.static.other == gathered
        assert r_always.static == r_held.static
    # in flight: the more microbatches a rank holds, the more activations, never more parameters
    r0 = held.ranks[0]
    fewer = pipemem.estimate(tc.model, **{**plan, "microbatches": 8}).ranks[0]
    assert r0.activations_at_peak_bytes - fewer.activations_at_peak_bytes < r0.static.params


def test_torchtitan_03_float8_recipe_reads_without_a_float8_gpu():
    """torchtitan 0.3.0's llama3_debugmodel_float8 (torchtitan/models/llama3/config_registry.py):
    its Float8 converter checks the building process's GPU; pipemem reads it on any machine."""
    pytest.importorskip("torchtitan")
    from pipemem.configs.torchtitan import read_args

    tc = read_args(["--module", "llama3", "--config", "llama3_debugmodel_float8"])
    assert tc.plan["fp8"] == "rowwise" and tc.plan["fsdp"] is True


# huggingface/accelerate examples/config_yaml_templates/{fsdp,deepspeed,multi_gpu}.yaml and
# examples/deepspeed_config_templates/zero_stage1_config.json (the path deepspeed.yaml names)
ACC = DATA / "accelerate" / "config_yaml_templates"
RUN_CLM = [
    "run_clm.py",
    "--model_name_or_path",
    "meta-llama/Meta-Llama-3-8B",
    "--block_size",
    "2048",
    "--per_device_train_batch_size",
    "1",
    "--gradient_checkpointing",
]


def _hf(line):
    from pipemem.configs.hf_trainer import read

    return read(line)


def test_accelerate_fsdp_config_file_equals_the_trainers_fsdp():
    acc = _hf(["accelerate", "launch", "--config_file", str(ACC / "fsdp.yaml")] + RUN_CLM)
    flags = _hf(
        ["accelerate", "launch", "--use_fsdp", "--num_processes", "2", "--mixed_precision", "bf16"] + RUN_CLM
    )
    trainer = _hf(
        ["torchrun", "--nproc_per_node", "2"] + RUN_CLM + ["--bf16", "--fsdp", "full_shard auto_wrap"]
    )
    assert acc.plan == flags.plan == trainer.plan
    assert acc.plan["fsdp"] is True and acc.plan["dp"] == 2 and acc.plan["dtype"] == "bf16"


def test_accelerate_multi_gpu_and_deepspeed_config_files():
    ddp = _hf(["accelerate", "launch", "--config_file", str(ACC / "multi_gpu.yaml")] + RUN_CLM)
    assert ddp.plan["dp"] == 2 and ddp.plan["dtype"] == "bf16" and "fsdp" not in ddp.plan
    # the ZeRO-1 template enables fp16, so the Trainer needs --fp16 (it refuses the mismatch)
    ds = _hf(["accelerate", "launch", "--config_file", str(ACC / "deepspeed.yaml")] + RUN_CLM + ["--fp16"])
    direct = _hf(
        ["torchrun", "--nproc_per_node", "2"]
        + RUN_CLM
        + [
            "--fp16",
            "--deepspeed",
            str(DATA / "accelerate" / "deepspeed_config_templates" / "zero_stage1_config.json"),
        ]
    )
    assert ds.plan == direct.plan and ds.plan["zero"] == 1 and ds.plan["dp"] == 2
    with pytest.raises(UserError, match="fp16.enabled"):
        _hf(["accelerate", "launch", "--config_file", str(ACC / "deepspeed.yaml")] + RUN_CLM)


def test_accelerate_fsdp2_and_refusals(tmp_path):
    two = _hf(
        [
            "accelerate",
            "launch",
            "--use_fsdp",
            "--fsdp_version",
            "2",
            "--fsdp_reshard_after_forward",
            "false",
            "--num_processes",
            "4",
        ]
        + RUN_CLM
    )
    assert two.plan["fsdp"] is True and two.plan["extra"]["fsdp_reshard_after_forward"] is False
    for extra, match in (
        (["--fsdp_offload_params", "true"], "offload"),
        (["--fsdp_sharding_strategy", "SHARD_GRAD_OP"], "SHARD_GRAD_OP"),
        (["--mixed_precision", "fp8"], "fp8"),
    ):
        with pytest.raises(UserError, match=match):
            _hf(["accelerate", "launch", "--use_fsdp", "--num_processes", "4"] + extra + RUN_CLM)
    with pytest.raises(UserError, match="not found"):
        _hf(["accelerate", "launch", "--config_file", str(tmp_path / "none.yaml")] + RUN_CLM)


def _cli_peaks(argv, capsys):
    import json

    assert main(["estimate", "--json"] + argv) == 0
    out = json.loads(capsys.readouterr().out)
    return [r["peak_allocated_bytes"] for r in out["ranks"]], out["model"]


def _api_peaks(model, plan):
    return [r.peak_allocated_bytes for r in pipemem.estimate(model, **plan).ranks]


def _megatron_line():
    import shlex

    text = (DATA / "megatron" / "llama3_8b_h100_fp8.txt").read_text()
    return shlex.split(" ".join(line for line in text.splitlines() if not line.startswith("#")))


@pytest.mark.parametrize(
    "tool,source,cli",
    [
        ("megatron", "megatron", ["--from-megatron", "--"]),
        ("paddlenlp", LAUNCH + [PADDLENLP_JSON], ["--from-paddlenlp", "--"]),
        ("torchtitan", "titan-405b-pp8", ["--from-torchtitan"]),
        ("torchtune", str(DATA / "torchtune" / "3B_full.yaml"), ["--from-torchtune"]),
        (
            "hf-trainer",
            ["accelerate", "launch", "--config_file", str(ACC / "fsdp.yaml")] + RUN_CLM,
            ["--from-hf-trainer", "--"],
        ),
    ],
)
def test_read_config_equals_the_cli(tool, source, cli, capsys, tmp_path):
    """pipemem.read_config(tool, source) + pipemem.estimate(model, **plan) =
    `pipemem estimate --from-<tool>`."""
    if source == "megatron":
        source = _megatron_line()
    if source == "titan-405b-pp8":
        source = _titan_405b_pp8(tmp_path)
    argv = cli + (source if isinstance(source, list) else [source])
    flags = {"dp": 4, "seq_len": 2048} if tool == "torchtune" else {}
    if tool == "torchtune":
        argv = ["--dp", "4", "--seq-len", "2048"] + argv
    model, plan = pipemem.read_config(tool, source, **flags)
    cli_peaks, _ = _cli_peaks(argv, capsys)
    assert _api_peaks(model, plan) == cli_peaks


def test_read_config_deepspeed_needs_a_model_and_equals_the_cli(capsys):
    ds = str(DATA / "accelerate" / "deepspeed_config_templates" / "zero_stage1_config.json")
    with pytest.raises(UserError, match="model="):
        pipemem.read_config("deepspeed", ds)
    model, plan = pipemem.read_config(
        "deepspeed", ds, model="llama3.2-1b", dtype="fp16", micro_batch=1, dp=4, seq_len=2048
    )
    cli_peaks, _ = _cli_peaks(
        [
            "--model",
            "llama3.2-1b",
            "--deepspeed",
            ds,
            "--dtype",
            "fp16",
            "--micro-batch",
            "1",
            "--dp",
            "4",
            "--seq-len",
            "2048",
        ],
        capsys,
    )
    assert plan["zero"] == 1 and _api_peaks(model, plan) == cli_peaks


def test_read_config_refuses_unknown_tools():
    with pytest.raises(UserError, match="unknown tool"):
        pipemem.read_config("colossalai", [])


def test_schedule_at_pp_1_is_refused(capsys):
    assert main(["estimate", "--model", "llama3.2-1b", "--schedule", "1F1B"]) == 2
    err = capsys.readouterr().err
    assert "--schedule 1F1B does nothing at --pp 1" in err and "Traceback" not in err


def test_compile_without_networkx_is_one_line(monkeypatch, capsys):
    import sys

    from pipemem.templates import compiled

    monkeypatch.setitem(sys.modules, "networkx", None)  # `import networkx` raises ImportError
    with pytest.raises(UserError, match="pip install networkx"):
        compiled.min_cut_region(None, 0)
    # a plan no other test estimates, so no cached partition hides the import
    assert (
        main(["estimate", "--model", "llama3.2-1b", "--compile", "--seq-len", "1234", "--layers", "1"]) == 2
    )
    err = capsys.readouterr().err
    assert "networkx" in err and "Traceback" not in err


def test_plan_line_names_the_master_weights_dtype():
    """Megatron --use-precision-aware-optimizer --main-params-dtype fp16: fp16 masters, said so."""
    from pipemem.report.text import describe_precision

    line = _megatron_line() + ["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"]
    model, plan = pipemem.read_config("megatron", line)
    assert plan["extra"]["main_params_dtype"] == "fp16"
    text = describe_precision(pipemem.estimate(model, **plan).plan)
    assert "fp16 master" in text and "fp32 grads + master" not in text


@pytest.mark.parametrize(
    "plan",
    [
        dict(convention="hf", recompute="full", seq_len=4096, optimizer_impl="fused"),  # set-to-none grads
        dict(convention="hf", recompute="none", seq_len=1024, optimizer_impl="fused", pp=4, microbatches=8),
        dict(convention="torchtune", recompute="full", seq_len=2048, fsdp=True, dp=8),
    ],
)
def test_report_row_adds_up_with_the_grads_the_backward_made(plan):
    """peak = static + grads made by the peak + activations + transient, each term >= 0; under full
    recompute a backward peak holds few activations (layer inputs) and the gradients it made are
    gradients, not activations."""
    est = pipemem.estimate("llama3-8b", **plan)
    for r in est.ranks:
        assert r.static.grads_in_step > 0
        assert 0 <= r.grads_at_peak_bytes <= r.static.grads_in_step
        assert min(r.activations_at_peak_bytes, r.transient_bytes) >= 0
        assert (
            r.static.total + r.grads_at_peak_bytes + r.activations_at_peak_bytes + r.transient_bytes
            == r.peak_allocated_bytes
        )
    if plan["recompute"] == "full" and plan["convention"] == "hf":
        r = est.ranks[0]
        assert r.peak_at.startswith("B") and r.activations_at_peak_bytes < r.grads_at_peak_bytes


def test_report_shows_other_static_bytes(capsys):
    import shlex

    text = (DATA / "megatron" / "llama3_8b_fsdp_h100_fp8.txt").read_text()
    line = shlex.split(" ".join(x for x in text.splitlines() if not x.startswith("#")))
    assert main(["estimate", "--wide", "--from-megatron", "--"] + line) == 0
    out = capsys.readouterr().out
    header = next(x for x in out.splitlines() if x.startswith("rank"))
    assert "other" in header.split()
    model, plan = pipemem.read_config("megatron", line)
    from pipemem.units import fmt_bytes

    assert fmt_bytes(pipemem.estimate(model, **plan).ranks[0].static.other) in out


def test_megatron_fp8_recipe_keeps_te_fp8_copies_of_linear_inputs():
    """NVIDIA/Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh (tests/data/megatron): each
    linear's input is kept for its weight gradient as Transformer Engine keeps it under fp8 -- the
    1-byte columnwise (transposed) fp8 copy only (TE 2.x `ln_out.update_usage(rowwise_usage=False)`
    without sequence parallelism, which Megatron turns off at tp 1) -- while what other ops read
    stays bf16 (the norms' inputs, the SwiGLU input, attention's q / k / v / out). So fp8 keeps
    less than the same line in bf16 by exactly the bf16 linear inputs less their fp8 copies, per
    layer. The line OOMs on 80 GB at its script's CP_SIZE=1; its README's default (and NVIDIA's
    published run) is context parallelism 2, which fits."""
    line = _megatron_line()
    model, plan = pipemem.read_config("megatron", line)
    fp8 = pipemem.estimate(model, **plan, explain=True, gpu="h100-80g")
    bf16_plan = {k: v for k, v in plan.items() if k not in ("fp8", "fp8_param_gather")}
    bf16 = pipemem.estimate(model, **bf16_plan, explain=True)

    def kept(est):
        return [r for r in est.explain if not r["tensor"].startswith("(")]

    def for_wgrad_only(r):
        return r["why"] == "read in backward by linear_wgrad"

    fp8_copies = [r for r in kept(fp8) if for_wgrad_only(r)]
    assert fp8_copies and all(
        r["dtype"] == "fp8" and r["tensor"].endswith("_fp8_columnwise") for r in fp8_copies
    )
    for r in fp8_copies:
        elems = 1
        for d in r["shape"]:
            elems *= d
        assert r["bytes"] == elems  # one byte per element
    bf16_inputs = [r for r in kept(bf16) if for_wgrad_only(r)]
    assert bf16_inputs and all(r["dtype"] == "bf16" for r in bf16_inputs)
    per_layer = sum(r["bytes"] for r in bf16_inputs) - sum(r["bytes"] for r in fp8_copies)
    assert sum(r["bytes"] for r in kept(bf16)) - sum(r["bytes"] for r in kept(fp8)) == per_layer
    layers = int(line[line.index("--num-layers") + 1])
    a, b = fp8.ranks[0].activations_at_peak_bytes, bf16.ranks[0].activations_at_peak_bytes
    assert b - a == layers * per_layer
    assert fp8.verdict == "oom"
    cp2 = list(line)
    cp2[cp2.index("--context-parallel-size") + 1] = "2"
    model, plan = pipemem.read_config("megatron", cp2)
    assert pipemem.estimate(model, **plan, gpu="h100-80g").fits


@pytest.mark.parametrize(
    "line,match",
    [
        ("lora_target: q_proj,v_proj,lm_head", "'lm_head': the output layer"),
        ("lora_target: qkv_proj", "'qkv_proj': a fused QKV projection"),
        ("lora_target: c_attn", "'c_attn': a GPT-2 style linear"),
        ("lora_target: gate_up_proj", "'gate_up_proj': a fused or non-gated MLP"),
        ("lora_target: experts", "'experts': mixture-of-experts"),
        ("additional_target: embed_tokens,lm_head", "additional_target .*modules_to_save"),
    ],
)
def test_lora_targets_not_modelled_are_refused_by_name(line, match, tmp_path):
    """hiyouga/LLaMA-Factory examples/train_lora/llama3_lora_sft.yaml with its `lora_target` (or
    FinetuningArguments' `additional_target`) set to a module PEFT would wrap whose adapter pipemem
    does not model (the output layer, fused QKV / MLP linears, experts; whole trained modules): one
    error naming it, not a silent estimate of another plan."""
    text = (DATA / "llamafactory" / "llama3_lora_sft.yaml").read_text()
    key = line.split(":")[0]
    text = "\n".join(x for x in text.splitlines() if not x.startswith(key + ":")) + "\n" + line + "\n"
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=match):
        model, plan = pipemem.read_config("llamafactory", str(path))
        pipemem.estimate(model, **plan)
