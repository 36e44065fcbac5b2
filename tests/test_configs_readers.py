"""Other tools' configurations -> pipemem model + plan, read the way each tool reads them."""

import shlex

import pytest

from pipemem.configs import read_megatron, read_paddlenlp, read_torchtitan
from pipemem.errors import UserError
from pipemem.model import arch_from_hf_config
from pipemem.presets import load_model_config

# The launch line of PaddleNLP's auto-parallel Llama pretraining with a 1F1B pipeline, as Paddle's
# pipeline-memory-estimator pull request runs it (run_pretrain_auto_static.py, 4 layers, pp 4).
SEED_LINE = """python -u -m paddle.distributed.launch \\
    --gpus "0,1,2,3" \\
    --log_dir "output/$task_name""_log" \\
    run_pretrain_auto_static.py \\
    --model_type "llama" \\
    --model_name_or_path "facebook/llama-7b" \\
    --tokenizer_name_or_path "facebook/llama-7b" \\
    --input_dir "../data" \\
    --output_dir "output/$task_name" \\
    --split 949,50,1 \\
    --max_seq_length 2048 \\
    --per_device_train_batch_size 1 \\
    --per_device_eval_batch_size 1 \\
    --gradient_accumulation_steps 8 \\
    --use_flash_attention 0 \\
    --use_fused_rms_norm 0 \\
    --fp16 0 \\
    --fp16_opt_level "O2"  \\
    --scale_loss 1024 \\
    --pipeline_parallel_degree  4 \\
    --tensor_parallel_degree 1 \\
    --pipeline_schedule_mode "1F1B" \\
    --learning_rate 0.0001 \\
    --min_learning_rate 0.00001 \\
    --max_steps 10 \\
    --save_steps 5000 \\
    --weight_decay 0.01 \\
    --warmup_ratio 0.01 \\
    --max_grad_norm 1.0 \\
    --logging_steps 1 \\
    --dataloader_num_workers 1 \\
    --eval_steps 1000 \\
    --report_to "visualdl" \\
    --disable_tqdm true \\
    --continue_training 0 \\
    --recompute 1 \\
    --recompute_granularity full \\
    --do_train \\
    --do_eval \\
    --device "gpu" \\
    --data_impl "mmap" \\
    --enable_auto_parallel 1 \\
    --sharding_parallel_degree 1 \\
    --sharding "stage1" \\
    --num_hidden_layers 4 \\
"""


def seed_tokens() -> list[str]:
    return shlex.split(SEED_LINE)


def test_paddlenlp_seed_line():
    tc = read_paddlenlp(seed_tokens())
    p = tc.plan
    # 4 GPUs = pp 4 x tp 1 x sharding 1 -> dp 1; gradient_accumulation_steps = microbatches with pp;
    # --fp16 0: AMP off, so fp32 training whatever fp16_opt_level says.
    assert (p["pp"], p["tp"], p["dp"], p["layers"], p["microbatches"]) == (4, 1, 1, 4, 8)
    assert (p["seq_len"], p["micro_batch"], p["recompute"], p["dtype"]) == (2048, 1, "full", "fp32")
    assert p["schedule"] == "1F1B" and p["flash_attn"] is False and p["convention"] == "paddle"
    assert tc.warnings == []  # every argument of the seed line is known or irrelevant to memory
    name, cfg = load_model_config(tc.model)
    assert name == "llama2-7b" and arch_from_hf_config(cfg).hidden == 4096


