"""Megatron-LM `pretrain_gpt.py` arguments -> an HF-style model config and a pipemem plan.

Megatron describes the model in its arguments, so we write the equivalent HF config:
`--swiglu` / `--normalization RMSNorm` / rotary positions give a Llama-style model
(`mixtral` when `--num-experts` is set), otherwise a GPT-2-style one. Defaults follow
Megatron's argument defaults: ffn = 4h (or 8h/3 rounded down to a multiple of 64 with
SwiGLU), biases on unless `--disable-bias-linear`, tied embeddings unless
`--untie-embeddings-and-output-weights`, fp32 unless `--bf16`/`--fp16`.
World size is not a Megatron argument: it comes from the launcher part of a pasted command
(`torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py ...`), `--world-size`, or `--dp`.
"""

from __future__ import annotations

from ..errors import UserError
from . import ToolConfig
from .argv import parse

TOOL = "Megatron"

KNOWN = {
    "num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "group-query-attention",
    "num-query-groups", "kv-channels", "seq-length", "max-position-embeddings", "micro-batch-size",
    "global-batch-size", "tensor-model-parallel-size", "pipeline-model-parallel-size",
    "num-layers-per-virtual-pipeline-stage", "num-virtual-stages-per-pipeline-rank",
    "context-parallel-size", "expert-model-parallel-size", "expert-tensor-parallel-size",
    "num-experts", "moe-router-topk", "moe-ffn-hidden-size", "moe-shared-expert-intermediate-size",
    "sequence-parallel", "use-distributed-optimizer", "recompute-granularity", "recompute-method",
    "recompute-num-layers", "recompute-activations", "bf16", "fp16", "swiglu", "normalization",
    "untie-embeddings-and-output-weights", "padded-vocab-size", "vocab-size", "tokenizer-type",
    "tokenizer-model", "make-vocab-size-divisible-by", "use-flash-attn", "attention-backend",
    "disable-bias-linear", "add-qkv-bias", "position-embedding-type", "use-rotary-position-embeddings",
    "world-size", "nproc-per-node", "nnodes", "optimizer", "attention-dropout", "hidden-dropout",
    "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers", "qk-layernorm",
    "moe-layer-freq", "accumulate-allreduce-grads-in-fp32", "data-parallel-size",
}
IGNORED = {
    "overlap-grad-reduce", "overlap-param-gather", "overlap-param-gather-with-optimizer-step",
    "tp-comm-overlap", "lr", "min-lr", "lr-decay-style", "lr-warmup-iters", "lr-warmup-fraction",
    "lr-decay-iters", "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "adam-eps", "init-method-std",
    "train-iters", "train-samples", "log-interval", "save-interval", "eval-interval", "eval-iters", "save",
    "load", "data-path", "split", "vocab-file", "merge-file", "tensorboard-dir", "wandb-project",
    "wandb-exp-name", "seed", "no-gradient-accumulation-fusion", "no-masked-softmax-fusion",
    "no-bias-gelu-fusion", "no-bias-dropout-fusion", "no-bias-swiglu-fusion", "no-rope-fusion",
    "use-mcore-models", "transformer-impl", "distributed-backend", "distributed-timeout-minutes",
    "log-throughput", "log-timers-to-tensorboard", "log-memory-to-tensorboard", "timing-log-level",
    "num-workers", "dataloader-type", "no-async-tensor-model-parallel-allreduce", "manual-gc",
    "manual-gc-interval", "ckpt-format", "rotary-base", "rotary-percent", "norm-epsilon",
    "layernorm-epsilon", "apply-layernorm-1p", "no-position-embedding", "use-checkpoint-args",
    "exit-interval", "exit-duration-in-mins", "no-load-optim", "no-load-rng", "finetune",
    "moe-router-load-balancing-type", "moe-aux-loss-coeff", "moe-grouped-gemm", "moe-token-dispatcher-type",
    "moe-router-dtype", "moe-permute-fusion", "moe-z-loss-coeff", "mock-data", "bias-swiglu-fusion",
    "cross-entropy-loss-fusion", "use-torch-fsdp2", "profile", "profile-step-start", "profile-step-end",
    "log-params-norm", "log-num-zeros-in-grad", "loss-scale", "initial-loss-scale", "min-loss-scale",
    "loss-scale-window", "hysteresis", "attention-softmax-in-fp32", "sequence-parallel-overlap",
    "rope-scaling", "rotary-seq-len-interpolation-factor", "no-create-attention-mask-in-dataloader",
    "eod-mask-loss", "reset-position-ids", "reset-attention-mask", "override-opposite-embeddings",
    "defer-embedding-wgrad-compute", "use-legacy-models", "bf16-reduce",
}

