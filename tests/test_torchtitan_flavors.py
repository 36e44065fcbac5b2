"""torchtitan 0.3's qwen3 and deepseek_v3 models under `--from-torchtitan` and `--convention
torchtitan`: the flavor table read from torchtitan's own flavor functions, what a job TOML names,
the refusals, torchtitan's expert-TP default and its per-layer buffers."""

import subprocess
import sys

import pytest

from pipemem import estimate
from pipemem.configs.torchtitan import flavor_table, from_tables
from pipemem.errors import UserError
from pipemem.model import arch_from_hf_config


def _torchtitan():
    pytest.importorskip("torch")
    from pipemem.validation.torchtitan_trace import available

    if available() is not None:
        pytest.skip("torchtitan==0.3.0 not installed")


def _tables(name, flavor, **par):
    return {
        "model": {"name": name, "flavor": flavor},
        "training": {"local_batch_size": 2, "seq_len": 256},
        "parallelism": {"data_parallel_shard_degree": 4, **par},
        "activation_checkpoint": {"mode": "full"},
    }


def test_flavor_table_is_torchtitans_own():
    """The shipped table equals what torchtitan's own flavor functions build, read again."""
    _torchtitan()
    from pipemem.traced.torchtitan_model import FLAVOR_MODELS
    from pipemem.traced.torchtitan_model import flavor_table as from_torchtitan

    # llama4's flavors are torchtitan 0.2.2's (test_llama4_flavor_table_is_torchtitan_022s_own)
    assert set(flavor_table()) == {*FLAVOR_MODELS, "llama4"}
    assert from_torchtitan() == {k: v for k, v in flavor_table().items() if k in FLAVOR_MODELS}


@pytest.mark.parametrize("name,flavor", [("qwen3", "0.6B"), ("qwen3", "30B-A3B"), ("deepseek_v3", "16B")])
def test_flavor_parameters_match_the_built_model(name, flavor):
    """The HF-style config of a flavor gives the parameter count of torchtitan's model built on meta."""
    _torchtitan()
    import importlib

    import torch

    from pipemem.traced.torchtitan_model import import_stubs

    with import_stubs():
        mod = importlib.import_module(f"torchtitan.models.{name}")
    with torch.device("meta"):
        model = mod.model_registry(flavor).model.build()
    built = sum(p.numel() for p in model.parameters())
    arch = arch_from_hf_config(dict(flavor_table()[name][flavor]), f"{name}-{flavor}")
    assert arch.param_count() == built


def test_toml_names_flavors_case_insensitively():
    tc = from_tables(_tables("deepseek_v3", "671b", expert_parallel_degree=8), "job.toml")
    assert tc.model == flavor_table()["deepseek_v3"]["671B"]
    arch = arch_from_hf_config(dict(tc.model), "dsv3")
    # the sigmoid router with groups and its three dense layers, as torchtitan's 671B flavor has
    assert arch.router == "sigmoid_group" and arch.router_groups == 8 and arch.dense_layers == (0, 1, 2)
    assert tc.plan["ep"] == 8 and tc.plan["recompute"] == "full"
    tc = from_tables(_tables("qwen3", "30b-a3b"), "job.toml")
    assert tc.model["model_type"] == "qwen3_moe" and tc.model_name == "torchtitan-qwen3-30b-a3b"


