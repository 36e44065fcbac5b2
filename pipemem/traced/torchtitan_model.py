"""Importing torchtitan on a CPU-only machine, and reading its models' shapes.

Shared by `--from-torchtitan - -- ARGS` (pipemem/configs/torchtitan.py) and `pipemem validate
torchtitan` (pipemem/validation/torchtitan_trace.py); nothing here runs a training step.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

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
