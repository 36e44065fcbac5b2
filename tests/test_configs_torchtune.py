"""--from-torchtune: torchtune recipe configs (YAML) -> plan, and the torchtune convention's
refusals. The configs are written here in torchtune's format; when torchtune is installed its
own shipped configs are read too."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("yaml")

import pipemem  # noqa: E402
from pipemem.configs.torchtune import BUILDERS, builder_config, from_dict, read  # noqa: E402
from pipemem.errors import UserError  # noqa: E402
from pipemem.estimate import estimate  # noqa: E402

SINGLE = """\
model:
  _component_: torchtune.models.llama3_2.llama3_2_3b
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  max_seq_len: 4096
dataset:
  _component_: torchtune.datasets.alpaca_dataset
  packed: True
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  lr: 2e-5
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
gradient_accumulation_steps: 1
optimizer_in_bwd: False
compile: True
enable_activation_checkpointing: True
enable_activation_offloading: False
dtype: bf16
log_peak_memory_stats: True
"""


def _write(tmp_path, text, name="3B_full_single_device.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_single_device_config_is_read_key_by_key(tmp_path):
    tool = read(_write(tmp_path, SINGLE))
    assert tool.model == "llama3.2-3b" and not tool.dp_unknown
    assert [w for w in tool.warnings if "names no recipe" not in w] == []
    assert tool.plan == {
        "convention": "torchtune",
        "micro_batch": 2,
        "seq_len": 4096,
        "dtype": "bf16",
        "optimizer": "adamw",
        "optimizer_impl": "fused",
        "loss": "chunked",
        "loss_chunks": 8,
        "compile": "all",
        "recompute": "full",
    }
    est = estimate(tool.model, **tool.plan)
    assert est.ranks[0].peak_allocated_bytes > 0


def test_options_that_change_memory(tmp_path):
    text = (
        SINGLE.replace("fused: True", "lr: 1e-5")
        .replace("optimizer_in_bwd: False", "optimizer_in_bwd: True")
        .replace("enable_activation_offloading: False", "enable_activation_offloading: True")
        .replace("compile: True", "compile:\n  model: True\n  loss: False")
    )
    tool = read(_write(tmp_path, text))
    assert tool.plan["optimizer_impl"] == "foreach"  # torch.optim.AdamW without fused=True
    assert tool.plan["optimizer_in_backward"] and tool.plan["activation_offload"] == "all"
    assert tool.plan["compile"] == "layers"
    paged = read(_write(tmp_path, SINGLE.replace("torch.optim.AdamW", "bitsandbytes.optim.PagedAdamW8bit")))
    assert paged.plan["optimizer"] == "adam8bit" and "optimizer_impl" not in paged.plan
    assert any("paging not modelled" in w for w in paged.warnings)
    unknown = read(_write(tmp_path, SINGLE + "my_new_switch: 3\n"))
    assert any("my_new_switch" in w for w in unknown.warnings)


def test_distributed_config_shards_with_fsdp_over_dp(tmp_path):
    tool = read(_write(tmp_path, SINGLE, "3B_full.yaml"))
    # no recipe named in the file: taken from its name, with a note
    assert tool.plan["fsdp"] is True and tool.dp_unknown and len(tool.warnings) == 1
    assert "names no recipe" in tool.warnings[0] and "full_finetune_distributed" in tool.warnings[0]
    assert "custom_sharded_layers" not in tool.plan.get("extra", {})  # FSDP2's root unit: modelled
    given = read(
        _write(
            tmp_path,
            SINGLE + "data_parallel_shard_dim: 4\ncustom_sharded_layers: ['tok_embeddings', 'output']\n",
            "8B_full.yaml",
        )
    )
    assert given.plan["dp"] == 4 and not given.dp_unknown and given.warnings == []
    assert given.plan["extra"] == {"custom_sharded_layers": ["output", "tok_embeddings"]}
    with pytest.raises(UserError, match="names output but not tok_embeddings"):
        read(_write(tmp_path, SINGLE + "custom_sharded_layers: ['output']\n", "8B_full.yaml"))
    one = estimate(tool.model, **dict(tool.plan, dp=1)).ranks[0].static.total
    eight = estimate(tool.model, **dict(tool.plan, dp=8)).ranks[0].static.total
    assert eight < one / 4  # params, grads and states sharded 8 ways


@pytest.mark.parametrize(
    "edit, words",
    [
        # a LoRA builder without its adapters' modules (lora_llama3_2_3b's required argument)
        (("llama3_2_3b", "lora_llama3_2_3b"), "model.lora_attn_modules"),
        (("llama3_2.llama3_2_3b", "gemma.gemma_2b"), "not modelled under the torchtune convention"),
        (("dtype: bf16", "dtype: fp16"), "bf16 or fp32"),
        (("torch.optim.AdamW", "torch.optim.Adagrad"), "not modelled"),
        (
            (
                "enable_activation_checkpointing: True",
                "enable_activation_checkpointing: True\nac_mode: selective",
            ),
            "selective",
        ),
        (
            (
                "dtype: bf16",
                "dtype: bf16\nquantizer:\n  _component_: torchtune.training.quantization.Int8Quantizer",
            ),
            "quantization-aware",
        ),
        (("dtype: bf16", "dtype: bf16\nfsdp_cpu_offload: True"), "CPU offloading"),
        (("batch_size: 2", "batch_size: 0"), "positive integer"),
    ],
)
def test_refusals_name_the_key(tmp_path, edit, words):
    with pytest.raises(UserError, match=words):
        read(_write(tmp_path, SINGLE.replace(*edit)))


def test_cli_errors_exit_2_with_one_line(tmp_path):
    null_seq = _write(
        tmp_path, SINGLE.replace("max_seq_len: 4096", "max_seq_len: null"), "null_single_device.yaml"
    )
    for args, words in (
        (["--from-torchtune", null_seq], "--seq-len"),
        (["--from-torchtune", _write(tmp_path, SINGLE), "--dp", "8"], "single-device"),
        (["--from-torchtune", str(tmp_path / "missing.yaml")], "no such file"),
        (["--from-torchtune", _write(tmp_path, "model: [", "bad.yaml")], "not valid YAML"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "pipemem", "estimate", *args], capture_output=True, text=True
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr, r.stderr
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipemem",
            "estimate",
            "--gpu",
            "a100-80g",
            "--from-torchtune",
            null_seq,
            "--seq-len",
            "2048",
        ],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "FITS" in ok.stdout, ok.stderr


@pytest.mark.parametrize(
    "plan, words",
    [
        ({"tp": 2}, "--tp 2"),
        ({"pp": 2}, "--pp 2"),
        ({"dtype": "fp16"}, "fp16"),
        ({"flash_attn": False}, "--no-flash-attn"),
        ({"dp": 4}, "--fsdp"),
        ({"recompute": "selective"}, "--recompute selective"),
        ({"recompute": "full", "recompute_layers": 4}, "--recompute-layers"),
    ],
)
def test_torchtune_convention_refuses_what_it_does_not_model(plan, words):
    with pytest.raises(UserError, match=words):
        estimate("llama3.2-3b", convention="torchtune", **plan)
    with pytest.raises(UserError, match="mixture-of-experts"):
        estimate("qwen3-30b-a3b", convention="torchtune")


def test_torchtune_trains_without_master_weights():
    est = estimate("llama3.2-3b", convention="torchtune", dtype="bf16")
    assert est.plan.master_weights is False and est.plan.main_grad_dtype == "bf16"


@pytest.mark.skipif(importlib.util.find_spec("torchtune") is None, reason="torchtune not installed")
def test_torchtunes_shipped_configs():
    # the configs torchtune 0.6.1 installs: every full-finetune config of a model with a preset
    # reads into a plan pipemem estimates, or is refused by name
    root = (
        Path(importlib.util.find_spec("torchtune").submodule_search_locations[0]).parent
        / "recipes"
        / "configs"
    )
    if not root.is_dir():
        pytest.skip("torchtune's recipe configs are not installed")
    read_ok = 0
    for path in sorted(root.glob("*/*full*.yaml")):
        try:
            tool = read(str(path))
        except UserError as e:
            assert str(path) in str(e)
            continue
        plan = dict(
            tool.plan, seq_len=tool.plan.get("seq_len", 2048), **({"dp": 8} if tool.dp_unknown else {})
        )
        assert estimate(tool.model, **plan).ranks[0].peak_allocated_bytes > 0
        read_ok += 1
    assert read_ok >= 10


def test_from_dict_needs_a_model():
    with pytest.raises(UserError, match="model._component_"):
        from_dict({"model": {}}, "x.yaml")


TORCHTUNE = importlib.util.find_spec("torchtune") is not None


@pytest.mark.skipif(not TORCHTUNE, reason="torchtune not installed")
def test_builders_read_from_torchtunes_source_match_the_presets():
    # torchtune's builder source, read without importing torchtune, gives the shapes of the
    # presets the reader maps the same builders to
    from pipemem.estimate import resolve_model

    families = sorted(
        {"llama2", "llama3", "llama3_1", "llama3_2", "llama3_3", "mistral", "qwen2_5"}, key=len, reverse=True
    )
    compared = 0
    for name, preset in BUILDERS.items():
        family = next(f for f in families if name.startswith(f + "_"))
        cfg = builder_config(f"torchtune.models.{family}.{name}")
        if cfg is None:  # e.g. llama2_7b: its FFN width is computed by the component builder
            continue
        _, _, want = resolve_model(preset)
        for key in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "tie_word_embeddings",
        ):
            assert cfg[key] == want.get(key, False if key == "tie_word_embeddings" else None), (name, key)
        compared += 1
    assert compared >= 12


@pytest.mark.skipif(not TORCHTUNE, reason="torchtune not installed")
def test_a_builder_without_a_preset_is_read_from_torchtune(tmp_path):
    tool = read(_write(tmp_path, SINGLE.replace("llama3_2.llama3_2_3b", "qwen2_5.qwen2_5_3b")))
    assert isinstance(tool.model, dict) and tool.model["model_type"] == "qwen2"
    assert tool.model["num_hidden_layers"] == 36 and tool.model["tie_word_embeddings"] is True
    assert estimate(tool.model, **tool.plan).ranks[0].peak_allocated_bytes > 0


# torchtune 0.6.1 recipes/configs/llama3_2/3B_full.yaml and 3B_full_single_device.yaml, as installed
TUNE_DATA = Path(__file__).parent / "data" / "torchtune"


@pytest.mark.parametrize(
    "shipped,distributed", [("3B_full.yaml", True), ("3B_full_single_device.yaml", False)]
)
def test_recipe_is_read_from_the_config_not_its_file_name(tmp_path, shipped, distributed):
    """`tune cp llama3_2/3B_full my_3b.yaml`: the copy keeps torchtune's header, which names the
    recipe (full_finetune_distributed / full_finetune_single_device), whatever the file is called."""
    mine = tmp_path / "my_3b.yaml"
    mine.write_text((TUNE_DATA / shipped).read_text())
    tool = read(str(mine))
    assert bool(tool.plan.get("fsdp")) is distributed
    assert not [w for w in tool.warnings if "names no recipe" in w]
    assert tool.plan == read(str(TUNE_DATA / shipped)).plan


def test_tune_run_line_decides_and_gives_the_world(tmp_path, capsys):
    """The launch line of 3B_full.yaml's header, with the config copied and overrides."""
    mine = tmp_path / "my_8b.yaml"
    mine.write_text((TUNE_DATA / "3B_full.yaml").read_text())
    line = [
        "tune",
        "run",
        "--nproc_per_node",
        "4",
        "full_finetune_distributed",
        "--config",
        str(mine),
        "batch_size=2",
        "tokenizer.max_seq_len=2048",
    ]
    from pipemem.configs.torchtune import read_tune_run

    tool = read_tune_run(line)
    assert tool.plan["fsdp"] is True and tool.plan["dp"] == 4 and tool.plan["micro_batch"] == 2
    assert tool.plan["seq_len"] == 2048 and not tool.dp_unknown
    import json

    from pipemem.cli.main import main

    assert main(["estimate", "--json", "--from-torchtune", "-", "--"] + line) == 0
    via_line = json.loads(capsys.readouterr().out)["max_peak_allocated_bytes"]
    assert via_line == estimate(tool.model, **tool.plan).max_peak_allocated_bytes
    with pytest.raises(UserError, match="runs on one device"):
        read_tune_run(
            ["tune", "run", "--nproc_per_node", "4", "full_finetune_single_device", "--config", str(mine)]
        )
    with pytest.raises(UserError, match="recipe knowledge_distillation_distributed: not modelled"):
        read_tune_run(["tune", "run", "knowledge_distillation_distributed", "--config", str(mine)])


