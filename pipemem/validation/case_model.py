"""The tiny Llama a validate case names (`case["model"]`: vocab, layers, heads, kv_heads, hidden,
ffn, tied) in the forms each side needs: a Hugging Face config.json dict (what `pipemem.estimate`
reads, and what transformers builds from) and torchtune's component-builder arguments. One
translation, so that a target's measured run and its estimate cannot read the case differently.
No torch here: the harness imports it as well as the workers.
"""

from __future__ import annotations


def llama_hf_config(case: dict) -> dict:
    """The case's model as a Llama config.json dict: its shapes, `max_position_embeddings` = the
    case's `seq_len`, Llama 3's RoPE base."""
    m = case["model"]
    return {
        "model_type": "llama",
        "hidden_size": m["hidden"],
        "intermediate_size": m["ffn"],
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv_heads"],
        "num_hidden_layers": m["layers"],
        "vocab_size": m["vocab"],
        "tie_word_embeddings": bool(m.get("tied", False)),
        "max_position_embeddings": case["seq_len"],
        "rope_theta": 500000,
    }


def torchtune_decoder_kwargs(config: dict, max_seq_len: int) -> dict:
    """The arguments torchtune's decoder builders (`llama3_2`, `qwen2`) take for an HF config's
    shapes: no attention dropout, RMSNorm eps 1e-5 (the builders' defaults for these models)."""
    return dict(
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        embed_dim=config["hidden_size"],
        max_seq_len=max_seq_len,
        intermediate_dim=config["intermediate_size"],
        attn_dropout=0.0,
        norm_eps=1e-5,
    )
