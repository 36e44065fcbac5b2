"""How each framework builds a transformer layer, as far as memory is concerned.

Only the switches that change what autograd keeps or which buffers exist are here; every
number comes out of the generated op-level programs and the liveness engine.

megatron   Megatron-Core with Transformer Engine: fused QKV and fused gate/up (fc1) linears,
           fused bias-SwiGLU / bias-GeLU (saves the fc1 output only), fused norms (save input +
           statistics), fused rope. Sequence-parallel column linears save the *sharded* input
           and all-gather it again in backward. fp32 main grads; vocab padded to 128*tp.
           Vocab-parallel cross entropy works in place on an fp32 copy of the logits.
paddle     PaddleNLP on Fleet: fused QKV / fused FFN (fuse_attention_qkv, fuse_attention_ffn),
           fused rms_norm and swiglu. `ColumnSequenceParallelLinear` saves the sharded input AND
           the gathered one, unless recompute_allgather (FINDINGS 1b). Each column-parallel
           linear gathers its own input. Vocab padded to a multiple of tp. `--from-paddlenlp`
           applies PaddleNLP's own defaults (LlamaConfig: use_fused_rms_norm, use_fused_rope
           off: unfused RMSNorm and rotate_half rope, as in the programs Paddle builds). Without
           flash attention the executor's in-place pass runs the mask add and the softmax in
           the scores' buffer (fp32 softmax plus a cast copy under AMP); gradient clipping
           (max_grad_norm > 0, the default) copies every gradient before the update. The loss
           (cross_entropy_with_softmax) runs in place on the fp32 logits (the in-place pass).
           Weight gradients are new tensors added into the gradient(-merge) buffer (matmul_grad
           then add_), not accumulated inside the GEMM. PaddleNLP's auto-parallel trainer
           (--enable_auto_parallel) gathers tp-sharded logits to the full vocabulary for its
           plain cross entropy (the reshard Paddle inserts: all_gather, split, concat).
torchtitan DTensor TP/SP + FSDP2: separate wq/wk/wv and w1/w3 linears, F.silu(w1(x)) * w3(x)
           unfused, fused RMSNorm. SequenceParallel norm output is all-gathered once per block
           (PrepareModuleInput) and the gathered tensor is what the projections save; with
           recompute_allgather (pipemem.torch_tp.RegatherColwiseParallel) they save a copy of
           this rank's shard and the block all-gathers it again once in backward.
           Cross entropy: log_softmax over an fp32 copy, out of place. Grads in param dtype.
hf         Hugging Face transformers modules, eager on CUDA (what traced mode records): separate
           projections, unfused SwiGLU, RMSNorm computed in fp32 by separate ops.
torchtune  torchtune's own modules (torchtune.modules, read in 0.6.1 and held against them on fake
           tensors by `pipemem validate features`), as its recipes run them: no autocast (the
           model is in the training dtype). Like hf except: RMSNorm is
           `F.rms_norm(x.float(), weight=scale).to(x.dtype)`; with a bf16 scale the dtypes differ,
           so CUDA takes the composite path too (no `_fused_rms_norm`), which scales in fp32
           before the cast and saves the fp32 input and the fp32 normalised tensor; an fp32
           model takes the fused kernel. MultiHeadAttention expands grouped K/V to every head
           (expand + flatten: copies) before SDPA or flex attention, which save the expanded
           copies. The decoder returns `output(h).float()` when the output is not chunked, so a
           compiled loss receives (and saves) fp32 logits. A layer holds its attention output in
           a local (`attn_out`) until it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Convention:
    name: str
    fused_qkv: bool            # one column-parallel linear for q, k, v
    fused_gate_up: bool        # one fc1 producing [gate | up] and a fused SwiGLU saving only its input
    sp_save: str               # what an SP column linear keeps: "shard" | "shard+gathered" | "gathered" |
                               # "shard_regather" (torchtitan with pipemem.torch_tp.RegatherColwiseParallel)
    gather_once_per_block: bool  # one all-gather feeds every projection of a block
    fused_norm: bool           # norm saves input + fp32 statistics only
    ce_inplace: bool           # cross-entropy backward reuses the saved fp32 softmax
    vocab_multiple: int        # vocab padded to a multiple of vocab_multiple * tp
    gqa_expand_eager: bool     # eager attention expands K/V to all heads (copies) before matmuls
    wgrad_fused: bool = True   # weight-grad GEMMs accumulate straight into the grad buffer
    fused_rope: bool = True    # rope in one kernel saving nothing (else: PaddleNLP's unfused rotate_half)
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


CONVENTIONS = {
    "megatron": Convention("megatron", fused_qkv=True, fused_gate_up=True, sp_save="shard",
                           gather_once_per_block=True, fused_norm=True, ce_inplace=True, vocab_multiple=128,
                           gqa_expand_eager=True, checkpoint_keeps_outputs=True),
    "paddle": Convention("paddle", fused_qkv=True, fused_gate_up=True, sp_save="shard+gathered",
                         gather_once_per_block=False, fused_norm=True, ce_inplace=True, vocab_multiple=1,
                         gqa_expand_eager=True, wgrad_fused=False, grad_clip_copy=True,
                         caller_holds_input=False),
    "torchtitan": Convention("torchtitan", fused_qkv=False, fused_gate_up=False, sp_save="gathered",
                             gather_once_per_block=True, fused_norm=True, ce_inplace=False, vocab_multiple=1,
                             gqa_expand_eager=True, wgrad_fused=False, fsdp2=True, fsdp2_reduce_fp32=True),
    "hf": Convention("hf", fused_qkv=False, fused_gate_up=False, sp_save="gathered", gather_once_per_block=True,
                     fused_norm=False, ce_inplace=False, vocab_multiple=1, gqa_expand_eager=True,
                     wgrad_fused=False),
    "torchtune": Convention("torchtune", fused_qkv=False, fused_gate_up=False, sp_save="gathered",
                            gather_once_per_block=True, fused_norm=False, ce_inplace=False, vocab_multiple=1,
                            gqa_expand_eager=True, wgrad_fused=False, norm_weight_first=True,
                            gqa_expand_always=True, logits_fp32_in_model=True,
                            attn_out_held_to_return=True, fsdp2=True),
}


def convention_for(plan) -> Convention:
    """The convention of a validated plan, with the per-plan switches applied
    (recompute_allgather under paddle and torchtitan; fused-projection overrides in plan.extra)."""
    c = CONVENTIONS[plan.convention]
    sp_save = c.sp_save
    if c.name == "paddle" and plan.recompute_allgather:
        sp_save = "shard"
    elif c.name == "torchtitan" and plan.recompute_allgather:
        sp_save = "shard_regather"
    extra = plan.extra or {}
    fused_qkv = bool(extra.get("fuse_qkv", c.fused_qkv))
    fused_gate_up = bool(extra.get("fuse_gate_up", c.fused_gate_up))
    # torchtune's fp32 model: input and scale share a dtype, so CUDA runs `_fused_rms_norm`
    fused_norm = bool(extra.get("fused_norm", c.fused_norm or (c.name == "torchtune" and plan.dtype == "fp32")))
    fused_rope = bool(extra.get("fused_rope", c.fused_rope))
    # torchtune before PR #2054 (2024-11-25) ran its own RMSNorm: cast, then scale
    norm_weight_first = bool(extra.get("norm_weight_first", c.norm_weight_first))
    clip = bool(extra.get("grad_clip", True)) and c.grad_clip_copy
    full_vocab = bool(extra.get("full_vocab_loss", c.full_vocab_loss))
    # Megatron --no-gradient-accumulation-fusion: weight grads are eager temporaries added into
    # the main grad (extra["wgrad_fused"] = False)
    wgrad_fused = bool(extra.get("wgrad_fused", c.wgrad_fused))
    if (sp_save, fused_qkv, fused_gate_up, fused_norm, fused_rope, clip, full_vocab, wgrad_fused,
            norm_weight_first) == \
            (c.sp_save, c.fused_qkv, c.fused_gate_up, c.fused_norm, c.fused_rope, c.grad_clip_copy,
             c.full_vocab_loss, c.wgrad_fused, c.norm_weight_first):
        return c
    return replace(c, fused_qkv=fused_qkv, fused_gate_up=fused_gate_up, sp_save=sp_save, wgrad_fused=wgrad_fused,
                   fused_norm=fused_norm, fused_rope=fused_rope, grad_clip_copy=clip, full_vocab_loss=full_vocab,
                   norm_weight_first=norm_weight_first)


def padded_vocab(vocab: int, tp: int, conv: Convention) -> int:
    """Vocabulary size after the convention's padding (Megatron: multiple of 128*tp)."""
    m = conv.vocab_multiple * tp
    return -(-vocab // m) * m
