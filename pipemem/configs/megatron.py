"""Megatron-LM `pretrain_gpt.py` arguments -> an HF-style model config and a pipemem plan.

Megatron describes the model in its arguments, so we write the equivalent HF config:
`--swiglu` / `--normalization RMSNorm` / rotary positions give a Llama-style model
(`qwen2_moe`-shaped when `--num-experts` is set: separate dense and expert FFN widths, shared
experts, dense layers), otherwise a GPT-2-style one. Defaults follow Megatron's argument
defaults: ffn = 4h (or 8h/3 rounded down to a multiple of 64 with SwiGLU), biases on unless
`--disable-bias-linear`, tied embeddings unless `--untie-embeddings-and-output-weights`, fp32
unless `--bf16`/`--fp16`.

Every argument that changes memory is either honoured (read below into the model or the
plan) or refused with one line naming it (`REFUSED`, and the conditional refusals below);
arguments that do not change allocated memory are listed in `NO_MEMORY_EFFECT` with the
reason; anything else is named in one "not modelled, ignored" warning.

Precision as `megatron/training/arguments.py` resolves it: with `--bf16` the main grads
(DDP's contiguous grad buffer) are fp32 unless `--grad-reduce-in-bf16` or `--main-grads-dtype
bf16`; with `--fp16` they are fp16 unless `--accumulate-allreduce-grads-in-fp32`.
`--use-precision-aware-optimizer` makes `--main-params-dtype`, `--exp-avg-dtype` and
`--exp-avg-sq-dtype` the stored dtypes of the master weights and Adam moments.

World size is not a Megatron argument: it comes from the launcher part of a pasted command
(`torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py ...`), `--world-size`, or `--dp`.
"""

from __future__ import annotations

import ast

from ..errors import UserError
from .argv import parse
from .tool_config import ToolConfig

TOOL = "Megatron"

KNOWN = {
    "num-layers",
    "hidden-size",
    "ffn-hidden-size",
    "num-attention-heads",
    "group-query-attention",
    "num-query-groups",
    "kv-channels",
    "seq-length",
    "max-position-embeddings",
    "micro-batch-size",
    "global-batch-size",
    "tensor-model-parallel-size",
    "pipeline-model-parallel-size",
    "num-layers-per-virtual-pipeline-stage",
    "num-virtual-stages-per-pipeline-rank",
    "context-parallel-size",
    "expert-model-parallel-size",
    "expert-tensor-parallel-size",
    "num-experts",
    "moe-router-topk",
    "moe-ffn-hidden-size",
    "moe-shared-expert-intermediate-size",
    "sequence-parallel",
    "use-distributed-optimizer",
    "recompute-granularity",
    "recompute-method",
    "recompute-num-layers",
    "recompute-activations",
    "recompute-modules",
    "bf16",
    "fp16",
    "swiglu",
    "normalization",
    "untie-embeddings-and-output-weights",
    "padded-vocab-size",
    "vocab-size",
    "tokenizer-type",
    "tokenizer-model",
    "make-vocab-size-divisible-by",
    "use-flash-attn",
    "attention-backend",
    "disable-bias-linear",
    "add-qkv-bias",
    "position-embedding-type",
    "use-rotary-position-embeddings",
    "world-size",
    "nproc-per-node",
    "nnodes",
    "optimizer",
    "attention-dropout",
    "hidden-dropout",
    "decoder-first-pipeline-num-layers",
    "decoder-last-pipeline-num-layers",
    "qk-layernorm",
    "moe-layer-freq",
    "accumulate-allreduce-grads-in-fp32",
    "data-parallel-size",
    "grad-reduce-in-bf16",
    "use-precision-aware-optimizer",
    "main-grads-dtype",
    "main-params-dtype",
    "exp-avg-dtype",
    "exp-avg-sq-dtype",
    "no-gradient-accumulation-fusion",
    "moe-token-dispatcher-type",
    "cp-comm-type",
    "cross-entropy-loss-fusion",
    "cross-entropy-fusion-impl",
    "num-distributed-optimizer-instances",
    "use-torch-fsdp2",
    "use-megatron-fsdp",
    "use-custom-fsdp",
    "data-parallel-sharding-strategy",
    "no-bias-swiglu-fusion",
    "attention-softmax-in-fp32",
    "apply-query-key-layer-scaling",
    "transformer-impl",
    "microbatch-group-size-per-virtual-pipeline-stage",
    # multi-head latent attention, multi-token prediction, DeepSeek's router (`_mla`)
    "multi-latent-attention",
    "q-lora-rank",
    "kv-lora-rank",
    "qk-head-dim",
    "qk-pos-emb-head-dim",
    "v-head-dim",
    "mtp-num-layers",
    "mtp-loss-scaling-factor",
    "moe-router-score-function",
    "moe-router-enable-expert-bias",
    "moe-router-num-groups",
    "moe-router-group-topk",
    "moe-router-topk-scaling-factor",
}

