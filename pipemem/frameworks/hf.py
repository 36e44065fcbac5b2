"""Hugging Face transformers modules, eager on CUDA (what traced mode records), as the HF
Trainer, accelerate or Lightning run them; `--zero 1-3` (not `--fsdp`) is DeepSpeed's ZeRO.

Layers: separate projections (a model whose own module fuses q, k, v keeps it), unfused
SwiGLU, RMSNorm computed in fp32 by separate ops, eager attention's fp32 softmax and cast,
GPT-2's Conv1D and NewGELU op by op, under torch.autocast over fp32 parameters. DeepSpeed's
ZeRO: in fp16 / bf16 its engine converts the model itself (no autocast), keeps fp32 master
partitions with the optimizer states and gradients in the model's dtype (held against its
own engine by `pipemem validate deepspeed` and `validate hf-trainer`).
"""

from __future__ import annotations

from .base import Framework
from .convention import EAGER_MODULES, Convention


class HF(Framework):
    name = "hf"
    title = "Hugging Face transformers modules (Trainer, accelerate, Lightning; DeepSpeed ZeRO)"
    convention = Convention("hf", **EAGER_MODULES)

    unsharded_modules = True  # HF modules as written: one rank holds whole layers
    zero_is_deepspeed = True
    default_optimizer_impl = "foreach"  # a plain torch.optim.AdamW on GPUs
    whole_logits_loss = True
    torch_modules = True
    # PEFT: adapters upcast to fp32 (get_peft_model's autocast_adapter_dtype=True), their input
    # cast to it (LoraLayer._cast_input_dtype); QLoRA through bitsandbytes' load_in_4bit
    lora_adapter_dtype = "fp32"
    qlora_quantizes_all_linears = True

    def default_grads(self, dp: int = 1, zero: int = 0, fsdp: bool = False) -> str:
        """zero_grad(set_to_none=True), wrapped in DistributedDataParallel (default buckets) when
        the loop data-parallelises without sharding (HF Trainer / accelerate, Lightning)."""
        if dp > 1 and zero == 0:
            return "ddp-bucket"
        if zero == 3 and not fsdp:
            # DeepSpeed's ZeRO-3 keeps the rank's grad partitions in one flat buffer for the whole
            # run (stage3 `grad_partitions_flat_buffer`); ZeRO-1/2 make theirs in each backward and
            # free them at the step (validate deepspeed)
            return "buffer"
        return "set-to-none"

    fp32_params_are_master = True  # autocast over fp32 parameters

    autocast = True
    model_fused_qkv = True
    eager_softmax = "fp32_softmax_cast"
    gelu_new_op_by_op = True
    moe_program = "moe_hf"
    mla_templates = True  # transformers' DeepseekV2 / V3 modules (templates/mla.py)
    transformers_modules = True
    conv1d_weight_saved = True

    # Hugging Face Trainer with DeepSpeed ZeRO 1-3
    shardings = (("ddp", {}), ("zero1", {"zero": 1}), ("zero2", {"zero": 2}), ("zero3", {"zero": 3}))
    schedules = ("1F1B",)

    readers = ("pipemem.configs.hf_trainer", "pipemem.configs.deepspeed")


FRAMEWORK = HF()
