"""The parameter tensors a rank's static allocation stream holds (pipemem.model.layer_param_tensors,
templates/static.py): one per tensor of the framework's own modules, built on the meta device, so
the caching-allocator model sees the blocks a real run allocates."""

import pytest

from pipemem.frameworks import ALL
from pipemem.model import arch_from_hf_config, layer_param_tensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    num_hidden_layers=2,
    vocab_size=1000,
    head_dim=32,
)


def _hf_layer_sizes(cfg: dict) -> list[int]:
    c = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(c)
    layers = model.transformer.h if cfg["model_type"] == "gpt2" else model.model.layers
    # element counts: GPT-2's Conv1D keeps its weights transposed ([in, out])
    return sorted(p.numel() for p in layers[0].parameters())


@pytest.mark.parametrize(
    "cfg",
    [
        dict(SMALL, model_type="llama"),
        dict(SMALL, model_type="qwen2"),  # q / k / v biases
        dict(SMALL, model_type="qwen3"),  # per-head q / k norms
        dict(model_type="gpt2", n_embd=256, n_head=8, n_layer=2, vocab_size=1000),  # fused c_attn
    ],
    ids=lambda c: c["model_type"],
)
def test_hf_layer_tensors_are_transformers_own(cfg):
    fw = ALL["hf"]
    arch = arch_from_hf_config(cfg, cfg["model_type"])
    ours = layer_param_tensors(
        arch,
        0,
        1,
        1,
        1,
        fused_qkv=fw.fused_qkv_params or arch.fused_qkv,
        fused_gate_up=fw.fused_gate_up_params,
    )
    assert sorted(torch.Size(s).numel() for s, _ in ours) == _hf_layer_sizes(cfg)


def test_megatron_keeps_linear_qkv_and_linear_fc1_whole():
    """megatron-core's layer: linear_qkv (q, k, v in one), linear_proj, linear_fc1 (gate and up in
    one), linear_fc2, two norms; the same elements as the separate projections of the HF layer."""
    fw = ALL["megatron"]
    arch = arch_from_hf_config(dict(SMALL, model_type="llama"), "l")
    fused = layer_param_tensors(arch, 0, 2, 1, 1, fw.fused_qkv_params, fw.fused_gate_up_params)
    split = layer_param_tensors(arch, 0, 2, 1, 1, False, False)
    # tp 2: 4 query heads and 1 KV head of 32, ffn 256 per rank
    assert sorted(s for s, _ in fused) == sorted(
        [(256,), (256,), (192, 256), (256, 128), (256, 256), (512, 256)]
    )
    assert sum(torch.Size(s).numel() for s, _ in fused) == sum(torch.Size(s).numel() for s, _ in split)


def test_torchtitan_layer_tensors_are_torchtitans_own():
    """torchtitan 0.3's llama3 block (debugmodel), built on the meta device: one fused wqkv, wo,
    w1 / w2 / w3, two norms."""
    import importlib

    pytest.importorskip("torchtitan")
    from pipemem.traced.torchtitan_model import hf_config, import_stubs

    with import_stubs():
        registry = importlib.import_module("torchtitan.models.llama3")
    mc = registry.model_registry("debugmodel").model
    with torch.device("meta"):
        model = mc.build()
    theirs = sorted(p.numel() for p in next(iter(model.layers.values())).parameters())
    fw = ALL["torchtitan"]
    arch = arch_from_hf_config(hf_config(mc), "debugmodel")
    ours = layer_param_tensors(arch, 0, 1, 1, 1, fw.fused_qkv_params, fw.fused_gate_up_params)
    assert sorted(torch.Size(s).numel() for s, _ in ours) == theirs