# Arguments that change no allocated bytes (or only in ways stated here), accepted as they are.
NO_MEMORY_EFFECT = {
    # learning rate, schedule, regularisation, initialisation, loss scaling
    "lr",
    "min-lr",
    "lr-decay-style",
    "lr-warmup-iters",
    "lr-warmup-fraction",
    "lr-warmup-samples",
    "lr-decay-iters",
    "lr-decay-samples",
    "lr-warmup-init",
    "decoupled-lr",
    "decoupled-min-lr",
    "weight-decay",
    "start-weight-decay",
    "end-weight-decay",
    "weight-decay-incr-style",
    "clip-grad",
    "adam-beta1",
    "adam-beta2",
    "adam-eps",
    "sgd-momentum",
    "init-method-std",
    "init-method-xavier-uniform",
    "seed",
    "loss-scale",
    "initial-loss-scale",
    "min-loss-scale",
    "loss-scale-window",
    "hysteresis",
    "head-lr-mult",
    "apply-wd-to-qk-layernorm",
    "calculate-per-token-loss",
    # run length, logging, checkpoints, data, tokenizer details
    "train-iters",
    "train-samples",
    "exit-interval",
    "exit-duration-in-mins",
    "exit-signal-handler",
    "log-interval",
    "log-throughput",
    "log-timers-to-tensorboard",
    "log-memory-to-tensorboard",
    "log-validation-ppl-to-tensorboard",
    "log-params-norm",
    "log-num-zeros-in-grad",
    "timing-log-level",
    "timing-log-option",
    "tensorboard-dir",
    "tensorboard-log-interval",
    "wandb-project",
    "wandb-exp-name",
    "wandb-save-dir",
    "save",
    "load",
    "save-interval",
    "eval-interval",
    "eval-iters",
    "ckpt-format",
    "use-checkpoint-args",
    "no-load-optim",
    "no-load-rng",
    "no-save-optim",
    "no-save-rng",
    "finetune",
    "use-dist-ckpt",
    "dist-ckpt-format",
    "ckpt-fully-parallel-save",
    "ckpt-fully-parallel-load",
    "async-save",
    "data-path",
    "split",
    "vocab-file",
    "merge-file",
    "mock-data",
    "data-cache-path",
    "num-workers",
    "dataloader-type",
    "tiktoken-pattern",
    "no-mmap-bin-files",
    "no-create-attention-mask-in-dataloader",
    "eod-mask-loss",
    "reset-position-ids",
    "reset-attention-mask",
    "train-data-path",
    "valid-data-path",
    "test-data-path",
    "profile",
    "profile-step-start",
    "profile-step-end",
    "profile-ranks",
    "use-pytorch-profiler",
    "distributed-backend",
    "distributed-timeout-minutes",
    "local-rank",
    "node-rank",
    "master-addr",
    "master-port",
    "use-mcore-models",
    "use-legacy-models",
    # numerics only (same tensors kept): rope variants, norm variants, softmax scale
    "rotary-base",
    "rotary-percent",
    "rotary-interleaved",
    "rope-scaling",
    "use-rope-scaling",
    "rope-scaling-factor",
    "rotary-seq-len-interpolation-factor",
    "norm-epsilon",
    "layernorm-epsilon",
    "apply-layernorm-1p",
    "layernorm-zero-centered-gamma",
    "no-position-embedding",
    "openai-gelu",
    "window-size",
    "moe-z-loss-coeff",
    "moe-router-pre-softmax",
    "moe-router-bias-update-rate",
    "moe-router-dtype",
    # yarn rope of multi-head latent attention: its cos / sin only
    "rope-type",
    "rotary-scaling-factor",
    "mscale",
    "mscale-all-dim",
    "beta-fast",
    "beta-slow",
    "original-max-position-embeddings",
    "moe-input-jitter-eps",
    "moe-per-layer-logging",
    "moe-use-upcycling",
    "check-for-nan-in-loss-and-grad",
    "no-check-for-nan-in-loss-and-grad",
    "deterministic-mode",
    # fusions whose kernels keep the same tensors for backward (transients only)
    "no-masked-softmax-fusion",
    "no-bias-gelu-fusion",
    "no-bias-dropout-fusion",
    "no-rope-fusion",
    "no-persist-layer-norm",
    "bias-swiglu-fusion",
    "moe-permute-fusion",
    "moe-router-fusion",
    "moe-grouped-gemm",
    "no-async-tensor-model-parallel-allreduce",
    "no-gradient-reduce-div-fusion",
    # communication scheduling over the same buffers (DDP buckets, p2p, param all-gather)
    "overlap-grad-reduce",
    "overlap-param-gather",
    "overlap-param-gather-with-optimizer-step",
    "align-param-gather",
    "no-align-param-gather",
    "ddp-bucket-size",
    "ddp-num-buckets",
    "ddp-average-in-collective",
    "ddp-pad-buckets-for-high-nccl-busbw",
    "overlap-p2p-comm",
    "batch-p2p-comm",
    "no-overlap-p2p-communication",
    "moe-shared-expert-overlap",
    "high-priority-stream-groups",
    # allocator hygiene: changes reserved, never allocated, bytes
    "empty-unused-memory-level",
    "manual-gc",
    "manual-gc-interval",
    "manual-gc-eval",
}

_FP8 = (
    "changes memory (FP8 weights, transposes and scaling state) and FP8 is not modelled yet; "
    "remove the FP8 arguments to estimate the BF16 run instead"
)
_OFFLOAD = "moves tensors to host memory, which pipemem does not model yet"
REFUSED = {
    "no-fp8-wgrad": _FP8,
    "fp8-dot-product-attention": _FP8,
    "fp8-multi-head-attention": _FP8,
    "first-last-layers-bf16": _FP8,
    "num-layers-at-start-in-bf16": _FP8,
    "num-layers-at-end-in-bf16": _FP8,
    "keep-fp8-transpose-cache": _FP8,
    "reuse-grad-buf-for-mxfp8-param-ag": _FP8,
    "te-precision-config-file": _FP8,
    "fp4-format": "changes memory (FP4 weights) and FP4 is not modelled",
    "fp4": "FP4 is not modelled",
    "fp4-recipe": "FP4 is not modelled",
    "fp4-param-gather": "FP4 is not modelled",
    "cpu-offloading": _OFFLOAD,
    "cpu-offloading-num-layers": _OFFLOAD,
    "cpu-offloading-activations": _OFFLOAD,
    "cpu-offloading-weights": _OFFLOAD,
    "tp-comm-overlap": "allocates Transformer Engine's userbuffers "
    "(communication/GEMM overlap), not modelled",
    "delay-wgrad-compute": "keeps weight-gradient inputs until a delayed wgrad pass, not modelled",
    "defer-embedding-wgrad-compute": "keeps the embedding's wgrad inputs across microbatches, not modelled",
    "moe-layer-recompute": "recomputes the MoE layer, not modelled",
    "moe-shared-expert-gate": "the shared-expert gate is not modelled",
    "moe-extended-tp": "extended tensor parallelism of experts is not modelled",
    "pipeline-model-parallel-layout": "custom pipeline layouts are not read; use "
    "--decoder-first/last-pipeline-num-layers",
    "account-for-embedding-in-pipeline-split": "changes the layer split, not modelled",
    "account-for-loss-in-pipeline-split": "changes the layer split, not modelled",
    "hierarchical-context-parallel-sizes": "hierarchical context parallelism is not modelled",
    "hybrid-context-parallel": "hybrid context parallelism is not modelled",
    "enable-cuda-graph": "CUDA graphs keep static input/output buffers, not modelled",
    "external-cuda-graph": "CUDA graphs keep static input/output buffers, not modelled",
    "cuda-graph-impl": "CUDA graphs keep static input/output buffers, not modelled",
    "cuda-graph-scope": "CUDA graphs keep static input/output buffers, not modelled",
    "fp16-lm-cross-entropy": "cross entropy on fp16 logits (no fp32 copy) is not modelled",
    "distribute-saved-activations": "distributing saved activations over tp is not modelled",
    "squared-relu": "the squared-ReLU MLP is not modelled",
    "quick-geglu": "the quick-GeGLU MLP is not modelled",
    "hybrid-override-pattern": "hybrid (Mamba) models are not modelled",
    "hybrid-layer-pattern": "hybrid (Mamba) models are not modelled",
    "heterogeneous-layers-config-path": "heterogeneous layers are not modelled",
    "heterogeneous-layers-config-encoded-json": "heterogeneous layers are not modelled",
    "experimental-attention-variant": "attention variants are not modelled",
    "qk-l2-norm": "QK L2 norm is not modelled",
    "attention-output-gate": "the attention output gate is not modelled",
    "spec": "names a custom layer spec, which pipemem does not read; it models megatron-core's Transformer "
    "Engine spec (the default)",
    "overlap-moe-expert-parallel-comm": "runs one microbatch's forward with another's backward (combined "
    "1F1B expert-parallel overlap), not modelled",
}