# torchtune 0.6.1's own LoRA / QLoRA recipe configs (pytorch/torchtune recipes/configs/llama3_1/
# 8B_lora_single_device.yaml, 8B_qlora_single_device.yaml, 8B_lora.yaml; copied unchanged)
TT = Path(__file__).parent / "data" / "torchtune"


@pytest.mark.parametrize(
    "name, qlora, distributed",
    [
        ("8B_lora_single_device", False, False),
        ("8B_qlora_single_device", True, False),
        ("8B_lora", False, True),
    ],
)
def test_lora_recipe_configs_are_read(name, qlora, distributed):
    tool = read(str(TT / f"{name}.yaml"))
    p = tool.plan
    assert tool.model == "llama3-8b" and tool.warnings == []
    # lora_attn_modules ['q_proj', 'v_proj', 'output_proj'] + apply_lora_to_mlp (w1, w2, w3)
    assert (p["lora_rank"], p["lora_targets"]) == (8, "q_proj,v_proj,output_proj,w1,w2,w3")
    assert p.get("qlora", False) is qlora and p.get("fsdp", False) is distributed
    plan = dict(p, seq_len=2048, layers=2, **({"dp": 2} if distributed else {}))
    est = estimate(tool.model, **plan)
    assert est.to_dict()["plan"]["lora_targets"] == "q,v,o,gate,up,down"
    full = estimate(tool.model, **{k: v for k, v in plan.items() if not k.startswith(("lora", "qlora"))})
    assert est.ranks[0].static.optimizer < full.ranks[0].static.optimizer / 100


