"""`Framework`: one training framework's rules, in one object.

A framework module (megatron.py, paddle.py, torchtitan.py, hf.py, torchtune.py) subclasses
`Framework` and sets what differs from these defaults. Core code asks the object
(`fw.tp_must_divide_kv_heads`, `fw.default_grads(dp, zero, fsdp)`, `fw.moe_program`...) and
never compares framework names. Grouped as the core reads them:

* plan rules and defaults (pipemem.plan.validate_plan);
* static bytes (pipemem.templates.static);
* layer-program hooks (pipemem.templates.layers / programs, pipemem.stages);
* the answer: default schedule and runtime, fix suggestions (pipemem.estimate, pipemem.runtime);
* the plan space `pipemem plan` searches (pipemem.planner.space);
* the reader of the framework's own configuration (pipemem.configs, named, not imported).

This module sits below plan.py, templates/, stages.py, runtime.py, planner/ and estimate.py:
it imports none of them, and what its methods need comes in as arguments.
"""

from __future__ import annotations

from dataclasses import replace

from .convention import Convention

# (label, estimate keyword arguments) of the model-state shardings a framework offers
Shardings = tuple[tuple[str, dict], ...]


class Framework:
    name: str = ""
    title: str = ""  # who runs it, one phrase (docs, --help)
    convention: Convention  # the layer switches (templates)

    # -- plan rules and defaults ---------------------------------------------------------------
    unsharded_modules = False  # modules modelled as written: no tp / cp / ep
    tp_must_divide_kv_heads = False  # no KV-head replication when tp > KV heads
    interleaved_needs_pp_multiple = False  # --vpp > 1: microbatches a multiple of pp
    has_dist_opt = False  # --dist-opt (Megatron's distributed optimizer)
    mixed_precision = True  # fp32 master weights under bf16 / fp16
    zero_is_deepspeed = False  # --zero 1-3 (not --fsdp) is DeepSpeed's ZeRO engine
    contiguous_grad_buffer = False  # one resident grad buffer; no DDP buckets
    pytorch_allocator = True  # its tensors live in PyTorch's CUDA caching allocator
    # its modules keep q / k / v in one parameter (Megatron's linear_qkv) and gate / up in one
    # (linear_fc1): the tensors the caching allocator holds (templates/static.py)
    fused_qkv_params = False
    fused_gate_up_params = False
    allocator_note = ""  # where not: whose allocator, said when reserved is not modelled
    default_optimizer_impl = "fused"  # plan.OPTIMIZER_IMPLS
    fused_ce_loss = False  # --loss fused / fused_te (Megatron's CE fusion)
    whole_logits_loss = False  # --loss shifted (a step's own CE on whole logits)
    chunked_loss_wrapper = False  # --loss chunked is the framework's own sequence-chunked head
    torch_modules = False  # plain PyTorch modules: torchtune / Liger losses, optimizer
    # in backward, the trainer features as fixes
    fp8 = "torchao"  # "te" (Transformer Engine), "torchao" (Float8) or None
    activation_offload = True  # --activation-offload modelled
    torch_compile = True  # --compile applies
    traced_mode = True  # --mode traced records this framework's modules
    paddle_programs = False  # --mode paddle (Paddle's own programs) applies
    # LoRA / QLoRA (pipemem.lora): None = not modelled for this framework; else the adapters'
    # dtype: "fp32" (PEFT's get_peft_model(autocast_adapter_dtype=True) upcasts bf16 / fp16
    # adapters) or "model" (the model's dtype)
    lora_adapter_dtype: str | None = None
    qlora_quantizes_all_linears = False  # load_in_4bit: every nn.Linear but the output layer

    def check_plan(self, arch, plan, dtype: str) -> None:
        """Refuse (UserError) what this framework's runs never do; called by validate_plan
        after the generic parallelism checks of the convention."""

    def default_etp(self, tp: int, ep: int) -> int:
        """Expert tensor parallelism when --etp is not given: the experts split as the dense
        layers are (Megatron-Core's default, --expert-tensor-parallel-size = tp)."""
        return tp

    def default_grads(self, dp: int = 1, zero: int = 0, fsdp: bool = False) -> str:
        """How the trainer keeps gradients between steps (plan.GRADS); PyTorch's
        zero_grad(set_to_none=True) unless the framework says otherwise."""
        return "set-to-none"

    # -- static bytes ----------------------------------------------------------------------------
    fp32_params_are_master = False  # mixed precision keeps fp32 params, compute casts (autocast,
    # FSDP2 MixedPrecisionPolicy): no separate master copy
    precision_aware_optimizer = False  # Megatron's --use-precision-aware-optimizer dtypes apply
    te_runtime_buffers = False  # Transformer Engine / Megatron buffers held all run
    fp32_grad_copies = False  # narrow main grads handed to the optimizer as fp32 copies
    te_fp8_weight_caches = False  # TE keeps fp8 weight copies (and transposes) all step

    # -- layer-program hooks ---------------------------------------------------------------------
    autocast = False  # modules run under torch.autocast over fp32 params
    fsdp_reshards_head = True  # FSDP's root reshards the output layer after forward
    fsdp_root_holds_ends = False  # FSDP2's root unit holds the embedding and the output layer
    model_fused_qkv = False  # a model whose own module fuses q, k, v keeps it fused
    qkv_one_matmul = False  # separate q, k, v linears computed as one matmul
    cp_attention = "ring"  # context parallel: "ring" or "allgather_kv"
    eager_softmax = "scale_mask_softmax"  # attention without flash: "scale_mask_softmax" (fused),
    # "fp32_softmax_cast" (HF eager), "inplace_mask_softmax" (Paddle)
    gelu_new_op_by_op = False  # HF's NewGELUActivation, op by op
    op_level_sac = False  # --recompute selective is op-level selective checkpointing
    moe_program = "moe"  # the layer generator's MoE method (templates.layers._Gen)
    mla_templates = False  # templates/mla.py holds its multi-head latent attention (DeepSeek)
    moe_program_runs_mla = False  # its moe_program also runs DeepSeek's MoE (else templates/mla.py's)
    mla_rope_style: str | None = None  # the MLA rotary form it runs (None: the model's rope_style)
    # those templates follow megatron-core's MLASelfAttention and its MoE router (else transformers'
    # DeepseekV2 / V3 attention and MoE)
    mla_megatron = False
    # the config's multi-token prediction layers (ArchSpec.mtp_layers) run on the last stage:
    # megatron-core's MTP block, its heads and losses (templates/mtp.py); else none is built
    mtp_block = False
    # the layer programs are transformers' modules: the families held only against them (sliding
    # windows, attention sinks, a partial rope's concatenated query) are modelled under it alone
    transformers_modules = False
    conv1d_weight_saved = False  # Conv1D layers save their weight (a parameter) for backward
    te_offload_spec = False  # activation offloading follows TE's offload spec
    vocab_parallel_embedding_mask = False  # tp > 1: VocabParallelEmbedding's masked ids
    compile_covers_loss = True  # --compile all compiles the loss too
    ce_with_softmax_inplace = False  # Paddle's cross_entropy_with_softmax in place
    stage_causal_mask = False  # every stage builds its causal mask (no flash)
    offload_keeps_last_layer = False  # fine-grained offload keeps a chunk's last layer
    static_backward_frees_dy = False  # the backward frees a received output grad at its last use
    regather_sp_save: str | None = None  # what SP linears save under --recompute-allgather
    fused_norm_in_fp32 = False  # an fp32 model runs the fused norm kernel

    def loss_chunks(self, plan) -> int:
        """Sequence chunks of the framework's own chunked head (1: none)."""
        return 1

    def template_warnings(self, arch, plan) -> list[str]:
        """What this framework's templates model less surely for the plan, said beside the
        numbers (pipemem.stages.template_warnings adds them)."""
        return []

    def layer_buffer_bytes(self, arch, plan, layers: int, moe_layers: int) -> int:
        """Bytes of the buffers its modules register in `layers` decoder layers (`moe_layers` of
        them MoE), held all run beside the parameters (templates/static.py: `other`)."""
        return 0

    # -- the answer ------------------------------------------------------------------------------
    default_interleaved_schedule = "VPP"  # the schedule of --vpp > 1 without --schedule
    runtime = "torch"  # pipeline runtime profile (pipemem.runtime)

    def sharding_levers(self, plan) -> list[tuple[str, dict]]:
        """Fix suggestions that shard the optimizer states (and more) over the data-parallel
        ranks: (flags, estimate keyword changes). ZeRO-1 and ZeRO-3 by default."""
        return [(f"--zero {z}", {"zero": z}) for z in (1, 3) if z > plan.zero]

    # -- the plan space --------------------------------------------------------------------------
    shardings: Shardings = (("ddp", {}),)
    # pipeline schedules it runs; which fit a plan's chunks per rank, and their placement, is the
    # schedule registry's (pipemem.schedules.registry)
    schedules: tuple = ("1F1B",)
    recompute_whole_model = False  # recomputes every layer or none (no selective / partial)

    # -- configuration readers -------------------------------------------------------------------
    readers: tuple[str, ...] = ()  # pipemem.configs modules reading this framework's config

    def __init__(self) -> None:
        # the convention knows its framework: template code holding a Convention asks it
        self.convention = replace(type(self).convention, framework=self)

    def __repr__(self) -> str:
        return f"<framework {self.name}>"
