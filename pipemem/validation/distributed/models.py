"""The tiny models `pipemem validate dist` trains. The model code itself is the product's
(pipemem.traced.stack: `DecoderStack`, torchtitan's TP plan, FSDP2 wrapping, the loss), so
the real ranks (dist_worker.py) and the estimate (`pipemem.estimate(..., mode="traced")`)
run the same Python; here only the case's config, batch, optimizer and layer split.
"""

from __future__ import annotations

import os

import torch

from ...traced.stack import (  # noqa: F401
    DecoderStack,
    build_ddp_module,
    build_fsdp_model,
    build_stack,
    build_tp_model,
    local_tensor,
    make_mesh,
    tp_plan,
)
from ...traced.stack import causal_lm_loss as loss_fn  # noqa: F401 (the workers' loss, named here)


def hf_config(spec: dict) -> dict:
    """The case's model as a Hugging Face config.json dict (what pipemem.estimate takes)."""
    cfg = {
        "model_type": spec.get("arch", "llama"),
        "hidden_size": spec["hidden"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "intermediate_size": spec["ffn"],
        "vocab_size": spec["vocab"],
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
    }
    if cfg["model_type"] == "mixtral":
        cfg.update(num_local_experts=spec.get("experts", 4), num_experts_per_tok=spec.get("topk", 2))
    return cfg


def model_config(spec: dict):
    """The HF config object of the case (as traced mode builds it: sdpa attention, grouped_mm experts)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from ...traced.hf import make_config

    return make_config(hf_config(spec), "sdpa")


def param_dtype(cfg) -> torch.dtype:
    """fp32, except bf16 for MoE models (HF's grouped_mm experts run only in bf16 on CPU)."""
    return torch.bfloat16 if getattr(cfg, "model_type", "") == "mixtral" else torch.float32


def precision(spec: dict) -> dict:
    """The estimate's dtype flags for the case's parameters."""
    if spec.get("arch") == "mixtral":
        return {"dtype": "bf16", "master_weights": False}
    return {"dtype": "fp32"}


def make_batch(spec: dict, batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec["vocab"], (batch, seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def make_optimizer(params):
    """AdamW as traced mode builds it for the `cpu` kernel policy (PyTorch's defaults)."""
    from ...traced.hf import optimizer_factory
    from ...traced.kernel_policy import configure_optimizer

    opt = optimizer_factory("adamw")(params)
    configure_optimizer("cpu", opt)
    return opt


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        k = base + (1 if s < extra else 0)
        out.append(list(range(start, start + k)))
        start += k
    return out
