"""How each framework builds a transformer layer, as far as memory is concerned.

Only the switches that change what autograd keeps or which buffers exist; every number comes
out of the generated op-level programs and the liveness engine. Each framework's `Convention`
and why each switch is set live in its module of pipemem.frameworks (megatron.py, paddle.py,
torchtitan.py, hf.py, torchtune.py); this module applies a plan's own switches to it.
"""

from __future__ import annotations

from dataclasses import replace

from ..frameworks import ALL, Convention

CONVENTIONS = {name: fw.convention for name, fw in ALL.items()}


def convention_for(plan) -> Convention:
    """The convention of a validated plan, with the per-plan switches applied
    (recompute_allgather where the framework regathers; fused-projection overrides in plan.extra)."""
    c = CONVENTIONS[plan.convention]
    fw = c.framework
    sp_save = c.sp_save
    if fw.regather_sp_save and plan.recompute_allgather:
        sp_save = fw.regather_sp_save
    extra = plan.extra or {}
    fused_qkv = bool(extra.get("fuse_qkv", c.fused_qkv))
    fused_gate_up = bool(extra.get("fuse_gate_up", c.fused_gate_up))
    # torchtune's fp32 model: input and scale share a dtype, so CUDA runs `_fused_rms_norm`
    fused_norm = bool(
        extra.get("fused_norm", c.fused_norm or (fw.fused_norm_in_fp32 and plan.dtype == "fp32"))
    )
    fused_rope = bool(extra.get("fused_rope", c.fused_rope))
    # torchtune before PR #2054 (2024-11-25) ran its own RMSNorm: cast, then scale
    norm_weight_first = bool(extra.get("norm_weight_first", c.norm_weight_first))
    clip = bool(extra.get("grad_clip", True)) and c.grad_clip_copy
    full_vocab = bool(extra.get("full_vocab_loss", c.full_vocab_loss))
    # Megatron --no-gradient-accumulation-fusion: weight grads are eager temporaries added into
    # the main grad (extra["wgrad_fused"] = False)
    wgrad_fused = bool(extra.get("wgrad_fused", c.wgrad_fused))
    if (
        sp_save,
        fused_qkv,
        fused_gate_up,
        fused_norm,
        fused_rope,
        clip,
        full_vocab,
        wgrad_fused,
        norm_weight_first,
    ) == (
        c.sp_save,
        c.fused_qkv,
        c.fused_gate_up,
        c.fused_norm,
        c.fused_rope,
        c.grad_clip_copy,
        c.full_vocab_loss,
        c.wgrad_fused,
        c.norm_weight_first,
    ):
        return c
    return replace(
        c,
        fused_qkv=fused_qkv,
        fused_gate_up=fused_gate_up,
        sp_save=sp_save,
        wgrad_fused=wgrad_fused,
        fused_norm=fused_norm,
        fused_rope=fused_rope,
        grad_clip_copy=clip,
        full_vocab_loss=full_vocab,
        norm_weight_first=norm_weight_first,
    )


def padded_vocab(vocab: int, tp: int, conv: Convention) -> int:
    """Vocabulary size after the convention's padding (Megatron: multiple of 128*tp)."""
    m = conv.vocab_multiple * tp
    return -(-vocab // m) * m