def test_paddlenlp_bf16_sharding_and_unknown():
    tc = read_paddlenlp(
        [
            "--model_name_or_path",
            "meta-llama/Llama-2-13b",
            "--bf16",
            "1",
            "--fp16_opt_level",
            "O2",
            "--sharding_parallel_degree",
            "8",
            "--sharding",
            "stage2",
            "--tensor_parallel_degree",
            "2",
            "--world_size",
            "16",
            "--recompute",
            "0",
            "--some_new_flag",
            "3",
            "--other_flag",
        ]
    )
    p = tc.plan
    assert p["dtype"] == "bf16" and p["master_weights"] is True
    assert p["zero"] == 2 and p["dp"] == 8 and p["tp"] == 2 and p["recompute"] == "none"
    unknown = [w for w in tc.warnings if "ignored" in w]
    assert len(unknown) == 1 and "--some_new_flag" in unknown[0] and "--other_flag" in unknown[0]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--model_name_or_path", "x", "--fp16", "1", "--bf16", "1"], "choose one"),
        (["--model_name_or_path", "x", "--pipeline_parallel_degree", "abc"], "integer"),
        (["--model_name_or_path", "x", "--tensor_parallel_degree", "-2"], ">= 1"),
        (["--max_seq_length", "10"], "model_name_or_path"),
        ([], "no arguments"),
        (
            ["--model_name_or_path", "x", "--gradient_accumulation_steps", "4", "--global_batch_size", "7"],
            "contradicts",
        ),
        (
            ["--gpus", "0,1,2", "run.py", "--model_name_or_path", "x", "--pipeline_parallel_degree", "2"],
            "divisible",
        ),
    ],
)
def test_paddlenlp_bad_inputs(argv, match):
    with pytest.raises(UserError, match=match):
        read_paddlenlp(argv)


LLAMA2_7B_MEGATRON = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --seq-length 4096 "
    "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 64 --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear "
    "--position-embedding-type rope --tokenizer-type Llama2Tokenizer --bf16"
)


def test_megatron_llama2_7b_matches_hf_shape():
    tc = read_megatron(shlex.split(LLAMA2_7B_MEGATRON))
    ours = arch_from_hf_config(tc.model, "m")
    hf = arch_from_hf_config(load_model_config("llama2-7b")[1], "hf")
    fields = (
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "head_dim",
        "ffn",
        "vocab",
        "norm",
        "activation",
        "tied_embeddings",
        "qkv_bias",
        "mlp_bias",
    )
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(hf, f) for f in fields}
    assert tc.plan["dtype"] == "bf16" and tc.plan["global_batch"] == 64 and tc.dp_unknown


def test_megatron_gpt3_175b_matches_preset():
    argv = (
        "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
        "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 "
        "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --fp16 "
        "--tokenizer-type GPT2BPETokenizer --world-size 1024"
    )
    tc = read_megatron(argv.split())
    ours = arch_from_hf_config(tc.model, "m")
    ref = arch_from_hf_config(load_model_config("gpt3-175b")[1], "ref")
    for f in (
        "layers",
        "hidden",
        "heads",
        "ffn",
        "vocab",
        "norm",
        "activation",
        "position",
        "tied_embeddings",
    ):
        assert getattr(ours, f) == getattr(ref, f), f
    # world 1024 / (tp 8 x pp 16) = dp 8
    assert tc.plan["dp"] == 8 and tc.plan["dtype"] == "fp16" and tc.plan["sp"] is False


def test_megatron_defaults_follow_megatron_rules():
    tc = read_megatron(
        "--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --seq-length 128 --swiglu "
        "--vocab-size 1000 --num-layers-per-virtual-pipeline-stage 1 "
        "--pipeline-model-parallel-size 4".split()
    )
    # Megatron: with --swiglu, ffn = int(4h * 2/3 / 64) * 64 = int(10922.67 / 64) * 64 = 170 * 64
    assert tc.model["intermediate_size"] == 10880
    assert tc.model["tie_word_embeddings"] is True and tc.model["attention_bias"] is True
    assert tc.plan["vpp"] == 2 and tc.plan["dtype"] == "fp32"


def test_megatron_moe_gqa_launcher_world():
    argv = shlex.split(
        "torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py --num-layers 32 --hidden-size 4096 "
        "--ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --seq-length 4096 --swiglu --normalization RMSNorm --num-experts 8 "
        "--moe-router-topk 2 --expert-model-parallel-size 8 --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --context-parallel-size 2 --vocab-size 32000 "
        "--recompute-granularity selective --use-distributed-optimizer --bf16 --overlap-grad-reduce "
        "--disable-bias-linear --moe-token-dispatcher-type alltoall"
    )
    tc = read_megatron(argv)
    a = arch_from_hf_config(tc.model, "m")
    assert (a.experts, a.top_k, a.kv_heads, a.expert_ffn) == (8, 2, 8, 14336)
    # 32 GPUs / (tp 2 x pp 2 x cp 2) = dp 4; EP is carved out of dp x cp in Megatron
    assert tc.plan["dp"] == 4 and tc.plan["ep"] == 8 and tc.plan["cp"] == 2
    assert tc.plan["recompute"] == "selective" and tc.plan["dist_opt"] is True and tc.warnings == []


