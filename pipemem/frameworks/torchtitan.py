"""torchtitan (read in 0.3): DTensor TP/SP + FSDP2.

Layers: separate wq/wk/wv and w1/w3 linears, F.silu(w1(x)) * w3(x) unfused, fused RMSNorm.
SequenceParallel norm output is all-gathered once per block (PrepareModuleInput) and the
gathered tensor is what the projections save; with recompute_allgather
(pipemem.torch_tp.RegatherColwiseParallel) they save a copy of this rank's shard and the block
all-gathers it again once in backward. Cross entropy: log_softmax over an fp32 copy, out of
place. Grads in param dtype. Held against torchtitan's own step by `pipemem validate torchtitan`.
"""

from __future__ import annotations

from ..errors import UserError
from .base import Framework
from .convention import EAGER_MODULES, Convention

# the model types whose torchtitan module uses CosSinRoPE (models/qwen3: `CosSinRoPE.Config`)
COS_SIN_ROPE = ("qwen3", "qwen3_moe")


class Torchtitan(Framework):
    name = "torchtitan"
    title = "torchtitan (DTensor TP/SP, FSDP2, torch pipelining)"
    convention = Convention(
        "torchtitan", **EAGER_MODULES | dict(fused_norm=True), fsdp2=True, fsdp2_reduce_fp32=True
    )

    default_optimizer_impl = "fused"  # [optimizer] implementation defaults to "fused"
    chunked_loss_wrapper = True  # its ChunkedLossWrapper: loss parallel
    torch_modules = True
    fused_qkv_params = True  # torchtitan 0.3's attention: one wqkv (fuse_qkv=True); w1 / w2 / w3 apart

    def default_etp(self, tp: int, ep: int) -> int:
        """torchtitan 0.3 has no expert-TP degree of its own: without expert parallelism the
        routed experts are split over the TP axis (models/common/moe_sharding.py
        `expert_param_placement_dense`); with it, EP borrows its ranks from FSDP and TP
        (config/configs.py: efsdp x ep = dp_shard x cp x tp) and each expert is whole."""
        return 1 if ep > 1 else tp

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
    # its MoE module (models/common/moe.py: fp32 gate, expert bias, grouped experts, local token
    # dispatch; templates/torchtitan_moe.py), for qwen3's MoE flavors and deepseek_v3's alike
    moe_program = "moe_torchtitan"
    moe_program_runs_mla = True
    # deepseek_v3's multi-head latent attention (models/deepseek_v3/model.py `Attention`): the
    # module transformers' DeepseekV2 runs (templates/mla.py), with ComplexRoPE for every flavor
    mla_templates = True
    mla_rope_style = "complex"

    def loss_chunks(self, plan) -> int:
        """Sequence chunks of ChunkedLossWrapper: `--loss chunked --loss-chunks N` names it (under
        torchtitan, chunked means its wrapper), otherwise 0.3's default (8 chunks) or what the
        trainer's TOML says (`[loss] num_chunks`, read into plan.extra; 1 = one plain CE)."""
        if plan.loss == "chunked":
            return int(plan.loss_chunks)
        return int((plan.extra or {}).get("loss_chunks", 8))

    def check_plan(self, arch, plan, dtype: str) -> None:
        """deepseek_v3's multi-head latent attention is held against torchtitan's step with FSDP
        and activation checkpointing (validate torchtitan); its TP and CP plans (the latent
        projection replicated, the sequence-parallel gathers of wq / wkv_a's input, CP around the
        inner attention) are not modelled: a trace of each is 3-5 % above the template."""
        if not getattr(arch, "kv_lora_rank", 0):
            return
        for flag, n in (("--tp", plan.tp), ("--cp", plan.cp)):
            if n > 1:
                raise UserError(
                    f"{flag} {n}: multi-head latent attention (deepseek_v3) under --convention "
                    f"torchtitan is modelled without {'tensor' if flag == '--tp' else 'context'} "
                    f"parallelism (its sharded module is not checked against torchtitan's step); use "
                    f"{flag} 1 with FSDP / --ep"
                )

    def template_warnings(self, arch, plan) -> list[str]:
        out = []
        if arch.experts and plan.ep > 1:
            out.append(
                "torchtitan MoE with --ep > 1: the all-to-all token dispatch is modelled from its code "
                "(buffers the size of the routed tokens), not checked against a trace of its step"
            )
        if arch.model_type == "llama4_text" and arch.experts and (plan.tp > 1 or plan.ep > 1):
            out.append(
                "torchtitan llama4 with --tp / --ep > 1: its MoE is torchtitan 0.2.2's module "
                "(templates/torchtitan_llama4.py) only without tensor or expert parallelism; with them "
                "0.3's sharded MoE module is modelled, not checked against 0.2.2's step"
            )
        if arch.tied_embeddings and plan.fsdp and self.loss_chunks(plan) > 1:
            out.append(
                "torchtitan with tied embeddings under FSDP: the embedding, final norm and output "
                "layer are one FSDP unit, driven by the chunked loss and the embedding's backward; "
                "a trace of its step (qwen3 debugmodel) holds a second fp32 gradient shard of the "
                "tied weight and about 3x the weight's bf16 size more at the backward's peak, not "
                "modelled (0.9 % more than estimated there)"
            )
        return out

    def layer_buffer_bytes(self, arch, plan, layers: int, moe_layers: int) -> int:
        """torchtitan 0.3 builds a RoPE module in every attention (models/common/rope.py), each
        with its own cache buffer for training.seq_len positions (`Decoder.Config.update_from_config`
        sets max_seq_len to it): `ComplexRoPE` complex64 [seq, rope_dim / 2] (llama3, and
        deepseek_v3 over qk_rope_head_dim), `CosSinRoPE` fp32 [seq, 2 x head_dim] (qwen3). Each
        MoE module keeps fp32 `expert_bias_E` and `tokens_per_expert_E` buffers [experts]."""
        if arch.position != "rope":
            return 0
        # torchtitan before 0.3: one `freqs_cis` buffer on the model (complex64 [seq, head_dim / 2])
        # per stage, not one per attention (plan.extra rope_cache = "model")
        one_per_model = (plan.extra or {}).get("rope_cache") == "model"
        if arch.mla:
            per_position = arch.qk_rope_head_dim * 4
        elif arch.model_type in COS_SIN_ROPE:
            per_position = 2 * arch.head_dim * 4
        else:
            per_position = arch.head_dim * 4
        caches = (1 if layers else 0) if one_per_model else layers
        return caches * plan.seq_len * per_position + moe_layers * 2 * arch.experts * 4

    default_interleaved_schedule = "Interleaved1F1B"
    runtime = "torch"  # torch.distributed.pipelining

    def sharding_levers(self, plan) -> list[tuple[str, dict]]:
        return [("--fsdp", {"fsdp": True, "zero": None})]

    # data parallel replicate (DDP) or FSDP2 full sharding
    shardings = (("ddp", {}), ("fsdp", {"fsdp": True}))
    schedules = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

    readers = ("pipemem.configs.torchtitan",)


FRAMEWORK = Torchtitan()