@pytest.mark.parametrize(
    "model_edit, words",
    [("  apply_lora_to_output: True\n", "apply_lora_to_output"), ("  use_dora: True\n", "use_dora")],
)
def test_lora_builder_refusals(tmp_path, model_edit, words):
    text = (TT / "8B_lora_single_device.yaml").read_text()
    text = text.replace("  apply_lora_to_output: False\n", "").replace("  lora_dropout: 0.0\n", model_edit)
    with pytest.raises(UserError, match=words):
        read(_write(tmp_path, text, "8B_lora_single_device.yaml"))


def test_lora_dropout_and_qlora_builder_argument(tmp_path):
    text = (TT / "8B_lora_single_device.yaml").read_text()
    text = text.replace("  lora_dropout: 0.0\n", "  lora_dropout: 0.05\n  quantize_base: True\n")
    p = read(_write(tmp_path, text, "8B_lora_single_device.yaml")).plan
    assert p["lora_dropout"] == 0.05 and p["qlora"] is True


def test_lora_tune_run_line_equals_the_file(capsys):
    import json

    from pipemem.cli.main import main

    line = [
        "tune",
        "run",
        "--nproc_per_node",
        "2",
        "lora_finetune_distributed",
        "--config",
        str(TT / "8B_lora.yaml"),
    ]
    flags = ["--seq-len", "1024", "--layers", "2"]
    assert main(["estimate", "--json", *flags, "--from-torchtune", "-", "--", *line]) == 0
    cli = json.loads(capsys.readouterr().out)["max_peak_allocated_bytes"]
    model, plan = pipemem.read_config("torchtune", line, seq_len=1024, layers=2)
    assert plan["dp"] == 2 and plan["lora_rank"] == 8
    assert estimate(model, **plan).max_peak_allocated_bytes == cli
