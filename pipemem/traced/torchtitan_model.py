"""Importing torchtitan on a CPU-only machine, and reading its models' shapes.

Shared by `--from-torchtitan - -- ARGS` (pipemem/configs/torchtitan.py) and `pipemem validate
torchtitan` (pipemem/validation/torchtitan_trace.py); nothing here runs a training step.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

from ..errors import UserError

# Modules torchtitan imports at load time for things the traced step never runs: triton
# kernels (MoE dispatch, fused ops; no triton on a CPU build), TensorBoard logging and HF
# datasets (its data loaders). Stubbed only while torchtitan is imported, only if missing.
_STUBBED = ("triton", "triton.language", "torch.utils.tensorboard", "datasets", "datasets.distributed")


@contextlib.contextmanager
def import_stubs():
    """Stand-ins for the missing modules of `_STUBBED` while torchtitan is imported; removed
    again afterwards so PyTorch does not take triton as installed."""
    # torch's own triton probes must run without the stubs
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.nn.attention.flex_attention  # noqa: F401

    missing = [m for m in _STUBBED if m not in sys.modules and not _importable(m)]
    if not missing:
        yield
        return

    class _Any:
        def __getattr__(self, name):
            return _Any()

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]  # @triton.jit
            return _Any()

        def __mro_entries__(self, bases):
            return (object,)  # class X(SummaryWriter-stub): ...

    def attribute(name):
        if name.startswith("__"):  # inspect and importlib probe dunders: a plain module's answer
            raise AttributeError(name)
        return _Any()

    for name in missing:
        mod = types.ModuleType(name)
        mod.__getattr__ = attribute
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and parent in missing:
            setattr(sys.modules[parent], child, mod)
    try:
        yield
    finally:
        for name in missing:
            sys.modules.pop(name, None)


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def model_shapes(model) -> dict:
    """The shapes of torchtitan's decoder (on meta, before parallelisation) in the words of
    an HF config: what the estimate is given."""
    vocab, dim = model.tok_embeddings.weight.shape
    first = model.layers["0"] if "0" in model.layers else next(iter(model.layers.values()))
    att = first.attention
    out = {
        "vocab": int(vocab),
        "dim": int(dim),
        "layers": len(model.layers),
        "n_heads": int(att.n_heads),
        "n_kv_heads": int(att.n_kv_heads),
        "head_dim": int(att.head_dim),
        "tied": bool(getattr(model, "enable_weight_tying", False)),
        "qk_norm": getattr(att, "q_norm", None) is not None,
    }
    if getattr(first, "moe_enabled", False):
        experts = first.moe.routed_experts.inner_experts
        w1 = next(p for n, p in experts.named_parameters() if n.startswith("w1"))
        out.update(
            experts=int(first.moe.router.num_experts),
            top_k=int(first.moe.router.top_k),
            expert_ffn=int(w1.shape[1]),
            ffn=int(w1.shape[1]),
            shared=first.moe.shared_experts is not None,
        )
    else:
        out["ffn"] = int(first.feed_forward.w1.weight.shape[0])
    return out


def hf_config(mc, max_position: int = 131072) -> dict:
    """An HF-style config.json dict of a torchtitan 0.3 decoder's `Model.Config` (its llama3, qwen3
    and deepseek_v3 flavors), read off the config tree without building the model: what
    `pipemem.model.arch_from_hf_config` reads. torchtitan's qwen3 is HF's `qwen3` / `qwen3_moe`
    (q/k norms, GQA); its deepseek_v3 is HF's DeepSeek with a softmax router (`deepseek_v2`: the
    debugmodel, 16B, 236B flavors) or a sigmoid one with its expert bias (`deepseek_v3`: 671B).
    Raises UserError for an attention or MoE layout pipemem does not read."""
    layers = list(mc.layers)
    last = layers[-1]
    att = last.attention
    kind = type(att).__qualname__.split(".")[0]
    cfg: dict = {
        "hidden_size": int(mc.dim),
        "num_hidden_layers": len(layers),
        "vocab_size": int(mc.vocab_size),
        "tie_word_embeddings": bool(getattr(mc, "enable_weight_tying", False)),
        "max_position_embeddings": int(max_position),
        "hidden_act": "silu",
    }
    dense = [i for i, lc in enumerate(layers) if getattr(lc, "moe", None) is None]
    ffn = next((lc.feed_forward for lc in layers if getattr(lc, "feed_forward", None) is not None), None)
    if ffn is not None:
        cfg["intermediate_size"] = int(ffn.w1.out_features)
    moe = getattr(last, "moe", None)
    if kind == "Attention" and hasattr(att, "kv_lora_rank"):  # deepseek_v3's multi-head latent attention
        if moe is None:
            raise UserError("torchtitan deepseek_v3 flavor without MoE layers is not read by pipemem")
        router = moe.router
        sigmoid = router.score_func == "sigmoid"
        if dense != list(range(len(dense))):
            raise UserError(f"torchtitan deepseek_v3: dense layers {dense} are not the first ones")
        groups = router.num_expert_groups
        cfg.update(
            model_type="deepseek_v3" if sigmoid else "deepseek_v2",
            num_attention_heads=int(att.n_heads),
            num_key_value_heads=int(att.n_heads),
            q_lora_rank=int(att.q_lora_rank) or None,
            kv_lora_rank=int(att.kv_lora_rank),
            qk_nope_head_dim=int(att.qk_nope_head_dim),
            qk_rope_head_dim=int(att.qk_rope_head_dim),
            v_head_dim=int(att.v_head_dim),
            n_routed_experts=int(moe.num_experts),
            num_experts_per_tok=int(router.top_k),
            moe_intermediate_size=int(moe.routed_experts.inner_experts.hidden_dim),
            first_k_dense_replace=len(dense),
            n_group=int(groups) if groups else 1,
            topk_group=int(router.num_limited_groups) if groups else 1,
            norm_topk_prob=bool(router.route_norm),
            routed_scaling_factor=float(router.route_scale),
            num_nextn_predict_layers=len(getattr(mc, "mtp_layers", None) or ()),
        )
        shared = moe.shared_experts
        width = int(shared.w1.out_features) if shared is not None else 0
        per = cfg["moe_intermediate_size"]
        if width % per:
            raise UserError(
                f"torchtitan deepseek_v3: shared experts of width {width} are not a multiple of the "
                f"routed experts' {per}"
            )
        cfg["n_shared_experts"] = width // per
        if not sigmoid:
            if router.route_norm:
                raise UserError("torchtitan deepseek_v3: a softmax router with route_norm is not read")
            cfg["topk_method"] = "group_limited_greedy" if groups else "greedy"
        return cfg
    if kind != "GQAttention":
        raise UserError(f"torchtitan attention {kind} is not read by pipemem (GQAttention, MLA Attention)")
    cfg.update(
        num_attention_heads=int(att.n_heads),
        num_key_value_heads=int(att.n_kv_heads or att.n_heads),
        head_dim=int(att.head_dim or mc.dim // att.n_heads),
    )
    qk_norm = getattr(att, "qk_norm", None) is not None
    if moe is None:
        cfg["model_type"] = "qwen3" if qk_norm else "llama"
        return cfg
    if dense:
        raise UserError(f"torchtitan MoE model with dense layers {dense} is not read (only deepseek_v3's)")
    router = moe.router
    if router.score_func != "softmax" or router.num_expert_groups:
        raise UserError(
            f"torchtitan MoE router {router.score_func} with groups {router.num_expert_groups} "
            "outside deepseek_v3 is not read"
        )
    shared = moe.shared_experts
    cfg.update(
        model_type="qwen3_moe",
        num_experts=int(moe.num_experts),
        num_experts_per_tok=int(router.top_k),
        moe_intermediate_size=int(moe.routed_experts.inner_experts.hidden_dim),
        norm_topk_prob=bool(router.route_norm),
        shared_expert_intermediate_size=int(shared.w1.out_features) if shared is not None else 0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    if not qk_norm:
        raise UserError("torchtitan MoE model without q/k norms is not read (qwen3 MoE has them)")
    return cfg


# The models whose flavors `--from-torchtitan` reads from pipemem/presets/torchtitan_flavors.json
# (written from torchtitan's own flavor functions by `main`; tests/test_torchtitan_flavors.py holds
# the file equal to them). llama3 / llama2 flavors map to presets (configs/torchtitan.py FLAVORS).
FLAVOR_MODELS = ("qwen3", "deepseek_v3")


def flavor_table() -> dict:
    """{model name: {flavor: HF-style config}} of torchtitan's qwen3 and deepseek_v3 flavors, from
    the installed torchtitan (each flavor's `model_registry(flavor).model`)."""
    out: dict = {}
    with import_stubs():
        for name in FLAVOR_MODELS:
            mod = importlib.import_module(f"torchtitan.models.{name}")
            flavors = next(v for k, v in vars(mod).items() if k.endswith("_configs") and isinstance(v, dict))
            out[name] = {fl: hf_config(mod.model_registry(fl).model) for fl in flavors}
    return out


def main(argv=None) -> int:
    """`python -m pipemem.traced.torchtitan_model PATH`: write the flavor table (torchtitan 0.3)."""
    import json

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pipemem.traced.torchtitan_model pipemem/presets/torchtitan_flavors.json")
        return 2
    import torchtitan

    table = {
        "_pipemem_source": f"torchtitan {getattr(torchtitan, '__version__', '0.3.0')} "
        "models/<name>/__init__.py flavor functions, read by pipemem.traced.torchtitan_model.hf_config",
        **flavor_table(),
    }
    with open(args[0], "w") as f:
        json.dump(table, f, indent=1, sort_keys=False)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