def test_megatron_uneven_pipeline():
    tc = read_megatron(
        "--num-layers 30 --hidden-size 256 --num-attention-heads 4 --seq-length 64 "
        "--vocab-size 100 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 6 "
        "--decoder-last-pipeline-num-layers 6".split()
    )
    assert tc.plan["pp_layout"] == [6, 9, 9, 6]


@pytest.mark.parametrize(
    "argv,match",
    [
        ("--hidden-size 64 --num-attention-heads 4 --seq-length 8 --vocab-size 10", "--num-layers"),
        (
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
            "--vocab-size 10 --bf16 --fp16",
            "choose one",
        ),
        ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8", "vocabulary"),
        (
            "--num-layers 2 --hidden-size 66 --num-attention-heads 4 --seq-length 8 --vocab-size 10",
            "divisible",
        ),
        (
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 --vocab-size 10 "
            "--recompute-granularity full",
            "recompute-method",
        ),
        (
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 --vocab-size 10 "
            "--recompute-activations --recompute-granularity full --recompute-method block",
            "contradicts",
        ),
        (
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 --vocab-size 10 "
            "--tensor-model-parallel-size 2 --world-size 3",
            "divisible",
        ),
        (
            "--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 8 --vocab-size 10 "
            "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
            "divisible",
        ),
        (
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
            "--vocab-size 10 --num-experts 4",
            "Llama-style",
        ),
        ("stray --num-layers 2", "does not follow"),
    ],
)
def test_megatron_bad_inputs(argv, match):
    with pytest.raises(UserError, match=match):
        read_megatron(argv.split())


