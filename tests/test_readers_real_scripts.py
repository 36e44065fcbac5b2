"""Launch lines as real scripts write them: Megatron's GPT examples name GPT-2's vocabulary
file instead of a tokenizer type; PaddleNLP lines name chat / instruct checkpoints."""

import pytest

import pipemem
from pipemem.cli.main import main
from pipemem.configs import read_megatron
from pipemem.errors import UserError
from pipemem.presets import base_model_id, load_model_config

GPT3_EXAMPLE = [
    "torchrun",
    "--nproc_per_node",
    "8",
    "--nnodes",
    "16",
    "pretrain_gpt.py",
    "--num-layers",
    "96",
    "--hidden-size",
    "12288",
    "--num-attention-heads",
    "96",
    "--seq-length",
    "2048",
    "--max-position-embeddings",
    "2048",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1536",
    "--tensor-model-parallel-size",
    "8",
    "--pipeline-model-parallel-size",
    "16",
    "--bf16",
    "--vocab-file",
    "/data/gpt2-vocab.json",
    "--merge-file",
    "/data/gpt2-merges.txt",
]


def test_gpt2_vocab_file_means_gpt2_vocabulary():
    tool = read_megatron(GPT3_EXAMPLE)
    assert tool.model["vocab_size"] == 50257
    assert any("GPT-2" in w for w in tool.warnings)


@pytest.mark.parametrize("path", ["gpt2-vocab.json", "/x/gpt2_vocab.json", "data/gpt2/vocab.json"])
def test_gpt2_vocab_file_names(path):
    argv = [a if a != "/data/gpt2-vocab.json" else path for a in GPT3_EXAMPLE]
    assert read_megatron(argv).model["vocab_size"] == 50257


def test_other_vocab_file_still_needs_a_size():
    argv = [a if a != "/data/gpt2-vocab.json" else "/data/my-vocab.json" for a in GPT3_EXAMPLE]
    with pytest.raises(UserError, match="vocabulary size unknown"):
        read_megatron(argv)


@pytest.mark.parametrize(
    "name,base",
    [
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama3-8b"),
        ("meta-llama/Llama-2-7b-chat-hf", "llama2-7b"),
        ("meta-llama/Llama-2-7b-chat", "llama2-7b"),  # as PaddleNLP launch lines write it
        ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b"),
        ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b"),
    ],
)
def test_fine_tune_ids_resolve_to_the_base_shape_with_a_note(name, base):
    assert base_model_id(name) == base
    display, cfg = load_model_config(name)
    assert display == base and "base model" in cfg["_pipemem_note"]
    e = pipemem.estimate(name)
    assert e.model_name == base and any(base in w and "base model" in w for w in e.warnings)


def test_unknown_ids_are_still_errors():
    assert base_model_id("acme/Unknown-13B-Instruct") is None
    with pytest.raises(UserError, match="not a preset"):
        load_model_config("acme/Unknown-13B-Instruct")


def test_paddlenlp_instruct_line(capsys):
    rc = main(
        [
            "estimate",
            "--from-paddlenlp",
            "--",
            "--model_name_or_path",
            "meta-llama/Meta-Llama-3-8B-Instruct",
            "--per_device_train_batch_size",
            "1",
            "--max_seq_length",
            "2048",
            "--pipeline_parallel_degree",
            "1",
            "--pipeline_schedule_mode",
            "ZBH1",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0 and "llama3-8b" in out and "base model llama3-8b" in err
