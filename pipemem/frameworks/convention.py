"""`Convention`: how a framework builds a transformer layer, as far as memory is concerned.

Only the switches that change what autograd keeps or which buffers exist; each framework
module (megatron.py, paddle.py, ...) holds its own instance and says why each is set.
pipemem.templates.conventions re-exports this class and applies the per-plan switches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Convention:
    name: str
    fused_qkv: bool  # one column-parallel linear for q, k, v
    fused_gate_up: bool  # one fc1 producing [gate | up] and a fused SwiGLU saving only its input
    sp_save: str  # what an SP column linear keeps: "shard" | "shard+gathered" | "gathered" |
    # "shard_regather" (torchtitan with pipemem.torch_tp.RegatherColwiseParallel)
    gather_once_per_block: bool  # one all-gather feeds every projection of a block
    fused_norm: bool  # norm saves input + fp32 statistics only
    ce_inplace: bool  # cross-entropy backward reuses the saved fp32 softmax
    vocab_multiple: int  # vocab padded to a multiple of vocab_multiple * tp
    gqa_expand_eager: bool  # eager attention expands K/V to all heads (copies) before matmuls
    wgrad_fused: bool = True  # weight-grad GEMMs accumulate straight into the grad buffer
    fused_rope: bool = True  # rope in one kernel saving nothing (else: PaddleNLP's unfused rotate_half)
    grad_clip_copy: bool = False  # the optimizer step first makes a clipped copy of every gradient
    full_vocab_loss: bool = False  # tp > 1: the logits are gathered to the full vocabulary for the loss
    # A recomputed region's outputs stay alive until the region's whole backward is done
    # (Megatron's reentrant CheckpointFunction holds `outputs` while it runs
    # torch.autograd.backward(outputs, grads); torch.utils.checkpoint does not)
    checkpoint_keeps_outputs: bool = False
    # Eager frameworks call each layer as `h = layer(h)`: the caller's reference keeps the
    # layer's input alive until the layer returns. Paddle's static programs free it after its
    # last use.
    caller_holds_input: bool = True
    # RMSNorm multiplies by its weight in fp32 and then casts (torchtune), not after the cast (HF Llama)
    norm_weight_first: bool = False
    # grouped K/V are expanded to every head (copies) before any attention kernel, flash included
    gqa_expand_always: bool = False
    # the model upcasts the whole (unchunked) logits to fp32 before the loss sees them
    logits_fp32_in_model: bool = False
    # the layer's forward keeps the attention block's output in a local until it returns
    # (torchtune: `attn_out = self.attn(...); h = self.sa_scale(attn_out) + x`)
    attn_out_held_to_return: bool = False
    # --fsdp is FSDP2's fully_shard (its all-gather and reduce-scatter buffers, tape.py), reducing
    # in fp32 (torchtitan's MixedPrecisionPolicy reduce_dtype) or in the gradients' dtype
    # (torchtune passes no mixed-precision policy)
    fsdp2: bool = False
    fsdp2_reduce_fp32: bool = False

    # the `pipemem.frameworks.Framework` this convention belongs to (its other rules); set by the
    # framework object, carried along by dataclasses.replace, not part of equality or hashing
    framework: Any = field(default=None, compare=False, repr=False)


# The layer as eager PyTorch modules write it (HF transformers, torchtune, torchtitan): separate
# q/k/v and gate/up linears, one all-gather per block under SP keeping the gathered input,
# unfused norms and cross-entropy, no vocabulary padding, weight grads not accumulated in place.
# The frameworks start from it and say where they differ.
EAGER_MODULES = dict(
    fused_qkv=False,
    fused_gate_up=False,
    sp_save="gathered",
    gather_once_per_block=True,
    fused_norm=False,
    ce_inplace=False,
    vocab_multiple=1,
    gqa_expand_eager=True,
    wgrad_fused=False,
)

# The layer as the fused-kernel frameworks (Megatron, Paddle) build it: one q/k/v and one gate/up
# linear, norms saving their input and fp32 statistics, cross-entropy reusing its saved softmax.
FUSED_MODULES = dict(
    fused_qkv=True, fused_gate_up=True, fused_norm=True, ce_inplace=True, gqa_expand_eager=True
)
