"""`--from-hf-trainer`: Hugging Face Trainer launch arguments read into the plan
(pipemem.configs.hf_trainer). Held against transformers' own code where it decides: the optimizer
each `--optim` builds (Trainer.get_optimizer_cls_and_kwargs), TrainingArguments' defaults, and how
the Trainer fills a DeepSpeed config's "auto" (HfTrainerDeepSpeedConfig, the very object it hands
to DeepSpeed)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from test_deepspeed_config import HF_ZERO2, HF_ZERO3

import pipemem
from pipemem.configs.deepspeed import read as read_deepspeed
from pipemem.configs.hf_trainer import DEFAULT_MICRO_BATCH, DEFAULT_OPTIM, OPTIMS, read
from pipemem.errors import UserError

MODEL = "meta-llama/Meta-Llama-3-8B"  # a known hub id: its preset's shapes, nothing downloaded
HIDDEN = 4096


def _line(*extra):
    return [
        "torchrun",
        "--nproc_per_node",
        "8",
        "run_clm.py",
        "--model_name_or_path",
        MODEL,
        "--block_size",
        "2048",
        "--output_dir",
        "out",
        "--do_train",
        "--learning_rate",
        "2e-5",
        *extra,
    ]


def test_plain_trainer_run():
    t = read(
        _line(
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "4",
            "--bf16",
            "--gradient_checkpointing",
            "--optim",
            "adamw_torch",
        )
    )
    assert (
        t.model == MODEL and t.plan["convention"] == "hf" and t.plan["dp"] == 8 and t.plan["seq_len"] == 2048
    )
    assert t.plan["micro_batch"] == 2 and t.plan["microbatches"] == 4
    assert t.plan["dtype"] == "bf16" and "master_weights" not in t.plan  # autocast over fp32 parameters
    assert t.plan["recompute"] == "full" and t.plan["optimizer_impl"] == "foreach"
    assert not t.warnings


def test_loaded_in_half_keeps_no_master_and_launchers_give_the_world():
    t = read(
        [
            "accelerate",
            "launch",
            "--num_processes",
            "4",
            "run_clm.py",
            "--model_name_or_path",
            MODEL,
            "--torch_dtype",
            "bfloat16",
            "--block_size",
            "1024",
        ]
    )
    assert t.plan["dtype"] == "bf16" and t.plan["master_weights"] is False and t.plan["dp"] == 4
    t = read(
        [
            "deepspeed",
            "--num_gpus",
            "8",
            "--num_nodes",
            "2",
            "run_clm.py",
            "--model_name_or_path",
            MODEL,
            "--block_size",
            "1024",
        ]
    )
    assert t.plan["dp"] == 16 and t.plan["dtype"] == "fp32"


def test_defaults_are_the_trainers():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    a = transformers.TrainingArguments(output_dir="/tmp/pipemem-hf-defaults")
    assert a.per_device_train_batch_size == DEFAULT_MICRO_BATCH
    assert str(getattr(a.optim, "value", a.optim)) == DEFAULT_OPTIM


@pytest.mark.parametrize("optim", sorted(OPTIMS))
def test_optim_maps_to_the_optimizer_the_trainer_builds(optim, tmp_path):
    """What pipemem takes for each --optim is what Trainer.get_optimizer_cls_and_kwargs builds."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    if optim == "adamw_apex_fused" or optim == "adamw_hf":
        pytest.skip(f"{optim}: not offered by this transformers")
    try:
        args = transformers.TrainingArguments(output_dir=str(tmp_path), optim=optim)
        cls, kw = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    except (ImportError, ValueError) as e:
        pytest.skip(f"{optim}: its library is not importable here ({e})")
    ours, impl, _ = OPTIMS[optim]
    name = f"{cls.__module__}.{cls.__name__}"
    if ours == "adamw":
        assert name in ("torch.optim.adamw.AdamW", "bitsandbytes.optim.adamw.AdamW"), name
        if name.startswith("torch"):
            assert (impl == "fused") == bool(kw.get("fused")), kw
        else:
            assert kw["optim_bits"] == 32
    elif ours == "adam8bit":
        assert name in ("torchao.optim.adam.AdamW8bit", "bitsandbytes.optim.adamw.AdamW"), name
        assert name.startswith("torchao") or kw["optim_bits"] == 8
    elif ours == "adam4bit":
        assert name == "torchao.optim.adam.AdamW4bit"
    else:
        assert ours == "sgd" and name == "torch.optim.sgd.SGD"


def _hf_filled(ds_cfg: dict, *, world, micro_batch, accumulation, bf16=False, fp16=False) -> dict:
    """transformers' own fill-in of a DeepSpeed config: HfTrainerDeepSpeedConfig's process and
    finalize stages with the Trainer's values (a stand-in for TrainingArguments: only the fields
    they read) and a model whose config has the hidden size."""
    ds = pytest.importorskip("transformers.integrations.deepspeed")
    pytest.importorskip("deepspeed")
    args = SimpleNamespace(
        world_size=world,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=1.0,
        learning_rate=2e-5,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        save_on_each_node=False,
        fp16=fp16,
        fp16_full_eval=False,
        bf16=bf16,
        bf16_full_eval=False,
        warmup_steps=0,
        warmup_ratio=0.0,
        get_warmup_steps=lambda n: 0,
    )
    hf = ds.HfTrainerDeepSpeedConfig(json.loads(json.dumps(ds_cfg)))
    hf.trainer_config_process(args)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=HIDDEN))
    hf.trainer_config_finalize(args, model, num_training_steps=100)
    return hf.config


