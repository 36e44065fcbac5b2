"""Megatron-LM / Megatron-Core with Transformer Engine (read in megatron-core 0.16.1).

Layers: fused QKV and fused gate/up (fc1) linears, fused bias-SwiGLU / bias-GeLU (saves the
fc1 output only), fused norms (save input + statistics), fused rope. Sequence-parallel column
linears save the *sharded* input and all-gather it again in backward. fp32 main grads in one
contiguous buffer; vocab padded to 128*tp. Vocab-parallel cross entropy works in place on an
fp32 copy of the logits. Held against megatron-core's own step by `pipemem validate megatron`.
"""

from __future__ import annotations

from .base import Framework
from .convention import FUSED_MODULES, Convention


class Megatron(Framework):
    name = "megatron"
    title = "Megatron-LM / Megatron-Core with Transformer Engine"
    convention = Convention(
        "megatron",
        **FUSED_MODULES,
        sp_save="shard",
        gather_once_per_block=True,
        vocab_multiple=128,
        checkpoint_keeps_outputs=True,
    )

    # megatron-core with tp > KV heads all-gathers the whole QKV projection on every rank and
    # slices it (attention.py get_query_key_value_tensors): not what the templates build
    tp_must_divide_kv_heads = True
    interleaved_needs_pp_multiple = True  # its interleaved schedule's rule
    has_dist_opt = True
    contiguous_grad_buffer = True
    fused_qkv_params = True  # linear_qkv
    fused_gate_up_params = True  # linear_fc1 (gate and up); linear_fc2 the down projection
    default_optimizer_impl = "fused"  # TE / Apex FusedAdam
    fused_ce_loss = True  # --cross-entropy-loss-fusion (native or TE)
    fp8 = "te"

    def default_grads(self, dp: int = 1, zero: int = 0, fsdp: bool = False) -> str:
        return "buffer"  # the DDP wrapper's contiguous main-grad buffer

    def check_plan(self, arch, plan, dtype: str) -> None:
        """Multi-token prediction (templates/mtp.py) is held against megatron-core's step with
        its plain cross entropy, without full recompute (MTP's own checkpointed forward), FSDP,
        context parallelism, offloading or fp8: each of those with it is refused by name."""
        if not getattr(arch, "mtp_layers", 0):
            return
        from ..errors import UserError

        for flag, on in (
            ("--recompute full", plan.recompute == "full"),
            (f"--loss {plan.loss}", plan.loss not in (None, "standard")),
            ("--fsdp / --zero 3", bool(plan.fsdp) or plan.zero >= 3),
            ("--cp > 1", plan.cp > 1),
            ("--activation-offload", bool(plan.activation_offload)),
            ("--fp8", bool(plan.fp8)),
            ("--compile", bool(plan.compile)),
        ):
            if on:
                raise UserError(
                    f"multi-token prediction layers ({arch.mtp_layers}, --mtp-num-layers / "
                    f"num_nextn_predict_layers) with {flag} are not modelled under --convention "
                    "megatron; drop one of them"
                )

    precision_aware_optimizer = True
    te_runtime_buffers = True
    fp32_grad_copies = True
    te_fp8_weight_caches = True

    moe_program = "moe_megatron"
    # megatron-core's MLASelfAttention (--multi-latent-attention; templates/mla.py
    # `attention_megatron`), its MoE router's sigmoid / group-limited scores (moe_megatron)
    mla_templates = True
    mla_megatron = True
    moe_program_runs_mla = True  # moe_megatron runs DeepSeek's router (sigmoid scores, groups, bias)
    mtp_block = True  # --mtp-num-layers: megatron-core's MultiTokenPredictionBlock (templates/mtp.py)
    te_offload_spec = True
    vocab_parallel_embedding_mask = True
    compile_covers_loss = False
    offload_keeps_last_layer = True

    runtime = "megatron"

    def sharding_levers(self, plan) -> list[tuple[str, dict]]:
        return [] if plan.dist_opt else [("--dist-opt", {"dist_opt": True})]

    # plain DDP, the distributed optimizer (ZeRO-1), Megatron-FSDP's optim_grads (ZeRO-2) and
    # optim_grads_params (ZeRO-3) strategies
    shardings = (
        ("ddp", {}),
        ("dist-opt", {"dist_opt": True}),
        ("zero2", {"zero": 2}),
        ("fsdp", {"fsdp": True}),
    )
    schedules = ("1F1B", "VPP")

    readers = ("pipemem.configs.megatron",)


FRAMEWORK = Megatron()
