"""Parameter shapes of one rank's shard of each model part.

Each decoder-layer entry is `name -> (shape, is_expert)`: expert weights are sharded over ep
and etp and their gradients reduced over the expert-data-parallel group; the rest over tp and
dp. Norm weights and the router are replicated across tp.
"""

from __future__ import annotations


def layer_param_shapes(arch, index: int, tp: int, etp: int, ep: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    h, d = arch.hidden, arch.head_dim
    a = arch.heads // tp
    kv = arch.kv_heads // tp if arch.kv_heads >= tp else 1
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    ln_parts = 2 if arch.norm == "layernorm" else 1
    out["input_norm"] = ((ln_parts * h,), False)
    out["post_attention_norm"] = ((ln_parts * h,), False)
    out["qkv"] = (((a + 2 * kv) * d, h), False)
    if arch.qkv_bias:
        out["qkv_bias"] = (((a + 2 * kv) * d,), False)
    out["o_proj"] = ((h, a * d), False)
    if arch.out_bias:
        out["o_proj_bias"] = ((h,), False)
    if arch.qk_norm:
        out["qk_norm"] = ((2 * d,), False)
    gated = arch.activation in ("swiglu", "geglu")
    if arch.is_moe_layer(index):
        e = arch.experts // ep
        f = arch.expert_ffn // etp
        out["router"] = ((arch.experts, h), False)
        out["experts"] = ((e, (3 if gated else 2) * f, h), True)
        if arch.shared_experts:
            sf = arch.shared_experts * arch.shared_ffn // tp
            out["shared_mlp"] = (((3 if gated else 2) * sf, h), False)
    else:
        f = arch.ffn // tp
        out["mlp"] = (((3 if gated else 2) * f, h), False)
        if arch.mlp_bias:
            out["mlp_bias"] = (((2 if gated else 1) * f + h,), False)
    return out


def embedding_param_shapes(arch, padded_vocab: int, tp: int, head: bool) -> dict[str, tuple[int, ...]]:
    """Word (and learned position) embedding; with `head`, also the final norm and output
    layer (the output layer is a separate weight unless tied on a single stage)."""
    h = arch.hidden
    out = {"word_embeddings": (padded_vocab // tp, h)}
    if arch.position == "learned":
        out["position_embeddings"] = (arch.max_positions, h)
    if head:
        out.update(head_param_shapes(arch, padded_vocab, tp, same_stage_as_embedding=True))
    return out


def head_param_shapes(arch, padded_vocab: int, tp: int, same_stage_as_embedding: bool) -> dict[str, tuple[int, ...]]:
    """Final norm and output layer. Tied embeddings share the word embedding on the same stage;
    on a different stage (pp > 1) the last stage holds its own copy (Megatron)."""
    h = arch.hidden
    out = {"final_norm": ((2 if arch.norm == "layernorm" else 1) * h,)}
    if not (arch.tied_embeddings and same_stage_as_embedding):
        out["output_layer"] = (padded_vocab // tp, h)
    return out
