"""LLaMA-Factory train YAMLs (--from-llamafactory, read_config("llamafactory")), read as LLaMA-Factory
0.9 reads them. The three files under tests/data/llamafactory/ are copied unchanged from
hiyouga/LLaMA-Factory: examples/train_lora/llama3_lora_sft.yaml,
examples/train_qlora/llama3_lora_sft_otfq.yaml, examples/train_full/llama3_full_sft.yaml (with
examples/deepspeed/ds_z3_config.json); tests/data/llamafactory/SOURCES.md names them."""

import json
from pathlib import Path

import pytest
import yaml

import pipemem
from pipemem.cli.main import main
from pipemem.configs.llamafactory import read, read_dict
from pipemem.errors import UserError

DATA = Path(__file__).parent / "data" / "llamafactory"
LORA = DATA / "llama3_lora_sft.yaml"
QLORA = DATA / "llama3_lora_sft_otfq.yaml"
FULL = DATA / "llama3_full_sft.yaml"
SMALL = {"layers": 2}  # a 2-layer Llama 3 8B: the same plan, a quick estimate


def base():
    return yaml.safe_load(LORA.read_text())


def test_lora_example_is_read_as_llamafactory_reads_it():
    tc = read(str(LORA))
    p = tc.plan
    assert tc.model == "meta-llama/Meta-Llama-3-8B-Instruct" and tc.tool == "LLaMA-Factory"
    assert (p["seq_len"], p["micro_batch"], p["microbatches"]) == (2048, 1, 8)
    assert (p["lora_rank"], p["lora_targets"]) == (8, "all")
    assert p["recompute"] == "full"  # LLaMA-Factory checkpoints unless disable_gradient_checkpointing
    assert p["dtype"] == "bf16" and "qlora" not in p
    assert tc.dp_unknown  # the launcher gives the world size


def test_qlora_example_quantizes_the_base():
    tc = read(str(QLORA))
    assert tc.plan["qlora"] is True and tc.plan["lora_rank"] == 8  # LLaMA-Factory's default rank
    q = pipemem.estimate(tc.model, **{**tc.plan, **SMALL})
    lo = pipemem.estimate(tc.model, **{**read(str(LORA)).plan, **SMALL})
    # Llama 3 8B's layer linears (q, o 4096^2; k, v 1024 x 4096; gate, up, down 14336 x 4096) go
    # from 2 bytes to about half a byte per weight in each of the 2 layers
    linear = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
    saved = lo.ranks[0].static.params - q.ranks[0].static.params
    assert 0.7 * 2 * 2 * linear < saved < 0.8 * 2 * 2 * linear


def test_full_example_runs_deepspeed_zero3():
    tc = read(str(FULL))
    p = tc.plan
    assert p["zero"] == 3 and "lora_rank" not in p and p["recompute"] == "full"


@pytest.mark.parametrize(
    "key, value, field, expected",
    [
        ("cutoff_len", 4096, "seq_len", 4096),
        ("per_device_train_batch_size", 4, "micro_batch", 4),
        ("gradient_accumulation_steps", 16, "microbatches", 16),
        ("lora_rank", 64, "lora_rank", 64),
        ("lora_target", "q_proj,v_proj", "lora_targets", "q_proj,v_proj"),
        ("lora_dropout", 0.05, "lora_dropout", 0.05),
        ("disable_gradient_checkpointing", True, "recompute", None),
        ("flash_attn", "disabled", "flash_attn", False),
        ("enable_liger_kernel", True, "loss", "fused_linear"),
        ("optim", "adamw_bnb_8bit", "optimizer", "adam8bit"),
    ],
)
def test_each_key_that_moves_memory_is_honoured(key, value, field, expected):
    cfg = base()
    cfg[key] = value
    p = read_dict(cfg).plan
    assert p.get(field) == expected
    # and it moves the estimate (or, for lora_target / rank, the adapters' bytes)
    a = pipemem.estimate(cfg["model_name_or_path"], **{**read_dict(base()).plan, **SMALL})
    b = pipemem.estimate(cfg["model_name_or_path"], **{**p, **SMALL})
    assert a.to_dict()["ranks"][0] != b.to_dict()["ranks"][0]


def test_pure_bf16_keeps_adapters_in_bf16():
    cfg = base()
    cfg.pop("bf16")
    cfg["pure_bf16"] = True
    p = read_dict(cfg).plan
    assert p["master_weights"] is False and p["extra"]["lora_dtype"] == "model"
    pure = pipemem.estimate(cfg["model_name_or_path"], **{**p, **SMALL}).ranks[0].static
    mixed = pipemem.estimate(cfg["model_name_or_path"], **{**read_dict(base()).plan, **SMALL}).ranks[0].static
    assert 2 * pure.optimizer == mixed.optimizer  # bf16 vs fp32 Adam states of the adapters


@pytest.mark.parametrize(
    "change, match",
    [
        ({"finetuning_type": "freeze"}, "finetuning_type freeze"),
        ({"stage": "dpo"}, "stage dpo"),
        ({"use_dora": True}, "use_dora"),
        ({"use_galore": True}, "use_galore"),
        ({"quantization_bit": 8}, "quantization_bit 8"),
        ({"quantization_bit": 4, "quantization_method": "hqq"}, "hqq"),
        ({"quantization_bit": 4, "finetuning_type": "full"}, "quantization_bit with finetuning_type full"),
        ({"deepspeed": "nowhere/ds.json"}, "deepspeed nowhere/ds.json"),
        ({"flash_attn": "magic"}, "flash_attn magic"),
    ],
)
def test_refused_by_name(change, match):
    cfg = {**base(), **change}
    with pytest.raises(UserError, match=match):
        read_dict(cfg)


def test_unknown_keys_are_named():
    cfg = {**base(), "some_new_switch": 1}
    assert any("some_new_switch" in w for w in read_dict(cfg).warnings)
    assert not any("Trainer arguments not read" in w for w in read(str(LORA)).warnings)


@pytest.mark.parametrize("path", [LORA, QLORA, FULL])
def test_read_config_equals_the_cli(path, capsys):
    model, plan = pipemem.read_config("llamafactory", str(path), dp=2, layers=2)
    api = [r.peak_allocated_bytes for r in pipemem.estimate(model, **plan).ranks]
    assert main(["estimate", "--json", "--dp", "2", "--layers", "2", "--from-llamafactory", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["peak_allocated_bytes"] for r in out["ranks"]] == api


def test_cli_bad_file_is_one_line(capsys):
    assert main(["estimate", "--from-llamafactory", "nowhere.yaml"]) == 2
    err = capsys.readouterr().err
    assert "nowhere.yaml" in err and "Traceback" not in err


def test_defaults_are_llamafactorys():
    """The defaults the reader assumes are LLaMA-Factory's own (its argument dataclasses, loaded
    by path: the package's __init__ imports its datasets stack)."""
    import dataclasses
    import importlib.util

    from pipemem.configs.llamafactory import DEFAULTS

    spec = importlib.util.find_spec("llamafactory")
    if spec is None:
        pytest.skip("llamafactory not installed (pip install --no-deps llamafactory)")
    root = Path(list(spec.submodule_search_locations)[0]) / "hparams"
    found = {}
    for name, cls in (("finetuning_args", "FinetuningArguments"), ("data_args", "DataArguments")):
        s = importlib.util.spec_from_file_location("_lf_" + name, root / f"{name}.py")
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
        found.update({f.name: f.default for f in dataclasses.fields(getattr(mod, cls))})
    assert {k: found[k] for k in DEFAULTS} == DEFAULTS
