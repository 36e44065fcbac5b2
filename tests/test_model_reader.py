"""What every HF family reader reads alike (`_Reader.spec`, `_Reader.gqa_heads`)."""

import pytest

from pipemem.errors import UserError
from pipemem.model import arch_from_hf_config

LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "intermediate_size": 512,
    "vocab_size": 1000,
}
NEOX = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"} | {"model_type": "gpt_neox"}
GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_head": 4, "n_layer": 2, "vocab_size": 500}


@pytest.mark.parametrize("config", [LLAMA, NEOX, GPT2], ids=["llama", "gpt_neox", "gpt2"])
def test_the_common_fields(config):
    arch = arch_from_hf_config(config, "m")
    assert (arch.name, arch.model_type, arch.vocab) == ("m", config["model_type"], config["vocab_size"])
    assert arch.layers == config.get("num_hidden_layers", config.get("n_layer"))
    assert arch.max_positions == 0  # not in the config
    # HF's GPT-2 ties its embeddings by default, the others do not
    assert arch.tied_embeddings is (config["model_type"] == "gpt2")
    told = arch_from_hf_config({**config, "max_position_embeddings": 2048, "tie_word_embeddings": True}, "m")
    assert told.tied_embeddings is True
    assert told.max_positions == 2048  # GPT-2: n_positions, else this


@pytest.mark.parametrize("config", [LLAMA, NEOX], ids=["llama", "gpt_neox"])
def test_missing_vocab_names_the_key(config):
    with pytest.raises(UserError, match="vocab_size"):
        arch_from_hf_config({k: v for k, v in config.items() if k != "vocab_size"}, "m")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_kv_heads_must_divide_the_heads(model_type):
    with pytest.raises(UserError, match="num_key_value_heads=3 must be positive and divide"):
        arch_from_hf_config({**LLAMA, "model_type": model_type, "num_key_value_heads": 3}, "m")
    arch = arch_from_hf_config({**LLAMA, "model_type": model_type}, "m")
    assert (arch.hidden, arch.heads, arch.kv_heads) == (256, 8, 2)
    no_kv = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert arch_from_hf_config({**no_kv, "model_type": model_type}, "m").kv_heads == 8