# Vocabulary sizes of Megatron's built-in tokenizers (before padding).
_TOKENIZER_VOCAB = {"gpt2bpetokenizer": 50257, "llama2tokenizer": 32000, "llama3tokenizer": 128256}


def read(argv: list[str]) -> ToolConfig:
    a = parse(list(argv), TOOL)
    if not a.values:
        raise UserError("--from-megatron: no arguments after `--`; paste the pretrain_gpt.py arguments, e.g. "
                        "pipemem estimate --from-megatron -- --num-layers 32 --hidden-size 4096 ...")
    warnings: list[str] = []
    plan: dict = {"convention": "megatron"}

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
        raise UserError(f"{TOOL}: --hidden-size {hidden} is not divisible by --num-attention-heads {heads}; "
                        "give --kv-channels")
    swiglu = bool(a.bool("swiglu"))
    norm = (a.str("normalization") or "LayerNorm").lower()
    if norm not in ("layernorm", "rmsnorm"):
        raise UserError(f"{TOOL}: --normalization {norm!r}: expected LayerNorm or RMSNorm")
    pos = (a.str("position-embedding-type") or ("rope" if a.bool("use-rotary-position-embeddings")
                                                else "learned_absolute")).lower()
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

    if llama_like:
        if not swiglu:
            warnings.append(f"{TOOL}: rotary/RMSNorm without --swiglu is modelled as a Llama-style "
                            "gated (SwiGLU) MLP")
        model = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
                 "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers,
                 "vocab_size": vocab, "max_position_embeddings": max_pos, "tie_word_embeddings": tied,
                 "attention_bias": qkv_bias, "mlp_bias": bias, "hidden_act": "silu"}
        if head_dim is not None:
            model["head_dim"] = head_dim
        if norm != "rmsnorm":
            warnings.append(f"{TOOL}: LayerNorm with a Llama-style model is modelled as RMSNorm "
                            "(saves the same input; one fewer parameter vector)")
        if a.bool("qk-layernorm"):
            warnings.append(f"{TOOL}: --qk-layernorm is not modelled for Llama-style models")
        if experts:
            model.update(model_type="mixtral", num_local_experts=experts, num_experts_per_tok=topk or 2,
                         intermediate_size=a.int("moe-ffn-hidden-size") or ffn)
            if topk is None:
                warnings.append(f"{TOOL}: --moe-router-topk not given; Megatron's default 2 used")
            if a.has("moe-shared-expert-intermediate-size"):
                warnings.append(f"{TOOL}: shared experts are not modelled")
    else:
        if experts:
            raise UserError(f"{TOOL}: --num-experts needs a Llama-style model (--swiglu, "
                            "--normalization RMSNorm); GPT-style MoE is not supported")
        if not bias:
            warnings.append(f"{TOOL}: --disable-bias-linear on a GPT-style model: biases still counted")
        model = {"model_type": "gpt2", "n_embd": hidden, "n_layer": layers, "n_head": heads,
                 "n_inner": ffn, "n_positions": max_pos, "vocab_size": vocab, "tie_word_embeddings": tied,
                 "activation_function": "gelu",
                 "attn_pdrop": _float(a, "attention-dropout", 0.1), "resid_pdrop": _float(a, "hidden-dropout", 0.1),
                 "embd_pdrop": _float(a, "hidden-dropout", 0.1)}
        if kv != heads:
            raise UserError(f"{TOOL}: --group-query-attention needs a Llama-style model (--swiglu or rope)")
    a.used.update({"attention-dropout", "hidden-dropout"})

    plan["seq_len"] = seq
    mb = a.int("micro-batch-size")
    if mb is not None:
        plan["micro_batch"] = mb
    tp = a.int("tensor-model-parallel-size") or 1
    pp = a.int("pipeline-model-parallel-size") or 1
    cp = a.int("context-parallel-size") or 1
    plan.update(tp=tp, pp=pp, cp=cp)
    ep = a.int("expert-model-parallel-size")
    if ep is not None:
        plan["ep"] = ep
    etp = a.int("expert-tensor-parallel-size")
    if etp is not None:
        plan["etp"] = etp

    world = a.int("world-size")
    if world is None and a.has("nproc-per-node"):
        world = a.int("nproc-per-node") * (a.int("nnodes") or 1)
    world = world or a.world_size
    dp = a.int("data-parallel-size")
    if world is not None:
        if world % (tp * pp * cp):
            raise UserError(f"{TOOL}: world size {world} is not divisible by tensor x pipeline x context "
                            f"parallel = {tp * pp * cp}")
        if dp is not None and dp != world // (tp * pp * cp):
            raise UserError(f"{TOOL}: --data-parallel-size {dp} contradicts world size {world} / "
                            f"(tp {tp} x pp {pp} x cp {cp})")
        dp = world // (tp * pp * cp)
    if dp is not None:
        plan["dp"] = dp

    vps = a.int("num-layers-per-virtual-pipeline-stage")
    vstages = a.int("num-virtual-stages-per-pipeline-rank")
    if vps is not None and vstages is not None:
        raise UserError(f"{TOOL}: give --num-layers-per-virtual-pipeline-stage or "
                        "--num-virtual-stages-per-pipeline-rank, not both")
    if vps is not None:
        if layers % (pp * vps):
            raise UserError(f"{TOOL}: --num-layers {layers} is not divisible by pipeline size {pp} x "
                            f"--num-layers-per-virtual-pipeline-stage {vps}")
        plan["vpp"] = layers // (pp * vps)
    elif vstages is not None:
        plan["vpp"] = vstages
    first = a.int("decoder-first-pipeline-num-layers", minimum=0)
    last = a.int("decoder-last-pipeline-num-layers", minimum=0)
    if first is not None or last is not None:
        plan["pp_layout"] = _uneven_layout(layers, pp, plan.get("vpp", 1), first, last)

    if a.bool("sequence-parallel"):
        plan["sp"] = True
    elif tp > 1:
        plan["sp"] = False
    if a.bool("use-distributed-optimizer"):
        plan["dist_opt"] = True

    fp16, bf16 = a.bool("fp16"), a.bool("bf16")
    if fp16 and bf16:
        raise UserError(f"{TOOL}: --fp16 and --bf16 both given; choose one")
    plan["dtype"] = "bf16" if bf16 else ("fp16" if fp16 else "fp32")
    if plan["dtype"] == "fp32":
        plan["master_weights"] = False
    a.bool("accumulate-allreduce-grads-in-fp32")

    _recompute(a, plan, warnings, layers)

    flash = a.bool("use-flash-attn")
    backend = (a.str("attention-backend") or "").lower()
    if backend in ("unfused", "local"):
        if flash:
            raise UserError(f"{TOOL}: --use-flash-attn contradicts --attention-backend {backend}")
        plan["flash_attn"] = False
    elif flash or backend in ("flash", "fused", "auto"):
        plan["flash_attn"] = True

    opt = a.str("optimizer")
    if opt:
        if opt.lower() not in ("adam", "sgd"):
            raise UserError(f"{TOOL}: --optimizer {opt!r}: expected adam or sgd")
        plan["optimizer"] = "adamw" if opt.lower() == "adam" else "sgd"   # Megatron's adam is AdamW

    gbs = a.int("global-batch-size")
    if gbs is not None:
        plan["global_batch"] = gbs
    if a.has("moe-layer-freq") and (a.str("moe-layer-freq") or "1") != "1":
        warnings.append(f"{TOOL}: --moe-layer-freq other than 1 is modelled as every layer MoE")

    unknown = a.unknown(KNOWN, IGNORED)
    if unknown:
        warnings.append(f"{TOOL}: not modelled, ignored: " + " ".join("--" + u for u in unknown))
    name = f"megatron-{layers}L-{hidden}h"
    return ToolConfig(model=model, plan=plan, warnings=warnings, tool=TOOL, model_name=name,
                      dp_unknown=dp is None)


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
    return name.endswith(".json") and "vocab" in name and ("gpt2" in name or (len(parts) > 1 and "gpt2" in parts[-2]))


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
        warnings.append(f"{TOOL}: --vocab-file {a.raw('vocab-file')} names GPT-2's BPE vocabulary: "
                        f"{vocab} tokens (GPT2BPETokenizer)")
    if vocab is None:
        raise UserError(f"{TOOL}: vocabulary size unknown for tokenizer {tok or '(none)'!r}; "
                        "add --vocab-size N or --padded-vocab-size N")
    if divisible is not None and divisible != 128:
        multiple = divisible * (a.int("tensor-model-parallel-size") or 1)
        vocab = -(-vocab // multiple) * multiple
        warnings.append(f"{TOOL}: vocabulary padded to a multiple of {multiple}; the megatron convention "
                        "then pads to a multiple of 128 x tp")
    return vocab


def _recompute(a, plan: dict, warnings: list[str], layers: int) -> None:
    gran = a.str("recompute-granularity")
    method = (a.str("recompute-method") or "").lower()
    num = a.int("recompute-num-layers")
    if a.bool("recompute-activations"):
        if gran and gran.lower() != "selective":
            raise UserError(f"{TOOL}: --recompute-activations (selective) contradicts "
                            f"--recompute-granularity {gran}")
        gran = "selective"
    if not gran:
        if method or num is not None:
            raise UserError(f"{TOOL}: --recompute-method/--recompute-num-layers need --recompute-granularity full")
        plan["recompute"] = "none"
        return
    gran = gran.lower()
    if gran == "selective":
        plan["recompute"] = "selective"
        return
    if gran != "full":
        raise UserError(f"{TOOL}: --recompute-granularity {gran!r}: expected full or selective")
    plan["recompute"] = "full"
    if method not in ("uniform", "block"):
        raise UserError(f"{TOOL}: --recompute-granularity full needs --recompute-method uniform or block")
    if method == "block":
        plan["recompute_layers"] = num if num is not None else layers
    elif num and num > 1:
        warnings.append(f"{TOOL}: --recompute-method uniform --recompute-num-layers {num} (one checkpoint per "
                        f"{num} layers) is modelled as one checkpoint per layer")


def _uneven_layout(layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int]:
    """Megatron's uneven pipeline: the first/last stage get the given counts, the rest split evenly."""
    if vpp > 1:
        raise UserError(f"{TOOL}: --decoder-first/last-pipeline-num-layers with virtual pipeline stages "
                        "is not supported")
    stages = pp
    fixed = [x for x in (first, last) if x is not None]
    middle_stages = stages - len(fixed)
    rest = layers - sum(fixed)
    if middle_stages <= 0 or rest < 0 or rest % middle_stages:
        raise UserError(f"{TOOL}: {layers} layers do not split over {pp} stages with first={first}, last={last}")
    each = rest // middle_stages
    out = [each] * stages
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out
