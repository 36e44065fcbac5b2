"""LoRA and QLoRA fine-tuning: which linears carry adapters, and what their weights weigh.

A LoRA plan (`lora_rank` > 0) freezes the base model and trains, beside each targeted linear
W [out, in], two adapter matrices A [r, in] and B [out, r] (PEFT's `LoraLayer`, torchtune's
`LoRALinear`): y = x W^T + scale * B(A(dropout(x))). What that does to memory:

* static: the base weights stay in their dtype, frozen (no gradient, no optimizer state, no
  master copy); only the adapters have gradients and optimizer states. With QLoRA the base
  linears are 4-bit NF4 (`nf4_bytes`); norms and embeddings stay in the model's dtype.
* activations (pipemem.templates.layers `_Gen.lora`): the frozen linear saves no input (its
  input grad needs W alone); the adapter's A saves its input -- the very tensor the base saw
  (no new storage) unless dropout (each adapter its own dropout: a new tensor and a mask) or a
  cast to the adapters' dtype makes a new one; B saves A's output, r wide.

Target names are canonical (`TARGETS`); Hugging Face's and torchtune's module names map onto
them (`ALIASES`). `all-linear` (PEFT) / `all` (LLaMA-Factory) are every linear of the decoder
layers (not the output layer).
"""

from __future__ import annotations

from .errors import UserError

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ALIASES = {
    "q": "q",
    "k": "k",
    "v": "v",
    "o": "o",
    "gate": "gate",
    "up": "up",
    "down": "down",
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "output_proj": "o",  # torchtune
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",  # torchtune's FeedForward: w2(silu(w1(x)) * w3(x))
    "w3": "up",
    "w2": "down",
}
ALL_LINEAR = ("all-linear", "all")
# Module names PEFT would wrap whose adapters are not modelled, and why (refused by name)
NOT_MODELLED = {
    **{
        n: "the output layer: its adapter's [tokens, vocab] outputs and the head are not modelled"
        for n in ("lm_head", "output", "embed_out")
    },
    **{
        n: "an embedding (LoRA's Embedding layer) is not modelled"
        for n in ("embed_tokens", "wte", "tok_embeddings")
    },
    **{
        n: "a fused QKV projection: LoRA is modelled on separate q_proj, k_proj, v_proj"
        for n in ("qkv_proj", "query_key_value", "W_pack", "Wqkv", "qkv")
    },
    **{
        n: "a GPT-2 style linear (c_attn is a fused QKV): LoRA is modelled on Llama-like linears"
        for n in ("c_attn", "c_proj", "c_fc")
    },
    **{
        n: "a fused or non-gated MLP linear: LoRA is modelled on gate_proj, up_proj, down_proj"
        for n in ("gate_up_proj", "fc1", "fc2", "dense_h_to_4h", "dense_4h_to_h")
    },
    **{n: "mixture-of-experts weights are not modelled" for n in ("experts", "router", "block_sparse_moe")},
}
# PEFT's default target modules for Llama-like models (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
DEFAULT_TARGETS = ("q", "v")
# The template's linear names (pipemem.templates.layers) -> canonical target
TEMPLATE_LINEARS = {
    "attn.q_proj": "q",
    "attn.k_proj": "k",
    "attn.v_proj": "v",
    "attn.o_proj": "o",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.fc2": "down",
}
# bitsandbytes' 4-bit storage (functional.quantize_4bit, bnb 0.50; torchao's NF4Tensor keeps the
# same layout): two 4-bit codes per uint8; one absmax per block of 64 weights, which double
# quantization (compress_statistics=True, bnb_4bit_use_double_quant) stores as a uint8 code per
# block plus an fp32 absmax per 256 blocks (quantize_blockwise, blocksize 256); per tensor, its
# 16-entry fp32 NF4 code, and with double quantization the 256-entry fp32 code of the second
# level and the fp32 offset.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256


def nf4_bytes(elems: int, double_quant: bool = True) -> int:
    """Bytes of one weight tensor of `elems` elements stored as NF4 by bitsandbytes."""
    blocks = -(-elems // NF4_BLOCK)
    data = -(-elems // 2)
    if not double_quant:
        return data + 4 * blocks + 16 * 4
    return data + blocks + 4 * -(-blocks // NF4_SCALER_BLOCK) + 256 * 4 + 4 + 16 * 4


def dequant_bytes(elems: int, compute_bytes: int) -> int:
    """What one use of an NF4 weight allocates: its double-quantized absmax dequantized to fp32
    (bitsandbytes' dequantize_blockwise, one per block of 64) and the weight in the compute dtype
    (dequantize_4bit). bitsandbytes 0.50 runs this in MatMul4Bit's forward (gemm_4bit: CUDA takes
    the dequantize + F.linear fallback past 256 tokens) and again for the input grad in its
    backward; torchtune's linear_nf4 likewise dequantizes the weight in each."""
    return elems * compute_bytes + 4 * -(-elems // NF4_BLOCK)


def parse_targets(value) -> frozenset:
    """`--lora-targets` (a comma list, a sequence, all-linear / all, or None = PEFT's default
    q,v) -> canonical target names; a UserError names an unknown module."""
    if value is None or value == "":
        return frozenset(DEFAULT_TARGETS)
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(x).strip() for x in items if str(x).strip()]
    if any(n.lower() in ALL_LINEAR for n in names):
        return frozenset(TARGETS)
    out = set()
    for n in names:
        key = n.rsplit(".", 1)[-1]  # "self_attn.q_proj" -> q_proj
        if key in NOT_MODELLED:
            raise UserError(f"--lora-targets {n!r}: {NOT_MODELLED[key]}; drop it from the targets")
        if key not in ALIASES:
            raise UserError(
                f"--lora-targets {n!r}: not a linear pipemem knows; use all-linear or a comma list of "
                "q_proj, k_proj, v_proj, o_proj (output_proj), gate_proj (w1), up_proj (w3), down_proj (w2)"
            )
        out.add(ALIASES[key])
    if not out:
        raise UserError("--lora-targets is empty: name the linears (q_proj,v_proj...) or all-linear")
    return frozenset(out)


def targets_text(targets) -> str:
    t = frozenset(targets)
    return "all-linear" if t == frozenset(TARGETS) else ",".join(x for x in TARGETS if x in t)


def layer_linears(arch, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(out, in) of each targetable linear of a dense decoder layer, by canonical name."""
    h, d = arch.hidden, arch.head_dim
    a = arch.heads // tp
    kv = arch.kv_heads // tp if arch.kv_heads >= tp else 1
    f = arch.ffn // tp
    return {
        "q": (a * d, h),
        "k": (kv * d, h),
        "v": (kv * d, h),
        "o": (h, a * d),
        "gate": (f, h),
        "up": (f, h),
        "down": (h, f),
    }


def adapter_elems(arch, targets, rank: int, tp: int = 1) -> int:
    """Adapter elements of one decoder layer: r x (in + out) per targeted linear."""
    lin = layer_linears(arch, tp)
    return sum(rank * (o + i) for t, (o, i) in lin.items() if t in targets)


def quantized_linears(arch, targets, quantize_all: bool, tp: int = 1) -> list[int]:
    """Elements of each base linear weight of one layer stored in NF4 under QLoRA: every layer
    linear (bitsandbytes' load_in_4bit replaces each nn.Linear but the output layer) or only the
    targeted ones (torchtune's LoRALinear(quantize_base=True))."""
    lin = layer_linears(arch, tp)
    return [o * i for t, (o, i) in lin.items() if quantize_all or t in targets]