TITAN_8B = """
[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true

[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "./assets/tokenizer/original/tokenizer.model"

[optimizer]
name = "AdamW"
lr = 3e-4

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0
steps = 1000
compile = false

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable_checkpoint = false

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def test_torchtitan_llama3_8b(tmp_path):
    f = tmp_path / "llama3_8b.toml"
    f.write_text(TITAN_8B)
    tc = read_torchtitan(str(f))
    assert tc.model == "llama3-8b"
    p = tc.plan
    assert (p["seq_len"], p["micro_batch"], p["microbatches"]) == (8192, 1, 1)
    assert p["fsdp"] is True and p["recompute"] == "selective" and p["dtype"] == "bf16"
    assert p["convention"] == "torchtitan" and tc.dp_unknown and "dp" not in p


@pytest.mark.parametrize("on", [True, False])
def test_torchtitan_training_compile_is_read_not_called_ignored(tmp_path, on):
    # older job configs' `[training] compile`: applied (the layers compiled), yet it was
    # warned about as "not known to pipemem; ignored"
    f = tmp_path / "t.toml"
    assert "\ncompile = false\n" in TITAN_8B
    f.write_text(TITAN_8B.replace("\ncompile = false\n", f"\ncompile = {str(on).lower()}\n"))
    tc = read_torchtitan(str(f))
    assert not any("compile" in w for w in tc.warnings), tc.warnings
    assert tc.plan.get("compile") == ("layers" if on else None)


def test_torchtitan_pipeline(tmp_path):
    text = TITAN_8B.replace('flavor = "8B"', 'flavor = "70B"').replace(
        "local_batch_size = 1", "local_batch_size = 8"
    )
    text = text.replace(
        "pipeline_parallel_degree = 1",
        "pipeline_parallel_degree = 4\n"
        'pipeline_parallel_schedule = "Interleaved1F1B"\npipeline_parallel_microbatch_size = 2',
    )
    text = text.replace("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 2")
    text = text.replace('mode = "selective"', 'mode = "full"')
    f = tmp_path / "t.toml"
    f.write_text(text)
    tc = read_torchtitan(str(f))
    p = tc.plan
    assert tc.model == "llama3-70b" and p["pp"] == 4 and p["micro_batch"] == 2 and p["microbatches"] == 4
    assert p["vpp"] == 2 and p["dp"] == 2 and p["recompute"] == "full" and p["schedule"] == "Interleaved1F1B"


@pytest.mark.parametrize(
    "text,match",
    [
        ("[model\nname=", "not valid TOML"),
        ('[model]\nname = "llama3"\nflavor = "7B"', "not known"),
        ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nseq_len = -5', "positive integer"),
        ('[model]\nname = "llama3"\nflavor = "8B"\n[activation_checkpoint]\nmode = "sometimes"', "mode"),
        (
            '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nmixed_precision_param = "int4"',
            "mixed_precision",
        ),
        ("model = 3", "must be a table"),
        ('{"model": {"name": "llama3", "flavor": "8B"}}', "looks like JSON: a torchtitan job config is TOML"),
    ],
)
def test_torchtitan_bad_inputs(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(UserError, match=match):
        read_torchtitan(str(f))


def test_torchtitan_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_torchtitan(str(tmp_path / "none.toml"))


def test_paddlenlp_recompute_allgather_and_vpp():
    tc = read_paddlenlp(
        [
            "--model_name_or_path",
            "llama2-13b",
            "--tensor_parallel_degree",
            "4",
            "--sequence_parallel",
            "1",
            "--tensor_parallel_config",
            "enable_mp_async_allreduce recompute_allgather",
            "--pipeline_parallel_degree",
            "2",
            "--virtual_pp_degree",
            "2",
            "--pipeline_schedule_mode",
            "VPP",
            "--bf16",
            "true",
        ]
    )
    p = tc.plan
    assert p["recompute_allgather"] is True and p["sp"] is True and p["vpp"] == 2 and p["schedule"] == "VPP"
    assert "recompute_allgather" not in read_paddlenlp(["--model_name_or_path", "x"]).plan


def test_readers_unpack_as_model_plan_warnings():
    model, plan, warnings = read_paddlenlp(seed_tokens())
    assert model == "facebook/llama-7b" and plan["pp"] == 4 and warnings == []


def test_paddlenlp_sharding_group_is_sharding_degree_only():
    """dp 2 x sharding 2 on 4 GPUs: the batch is split 4 ways, the ZeRO states 2 ways (PaddleNLP's
    sharding group), so each card holds half the optimizer states, not a quarter."""
    from pipemem import estimate

    argv = [
        "--model_name_or_path",
        "facebook/llama-7b",
        "--max_seq_length",
        "2048",
        "--bf16",
        "1",
        "--fp16_opt_level",
        "O2",
        "--sharding_parallel_degree",
        "2",
        "--sharding",
        "stage1",
        "--data_parallel_degree",
        "2",
        "--world_size",
        "4",
        "--num_hidden_layers",
        "4",
    ]
    tc = read_paddlenlp(argv)
    assert tc.plan["dp"] == 4 and tc.plan["zero"] == 1 and tc.plan["extra"]["zero_group"] == 2
    assert not [w for w in tc.warnings if "sharding" in w]
    # The AutoTrainer (run_pretrain_auto.py) shards over the whole [dp x sharding] mesh dimension;
    # the static auto-parallel script (the seed's) over the sharding group, as the fleet trainer.
    auto = read_paddlenlp(["run_pretrain_auto.py"] + argv + ["--enable_auto_parallel", "1"])
    assert auto.plan["zero"] == 1 and auto.plan["dp"] == 4 and "zero_group" not in auto.plan["extra"]
    static = read_paddlenlp(
        ["python", "-u", "llm/auto_parallel/llama/run_pretrain_auto_static.py"]
        + argv
        + ["--enable_auto_parallel", "1"]
    )
    assert static.plan["extra"]["zero_group"] == 2 and not static.warnings
    # Without the script the smaller group (more memory per card), said in a note.
    unnamed = read_paddlenlp(argv + ["--enable_auto_parallel", "1"])
    assert unnamed.plan["extra"]["zero_group"] == 2
    assert [w for w in unnamed.warnings if "run_pretrain_auto.py" in w and "sharding" in w]
    est = estimate(tc.model, **tc.plan)
    unsharded = estimate(tc.model, **{**tc.plan, "zero": 0, "extra": {}})
    over4 = estimate(
        tc.model, **{**tc.plan, "extra": {k: v for k, v in tc.plan["extra"].items() if k != "zero_group"}}
    )
    opt = est.ranks[0].static.optimizer
    assert opt == -(-unsharded.ranks[0].static.optimizer // 2)  # (ceil per shard, one pipeline rank)
    assert opt > over4.ranks[0].static.optimizer


def test_paddlenlp_unknown_id_read_from_paddlenlp_cache(tmp_path, monkeypatch):
    cfg = load_model_config("llama2-7b")[1]
    d = tmp_path / "models" / "my-org" / "my-llama"
    d.mkdir(parents=True)
    import json

    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 6}))
    monkeypatch.setenv("PPNLP_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    tc = read_paddlenlp(["--model_name_or_path", "my-org/my-llama"])
    assert tc.model == str(d / "config.json") and tc.model_name == "my-org/my-llama"
    assert arch_from_hf_config(load_model_config(tc.model)[1]).layers == 6
    # An id found nowhere is left as given (estimate's --model error lists the presets).
    assert read_paddlenlp(["--model_name_or_path", "nobody/nothing"]).model == "nobody/nothing"


def test_paddlenlp_unknown_id_read_from_hf_hub_cache(tmp_path, monkeypatch):
    import json

    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(load_model_config("llama3.2-1b")[1]))
    monkeypatch.setenv("PPNLP_HOME", str(tmp_path / "none"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tc = read_paddlenlp(["--model_name_or_path", "acme/tiny"])
    assert tc.model == str(snap / "config.json")


def test_paddlenlp_defaults_are_paddlenlps():
    """sequence_parallel off unless given; LlamaConfig's unfused norm and rope; clipping on."""
    tc = read_paddlenlp(
        ["--model_name_or_path", "facebook/llama-7b", "--tensor_parallel_degree", "2", "--world_size", "2"]
    )
    assert tc.plan["sp"] is False
    ex = tc.plan["extra"]
    assert ex["fused_norm"] is False and ex["fused_rope"] is False and ex["grad_clip"] is True
    tc = read_paddlenlp(
        [
            "--model_name_or_path",
            "facebook/llama-7b",
            "--sequence_parallel",
            "1",
            "--use_fused_rms_norm",
            "1",
            "--max_grad_norm",
            "0",
            "--enable_auto_parallel",
            "1",
        ]
    )
    ex = tc.plan["extra"]
    assert tc.plan["sp"] is True and ex["fused_norm"] is True and ex["grad_clip"] is False
    assert ex["full_vocab_loss"] is True
    with pytest.raises(UserError, match="max_grad_norm"):
        read_paddlenlp(["--model_name_or_path", "x", "--max_grad_norm", "big"])


