"""torchtitan's llama4 model (torchtitan 0.2.2 models/llama4; 0.3 ships none) in the words of an HF
`llama4_text` config.json: what `--from-torchtitan` ([model] name = "llama4") and `pipemem validate
torchtitan`'s llama4 cases give the estimate.

torchtitan 0.2.2 is not installed beside 0.3 (the same import name): it lives in a directory of its
own (`pip install --no-deps --target DIR torchtitan==0.2.2`), named by `PIPEMEM_TORCHTITAN_LLAMA4`
and put first on the path of the processes that import it (the validate worker; `python -m
pipemem.traced.torchtitan_llama4 PATH`, which writes pipemem/presets/torchtitan_llama4_flavors.json
from 0.2.2's own `llama4_args`).

Its llama4 (model/model.py `TransformerBlock`): separate wq / wk / wv projections, complex RoPE
from one model-level `freqs_cis` buffer, no q/k norm and no query temperature; a layer is MoE when
`(layer_id + 1) % interleave_moe_layer_step == 0` (`moe_layers` here), otherwise a dense
FeedForward; with `every_n_layers_nope` the layers `layer_id % n == 0` skip the rope (NoPE) and the
others attend within `fixed_attn_block_size` blocks, which only its FlexAttention flavors
(`*_irope`) apply: the SDPA flavors attend causally over the whole sequence.
"""

from __future__ import annotations

import os
import sys

from ..errors import UserError

RELEASE = "0.2.2"
ENV = "PIPEMEM_TORCHTITAN_LLAMA4"


def site() -> str | None:
    """The directory holding torchtitan 0.2.2 (`$PIPEMEM_TORCHTITAN_LLAMA4`), or None."""
    d = os.environ.get(ENV)
    return d if d and os.path.isdir(os.path.join(d, "torchtitan")) else None


def available() -> str | None:
    """None when a torchtitan 0.2.2 directory is named, else why not (one line)."""
    if site() is None:
        return (
            f"torchtitan {RELEASE} (the newest release with llama4) is not found: pip install --no-deps "
            f"--target DIR torchtitan=={RELEASE} and set {ENV}=DIR"
        )
    return None


def version_check() -> None:
    """Raise unless the imported torchtitan is 0.2.2's (the worker's path puts it first)."""
    import torchtitan

    path = os.path.dirname(os.path.abspath(torchtitan.__file__))
    if not os.path.isdir(os.path.join(path, "models", "llama4")):
        raise RuntimeError(
            f"the torchtitan imported from {path} has no models/llama4; put torchtitan {RELEASE}'s "
            f"directory first on PYTHONPATH ({ENV})"
        )


def hf_config(args, model, max_position: int = 131072) -> dict:
    """An HF `llama4_text` config.json dict of torchtitan 0.2.2's `TransformerModelArgs` and the
    model it builds (on meta: the FFN widths are read off the built layers)."""
    moe_args = args.moe_args
    layers = [model.layers[str(i)] for i in range(args.n_layers)]
    moe_layers = [i for i, b in enumerate(layers) if b.moe_enabled]
    dense = [b for b in layers if not b.moe_enabled]
    if moe_layers and moe_args.num_shared_experts != 1:
        raise UserError(
            f"torchtitan llama4 with {moe_args.num_shared_experts} shared experts is not read "
            "(pipemem models llama4's one shared expert)"
        )
    if moe_args.score_func != "sigmoid" or not moe_args.score_before_experts:
        raise UserError("torchtitan llama4 with a softmax router or scores after the experts is not read")
    if moe_args.num_expert_groups:
        raise UserError("torchtitan llama4 with group-limited routing is not read")
    n = args.every_n_layers_nope
    rope = [0 if n is not None and i % n == 0 else 1 for i in range(args.n_layers)]
    chunked = args.attn_type == "flex" and n is not None
    expert_ffn = int(layers[moe_layers[0]].moe.experts.w1.shape[1]) if moe_layers else 0
    return {
        "model_type": "llama4_text",
        "hidden_size": int(args.dim),
        "num_hidden_layers": int(args.n_layers),
        "num_attention_heads": int(args.n_heads),
        "num_key_value_heads": int(args.n_kv_heads or args.n_heads),
        "head_dim": int(args.dim // args.n_heads),
        "vocab_size": int(args.vocab_size),
        "intermediate_size": expert_ffn,
        "intermediate_size_mlp": int(dense[0].feed_forward.w1.weight.shape[0]) if dense else 0,
        "num_local_experts": int(moe_args.num_experts),
        "num_experts_per_tok": int(moe_args.top_k),
        "moe_layers": moe_layers,
        "no_rope_layers": rope,
        "attention_chunk_size": int(args.fixed_attn_block_size) if chunked else None,
        "use_qk_norm": False,
        "attn_temperature_tuning": False,
        "rms_norm_eps": float(args.norm_eps),
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "max_position_embeddings": int(max_position),
        "torchtitan_release": RELEASE,
    }


def flavor_table() -> dict:
    """{flavor: HF-style config} of the imported torchtitan 0.2.2's `llama4_args`."""
    import torch

    from .torchtitan_model import import_stubs

    version_check()
    with import_stubs():
        from torchtitan.models.llama4 import get_train_spec, llama4_args
    spec = get_train_spec()
    out = {}
    for flavor, args in llama4_args.items():
        with torch.device("meta"):
            model = spec.model_cls(args)
        out[flavor] = hf_config(args, model, max_position=131072)
    return out


def main(argv=None) -> int:
    """`python -m pipemem.traced.torchtitan_llama4 PATH` (with 0.2.2 first on PYTHONPATH): write
    the llama4 flavor table."""
    import json

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m pipemem.traced.torchtitan_llama4 pipemem/presets/torchtitan_llama4_flavors.json"
        )
        return 2
    table = {
        "_pipemem_source": f"torchtitan {RELEASE} models/llama4/__init__.py llama4_args, read by "
        "pipemem.traced.torchtitan_llama4.hf_config",
        "llama4": flavor_table(),
    }
    with open(args[0], "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
