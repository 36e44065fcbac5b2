"""Presets: every model preset is a readable HF config with the published shape, GPU presets
carry the device totals, and unknown names fail with close matches."""

import json

import pytest

from pipemem.errors import UserError
from pipemem.model import arch_from_hf_config
from pipemem.presets import gpu_info, gpu_memory_bytes, gpu_names, load_model_config, model_names

REQUIRED_MODELS = {
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
    "llama3.1-405b",
    "mistral-7b",
    "mixtral-8x7b",
    "mixtral-8x22b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-30b-a3b",
    "gpt3-175b",
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
}
# Families transformers builds that templates do not model: traced mode runs them
TRACED_MODELS = {
    "deepseek-v3",
    "deepseek-v2-lite",
    "kimi-k2",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "gemma3-4b",
    "gemma3-12b",
    "gemma3-27b",
    "llama4-scout",
    "llama4-maverick",
    "glm-4.5",
    "glm-4.5-air",
}
REQUIRED_GPUS = {
    "a100-40g",
    "a100-80g",
    "h100-80g",
    "h100-94g",
    "h200",
    "b200",
    "mi300x",
    "rtx3090",
    "gtx1080ti",
}

# Published shapes (layers, hidden, heads, kv heads, ffn or expert ffn, vocab, experts, top-k),
# typed from the model cards / papers, not from our files: Llama 2 paper Table 1 + HF configs,
# Llama 3 / 3.1 / 3.2 model cards, Mistral & Mixtral announcements, Qwen2.5 / Qwen3 technical reports,
# GPT-2 paper Table 2, GPT-3 paper Table 2.1.
PUBLISHED = {
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000, 0, 0),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000, 0, 0),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000, 0, 0),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 0, 0),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 0, 0),
    "llama3.1-405b": (126, 16384, 128, 8, 53248, 128256, 0, 0),
    "llama3.2-1b": (16, 2048, 32, 8, 8192, 128256, 0, 0),
    "llama3.2-3b": (28, 3072, 24, 8, 8192, 128256, 0, 0),
    "mistral-7b": (32, 4096, 32, 8, 14336, 32000, 0, 0),
    "mixtral-8x7b": (32, 4096, 32, 8, 14336, 32000, 8, 2),
    "mixtral-8x22b": (56, 6144, 48, 8, 16384, 32768, 8, 2),
    "qwen2.5-7b": (28, 3584, 28, 4, 18944, 152064, 0, 0),
    "qwen2.5-72b": (80, 8192, 64, 8, 29568, 152064, 0, 0),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 768, 151936, 128, 8),
    "qwen3-235b-a22b": (94, 4096, 64, 4, 1536, 151936, 128, 8),
    "gpt2": (12, 768, 12, 12, 3072, 50257, 0, 0),
    "gpt2-medium": (24, 1024, 16, 16, 4096, 50257, 0, 0),
    "gpt2-large": (36, 1280, 20, 20, 5120, 50257, 0, 0),
    "gpt2-xl": (48, 1600, 25, 25, 6400, 50257, 0, 0),
    "gpt3-175b": (96, 12288, 96, 96, 49152, 50257, 0, 0),
}

# Parameter counts as published (safetensors totals on the HF model pages / model cards).
PUBLISHED_PARAMS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "mixtral-8x22b": 140_630_071_296,
    "qwen3-30b-a3b": 30_532_122_624,
}