def test_paddle_optimizer_step_holds_a_clipped_copy_of_the_gradients():
    from pipemem import estimate

    base = [
        "--model_name_or_path",
        "facebook/llama-7b",
        "--num_hidden_layers",
        "4",
        "--fp16",
        "0",
        "--pipeline_parallel_degree",
        "2",
        "--gradient_accumulation_steps",
        "4",
        "--world_size",
        "2",
    ]
    on = read_paddlenlp(base)
    off = read_paddlenlp(base + ["--max_grad_norm", "0"])
    for r_on, r_off in zip(estimate(on.model, **on.plan).ranks, estimate(off.model, **off.plan).ranks):
        assert r_on.jobs["optimizer"].peak_bytes == r_on.static.grads
        assert r_off.jobs["optimizer"].peak_bytes == 0


def test_torchtitan_compile_and_float8(tmp_path):
    f = tmp_path / "fp8.toml"
    text = (
        TITAN_8B + '\n[compile]\nenable = true\ncomponents = ["model"]\n'
        "[float8]\nenable_fsdp_float8_all_gather = true\n"
    ).replace('flavor = "8B"', 'flavor = "8B"\nconverters = ["float8"]')
    f.write_text(text)
    p = read_torchtitan(str(f)).plan
    assert (p["compile"], p["fp8"], p["fp8_param_gather"]) == ("layers", "tensorwise", True)
    f.write_text(text.replace('converters = ["float8"]', 'converters = ["mx"]'))
    with pytest.raises(UserError, match="converters 'mx' is not modelled"):
        read_torchtitan(str(f))


