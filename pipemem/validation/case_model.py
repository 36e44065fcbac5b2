"""The tiny Llama a validate case names (`case["model"]`: vocab, layers, heads, kv_heads, hidden,
ffn, tied) in the forms each side needs: a Hugging Face config.json dict (what `pipemem.estimate`
reads, and what transformers builds from) and torchtune's component-builder arguments (and its
LoRA decoder). One
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


def torchtune_lora_llama(
    config: dict,
    max_seq_len: int,
    attn_modules,
    *,
    mlp: bool,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    **builder,
):
    """torchtune's own `lora_llama3_2` decoder of an HF config's shapes (`torchtune_decoder_kwargs`;
    `builder`: more of the builder's arguments): LoRA of `rank` / `alpha` on the `attn_modules`
    projections and, with `mlp`, on the MLP's w1 / w2 / w3, none on the output projection; the
    base frozen as lora_finetune_distributed's `set_trainable_params(model,
    get_adapter_params(model))` leaves it. Needs torchtune's model code importable
    (`features.torchtune_packages`)."""
    from torchtune.models.llama3_2._component_builders import lora_llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    model = lora_llama3_2(
        lora_attn_modules=list(attn_modules),
        apply_lora_to_mlp=mlp,
        apply_lora_to_output=False,
        lora_rank=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        **torchtune_decoder_kwargs(config, max_seq_len),
        **builder,
    )
    set_trainable_params(model, get_adapter_params(model))
    return model
