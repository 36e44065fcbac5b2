"""Small Paddle static training programs for the comparison (legacy IR).

Every builder returns a `Case`: the main and startup programs, the shapes that bind the
dynamic dims (inputs are declared with -1 batch / sequence dims, as real programs are),
and feeds of those shapes. Models are written out op by op, nanoGPT style.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Case:
    name: str
    main: object
    startup: object
    batch: int
    seq: int | None
    feeds: dict = field(default_factory=dict)
    split_bw: bool = False  # split the backward into backward_b / backward_w (zero bubble)


def _programs():
    import paddle

    paddle.enable_static()
    return paddle.static.Program(), paddle.static.Program()


def mlp(batch: int = 32, width: int = 64, hidden: int = 256, classes: int = 10) -> Case:
    """Two fully connected layers, ReLU, softmax cross-entropy, Adam."""
    import numpy as np
    import paddle

    main, startup = _programs()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        x = paddle.static.data("x", [-1, width], "float32")
        y = paddle.static.data("y", [-1, 1], "int64")
        h = paddle.static.nn.fc(x, hidden, activation="relu")
        logits = paddle.static.nn.fc(h, classes)
        loss = paddle.nn.functional.cross_entropy(logits, y).mean()
        paddle.optimizer.Adam(1e-3).minimize(loss)
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((batch, width), dtype=np.float32),
        "y": rng.integers(0, classes, (batch, 1)).astype("int64"),
    }
    return Case("mlp", main, startup, batch, None, feeds)


@dataclass(frozen=True)
class DecoderConfig:
    style: str = "gpt"  # gpt: LayerNorm, GELU, 4h MLP, dropout; llama: RMSNorm, SwiGLU
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    vocab: int = 128
    dropout: float = 0.1


def decoder(
    cfg: DecoderConfig = DecoderConfig(), batch: int = 2, seq: int = 32, recompute: bool = False
) -> Case:
    """A causal decoder (GPT or Llama style) with a language-model loss and AdamW.

    recompute: Paddle's static `RecomputeOptimizer` with each layer's output as a
    checkpoint (backward re-runs each layer's forward before its gradient ops).

    No AMP variant: on this CPU (no AVX-512) Paddle's bf16 matmul is oneDNN-only and
    fails to build its primitive, and silu has no CPU bf16 kernel; paddle.static.amp's
    O1 rewrite keeps everything fp32 on a CPU-only build (docs/ACCURACY.md)."""
    import paddle

    main, startup = _programs()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        tokens = paddle.static.data("tokens", [-1, -1], "int64")
        labels = paddle.static.data("labels", [-1, -1], "int64")
        positions = paddle.static.data("positions", [-1, -1], "int64") if cfg.style == "gpt" else None
        # Additive causal mask [1, 1, s, s]: fed, so it has the batch-independent dynamic shape.
        mask = paddle.static.data("mask", [1, 1, -1, -1], "float32")
        checkpoints = []
        loss = decoder_loss(cfg, tokens, labels, positions, mask, LEGACY_OPS, on_layer=checkpoints.append)
        opt = paddle.optimizer.AdamW(1e-3, weight_decay=0.01)
        if recompute:
            opt = paddle.incubate.optimizer.RecomputeOptimizer(opt)
            opt._set_checkpoints(checkpoints)
        opt.minimize(loss)
    feeds = decoder_feeds(cfg, batch, seq)
    name = f"{cfg.style}{cfg.layers}" + ("-recompute" if recompute else "")
    return Case(name, main, startup, batch, seq, feeds)


@dataclass(frozen=True)
class DecoderOps:
    """The few primitives the legacy and PIR builders spell differently (some paddle.*
    functions of 3.x only build PIR ops, so the legacy programs append those ops by hand)."""

    matmul: Callable  # (a, b, transpose_y) -> a @ b(^T)
    gelu: Callable  # exact (erf) GELU
    rsqrt: Callable


def _legacy_matmul(a, b, transpose_y):
    return _legacy_op("matmul_v2", {"X": a, "Y": b}, {"trans_x": False, "trans_y": transpose_y})


def _pir_matmul(a, b, transpose_y):
    import paddle

    return paddle.matmul(a, b, transpose_y=transpose_y)


def _pir_gelu(x):
    import paddle.nn.functional as F

    return F.gelu(x)


def _pir_rsqrt(x):
    import paddle

    return paddle.rsqrt(x)


LEGACY_OPS = DecoderOps(
    matmul=_legacy_matmul,
    gelu=lambda x: _legacy_op("gelu", {"X": x}, {"approximate": False}),
    rsqrt=lambda x: _legacy_op("rsqrt", {"X": x}),
)
PIR_OPS = DecoderOps(matmul=_pir_matmul, gelu=_pir_gelu, rsqrt=_pir_rsqrt)


def decoder_loss(
    cfg: DecoderConfig, tokens, labels, positions, mask, ops: DecoderOps, on_layer: Callable = lambda x: None
):
    """Embedding, `cfg.layers` decoder layers (each output handed to `on_layer`), final norm,
    LM head and mean cross-entropy, op by op, inside the caller's program guard."""
    import paddle
    import paddle.nn.functional as F

    h, nh = cfg.hidden, cfg.heads
    hd = h // nh
    x = paddle.nn.Embedding(cfg.vocab, h)(tokens)
    if positions is not None:
        x = x + paddle.nn.Embedding(1024, h)(positions)

    def norm():
        return paddle.nn.LayerNorm(h) if cfg.style == "gpt" else _RMSNorm(h, ops.rsqrt)

    for _ in range(cfg.layers):
        a = norm()(x)
        qkv = paddle.nn.Linear(h, 3 * h)(a)
        qkv = paddle.reshape(qkv, [0, 0, 3, nh, hd])
        qkv = paddle.transpose(qkv, [2, 0, 3, 1, 4])  # 3, b, nh, s, hd
        q, k, v = paddle.unbind(qkv, axis=0)
        scores = ops.matmul(q, k, True) * (hd**-0.5) + mask
        probs = F.softmax(scores, axis=-1)
        if cfg.dropout:
            probs = F.dropout(probs, cfg.dropout)
        ctx = ops.matmul(probs, v, False)
        ctx = paddle.reshape(paddle.transpose(ctx, [0, 2, 1, 3]), [0, 0, h])
        attn = paddle.nn.Linear(h, h)(ctx)
        if cfg.dropout:
            attn = F.dropout(attn, cfg.dropout)
        x = x + attn
        m = norm()(x)
        if cfg.style == "gpt":
            m = paddle.nn.Linear(cfg.ffn, h)(ops.gelu(paddle.nn.Linear(h, cfg.ffn)(m)))
        else:
            m = paddle.nn.Linear(cfg.ffn, h)(
                F.silu(paddle.nn.Linear(h, cfg.ffn)(m)) * paddle.nn.Linear(h, cfg.ffn)(m)
            )
        if cfg.dropout:
            m = F.dropout(m, cfg.dropout)
        x = x + m
        on_layer(x)
    logits = paddle.nn.Linear(h, cfg.vocab)(norm()(x))
    return F.cross_entropy(logits, paddle.unsqueeze(labels, -1)).mean()


def decoder_feeds(cfg: DecoderConfig, batch: int, seq: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    feeds = {
        "tokens": rng.integers(0, cfg.vocab, (batch, seq)).astype("int64"),
        "labels": rng.integers(0, cfg.vocab, (batch, seq)).astype("int64"),
        "mask": np.triu(np.full((seq, seq), -1e4, np.float32), 1)[None, None],
    }
    if cfg.style == "gpt":
        feeds["positions"] = np.tile(np.arange(seq, dtype=np.int64), (batch, 1))
    return feeds


class _RMSNorm:
    """x * rsqrt(mean(x^2) + eps) * w, written out (Llama's norm)."""

    def __init__(self, h: int, rsqrt: Callable, eps: float = 1e-6):
        import paddle

        self.w = paddle.create_parameter(
            [h], "float32", default_initializer=paddle.nn.initializer.Constant(1.0)
        )
        self.rsqrt = rsqrt
        self.eps = eps

    def __call__(self, x):
        import paddle

        return x * self.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + self.eps) * self.w


def _legacy_op(op_type: str, inputs: dict, attrs: dict | None = None):
    """Append one legacy-IR op (some paddle.* functions of 3.x only build PIR ops)."""
    from paddle.base.layer_helper import LayerHelper

    helper = LayerHelper(op_type)
    first = next(iter(inputs.values()))
    out = helper.create_variable_for_type_inference(first.dtype)
    helper.append_op(
        type=op_type, inputs={k: [v] for k, v in inputs.items()}, outputs={"Out": [out]}, attrs=attrs or {}
    )
    return out


def _named(case: Case, name: str) -> Case:
    case.name = name
    return case


def _zb(case: Case) -> Case:
    case.name += "-zb"
    case.split_bw = True
    return case


# Wider and deeper, one of each style: 28 MB of activations instead of 1 MB
WIDE_LLAMA = DecoderConfig(style="llama", layers=4, hidden=256, heads=8, ffn=688, vocab=1000, dropout=0.0)
WIDE_GPT = DecoderConfig(style="gpt", layers=4, hidden=256, heads=8, ffn=1024, vocab=1000)
WIDE_SHAPE = dict(batch=2, seq=128)

CASES = {
    "mlp": lambda: mlp(),
    "gpt2": lambda: decoder(DecoderConfig(style="gpt")),
    "gpt2-recompute": lambda: decoder(DecoderConfig(style="gpt"), recompute=True),
    "llama2": lambda: decoder(DecoderConfig(style="llama", dropout=0.0)),
    "llama2-recompute": lambda: decoder(DecoderConfig(style="llama", dropout=0.0), recompute=True),
    "llama2-zb": lambda: _zb(decoder(DecoderConfig(style="llama", dropout=0.0))),
    "gpt2-zb": lambda: _zb(decoder(DecoderConfig(style="gpt"))),
    "llama4-wide": lambda: _named(decoder(WIDE_LLAMA, **WIDE_SHAPE), "llama4-wide"),
    "gpt4-wide-recompute": lambda: _named(
        decoder(WIDE_GPT, **WIDE_SHAPE, recompute=True), "gpt4-wide-recompute"
    ),
}
