"""Small Paddle PIR training programs (``FLAGS_enable_pir_api=1``) for the comparison.

The same models as `pipemem.paddle.models` (MLP; GPT- and Llama-style decoders), written
with the paddle.* functions that build PIR ops. Each builder makes the program twice from
the same code: `main` with dynamic (-1) batch / sequence dims, as real programs declare
their inputs (this one is run and its op structure captured), and `sizes` with the bound
concrete shapes (pipemem reads value sizes from it: `pir_capture.capture`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .models import DecoderConfig


@dataclass
class PirCase:
    name: str
    main: object
    startup: object
    sizes: object
    feeds: dict = field(default_factory=dict)


def _build(fn, dynamic: bool):
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        fn(dynamic)
    return main, startup


def mlp(batch: int = 32, width: int = 64, hidden: int = 256, classes: int = 10) -> PirCase:
    """Two fully connected layers, ReLU, softmax cross-entropy, Adam."""
    import numpy as np
    import paddle

    def body(dynamic):
        b = -1 if dynamic else batch
        x = paddle.static.data("x", [b, width], "float32")
        y = paddle.static.data("y", [b, 1], "int64")
        h = paddle.static.nn.fc(x, hidden, activation="relu")
        logits = paddle.static.nn.fc(h, classes)
        loss = paddle.nn.functional.cross_entropy(logits, y).mean()
        paddle.optimizer.Adam(1e-3).minimize(loss)

    main, startup = _build(body, True)
    sizes, _ = _build(body, False)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((batch, width), dtype=np.float32),
             "y": rng.integers(0, classes, (batch, 1)).astype("int64")}
    return PirCase("mlp-pir", main, startup, sizes, feeds)


def decoder(cfg: DecoderConfig = DecoderConfig(), batch: int = 2, seq: int = 32) -> PirCase:
    """A causal decoder (GPT or Llama style) with a language-model loss and AdamW."""
    import numpy as np
    import paddle
    import paddle.nn.functional as F

    h, nh = cfg.hidden, cfg.heads
    hd = h // nh

    def body(dynamic):
        b, s = (-1, -1) if dynamic else (batch, seq)
        tokens = paddle.static.data("tokens", [b, s], "int64")
        labels = paddle.static.data("labels", [b, s], "int64")
        x = paddle.nn.Embedding(cfg.vocab, h)(tokens)
        if cfg.style == "gpt":
            pos = paddle.static.data("positions", [b, s], "int64")
            x = x + paddle.nn.Embedding(1024, h)(pos)
        mask = paddle.static.data("mask", [1, 1, s, s], "float32")

        def norm():
            return paddle.nn.LayerNorm(h) if cfg.style == "gpt" else _RMSNorm(h)

        for _ in range(cfg.layers):
            a = norm()(x)
            qkv = paddle.nn.Linear(h, 3 * h)(a)
            qkv = paddle.reshape(qkv, [0, 0, 3, nh, hd])
            qkv = paddle.transpose(qkv, [2, 0, 3, 1, 4])
            q, k, v = paddle.unbind(qkv, axis=0)
            scores = paddle.matmul(q, k, transpose_y=True) * (hd ** -0.5) + mask
            probs = F.softmax(scores, axis=-1)
            if cfg.dropout:
                probs = F.dropout(probs, cfg.dropout)
            ctx = paddle.matmul(probs, v)
            ctx = paddle.reshape(paddle.transpose(ctx, [0, 2, 1, 3]), [0, 0, h])
            attn = paddle.nn.Linear(h, h)(ctx)
            if cfg.dropout:
                attn = F.dropout(attn, cfg.dropout)
            x = x + attn
            m = norm()(x)
            if cfg.style == "gpt":
                m = paddle.nn.Linear(cfg.ffn, h)(F.gelu(paddle.nn.Linear(h, cfg.ffn)(m)))
            else:
                m = paddle.nn.Linear(cfg.ffn, h)(F.silu(paddle.nn.Linear(h, cfg.ffn)(m))
                                                 * paddle.nn.Linear(h, cfg.ffn)(m))
            if cfg.dropout:
                m = F.dropout(m, cfg.dropout)
            x = x + m
        logits = paddle.nn.Linear(h, cfg.vocab)(norm()(x))
        loss = F.cross_entropy(logits, paddle.unsqueeze(labels, -1)).mean()
        paddle.optimizer.AdamW(1e-3, weight_decay=0.01).minimize(loss)

    main, startup = _build(body, True)
    sizes, _ = _build(body, False)
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, cfg.vocab, (batch, seq)).astype("int64"),
             "labels": rng.integers(0, cfg.vocab, (batch, seq)).astype("int64"),
             "mask": np.triu(np.full((seq, seq), -1e4, np.float32), 1)[None, None]}
    if cfg.style == "gpt":
        feeds["positions"] = np.tile(np.arange(seq, dtype=np.int64), (batch, 1))
    return PirCase(f"{cfg.style}{cfg.layers}-pir", main, startup, sizes, feeds)


def _named(case: PirCase, name: str) -> PirCase:
    case.name = name
    return case


class _RMSNorm:
    """x * rsqrt(mean(x^2) + eps) * w, written out (Llama's norm)."""

    def __init__(self, h: int, eps: float = 1e-6):
        import paddle

        self.w = paddle.create_parameter([h], "float32", default_initializer=paddle.nn.initializer.Constant(1.0))
        self.eps = eps

    def __call__(self, x):
        import paddle

        return x * paddle.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + self.eps) * self.w


CASES = {
    "mlp-pir": lambda: mlp(),
    "gpt2-pir": lambda: decoder(DecoderConfig(style="gpt")),
    "llama2-pir": lambda: decoder(DecoderConfig(style="llama", dropout=0.0)),
    # Wider and deeper (as models.py's llama4-wide): 28 MB of activations instead of 1 MB.
    "llama4-wide-pir": lambda: _named(decoder(DecoderConfig(style="llama", layers=4, hidden=256, heads=8, ffn=688,
                                                            vocab=1000, dropout=0.0), batch=2, seq=128),
                                      "llama4-wide-pir"),
}
