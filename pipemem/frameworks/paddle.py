"""PaddleNLP on Paddle Fleet.

Layers: fused QKV / fused FFN (fuse_attention_qkv, fuse_attention_ffn), fused rms_norm and
swiglu. `ColumnSequenceParallelLinear` saves the sharded input AND the gathered one, unless
recompute_allgather. Each column-parallel linear gathers its own input. Vocab padded to a
multiple of tp. `--from-paddlenlp` applies PaddleNLP's own defaults (LlamaConfig:
use_fused_rms_norm, use_fused_rope off: unfused RMSNorm and rotate_half rope, as in the
programs Paddle builds). Without flash attention the executor's in-place pass runs the mask
add and the softmax in the scores' buffer (fp32 softmax plus a cast copy under AMP); gradient
clipping (max_grad_norm > 0, the default) copies every gradient before the update. The loss
(cross_entropy_with_softmax) runs in place on the fp32 logits (the in-place pass). Weight
gradients are new tensors added into the gradient(-merge) buffer (matmul_grad then add_), not
accumulated inside the GEMM. PaddleNLP's auto-parallel trainer (--enable_auto_parallel)
gathers tp-sharded logits to the full vocabulary for its plain cross entropy (the reshard
Paddle inserts: all_gather, split, concat). Held against the programs Paddle builds by
`pipemem validate paddle`.
"""

from __future__ import annotations

from .base import Framework
from .convention import FUSED_MODULES, Convention


class Paddle(Framework):
    name = "paddle"
    title = "PaddleNLP on Paddle Fleet"
    convention = Convention(
        "paddle",
        **FUSED_MODULES,
        sp_save="shard+gathered",
        gather_once_per_block=False,
        vocab_multiple=1,
        wgrad_fused=False,
        grad_clip_copy=True,
        caller_holds_input=False,
    )

    contiguous_grad_buffer = True
    default_optimizer_impl = "fused"  # in-place adamw kernels
    fp8 = None  # PaddleNLP's fp8 linears are not modelled
    activation_offload = False  # its recompute offload keeps checkpoints on the CPU
    torch_compile = False
    paddle_programs = True

    def default_grads(self, dp: int = 1, zero: int = 0, fsdp: bool = False) -> str:
        return "buffer"  # the contiguous main-grad buffer

    eager_softmax = "inplace_mask_softmax"
    ce_with_softmax_inplace = True
    stage_causal_mask = True  # each stage's causal mask (kept when layers recompute)
    static_backward_frees_dy = True
    regather_sp_save = "shard"  # recompute_allgather: only the shard, gathered again

    runtime = "paddle"  # PaddleNLP's PipelineParallel

    # PaddleNLP sharding stages 1-3
    shardings = (("ddp", {}), ("zero1", {"zero": 1}), ("zero2", {"zero": 2}), ("zero3", {"zero": 3}))
    pytorch_allocator = False
    allocator_note = "Paddle's auto-growth allocator is not PyTorch's"
    schedules = ("1F1B", "ZBH1", "VPP")

    readers = ("pipemem.configs.paddlenlp",)


FRAMEWORK = Paddle()
