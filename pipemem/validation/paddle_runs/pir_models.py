"""Small Paddle PIR training programs (``FLAGS_enable_pir_api=1``) for the comparison.

The same models as `pipemem.validation.paddle_runs.models` (MLP; GPT- and Llama-style decoders), written
with the paddle.* functions that build PIR ops. Each builder makes the program twice from
the same code: `main` with dynamic (-1) batch / sequence dims, as real programs declare
their inputs (this one is run and its op structure captured), and `sizes` with the bound
concrete shapes (pipemem reads value sizes from it: `pir_capture.capture`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .models import PIR_OPS, WIDE_LLAMA, WIDE_SHAPE, DecoderConfig, decoder_feeds, decoder_loss

_DEFAULT_DECODER = DecoderConfig()  # a frozen dataclass: one shared default instance


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
    feeds = {
        "x": rng.standard_normal((batch, width), dtype=np.float32),
        "y": rng.integers(0, classes, (batch, 1)).astype("int64"),
    }
    return PirCase("mlp-pir", main, startup, sizes, feeds)


def decoder(cfg: DecoderConfig = _DEFAULT_DECODER, batch: int = 2, seq: int = 32) -> PirCase:
    """A causal decoder (GPT or Llama style) with a language-model loss and AdamW."""
    import paddle

    def body(dynamic):
        b, s = (-1, -1) if dynamic else (batch, seq)
        tokens = paddle.static.data("tokens", [b, s], "int64")
        labels = paddle.static.data("labels", [b, s], "int64")
        positions = paddle.static.data("positions", [b, s], "int64") if cfg.style == "gpt" else None
        mask = paddle.static.data("mask", [1, 1, s, s], "float32")
        loss = decoder_loss(cfg, tokens, labels, positions, mask, PIR_OPS)
        paddle.optimizer.AdamW(1e-3, weight_decay=0.01).minimize(loss)

    main, startup = _build(body, True)
    sizes, _ = _build(body, False)
    feeds = decoder_feeds(cfg, batch, seq)
    return PirCase(f"{cfg.style}{cfg.layers}-pir", main, startup, sizes, feeds)


def _named(case: PirCase, name: str) -> PirCase:
    case.name = name
    return case


CASES = {
    "mlp-pir": lambda: mlp(),
    "gpt2-pir": lambda: decoder(DecoderConfig(style="gpt")),
    "llama2-pir": lambda: decoder(DecoderConfig(style="llama", dropout=0.0)),
    # Wider and deeper (as models.py's llama4-wide): 28 MB of activations instead of 1 MB.
    "llama4-wide-pir": lambda: _named(decoder(WIDE_LLAMA, **WIDE_SHAPE), "llama4-wide-pir"),
}