@pytest.mark.parametrize(
    "name,flavor,words",
    [
        ("deepseek_v3", "7B", ["flavor", "'7B'", "16B", "671B"]),
        ("qwen3", "2B", ["flavor", "0.6B", "235B-A22B"]),
        ("llama4", "scout", ["flavor", "torchtitan 0.2.2's llama4", "17bx16e", "17bx128e"]),
        ("llama4", "17bx16e_irope", ["flavor", "block mask", "do not run", "17bx16e,"]),
        ("gpt_oss", "20b", ["name", "'gpt_oss'", "llama3"]),
    ],
)
def test_unknown_model_or_flavor_is_one_line_naming_the_known(name, flavor, words, tmp_path):
    with pytest.raises(UserError) as e:
        from_tables(_tables(name, flavor), "job.toml")
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    toml = tmp_path / "job.toml"
    toml.write_text(f'[model]\nname = "{name}"\nflavor = "{flavor}"\n')
    r = subprocess.run(
        [sys.executable, "-m", "pipemem", "estimate", "--from-torchtitan", str(toml), "--dp", "8"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_expert_tp_follows_torchtitan():
    """torchtitan 0.3 splits experts over the TP axis without EP, keeps them whole with it."""
    m = dict(flavor_table()["qwen3"]["debugmodel_moe"])
    kw = dict(convention="torchtitan", seq_len=256, micro_batch=2, fsdp=True)
    assert estimate(m, dp=2, tp=2, **kw).plan.etp == 2
    assert estimate(m, dp=4, tp=2, ep=2, **kw).plan.etp == 1
    assert estimate(m, dp=4, tp=2, ep=2, **dict(kw, convention="megatron", fsdp=False)).plan.etp == 2


def test_mla_tensor_and_context_parallel_refused_by_name():
    m = dict(flavor_table()["deepseek_v3"]["debugmodel"])
    for flag, kw in (("--tp 2", dict(tp=2)), ("--cp 2", dict(cp=2))):
        with pytest.raises(UserError, match=flag):
            estimate(m, convention="torchtitan", seq_len=256, micro_batch=2, fsdp=True, dp=2, **kw)


@pytest.mark.parametrize("name,flavor", [("qwen3", "debugmodel"), ("deepseek_v3", "debugmodel")])
def test_layer_buffers_are_torchtitans(name, flavor):
    """The static `other` bytes of a torchtitan plan are the buffers torchtitan's model registers
    for training.seq_len (each attention's RoPE cache, each MoE's expert-bias and token counts)."""
    _torchtitan()
    import dataclasses
    import importlib

    import torch

    from pipemem.traced.torchtitan_model import import_stubs

    seq = 512
    with import_stubs():
        mod = importlib.import_module(f"torchtitan.models.{name}")
    mc = mod.model_registry(flavor).model
    for lc in mc.layers:  # what Decoder.Config.update_from_config does with training.seq_len
        lc.attention.rope = dataclasses.replace(lc.attention.rope, max_seq_len=seq)
    with torch.device("meta"):
        model = mc.build()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    est = estimate(
        dict(flavor_table()[name][flavor]),
        convention="torchtitan",
        seq_len=seq,
        micro_batch=1,
        dp=2,
        fsdp=True,
    )
    assert est.ranks[0].static.other == buffers


def test_rope_cache_before_0_3_is_one_per_model():
    """torchtitan before 0.3 kept one freqs_cis buffer on the model (plan.extra rope_cache =
    "model", as validation.published sets for its records), 0.3 one per attention."""
    kw = dict(convention="torchtitan", seq_len=1024, micro_batch=1, dp=2, fsdp=True, layers=4)
    per_layer = estimate("llama3-8b", **kw).ranks[0].static.other
    one = estimate("llama3-8b", extra={"rope_cache": "model"}, **kw).ranks[0].static.other
    assert per_layer == 4 * one > 0


def _llama4_site():
    import os

    from pipemem.traced.torchtitan_llama4 import ENV, available

    if available() is not None:
        pytest.skip(f"torchtitan 0.2.2 not found (${ENV})")
    return os.environ[ENV]


def test_llama4_flavor_table_is_torchtitan_022s_own(tmp_path):
    """torchtitan 0.3 ships no llama4: the shipped llama4 flavors equal what 0.2.2's own
    `llama4_args` build (read again in a process with 0.2.2 first on its path), and each flavor's
    HF-style config gives the parameter count of 0.2.2's model built on meta."""
    import json
    import os

    site = _llama4_site()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((site, root)))
    out = tmp_path / "flavors.json"
    code = (
        "import json, sys, torch\n"
        "from pipemem.traced.torchtitan_llama4 import main\n"
        "from pipemem.traced.torchtitan_model import import_stubs\n"
        "main([sys.argv[1]])\n"
        "with import_stubs():\n"
        "    from torchtitan.models.llama4 import llama4_args, get_train_spec\n"
        "counts = {}\n"
        "for f, a in llama4_args.items():\n"
        "    with torch.device('meta'):\n"
        "        counts[f] = sum(p.numel() for p in get_train_spec().model_cls(a).parameters())\n"
        "print(json.dumps(counts))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    built = json.loads(r.stdout.strip().splitlines()[-1])
    table = flavor_table()["llama4"]
    assert json.loads(out.read_text())["llama4"] == table
    assert set(built) == set(table)
    for flavor, count in built.items():
        if flavor.endswith("_irope"):
            continue
        assert arch_from_hf_config(dict(table[flavor]), f"llama4-{flavor}").param_count() == count, flavor


def test_llama4_job_runs_as_torchtitan_022_does(tmp_path):
    """A job TOML naming llama4 gets 0.2.2's model (interleaved MoE, the shared expert, separate
    dense FFN width) and its trainer's habits: set-to-none grads, one model-level RoPE buffer,
    one whole-sequence cross entropy."""
    tc = from_tables(_tables("llama4", "17bx128e"), "job.toml")
    arch = arch_from_hf_config(dict(tc.model), "llama4")
    assert arch.model_type == "llama4_text" and arch.experts == 128 and arch.shared_ffn == arch.expert_ffn
    assert arch.dense_layers == tuple(range(0, 48, 2)) and not arch.nope_layers and not arch.qk_norm
    assert tc.plan["grads"] == "set-to-none"
    assert tc.plan["extra"]["rope_cache"] == "model" and tc.plan["extra"]["loss_chunks"] == 1
    # every layer MoE (interleave step 1): no dense FFN
    arch16 = arch_from_hf_config(dict(from_tables(_tables("llama4", "17bx16e"), "j").model), "l")
    assert arch16.dense_layers == () and arch16.experts == 16