# Vocabulary sizes of Megatron's built-in tokenizers (before padding).
_TOKENIZER_VOCAB = {"gpt2bpetokenizer": 50257, "llama2tokenizer": 32000, "llama3tokenizer": 128256}
_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}


def refuse(flag: str, why: str):
    raise UserError(f"{TOOL}: --{flag} {why}")


def read(argv: list[str]) -> ToolConfig:
    a = parse(list(argv), TOOL)
    if not a.values:
        raise UserError(
            "--from-megatron: no arguments after `--`; paste the pretrain_gpt.py arguments, e.g. "
            "pipemem estimate --from-megatron -- --num-layers 32 --hidden-size 4096 ..."
        )
    for flag, values in a.values.items():
        off = len(values) == 1 and values[0].strip("'\"").lower() in ("0", "false", "no", "off", "none")
        if flag in REFUSED:
            if not off:
                refuse(flag, REFUSED[flag])
            a.used.add(flag)  # switched off explicitly: nothing to model
    warnings: list[str] = []
    plan: dict = {"convention": "megatron"}
    extra: dict = {}

    layers = _required(a, "num-layers")
    hidden = _required(a, "hidden-size")
    heads = _required(a, "num-attention-heads")
    kv = heads
    if a.bool("group-query-attention"):
        kv = a.int("num-query-groups") or 1
    elif a.has("num-query-groups"):
        a.int("num-query-groups")
    head_dim = a.int("kv-channels")
    if head_dim is None and hidden % heads:
        raise UserError(
            f"{TOOL}: --hidden-size {hidden} is not divisible by --num-attention-heads {heads}; "
            "give --kv-channels"
        )
    swiglu = bool(a.bool("swiglu"))
    norm = (a.str("normalization") or "LayerNorm").lower()
    if norm not in ("layernorm", "rmsnorm"):
        raise UserError(f"{TOOL}: --normalization {norm!r}: expected LayerNorm or RMSNorm")
    pos = (
        a.str("position-embedding-type")
        or ("rope" if a.bool("use-rotary-position-embeddings") else "learned_absolute")
    ).lower()
    if pos not in ("rope", "learned_absolute", "none"):
        refuse("position-embedding-type", f"{pos!r} is not modelled; use rope or learned_absolute")
    llama_like = swiglu or norm == "rmsnorm" or pos == "rope"
    ffn = a.int("ffn-hidden-size")
    if ffn is None:
        ffn = (int(4 * hidden * 2 / 3) // 64) * 64 if swiglu else 4 * hidden
    vocab = _vocab(a, warnings)
    seq = _required(a, "seq-length")
    max_pos = a.int("max-position-embeddings") or seq
    tied = not a.bool("untie-embeddings-and-output-weights")
    bias = not a.bool("disable-bias-linear")
    qkv_bias = bool(a.bool("add-qkv-bias")) or bias
    experts = a.int("num-experts")
    topk = a.int("moe-router-topk")
    if swiglu and a.bool("no-bias-swiglu-fusion"):
        refuse(
            "no-bias-swiglu-fusion",
            "keeps the unfused SwiGLU's intermediates (silu output and both halves), not modelled",
        )

    if llama_like:
        if not swiglu:
            warnings.append(
                f"{TOOL}: rotary/RMSNorm without --swiglu is modelled as a Llama-style gated (SwiGLU) MLP"
            )
        model = {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": ffn,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "num_hidden_layers": layers,
            "vocab_size": vocab,
            "max_position_embeddings": max_pos,
            "tie_word_embeddings": tied,
            "attention_bias": qkv_bias,
            "mlp_bias": bias,
            "hidden_act": "silu",
        }
        if head_dim is not None:
            model["head_dim"] = head_dim
        if norm != "rmsnorm":
            warnings.append(
                f"{TOOL}: LayerNorm with a Llama-style model is modelled as RMSNorm "
                "(saves the same input; one fewer parameter vector)"
            )
        if a.bool("qk-layernorm"):
            model["qk_layernorm"] = True
        if experts and bias:
            raise UserError(
                f"{TOOL}: --num-experts without --disable-bias-linear: biases in MoE layers are "
                "not modelled; add --disable-bias-linear (as Megatron's MoE examples do)"
            )
        if a.bool("multi-latent-attention"):
            model = _mla(a, model, experts, topk, ffn, layers, bias, warnings)
        elif experts:
            _moe(a, model, experts, topk, ffn, layers, warnings)
    else:
        if experts:
            raise UserError(
                f"{TOOL}: --num-experts needs a Llama-style model (--swiglu, "
                "--normalization RMSNorm); GPT-style MoE is not supported"
            )
        if a.bool("multi-latent-attention"):
            raise UserError(
                f"{TOOL}: --multi-latent-attention needs a Llama-style model (--swiglu, "
                "--normalization RMSNorm, rope), as Megatron's DeepSeek examples give"
            )
        if a.bool("qk-layernorm"):
            refuse("qk-layernorm", "on a GPT-style model is not modelled")
        model = {
            "model_type": "gpt2",
            "n_embd": hidden,
            "n_layer": layers,
            "n_head": heads,
            "n_inner": ffn,
            "n_positions": max_pos,
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            "activation_function": "gelu",
            "add_bias_linear": bias,
            "attn_pdrop": _float(a, "attention-dropout", 0.1),
            "resid_pdrop": _float(a, "hidden-dropout", 0.1),
            "embd_pdrop": _float(a, "hidden-dropout", 0.1),
        }
        if kv != heads:
            raise UserError(f"{TOOL}: --group-query-attention needs a Llama-style model (--swiglu or rope)")
        if pos == "none":
            refuse("position-embedding-type", "none on a GPT-style model is not modelled")
    a.used.update({"attention-dropout", "hidden-dropout"})
    if not a.bool("multi-latent-attention"):
        for flag in _MLA_FLAGS:
            if a.has(flag):
                raise UserError(f"{TOOL}: --{flag} needs --multi-latent-attention")
    if not a.bool("multi-latent-attention"):
        if a.int("mtp-num-layers", minimum=0):
            refuse(
                "mtp-num-layers",
                "without --multi-latent-attention: pipemem models multi-token prediction on "
                "DeepSeek-style models (MLA) only",
            )
    if experts and not a.bool("multi-latent-attention"):
        _router_without_mla(a, warnings)

    plan["seq_len"] = seq
    a.ints_into(plan, micro_batch="micro-batch-size")
    tp = a.int("tensor-model-parallel-size") or 1
    pp = a.int("pipeline-model-parallel-size") or 1
    cp = a.int("context-parallel-size") or 1
    plan.update(tp=tp, pp=pp, cp=cp)
    cp_comm = (a.str("cp-comm-type") or "p2p").lower()
    if cp > 1 and cp_comm != "p2p":
        refuse("cp-comm-type", f"{cp_comm} is not modelled; pipemem models the p2p ring (the default)")
    a.ints_into(plan, ep="expert-model-parallel-size", etp="expert-tensor-parallel-size")
    if experts:
        dispatcher = (a.str("moe-token-dispatcher-type") or "allgather").lower()
        if dispatcher != "alltoall" and (plan.get("ep", 1) > 1 or tp > 1):
            refuse(
                "moe-token-dispatcher-type",
                f"{dispatcher} (Megatron's default when not given) is not "
                "modelled with expert or tensor parallelism; pipemem models alltoall",
            )
        _capacity(a, extra)
        _aux_loss(a, experts, seq * plan.get("micro_batch", 1) // (tp * cp), warnings)

    world = a.int("world-size")
    if world is None and a.has("nproc-per-node"):
        world = a.int("nproc-per-node") * (a.int("nnodes") or 1)
    world = world or a.world_size
    dp = a.int("data-parallel-size")
    if world is not None:
        if world % (tp * pp * cp):
            raise UserError(
                f"{TOOL}: world size {world} is not divisible by tensor x pipeline x context "
                f"parallel = {tp * pp * cp}"
            )
        if dp is not None and dp != world // (tp * pp * cp):
            raise UserError(
                f"{TOOL}: --data-parallel-size {dp} contradicts world size {world} / "
                f"(tp {tp} x pp {pp} x cp {cp})"
            )
        dp = world // (tp * pp * cp)
    if dp is not None:
        plan["dp"] = dp

    vps = a.int("num-layers-per-virtual-pipeline-stage")
    vstages = a.int("num-virtual-stages-per-pipeline-rank")
    if vps is not None and vstages is not None:
        raise UserError(
            f"{TOOL}: give --num-layers-per-virtual-pipeline-stage or "
            "--num-virtual-stages-per-pipeline-rank, not both"
        )
    if vps is not None:
        if layers % (pp * vps):
            raise UserError(
                f"{TOOL}: --num-layers {layers} is not divisible by pipeline size {pp} x "
                f"--num-layers-per-virtual-pipeline-stage {vps}"
            )
        plan["vpp"] = layers // (pp * vps)
    elif vstages is not None:
        plan["vpp"] = vstages
    group = a.int("microbatch-group-size-per-virtual-pipeline-stage")
    if group is not None and plan.get("vpp", 1) > 1 and group != pp:
        refuse(
            "microbatch-group-size-per-virtual-pipeline-stage",
            f"{group}: the interleaved schedule with "
            f"microbatch groups other than the pipeline size ({pp}) is not modelled",
        )
    first = a.int("decoder-first-pipeline-num-layers", minimum=0)
    last = a.int("decoder-last-pipeline-num-layers", minimum=0)
    if first is not None or last is not None:
        plan["pp_layout"] = _uneven_layout(layers, pp, plan.get("vpp", 1), first, last)

    if a.bool("sequence-parallel"):
        plan["sp"] = True
    elif tp > 1:
        plan["sp"] = False
    _sharding(a, plan)

    _precision(a, plan, extra)
    _recompute(a, plan, warnings, layers)
    if a.bool("no-gradient-accumulation-fusion"):
        extra["wgrad_fused"] = False  # eager dW temporaries, then added into the main grad

    flash = a.bool("use-flash-attn")
    backend = (a.str("attention-backend") or "").lower()
    impl = (a.str("transformer-impl") or "transformer_engine").lower()
    if impl != "transformer_engine":
        # the local spec: megatron-core's unfused DotProductAttention (keeps the softmax probs) and
        # torch / apex norms and linears instead of Transformer Engine's modules
        refuse(
            "transformer-impl",
            f"{impl} is not modelled; pipemem models the transformer_engine layer spec (the default)",
        )
    if backend in ("unfused", "local"):
        if flash:
            raise UserError(f"{TOOL}: --use-flash-attn contradicts --attention-backend {backend}")
        plan["flash_attn"] = False
    elif plan["dtype"] == "fp32":
        # Transformer Engine's flash and cuDNN fused attention take bf16 / fp16 only: an fp32 run
        # gets TE's unfused attention under --attention-backend auto (the default)
        if flash or backend in ("flash", "fused"):
            raise UserError(
                f"{TOOL}: {'--use-flash-attn' if flash else '--attention-backend ' + backend} needs "
                "--bf16 or --fp16 (flash / fused attention take bf16 or fp16 only)"
            )
        plan["flash_attn"] = False
    elif flash or backend in ("flash", "fused", "auto"):
        plan["flash_attn"] = True
    if plan.get("flash_attn") is False:
        for flag in ("attention-softmax-in-fp32", "apply-query-key-layer-scaling"):
            if a.bool(flag):
                refuse(flag, "changes the unfused attention's softmax dtype, not modelled")
    else:
        a.used.update({"attention-softmax-in-fp32", "apply-query-key-layer-scaling"})

    if a.bool("cross-entropy-loss-fusion"):
        impl = (a.str("cross-entropy-fusion-impl") or "native").lower()
        if impl not in ("native", "te"):
            refuse("cross-entropy-fusion-impl", f"{impl!r}: expected native or te")
        # native keeps what the unfused CE keeps; te works in place on the bf16 logits
        plan["loss"] = "fused_te" if impl == "te" else "fused"
    a.str("cross-entropy-fusion-impl")
    _modern_flags(a, plan)

    opt = a.str("optimizer")
    if opt:
        if opt.lower() not in ("adam", "sgd"):
            refuse("optimizer", f"{opt!r} is not modelled; expected adam or sgd")
        plan["optimizer"] = "adamw" if opt.lower() == "adam" else "sgd"  # Megatron's adam is AdamW

    a.ints_into(plan, global_batch="global-batch-size")
    if extra:
        plan["extra"] = extra

    unknown = a.unknown(KNOWN, NO_MEMORY_EFFECT)
    if unknown:
        warnings.append(f"{TOOL}: not modelled, ignored: " + " ".join("--" + u for u in unknown))
    name = f"megatron-{layers}L-{hidden}h"
    return ToolConfig(
        model=model, plan=plan, warnings=warnings, tool=TOOL, model_name=name, dp_unknown=dp is None
    )


# Megatron's names for the modules its fine-grained activation offloading can move
# (--offload-modules) -> pipemem's (pipemem.features.OFFLOAD_MODULES)
OFFLOAD_MODULES = {
    "attn_norm": "attn_norm",
    "qkv_linear": "qkv",
    "core_attn": "core_attn",
    "attn_proj": "attn_proj",
    "mlp_norm": "mlp_norm",
    "expert_fc1": "expert_fc1",
    "moe_act": "moe_act",
}
_FP8_RECIPES = {"delayed": "delayed", "tensorwise": "current", "mxfp8": "mxfp8"}


def _modern_flags(a, plan: dict) -> None:
    """FP8 (Transformer Engine recipes), optimizer CPU offload and fine-grained activation
    offloading -> pipemem.features plan fields."""
    fmt = a.str("fp8-format") or a.str("fp8")
    if fmt and fmt.lower() not in ("0", "false", "none"):
        if fmt.lower() not in ("e4m3", "hybrid"):
            refuse("fp8-format", f"{fmt!r}: expected e4m3 or hybrid")
        recipe = (a.str("fp8-recipe") or "delayed").lower()  # Megatron's default recipe
        if recipe not in _FP8_RECIPES:
            refuse(
                "fp8-recipe",
                f"{recipe!r} is not modelled; pipemem models delayed, tensorwise (current scaling) and mxfp8",
            )
        plan["fp8"] = _FP8_RECIPES[recipe]
        if a.bool("fp8-param-gather"):
            plan["fp8_param_gather"] = True
        # per-tensor scaling state (amax history, scales): a few KB per layer
        for flag in (
            "fp8-margin",
            "fp8-interval",
            "fp8-amax-history-len",
            "fp8-amax-compute-algo",
            "fp8-wgrad",
        ):
            a.raw(flag)
    else:
        for flag in ("fp8-recipe", "fp8-param-gather"):
            if a.bool(flag) if flag == "fp8-param-gather" else a.str(flag):
                refuse(flag, "needs --fp8-format (FP8 training)")
    if a.bool("optimizer-cpu-offload"):
        if not a.bool("use-precision-aware-optimizer"):
            # Megatron-LM's argument check: its HybridDeviceOptimizer reuses that code path
            refuse(
                "optimizer-cpu-offload",
                "needs --use-precision-aware-optimizer (Megatron-LM refuses it without)",
            )
        frac = a.raw("optimizer-offload-fraction")
        try:
            plan["optimizer_offload"] = float(frac) if frac else 1.0
        except ValueError:
            refuse("optimizer-offload-fraction", f"{frac!r}: expected a number between 0 and 1")
    else:
        a.raw("optimizer-offload-fraction")
    if a.bool("fine-grained-activation-offloading"):
        mods = [m.strip() for m in (a.str("offload-modules") or "").replace(",", " ").split() if m.strip()]
        if not mods:
            refuse(
                "fine-grained-activation-offloading", "without --offload-modules: name the modules to offload"
            )
        bad = [m for m in mods if m not in OFFLOAD_MODULES]
        if bad:
            refuse("offload-modules", f"{bad[0]!r} is not modelled; known: {', '.join(OFFLOAD_MODULES)}")
        plan["activation_offload"] = ",".join(OFFLOAD_MODULES[m] for m in mods)
    else:
        a.raw("offload-modules")


_AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def _aux_loss(a, experts: int, tokens: int, warnings: list[str]) -> None:
    """--moe-router-load-balancing-type (one type or several, Megatron's default aux_loss) with
    --moe-aux-loss-coeff (one coefficient per type; default 0: no loss). Each auxiliary loss
    with a coefficient above 0 makes megatron-core's router (transformer/moe/router.py
    `TopKRouter.routing` -> moe_utils.py `compute_routing_scores_for_aux_loss`) compute a second
    set of [tokens, experts] scores (softmax in fp32; or sigmoid, divided by its row sum) whose
    autograd node keeps them for the backward of the loss: T x E x 4 bytes per MoE layer per
    micro-batch in flight (T = micro batch x seq / (tp x cp), the router's tokens under sequence
    parallelism), shared by every type given. Not modelled: said, with its size."""
    text = a.str("moe-router-load-balancing-type")
    types = text.replace(",", " ").split() if text else ["aux_loss"]
    for t in types:
        if t not in _AUX_LOSSES + ("sinkhorn", "none"):
            raise UserError(
                f"{TOOL}: --moe-router-load-balancing-type {t!r}: expected aux_loss, seq_aux_loss, "
                "global_aux_loss, sinkhorn or none"
            )
    ctext = a.str("moe-aux-loss-coeff")
    try:
        coeffs = [float(c) for c in ctext.replace(",", " ").split()] if ctext else [0.0]
    except ValueError:
        raise UserError(f"{TOOL} argument --moe-aux-loss-coeff {ctext!r}: expected a number") from None
    if len(types) > 1 and len(coeffs) != len(types):
        raise UserError(
            f"{TOOL}: --moe-aux-loss-coeff gives {len(coeffs)} coefficient(s) for "
            f"{len(types)} --moe-router-load-balancing-type values; give one per type"
        )
    if len(types) == 1:
        coeffs = coeffs[:1]
    on = [t for t, c in zip(types, coeffs) if t in _AUX_LOSSES and c > 0]
    if on:
        per_layer = tokens * experts * 4
        warnings.append(
            f"{TOOL}: --moe-router-load-balancing-type {' '.join(on)} with --moe-aux-loss-coeff > 0: "
            "the router's [tokens, experts] scores for the auxiliary loss are kept for its "
            f"backward and not counted: {tokens} x {experts} x 4 B = {per_layer / 2**20:.2f} MiB "
            "per MoE layer per micro-batch in flight"
        )
    if "sinkhorn" in types:
        warnings.append(
            f"{TOOL}: --moe-router-load-balancing-type sinkhorn is not modelled (routed as top-k; "
            "its fp32 Sinkhorn iterations run without autograd, its [tokens, experts] scores are kept)"
        )


def _capacity(a, extra: dict) -> None:
    """--moe-expert-capacity-factor C: each expert takes at most C x its balanced share of tokens
    (the rest dropped, by --moe-token-drop-policy: which ones, not how many); with
    --moe-pad-expert-input-to-capacity every expert's input is padded to that capacity
    (pipemem.templates.moe.rank_load)."""
    text = a.str("moe-expert-capacity-factor")
    factor = None
    if text is not None and text.lower() != "none":
        try:
            factor = float(text)
        except ValueError:
            factor = -1.0
        if not factor > 0:
            raise UserError(f"{TOOL}: --moe-expert-capacity-factor {text!r}: expected a positive number")
        extra["moe_capacity_factor"] = factor
    policy = a.str("moe-token-drop-policy")
    if policy is not None and policy not in ("probs", "position"):
        raise UserError(f"{TOOL}: --moe-token-drop-policy {policy!r}: expected probs or position")
    if a.bool("moe-pad-expert-input-to-capacity"):
        if factor is None:
            raise UserError(
                f"{TOOL}: --moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
                "(Megatron asserts it: padding is to the capacity)"
            )
        extra["moe_pad_to_capacity"] = True


def _moe(a, model: dict, experts: int, topk: int | None, ffn: int, layers: int, warnings: list[str]) -> None:
    """MoE shape as megatron-core builds it: expert width --moe-ffn-hidden-size (default the
    dense width), shared experts of --moe-shared-expert-intermediate-size (all shared experts
    fused in one MLP), --moe-layer-freq choosing which layers are MoE (an int N: layers
    0, N, 2N...; or a list of 0/1 per layer). Written as a qwen2_moe-style HF config."""
    model.update(
        model_type="qwen2_moe",
        num_experts=experts,
        num_experts_per_tok=topk or 2,
        moe_intermediate_size=a.int("moe-ffn-hidden-size") or ffn,
    )
    if topk is None:
        warnings.append(f"{TOOL}: --moe-router-topk not given; Megatron's default 2 used")
    shared = a.int("moe-shared-expert-intermediate-size")
    model["shared_expert_intermediate_size"] = shared or 0
    freq = a.str("moe-layer-freq")
    moe_layers = set(range(layers))
    if freq is not None:
        pattern = _layer_pattern(freq, layers)
        moe_layers = {i for i in range(layers) if pattern[i]}
    model["mlp_only_layers"] = sorted(set(range(layers)) - moe_layers)


_MLA_FLAGS = ("q-lora-rank", "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim")


def _mla(
    a, llama: dict, experts: int | None, topk: int | None, ffn: int, layers: int, bias: bool, warnings
) -> dict:
    """--multi-latent-attention: megatron-core's MLASelfAttention, written as a DeepSeek-V3
    config (a DeepSeek-V2 one with the softmax router): --q-lora-rank (absent: one query
    projection, Megatron-LM's default), --kv-lora-rank, --qk-head-dim (the no-position part),
    --qk-pos-emb-head-dim (the rotary part), --v-head-dim; --qk-layernorm (the latents' norms:
    Megatron's DeepSeek examples give it). With --num-experts, DeepSeek's MoE as megatron-core
    builds it: the router (`_router`), --moe-shared-expert-intermediate-size (all shared
    experts fused in one MLP: n_shared_experts x --moe-ffn-hidden-size), --moe-layer-freq's dense
    layers; --mtp-num-layers multi-token prediction depths on the last stage."""
    if not a.bool("qk-layernorm"):
        refuse(
            "multi-latent-attention",
            "without --qk-layernorm (no norms on the q / kv latents) is not modelled; "
            "Megatron's DeepSeek examples give --qk-layernorm",
        )
    if bias:
        refuse(
            "multi-latent-attention", "without --disable-bias-linear: biased MLA projections are not modelled"
        )
    dims = {}
    for flag in _MLA_FLAGS[1:]:
        v = a.int(flag)
        if v is None or v <= 0:
            raise UserError(f"{TOOL}: --multi-latent-attention needs --{flag} (a positive integer)")
        dims[flag] = v
    if dims["qk-pos-emb-head-dim"] % 2:
        raise UserError(
            f"{TOOL}: --qk-pos-emb-head-dim {dims['qk-pos-emb-head-dim']} must be even (rotary pairs)"
        )
    q_lora = a.int("q-lora-rank")
    if q_lora is not None and q_lora <= 0:
        raise UserError(f"{TOOL}: --q-lora-rank {q_lora}: expected a positive integer (or leave it out)")
    a.int("kv-channels")  # MLA's heads are --qk-head-dim + --qk-pos-emb-head-dim wide
    a.used.update({"group-query-attention", "num-query-groups"})  # MLA has no query groups
    mtp = a.int("mtp-num-layers", minimum=0) or 0
    a.raw("mtp-loss-scaling-factor")  # scales the MTP loss: no memory effect
    model = {
        "model_type": "deepseek_v3",
        "hidden_size": llama["hidden_size"],
        "intermediate_size": ffn,
        "num_attention_heads": llama["num_attention_heads"],
        "num_key_value_heads": llama["num_attention_heads"],
        "num_hidden_layers": layers,
        "vocab_size": llama["vocab_size"],
        "max_position_embeddings": llama["max_position_embeddings"],
        "tie_word_embeddings": llama["tie_word_embeddings"],
        "attention_bias": False,
        "hidden_act": "silu",
        "q_lora_rank": q_lora,
        "kv_lora_rank": dims["kv-lora-rank"],
        "qk_nope_head_dim": dims["qk-head-dim"],
        "qk_rope_head_dim": dims["qk-pos-emb-head-dim"],
        "v_head_dim": dims["v-head-dim"],
        "num_nextn_predict_layers": mtp,
        "first_k_dense_replace": 0,
    }
    if not experts:
        # every layer dense: the MoE keys only say so (first_k_dense_replace = all layers)
        model.update(
            n_routed_experts=1, num_experts_per_tok=1, moe_intermediate_size=ffn, first_k_dense_replace=layers
        )
        model.update(n_shared_experts=0, n_group=1, topk_group=1)
        return model
    moe_ffn = a.int("moe-ffn-hidden-size") or ffn
    if topk is None:
        warnings.append(f"{TOOL}: --moe-router-topk not given; Megatron's default 2 used")
    topk = topk or 2
    if not 0 < topk <= experts:
        raise UserError(f"{TOOL}: --moe-router-topk {topk} must be in 1..{experts} (--num-experts)")
    shared = a.int("moe-shared-expert-intermediate-size") or 0
    if shared % moe_ffn:
        refuse(
            "moe-shared-expert-intermediate-size",
            f"{shared} is not a multiple of --moe-ffn-hidden-size {moe_ffn}: DeepSeek's shared experts "
            "are whole experts (n_shared_experts x the expert width)",
        )
    model.update(
        n_routed_experts=experts,
        num_experts_per_tok=topk,
        moe_intermediate_size=moe_ffn,
        n_shared_experts=shared // moe_ffn,
    )
    freq = a.str("moe-layer-freq")
    if freq is not None:
        pattern = _layer_pattern(freq, layers)
        model["mlp_only_layers"] = [i for i in range(layers) if not pattern[i]]
    model.update(_router(a, experts, topk))
    return model


def _router(a, experts: int, topk: int) -> dict:
    """megatron-core's top-k router (transformer/moe/router.py, moe_utils.py
    `topk_routing_with_score_function`) as a DeepSeek config: --moe-router-score-function sigmoid
    (DeepSeek-V3: sigmoid scores, renormalised over the k) or softmax (DeepSeek-V2),
    --moe-router-enable-expert-bias (sigmoid only: a bias on the choice, an fp32 buffer),
    group-limited top-k over --moe-router-num-groups (both group flags or neither; groups divide
    the experts), --moe-router-topk-scaling-factor."""
    score = (a.str("moe-router-score-function") or "softmax").lower()
    if score not in ("softmax", "sigmoid"):
        refuse("moe-router-score-function", f"{score!r}: expected softmax or sigmoid")
    if a.bool("moe-router-enable-expert-bias") and score != "sigmoid":
        raise UserError(
            f"{TOOL}: --moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
            "(Megatron asserts this)"
        )
    groups, group_topk = a.int("moe-router-num-groups"), a.int("moe-router-group-topk")
    if (groups is None) != (group_topk is None):
        given = "--moe-router-num-groups" if groups is not None else "--moe-router-group-topk"
        raise UserError(
            f"{TOOL}: {given} without its pair: group-limited routing needs both "
            "--moe-router-num-groups and --moe-router-group-topk"
        )
    if groups is not None:
        if groups <= 0 or experts % groups:
            raise UserError(f"{TOOL}: --moe-router-num-groups {groups} must divide --num-experts {experts}")
        if not 0 < group_topk <= groups:
            raise UserError(
                f"{TOOL}: --moe-router-group-topk {group_topk} must be in 1..{groups} "
                "(--moe-router-num-groups)"
            )
        if topk % group_topk:
            raise UserError(
                f"{TOOL}: --moe-router-topk {topk} must be a multiple of --moe-router-group-topk "
                f"{group_topk} (Megatron takes topk / group_topk experts per group)"
            )
    scaling = _float(a, "moe-router-topk-scaling-factor", 1.0)
    out = {"n_group": groups or 1, "topk_group": group_topk or 1, "routed_scaling_factor": scaling}
    if score == "softmax":
        out.update(
            model_type="deepseek_v2",
            topk_method="group_limited_greedy" if groups else "greedy",
            rope_interleave=False,
        )
    else:
        out["norm_topk_prob"] = True
    return out


def _router_without_mla(a, warnings: list[str]) -> None:
    """DeepSeek's router flags on a model without multi-head latent attention (a qwen2_moe-style
    config): read and checked, the choice modelled as the softmax top-k router."""
    score = (a.str("moe-router-score-function") or "softmax").lower()
    if score not in ("softmax", "sigmoid"):
        refuse("moe-router-score-function", f"{score!r}: expected softmax or sigmoid")
    a.bool("moe-router-enable-expert-bias")
    a.raw("moe-router-topk-scaling-factor")
    groups, group_topk = a.int("moe-router-num-groups"), a.int("moe-router-group-topk")
    if (groups is None) != (group_topk is None):
        raise UserError(
            f"{TOOL}: group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk"
        )
    if score == "sigmoid":
        warnings.append(
            f"{TOOL}: --moe-router-score-function sigmoid without --multi-latent-attention: the "
            "router is modelled as softmax top-k (it keeps [tokens, k] scores where the sigmoid "
            "router keeps [tokens, experts] fp32 ones per MoE layer)"
        )


def _layer_pattern(text: str, layers: int) -> list[int]:
    """--moe-layer-freq: an int N (every N-th layer from 0 is MoE) or a Python list expression of
    0/1 per layer, e.g. "([1]*3+[0])*8" (what megatron evaluates)."""
    text = text.strip()
    try:
        n = int(text)
    except ValueError:
        pass
    else:
        if n < 1:
            refuse("moe-layer-freq", f"{n}: must be >= 1")
        return [1 if i % n == 0 else 0 for i in range(layers)]
    try:
        value = _eval_list(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        refuse("moe-layer-freq", f"{text!r}: expected an integer or a list such as ([1]*3+[0])*8")
    if len(value) != layers or any(v not in (0, 1) for v in value):
        refuse("moe-layer-freq", f"{text!r}: needs one 0 or 1 per layer ({layers} layers)")
    return value


def _eval_list(node) -> list[int]:
    """Lists of ints with + and * only (no eval)."""
    if isinstance(node, ast.List):
        out = []
        for e in node.elts:
            if not (isinstance(e, ast.Constant) and isinstance(e.value, int)):
                raise ValueError("list items must be integers")
            out.append(e.value)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval_list(node.left) + _eval_list(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if isinstance(node.right, ast.Constant) and isinstance(node.right.value, int):
            return _eval_list(node.left) * node.right.value
        if isinstance(node.left, ast.Constant) and isinstance(node.left.value, int):
            return _eval_list(node.right) * node.left.value
    raise ValueError("unsupported expression")


def _sharding(a, plan: dict) -> None:
    """Distributed optimizer, Megatron-FSDP, torch FSDP2."""
    if a.bool("use-distributed-optimizer"):
        plan["dist_opt"] = True
    instances = a.int("num-distributed-optimizer-instances")
    if instances is not None and instances > 1:
        refuse(
            "num-distributed-optimizer-instances",
            f"{instances}: sharding the optimizer over part of the data-parallel group is not modelled",
        )
    if a.bool("use-torch-fsdp2"):
        plan.pop("dist_opt", None)
        plan["fsdp"] = True
    megatron_fsdp = a.bool("use-megatron-fsdp") or a.bool("use-custom-fsdp")
    strategy = (a.str("data-parallel-sharding-strategy") or "no_shard").lower()
    if megatron_fsdp:
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}.get(strategy)
        if zero is None:
            refuse(
                "data-parallel-sharding-strategy",
                f"{strategy!r}: expected no_shard, optim, optim_grads or optim_grads_params",
            )
        plan.pop("dist_opt", None)
        plan["zero"] = zero


def _precision(a, plan: dict, extra: dict) -> None:
    """Param, main-grad, master-weight and optimizer-state dtypes as Megatron resolves them."""
    fp16, bf16 = a.bool("fp16"), a.bool("bf16")
    if fp16 and bf16:
        raise UserError(f"{TOOL}: --fp16 and --bf16 both given; choose one")
    dtype = "bf16" if bf16 else ("fp16" if fp16 else "fp32")
    plan["dtype"] = dtype
    main_grads = _dtype_arg(a, "main-grads-dtype", ("fp32", "bf16"))
    accumulate_fp32 = bool(a.bool("accumulate-allreduce-grads-in-fp32"))
    grad_bf16 = bool(a.bool("grad-reduce-in-bf16"))
    if dtype == "fp32":
        plan["master_weights"] = False
        return
    if accumulate_fp32 and (grad_bf16 or main_grads == "bf16"):
        raise UserError(
            f"{TOOL}: --accumulate-allreduce-grads-in-fp32 contradicts "
            f"{'--grad-reduce-in-bf16' if grad_bf16 else '--main-grads-dtype bf16'}"
        )
    if dtype == "bf16":
        # arguments.py: bf16 accumulates and reduces grads in fp32 unless told otherwise
        fp32_grads = not grad_bf16 and (accumulate_fp32 or main_grads in (None, "fp32"))
    else:
        fp32_grads = accumulate_fp32  # fp16: grads in fp16 unless asked
    plan["main_grad_dtype"] = "fp32" if fp32_grads else dtype
    if a.bool("use-precision-aware-optimizer"):
        extra["precision_aware_optimizer"] = True
        for flag, key, allowed in (
            ("main-params-dtype", "main_params_dtype", ("fp32", "fp16")),
            ("exp-avg-dtype", "exp_avg_dtype", ("fp32", "fp16", "bf16", "fp8")),
            ("exp-avg-sq-dtype", "exp_avg_sq_dtype", ("fp32", "fp16", "bf16", "fp8")),
        ):
            value = _dtype_arg(a, flag, allowed)
            if value not in (None, "fp32"):
                extra[key] = value
    else:
        for flag in ("main-params-dtype", "exp-avg-dtype", "exp-avg-sq-dtype"):
            value = a.str(flag)
            if value is not None and value.lower() != "fp32":
                raise UserError(
                    f"{TOOL}: --{flag} {value} needs --use-precision-aware-optimizer "
                    "(Megatron ignores it otherwise)"
                )


def _dtype_arg(a, flag: str, allowed: tuple[str, ...]) -> str | None:
    value = a.str(flag)
    if value is None:
        return None
    value = value.lower()
    if value not in allowed:
        raise UserError(f"{TOOL}: --{flag} {value!r}: expected one of {', '.join(allowed)}")
    return _DTYPES[value]


def _required(a, name: str) -> int:
    v = a.int(name)
    if v is None:
        raise UserError(f"{TOOL}: --{name} is required to describe the model")
    return v


def _float(a, name: str, default: float) -> float:
    text = a.str(name)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{TOOL} argument --{name} {text!r}: expected a number") from None


def _is_gpt2_vocab_file(path: str | None) -> bool:
    """gpt2-vocab.json, gpt2_vocab.json, .../gpt2/vocab.json: GPT-2's BPE vocabulary by its name."""
    if not path:
        return False
    parts = path.replace("\\", "/").strip("'\"").lower().split("/")
    name = parts[-1]
    return (
        name.endswith(".json")
        and "vocab" in name
        and ("gpt2" in name or (len(parts) > 1 and "gpt2" in parts[-2]))
    )


def _vocab(a, warnings: list[str]) -> int:
    """The tokenizer's vocabulary, unpadded: the megatron convention pads it to 128 x tp itself."""
    padded = a.int("padded-vocab-size")
    vocab = a.int("vocab-size")
    tok = (a.str("tokenizer-type") or "").lower()
    a.str("tokenizer-model")
    divisible = a.int("make-vocab-size-divisible-by")
    if padded is not None:
        return padded
    if vocab is None:
        vocab = _TOKENIZER_VOCAB.get(tok)
    if vocab is None and tok in ("", "gpt2bpetokenizer") and _is_gpt2_vocab_file(a.raw("vocab-file")):
        # Megatron's GPT examples pass GPT-2's BPE files (gpt2-vocab.json + gpt2-merges.txt)
        vocab = _TOKENIZER_VOCAB["gpt2bpetokenizer"]
        warnings.append(
            f"{TOOL}: --vocab-file {a.raw('vocab-file')} names GPT-2's BPE vocabulary: "
            f"{vocab} tokens (GPT2BPETokenizer)"
        )
    if vocab is None:
        raise UserError(
            f"{TOOL}: vocabulary size unknown for tokenizer {tok or '(none)'!r}; "
            "add --vocab-size N or --padded-vocab-size N"
        )
    if divisible is not None and divisible != 128:
        multiple = divisible * (a.int("tensor-model-parallel-size") or 1)
        vocab = -(-vocab // multiple) * multiple
        warnings.append(
            f"{TOOL}: vocabulary padded to a multiple of {multiple}; the megatron convention "
            "then pads to a multiple of 128 x tp"
        )
    return vocab


def _recompute(a, plan: dict, warnings: list[str], layers: int) -> None:
    gran = a.str("recompute-granularity")
    method = (a.str("recompute-method") or "").lower()
    num = a.int("recompute-num-layers")
    modules = a.str("recompute-modules")
    if a.bool("recompute-activations"):
        if gran and gran.lower() != "selective":
            raise UserError(
                f"{TOOL}: --recompute-activations (selective) contradicts --recompute-granularity {gran}"
            )
        gran = "selective"
    if not gran:
        if method or num is not None:
            raise UserError(
                f"{TOOL}: --recompute-method/--recompute-num-layers need --recompute-granularity full"
            )
        plan["recompute"] = "none"
        return
    gran = gran.lower()
    if gran == "selective":
        if modules is not None and sorted(modules.replace(",", " ").split()) != ["core_attn"]:
            refuse(
                "recompute-modules",
                f"{modules}: pipemem models selective recompute of core_attn (the default) only",
            )
        if method or num is not None:
            raise UserError(
                f"{TOOL}: --recompute-method/--recompute-num-layers apply to --recompute-granularity "
                "full only (Megatron asserts this)"
            )
        plan["recompute"] = "selective"
        return
    if gran != "full":
        raise UserError(f"{TOOL}: --recompute-granularity {gran!r}: expected full or selective")
    plan["recompute"] = "full"
    if method not in ("uniform", "block"):
        raise UserError(f"{TOOL}: --recompute-granularity full needs --recompute-method uniform or block")
    if num is None:
        raise UserError(
            f"{TOOL}: --recompute-granularity full needs --recompute-num-layers (Megatron asserts this)"
        )
    if method == "block":
        plan["recompute_layers"] = num
    elif num > 1:
        refuse(
            "recompute-num-layers",
            f"{num} with --recompute-method uniform (one checkpoint over {num} layers) "
            "is not modelled; pipemem models uniform with 1 layer per checkpoint, or block",
        )


def _uneven_layout(layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int]:
    """Megatron's uneven pipeline: the first/last stage get the given counts, the rest split evenly."""
    if vpp > 1:
        raise UserError(
            f"{TOOL}: --decoder-first/last-pipeline-num-layers with virtual pipeline stages is not supported"
        )
    stages = pp
    fixed = [x for x in (first, last) if x is not None]
    middle_stages = stages - len(fixed)
    rest = layers - sum(fixed)
    if middle_stages <= 0 or rest < 0 or rest % middle_stages:
        raise UserError(
            f"{TOOL}: {layers} layers do not split over {pp} stages with first={first}, last={last}"
        )
    each = rest // middle_stages
    out = [each] * stages
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out