def test_all_required_presets_exist():
    assert REQUIRED_MODELS | TRACED_MODELS | {"qwen3-235b-a22b"} <= set(model_names())
    assert REQUIRED_GPUS <= set(gpu_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_published_shape(name):
    display, cfg = load_model_config(name)
    assert display == name
    a = arch_from_hf_config(cfg, name)
    ffn = a.expert_ffn if a.experts else a.ffn
    assert (a.layers, a.hidden, a.heads, a.kv_heads, ffn, a.vocab, a.experts, a.top_k) == PUBLISHED[name]


def test_gpt3_is_gpt2_style_with_2048_positions():
    _, cfg = load_model_config("gpt3-175b")
    assert cfg["model_type"] == "gpt2" and cfg["n_embd"] == 12288 and cfg["n_positions"] == 2048


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_published(name):
    pytest.importorskip("pipemem.templates.params")
    _, cfg = load_model_config(name)
    assert arch_from_hf_config(cfg, name).param_count() == PUBLISHED_PARAMS[name]


def test_every_preset_file_names_its_source():
    for name in model_names():
        _, cfg = load_model_config(name)
        assert cfg.get("_pipemem_source"), name


def test_aliases_resolve_to_presets():
    assert load_model_config("facebook/llama-7b")[0] == "llama2-7b"
    assert load_model_config("meta-llama/Meta-Llama-3-70B")[0] == "llama3-70b"
    assert load_model_config("LLAMA3-8B")[0] == "llama3-8b"


def test_h100_total_is_81559_mib():
    # nvidia-smi memory.total of an H100 80GB HBM3
    assert gpu_memory_bytes("h100-80g") == 81559 * 2**20
    assert gpu_memory_bytes("H100-80GB") == gpu_memory_bytes("h100-80g")


@pytest.mark.parametrize(
    "name,key",
    [
        ("gtx-1080-ti", "gtx1080ti"),
        ("RTX 3090", "rtx3090"),
        ("a100_80g", "a100-80g"),
        ("1080-ti", "gtx1080ti"),
        ("B-200", "b200"),
    ],
)
def test_gpu_names_ignore_separators(name, key):
    # as schedule names do: "--gpu gtx-1080-ti" was "unknown GPU (did you mean gtx1080ti?)"
    assert gpu_info(name)["key"] == key


def test_separators_do_not_hide_ambiguity_or_other_gpus():
    with pytest.raises(UserError, match="ambiguous"):
        gpu_info("h-100")
    with pytest.raises(UserError, match="unknown GPU"):
        gpu_info("gtx-1080")  # the 8 GB GTX 1080 is not the 11 GB Ti


@pytest.mark.parametrize(
    "name,cands", [("H100", ("h100-80g", "h100-94g")), ("a100", ("a100-40g", "a100-80g"))]
)
def test_ambiguous_gpu_names_list_the_candidates(name, cands):
    # "h100" alone is an 80 GB SXM or a 94 GB NVL: an error naming both, not a silent pick
    with pytest.raises(UserError, match="ambiguous") as e:
        gpu_info(name)
    assert all(c in str(e.value) for c in cands)


def test_ambiguous_model_names_list_the_candidates():
    with pytest.raises(UserError, match="ambiguous") as e:
        load_model_config("qwen2.5")
    assert "qwen2.5-7b" in str(e.value) and "qwen2.5-72b" in str(e.value)


def test_gpu_table_is_consistent():
    for n in gpu_names():
        info = gpu_info(n)
        assert info["bytes"] == info["mib"] * 2**20 and info["source"]
    # ordering facts from the vendors' nominal sizes (GB): 40 < 80 < 94 < 141 < 180/192
    mem = {n: gpu_memory_bytes(n) for n in gpu_names()}
    assert mem["gtx1080ti"] < mem["rtx3090"] < mem["a100-40g"] < mem["h100-80g"] <= mem["a100-80g"]
    assert mem["a100-80g"] < mem["h100-94g"] < mem["h200"] < mem["b200"] < mem["mi300x"]


def test_unknown_model_lists_close_matches():
    with pytest.raises(UserError, match="llama3-70b"):
        load_model_config("llama3-70")


def test_unknown_gpu_lists_close_matches():
    with pytest.raises(UserError, match="h100-80g"):
        gpu_info("h100-8g")


def test_config_path_and_directory(tmp_path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(str(tmp_path / "config.json"))[1] == cfg
    assert load_model_config(str(tmp_path))[1] == cfg


@pytest.mark.parametrize("text,match", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_malformed_config_is_user_error(tmp_path, text, match):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(UserError, match=match):
        load_model_config(str(p))


def test_missing_file_is_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_model_config(str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match="no config.json"):
        load_model_config(str(tmp_path))


# Published shapes of the traced-only presets (layers, hidden, heads, kv heads, routed experts,
# top-k, vocab), typed from the model cards / technical reports: DeepSeek-V3 report Table / model
# card, DeepSeek-V2 paper (Lite), Kimi K2 model card, gpt-oss model card, Gemma 3 report Table 1,
# Llama 4 model card, GLM-4.5 report Table 1. Read as transformers fills the config in.
PUBLISHED_TRACED = {
    "deepseek-v3": (61, 7168, 128, 128, 256, 8, 129280),
    "deepseek-v2-lite": (27, 2048, 16, 16, 64, 6, 102400),
    "kimi-k2": (61, 7168, 64, 64, 384, 8, 163840),
    "gpt-oss-20b": (24, 2880, 64, 8, 32, 4, 201088),
    "gpt-oss-120b": (36, 2880, 64, 8, 128, 4, 201088),
    "gemma3-4b": (34, 2560, 8, 4, 0, 0, 262208),
    "gemma3-12b": (48, 3840, 16, 8, 0, 0, 262208),
    "gemma3-27b": (62, 5376, 32, 16, 0, 0, 262208),
    "llama4-scout": (48, 5120, 40, 8, 16, 1, 202048),
    "llama4-maverick": (48, 5120, 40, 8, 128, 1, 202048),
    "glm-4.5": (92, 5120, 96, 8, 160, 8, 151552),
    "glm-4.5-air": (46, 4096, 96, 8, 128, 8, 151552),
}
# Total parameters as published, at the precision published: DeepSeek-V3 671B (main model, the
# MTP module's 14B aside), DeepSeek-V2-Lite 15.7B, gpt-oss-20b 20.91B and gpt-oss-120b 116.83B
# (gpt-oss model card, Table 1). (Llama 4 Maverick's "400B" and GLM-4.5-Air's "106B" are
# truncated, 400.7B and 106.85B, so they are not held to a rounding here.)
PUBLISHED_TRACED_PARAMS = {
    "deepseek-v3": (671, 1e9),
    "deepseek-v2-lite": (157, 1e8),
    "gpt-oss-20b": (2091, 1e7),
    "gpt-oss-120b": (11683, 1e7),
}


def _hf_params(cfg) -> int:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pipemem.traced.hf import build_model, make_config

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(make_config(cfg, "eager"), torch.bfloat16).parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED_TRACED))
def test_traced_preset_has_published_shape(name):
    pytest.importorskip("transformers")
    from pipemem.model import UnmodelledFamily, text_model_config
    from pipemem.traced.hf import traced_arch

    cfg, _ = text_model_config(load_model_config(name)[1])
    a = traced_arch(cfg, name)
    assert (a.layers, a.hidden, a.heads, a.kv_heads, a.experts, a.top_k, a.vocab) == PUBLISHED_TRACED[name]
    # templates read Gemma 3 (and refuse it past its window), DeepSeek-V2 / V3, Kimi-K2, GLM-4.5,
    # GPT-OSS, Llama 4
    if name.startswith(("gemma3", "deepseek", "kimi", "glm-4.5", "gpt-oss", "llama4")):
        t = arch_from_hf_config(cfg, name)
        if not name.startswith("gemma3"):  # the template counts the parameters transformers builds
            assert t.param_count() == _hf_params(cfg)
        assert (t.layers, t.hidden, t.heads, t.kv_heads, t.vocab, t.head_dim) == (
            a.layers,
            a.hidden,
            a.heads,
            a.kv_heads,
            a.vocab,
            a.head_dim,
        )
        return
    with pytest.raises(UnmodelledFamily, match="use --mode traced"):
        arch_from_hf_config(cfg, name)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TRACED_PARAMS))
def test_traced_preset_param_count_matches_published(name):
    value, unit = PUBLISHED_TRACED_PARAMS[name]
    assert round(_hf_params(load_model_config(name)[1]) / unit) == value


def test_template_and_transformers_count_qwen3_235b_alike():
    _, cfg = load_model_config("qwen3-235b-a22b")
    assert arch_from_hf_config(cfg, "q").param_count() == _hf_params(cfg)