MEMORY_KEYS = (
    "zero",
    "dtype",
    "micro_batch",
    "dp",
    "extra",
    "optimizer_offload",
    "optimizer",
    "optimizer_impl",
)


@pytest.mark.parametrize(
    "cfg, flags",
    [
        (HF_ZERO2, ("--bf16", "--per_device_train_batch_size", "2")),
        (HF_ZERO2, ("--fp16", "--gradient_accumulation_steps", "4")),
        (
            dict(
                HF_ZERO3,
                train_batch_size="auto",
                gradient_accumulation_steps="auto",
                train_micro_batch_size_per_gpu="auto",
            ),
            ("--bf16", "--per_device_train_batch_size", "1"),
        ),
    ],
)
def test_deepspeed_autos_are_filled_as_the_trainer_fills_them(cfg, flags, tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    t = read(_line("--deepspeed", str(path), *flags))
    mb = t.plan["micro_batch"]
    ga = (
        int(flags[flags.index("--gradient_accumulation_steps") + 1])
        if "--gradient_accumulation_steps" in flags
        else 1
    )
    filled = _hf_filled(
        cfg, world=8, micro_batch=mb, accumulation=ga, bf16="--bf16" in flags, fp16="--fp16" in flags
    )
    theirs = dict(read_deepspeed(filled, hidden=HIDDEN).plan)
    if "optimizer" not in cfg:  # no optimizer block: DeepSpeed wraps the Trainer's own (--optim's default)
        theirs["optimizer"], theirs["optimizer_impl"], _ = OPTIMS[DEFAULT_OPTIM]
    for k in MEMORY_KEYS:
        assert t.plan.get(k) == theirs.get(k), (k, t.plan.get(k), theirs.get(k))


def test_a_config_that_contradicts_the_trainer_is_refused(tmp_path):
    cfg = dict(HF_ZERO3)  # bf16 enabled, micro-batch 2 in the config
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="per_device_train_batch_size"):
        read(
            _line(
                "--deepspeed",
                str(path),
                "--bf16",
                "--per_device_train_batch_size",
                "4",
                "--gradient_accumulation_steps",
                "4",
            )
        )
    with pytest.raises(UserError, match="bf16.enabled = true"):
        read(
            _line(
                "--deepspeed",
                str(path),
                "--fp16",
                "--per_device_train_batch_size",
                "2",
                "--gradient_accumulation_steps",
                "4",
            )
        )


@pytest.mark.parametrize(
    "extra, says",
    [
        (("--optim", "adafactor"), "--optim adafactor"),
        (("--fsdp", "shard_grad_op"), "shard_grad_op"),
        (("--fsdp_config", "fsdp.json", "--fsdp", "full_shard"), "--fsdp_config"),
        (("--bf16", "--fp16"), "one"),
        (("--torch_dtype", "int8"), "torch_dtype"),
    ],
)
def test_unmodelled_trainer_settings_are_refused(extra, says):
    with pytest.raises(UserError, match=says):
        read(_line(*extra))


def test_cli_reads_a_pasted_line_and_matches_the_api():
    cmd = [
        sys.executable,
        "-m",
        "pipemem",
        "estimate",
        "--json",
        "--from-hf-trainer",
        "--",
        *_line(
            "--bf16",
            "--per_device_train_batch_size",
            "1",
            "--gradient_checkpointing",
            "--fsdp",
            "full_shard auto_wrap",
        ),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    t = read(
        _line(
            "--bf16",
            "--per_device_train_batch_size",
            "1",
            "--gradient_checkpointing",
            "--fsdp",
            "full_shard auto_wrap",
        )
    )
    want = pipemem.estimate(t.model, **t.plan).ranks[0].peak_allocated_bytes
    assert json.loads(out.stdout)["ranks"][0]["peak_allocated_bytes"] == want
    # no sequence length anywhere: one error line naming --seq-len
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipemem",
            "estimate",
            "--from-hf-trainer",
            "--",
            "run_clm.py",
            "--model_name_or_path",
            MODEL,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--seq-len" in out.stderr and out.stderr.count("\n") == 1


def test_sgd_keeps_a_momentum_buffer_only_with_momentum():
    """The Trainer's --optim sgd is torch.optim.SGD(lr) plus --optim_args: no momentum, no state
    (validate hf-trainer measures both)."""
    plain = read(_line("--optim", "sgd"))
    moment = read(_line("--optim", "sgd", "--optim_args", "momentum=0.9,nesterov=True"))
    assert plain.plan["extra"] == {"sgd_momentum": False} and moment.plan["extra"] == {"sgd_momentum": True}
    st = [pipemem.estimate(t.model, **t.plan).ranks[0].static for t in (plain, moment)]
    assert st[0].optimizer == 0 < st[1].optimizer == st[1].params  # one fp32 state per fp32 parameter
