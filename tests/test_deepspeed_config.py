"""`--deepspeed ds_config.json`: DeepSpeed's config read into the plan (pipemem.configs.deepspeed).
What each key does to memory is held against DeepSpeed's engine by `pipemem validate deepspeed`,
whose plans come from this reader; here: what is read, what "auto" needs, what is refused."""

import json
import subprocess
import sys

import pytest

import pipemem
from pipemem.configs.deepspeed import read
from pipemem.errors import UserError

# Hugging Face's ZeRO-2 / ZeRO-3 example configs (transformers' DeepSpeed docs), "auto" where the
# Trainer fills in
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 4,
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 2,
}


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pipemem", "estimate", *args], capture_output=True, text=True, timeout=120
    )


def test_hf_zero2_config_is_read():
    t = read(HF_ZERO2, hidden=4096)
    assert t.plan["convention"] == "hf" and t.plan["zero"] == 2
    assert t.plan["optimizer_offload"] == 1.0  # offload_optimizer: cpu
    assert t.plan["optimizer"] == "adamw" and t.plan["optimizer_impl"] == "fused"  # DeepSpeed's FusedAdam
    assert t.plan["extra"] == {
        "reduce_bucket_size": 200_000_000,
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    assert set(t.needs) == {"dtype", "micro_batch"} and t.dp_unknown  # "auto": the Trainer's arguments


def test_hf_zero3_auto_bucket_is_hidden_squared_and_dp_is_the_batch_quotient():
    t = read(HF_ZERO3, hidden=2048)
    assert t.plan["zero"] == 3 and t.plan["dtype"] == "bf16" and t.plan["micro_batch"] == 2
    assert t.plan["dp"] == 64 // (2 * 4) and not t.dp_unknown
    assert t.plan["extra"]["reduce_bucket_size"] == 2048 * 2048
    assert t.plan["extra"]["stage3_max_reuse_distance"] == 1_000_000_000
    assert "optimizer" not in t.plan  # no optimizer block: the Trainer's own
    t = read(dict(HF_ZERO3, optimizer={"type": "AdamW", "params": {"torch_adam": True}}), hidden=2048)
    assert t.plan["optimizer_impl"] == "foreach"  # torch.optim.AdamW on CUDA tensors


@pytest.mark.parametrize(
    "cfg, says",
    [
        (
            {
                "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
                "bf16": {"enabled": True},
            },
            "offload_param",
        ),
        ({"bf16": {"enabled": True}}, "stage 0"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, "ratio"),
        (
            {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}, "bf16": {"enabled": True}},
            "ZeRO++",
        ),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "OneBitLamb"}}, "optimizer.type"),
        ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": "auto"}}, "pipeline"),
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both"),
        (
            {
                "zero_optimization": {"stage": 2},
                "train_batch_size": 30,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
            },
            "train_batch_size",
        ),
        ({"zero_optimization": {"stage": 5}}, "stage"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, "reduce_bucket_size"),
    ],
)
def test_unmodelled_or_inconsistent_settings_are_refused(cfg, says):
    with pytest.raises(UserError, match=says):
        read(cfg, hidden=1024)


def test_switched_off_blocks_are_not_refused():
    t = read(
        {
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": True},
            "tensor_parallel": {"autotp_size": 1},
            "sequence_parallel_size": 1,
            "compression_training": {},
        },
        hidden=64,
    )
    assert t.plan["zero"] == 2
    with pytest.raises(UserError, match="AutoTP"):
        read({"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}}, hidden=64)


def test_unknown_keys_are_named_in_a_warning():
    t = read(
        {"zero_optimization": {"stage": 2, "shiny_new_knob": 1}, "bf16": {"enabled": True}, "mystery": {}},
        hidden=64,
    )
    assert any("mystery" in w and "zero_optimization.shiny_new_knob" in w for w in t.warnings)


def test_cli_needs_flags_for_auto_and_matches_the_api(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_ZERO2))
    out = _cli("--model", "llama3-8b", "--dp", "8", "--deepspeed", str(path))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--dtype" in out.stderr
    assert "--micro-batch" in out.stderr and "Traceback" not in out.stderr
    out = _cli(
        "--model",
        "llama3-8b",
        "--dp",
        "8",
        "--seq-len",
        "2048",
        "--dtype",
        "bf16",
        "--micro-batch",
        "1",
        "--deepspeed",
        str(path),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["ranks"][0]["peak_allocated_bytes"]
    want = pipemem.estimate(
        "llama3-8b",
        dp=8,
        seq_len=2048,
        dtype="bf16",
        micro_batch=1,
        **{k: v for k, v in read(HF_ZERO2, hidden=4096).plan.items()},
    ).ranks[0]
    assert got == want.peak_allocated_bytes
    # a flag that contradicts the config is refused, naming both
    out = _cli(
        "--model",
        "llama3-8b",
        "--dp",
        "8",
        "--dtype",
        "bf16",
        "--micro-batch",
        "1",
        "--zero",
        "3",
        "--deepspeed",
        str(path),
    )
    assert out.returncode == 2 and "--zero 3 contradicts" in out.stderr


@pytest.mark.parametrize(
    "text, says", [('{"zero_optimization": ', "not a readable JSON"), ("[1, 2]", "object")]
)
def test_malformed_config_is_one_error_line(tmp_path, text, says):
    path = tmp_path / "ds.json"
    path.write_text(text)
    out = _cli("--model", "llama3-8b", "--deepspeed", str(path))
    assert out.returncode == 2 and says in out.stderr and out.stderr.count("\n") == 1
    out = _cli("--deepspeed", str(path))
    assert out.returncode == 2 and "--model" in out.stderr
