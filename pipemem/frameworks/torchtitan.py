"""torchtitan (read in 0.3): DTensor TP/SP + FSDP2.

Layers: separate wq/wk/wv and w1/w3 linears, F.silu(w1(x)) * w3(x) unfused, fused RMSNorm.
SequenceParallel norm output is all-gathered once per block (PrepareModuleInput) and the
gathered tensor is what the projections save; with recompute_allgather
(pipemem.torch_tp.RegatherColwiseParallel) they save a copy of this rank's shard and the block
all-gathers it again once in backward. Cross entropy: log_softmax over an fp32 copy, out of
place. Grads in param dtype. Held against torchtitan's own step by `pipemem validate torchtitan`.
"""

from __future__ import annotations

from .base import Framework
from .convention import EAGER_MODULES, Convention


class Torchtitan(Framework):
    name = "torchtitan"
    title = "torchtitan (DTensor TP/SP, FSDP2, torch pipelining)"
    convention = Convention(
        "torchtitan", **EAGER_MODULES | dict(fused_norm=True), fsdp2=True, fsdp2_reduce_fp32=True
    )

    default_optimizer_impl = "fused"  # [optimizer] implementation defaults to "fused"
    chunked_loss_wrapper = True  # its ChunkedLossWrapper: loss parallel
    torch_modules = True

    def default_grads(self, dp: int = 1, zero: int = 0, fsdp: bool = False) -> str:
        # Trainer.train_step calls zero_grad(set_to_none=training.disable_cuda_graphs), False by
        # default: CUDA-graph replay needs fixed gradient addresses
        return "buffer"

    fp32_params_are_master = True  # FSDP2 MixedPrecisionPolicy: fp32 params, bf16 compute
    fsdp_reshards_head = False  # the output layer stays unsharded after forward
    qkv_one_matmul = True  # 0.3 computes wq, wk, wv as one wqkv matmul
    cp_attention = "allgather_kv"  # its CP for (flex) attention all-gathers K and V
    op_level_sac = True  # selective_ac_option = "op"
    regather_sp_save = "shard_regather"  # pipemem.torch_tp.RegatherColwiseParallel

    def loss_chunks(self, plan) -> int:
        """Sequence chunks of ChunkedLossWrapper: `--loss chunked --loss-chunks N` names it (under
        torchtitan, chunked means its wrapper), otherwise 0.3's default (8 chunks) or what the
        trainer's TOML says (`[loss] num_chunks`, read into plan.extra; 1 = one plain CE)."""
        if plan.loss == "chunked":
            return int(plan.loss_chunks)
        return int((plan.extra or {}).get("loss_chunks", 8))

    default_interleaved_schedule = "Interleaved1F1B"
    runtime = "torch"  # torch.distributed.pipelining

    def sharding_levers(self, plan) -> list[tuple[str, dict]]:
        return [("--fsdp", {"fsdp": True, "zero": None})]

    # data parallel replicate (DDP) or FSDP2 full sharding
    shardings = (("ddp", {}), ("fsdp", {"fsdp": True}))
    schedules = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

    readers = ("pipemem.configs.torchtitan",)


FRAMEWORK = Torchtitan()