# torchtitan 0.3: the tables of Trainer.Config.to_dict() ----------------------------------------
TITAN_03 = """
[model_spec]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 2
seq_len = 4096
dtype = "float32"
mixed_precision_param = "bfloat16"
mixed_precision_reduce = "float32"
disable_cuda_graphs = true
enable_cpu_offload = false

[parallelism]
data_parallel_shard_degree = 4
tensor_parallel_degree = 2
enable_sequence_parallel = true
pipeline_parallel_degree = 2
pipeline_parallel_microbatch_size = 1
fsdp_reshard_after_forward = "default"
enable_fsdp_symm_mem = false

[activation_checkpoint]
mode = "full"
preserve_rng_state = true

[compile]
enable = false

[optimizer]
implementation = "foreach"

[[optimizer.param_groups]]
pattern = ".*"
optimizer_name = "AdamW"

[loss]
num_chunks = 8
"""


def test_torchtitan_03_tables(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text(TITAN_03)
    tc = read_torchtitan(str(f))
    p = tc.plan
    assert tc.model == "llama3-8b" and p["dp"] == 4 and p["tp"] == 2 and p["sp"] is True and p["pp"] == 2
    assert (p["micro_batch"], p["microbatches"]) == (1, 2) and p["recompute"] == "full"
    assert p["dtype"] == "bf16" and p["master_weights"] is True and p["main_grad_dtype"] == "fp32"
    assert p["grads"] == "set-to-none" and p["fsdp"] is True
    # pipeline parallel: blocks keep their gathered parameters (torchtitan's "default" policy)
    assert (
        p["extra"] == {"fsdp_reshard_after_forward": False, "loss_chunks": 8}
        and p["optimizer_impl"] == "foreach"
    )
    assert p["_first_less"] == 1 and p["_last_less"] == 1  # torchtitan's default stage split
    from pipemem.configs.torchtitan import finish_plan

    assert finish_plan(p, 32)["pp_layout"] == (16, 16)  # (32 + 2) / 2 = 17, minus one each side
    plan = finish_plan(dict(p, _first_less=2, _last_less=0), 32)
    assert plan["pp_layout"] == (15, 17)


def test_torchtitan_always_reshards_the_output_unit_before_the_loss(tmp_path):
    """torchtitan keeps its [norm, output] FSDP unit unsharded after the forward unless the policy
    is "always" (distributed/fsdp.py); then the unit reshards when the model's forward returns,
    before the loss runs (FSDP2's post-forward hook), and the forward peak at the loss drops by
    the output layer's gathered weight and its all-gather buffer."""
    from pipemem.estimate import estimate

    text = (
        TITAN_03.replace("pipeline_parallel_degree = 2", "pipeline_parallel_degree = 1")
        .replace("tensor_parallel_degree = 2", "tensor_parallel_degree = 1")
        .replace("num_chunks = 8", "num_chunks = 1")
        .replace('mode = "full"', 'mode = "none"')
    )
    runs = {}
    for policy in ("default", "always"):
        f = tmp_path / f"{policy}.toml"
        f.write_text(
            text.replace('fsdp_reshard_after_forward = "default"', f'fsdp_reshard_after_forward = "{policy}"')
        )
        tc = read_torchtitan(str(f))
        runs[policy] = (tc.plan, estimate(tc.model, **tc.plan).ranks[0].jobs["F"].peak_bytes)
    assert runs["always"][0]["extra"].get("fsdp_reshard_head") is True
    assert "fsdp_reshard_head" not in runs["default"][0]["extra"]
    vocab, hidden = 128256, 4096
    # the unit's unsharded bf16 weights (output layer and final norm) and FSDP2's all-gather
    # output buffer of the same size
    assert runs["default"][1] - runs["always"][1] == 2 * (vocab * hidden + hidden) * 2


@pytest.mark.parametrize(
    "edit,match",
    [
        (("enable_cpu_offload = false", "enable_cpu_offload = true"), "enable_cpu_offload"),
        (("enable_fsdp_symm_mem = false", "enable_fsdp_symm_mem = true"), "enable_fsdp_symm_mem"),
        (("[loss]", '[mx]\nrecipe_name = "mxfp8"\n[loss]'), r"\[mx\]"),
        (('mode = "full"', 'mode = "memory_budget"'), "memory_budget"),
        (
            (
                "data_parallel_shard_degree = 4",
                "data_parallel_shard_degree = 4\ndata_parallel_replicate_degree = 2",
            ),
            "replicate",
        ),
        (('optimizer_name = "AdamW"', 'optimizer_name = "Muon"'), "Muon"),
        (("[model_spec]", '[model]\nconverters = ["mx"]\n[model_spec]'), "converters 'mx'"),
    ],
)
def test_torchtitan_03_refusals(tmp_path, edit, match):
    f = tmp_path / "job.toml"
    f.write_text(TITAN_03.replace(*edit))
    with pytest.raises(UserError, match=match):
        read_torchtitan(str(f))


def test_torchtitan_03_compile_and_float8_are_read(tmp_path):
    """torch.compile and torchao Float8 are modelled (pipemem.features): read, not refused."""
    f = tmp_path / "job.toml"
    text = TITAN_03.replace("enable = false", "enable = true")
    text = text.replace("[model_spec]", '[model]\nconverters = ["float8"]\n[model_spec]')
    text = text.replace("[loss]", "[float8]\nenable_fsdp_float8_all_gather = true\n[loss]")
    f.write_text(text)
    p = read_torchtitan(str(f)).plan
    assert p["compile"] in ("layers", "all") and p["fp8"] == "tensorwise" and p["fp8_param_gather"] is True


def test_torchtitan_03_precision(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text(TITAN_03.replace('dtype = "float32"', 'dtype = "bfloat16"'))
    p = read_torchtitan(str(f)).plan  # parameters stored in bf16: pure bf16 training
    assert p["dtype"] == "bf16" and p["master_weights"] is False and p["main_grad_dtype"] == "bf16"
    f.write_text(
        TITAN_03.replace('mixed_precision_reduce = "float32"', 'mixed_precision_reduce = "bfloat16"')
    )
    assert read_torchtitan(str(f)).plan["main_grad_dtype"] == "bf16"


def test_args_ints_into_sets_the_given_flags_only():
    from pipemem.configs.argv import parse

    a = parse(["train.py", "--ep", "4", "--vpp", "2", "--bad", "x"], "tool")
    plan = {"ep": 1}
    a.ints_into(plan, ep="ep", vpp="vpp", layers="num_layers")
    assert plan == {"ep": 4, "vpp": 2}  # a flag left out sets nothing
    assert {"ep", "vpp", "num_layers"} <= a.used
    with pytest.raises(UserError, match=r"tool argument --bad 'x': expected an integer"):
        a.ints_into(plan, layers="bad")


def test_megatron_and_paddlenlp_read_the_integer_flags_they_are_given():
    megatron = (
        "pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 3 --global-batch-size 48 --num-experts 4 "
        "--swiglu --normalization RMSNorm --disable-bias-linear --bf16 --vocab-size 1000 "
    )
    mg = read_megatron(
        shlex.split(megatron + "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall")
    )
    assert (mg.plan["micro_batch"], mg.plan["global_batch"], mg.plan["ep"]) == (3, 48, 2)
    # the dispatcher check reads the ep given: allgather is refused with ep 2, read without ep
    with pytest.raises(UserError, match="moe-token-dispatcher-type"):
        read_megatron(shlex.split(megatron + "--expert-model-parallel-size 2"))
    assert "ep" not in read_megatron(shlex.split(megatron)).plan
    assert "etp" not in mg.plan
    pn = read_paddlenlp(
        shlex.split(
            "run_pretrain.py --model_name_or_path facebook/llama-7b --num_hidden_layers 6 "
            "--max_seq_length 512 --per_device_train_batch_size 2 --pipeline_parallel_degree 2 "
            "--virtual_pp_degree 3 --gradient_accumulation_steps 4 --global_batch_size 8"
        )
    )
    assert (pn.plan["layers"], pn.plan["seq_len"], pn.plan["micro_batch"], pn.plan["vpp"]) == (6, 512, 2, 3)
    with pytest.raises(UserError, match="per_device_train_batch_size 2 x data parallel 1 = 8"):
        read_paddlenlp(
            shlex.split(
                "run_pretrain.py --model_name_or_path facebook/llama-7b --per_device_train_batch_size 2 "
                "--gradient_accumulation_steps 4 --global_batch_size 12"
            )
        )
