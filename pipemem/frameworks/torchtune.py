"""torchtune's own modules (torchtune.modules, read in 0.6.1 and held against them on fake
tensors by `pipemem validate features`), as its recipes run them: no autocast (the model is in
the training dtype), FSDP2 without a mixed-precision policy, every layer checkpointed or none.

Layers: like hf except: RMSNorm is `F.rms_norm(x.float(), weight=scale).to(x.dtype)`; with a
bf16 scale the dtypes differ, so CUDA takes the composite path too (no `_fused_rms_norm`),
which scales in fp32 before the cast and saves the fp32 input and the fp32 normalised tensor;
an fp32 model takes the fused kernel. MultiHeadAttention expands grouped K/V to every head
(expand + flatten: copies) before SDPA or flex attention, which save the expanded copies. The
decoder returns `output(h).float()` when the output is not chunked, so a compiled loss
receives (and saves) fp32 logits. A layer holds its attention output in a local (`attn_out`)
until it returns.
"""

from __future__ import annotations

from ..errors import UserError
from .base import Framework
from .convention import EAGER_MODULES, Convention


class Torchtune(Framework):
    name = "torchtune"
    title = "torchtune's recipes and modules"
    convention = Convention(
        "torchtune",
        **EAGER_MODULES,
        norm_weight_first=True,
        gqa_expand_always=True,
        logits_fp32_in_model=True,
        attn_out_held_to_return=True,
        fsdp2=True,
    )

    unsharded_modules = True
    mixed_precision = False  # model, grads and optimizer states in `dtype`
    # its recipe configs pass `fused: True` to torch.optim.AdamW (30 of the 33 full-finetune
    # configs shipped with 0.6.1 that name it)
    default_optimizer_impl = "fused"
    torch_modules = True
    # LoRALinear: adapters in the model's dtype; QLoRA quantizes the targeted linears only
    # (LoRALinear(quantize_base=True), torchao's NF4Tensor)
    lora_adapter_dtype = "model"
    traced_mode = False  # traced mode records HF's modules, not torchtune's

    def check_plan(self, arch, plan, dtype: str) -> None:
        """What the torchtune convention models: its dense decoders as its recipes run them."""
        if dtype == "fp16":
            raise UserError(
                "--dtype fp16 with --convention torchtune: torchtune trains in bf16 or fp32; use --dtype bf16"
            )
        if not plan.flash_attn:
            raise UserError(
                "--no-flash-attn with --convention torchtune: torchtune's attention always calls "
                "SDPA or flex attention (fused kernels); drop --no-flash-attn"
            )
        if plan.pp > 1:
            raise UserError(
                f"--pp {plan.pp} with --convention torchtune: torchtune's recipes do not "
                "pipeline; use --convention torchtitan for pipeline parallelism"
            )
        if plan.recompute not in ("none", "full") or plan.recompute_layers is not None:
            flag = (
                "--recompute-layers" if plan.recompute_layers is not None else f"--recompute {plan.recompute}"
            )
            raise UserError(
                f"{flag} with --convention torchtune: torchtune checkpoints every layer whole "
                "(enable_activation_checkpointing); use --recompute full or none"
            )
        if arch.experts or arch.conv1d:
            what = "mixture-of-experts layers" if arch.experts else "GPT-2's Conv1D layers"
            raise UserError(
                f"--convention torchtune: {what} are not modelled for torchtune; use --convention hf"
            )
        if plan.dp > 1 and not (plan.fsdp or plan.zero == 3):
            raise UserError(
                f"--dp {plan.dp} with --convention torchtune: torchtune's distributed "
                "recipes shard the model with FSDP2; add --fsdp"
            )

    def default_grads(self, dp: int = 1, zero: int = 0, fsdp: bool = False) -> str:
        return "set-to-none"  # its recipes call optimizer.zero_grad(set_to_none=True)

    fsdp_root_holds_ends = True  # shard_model leaves the embedding and output to the root
    fused_norm_in_fp32 = True  # fp32 input and scale: CUDA runs `_fused_rms_norm`

    # its distributed recipes: FSDP2 full sharding; no pipeline; every layer recomputed or none
    shardings = (("fsdp", {"fsdp": True}),)
    schedules = ()
    recompute_whole_model = True

    readers = ("pipemem.configs.torchtune",)


FRAMEWORK = Torchtune()
