"""The last stage's loss, op by op, for the cross-entropy variants trainers use to keep the
logits from ever being whole in fp32 (pipemem.features `loss`).

Every variant starts from the final norm's output `hn` [s, b, h] and the output weight; the
standard path (an fp32 copy of all logits, log-softmax or Megatron's in-place vocab-parallel
CE) stays in `layers.head_tape`. Read from the frameworks' code:

* chunked (torchtune `CEWithChunkedOutputLoss`, `TransformerDecoder.chunked_output`): the model
  returns `[output(c) for c in h.chunk(C, dim=1)]` -- all C bf16 logit chunks exist together
  (with batch > 1 each [b, s/C, h] chunk is strided, so the linear saves a contiguous copy)
  (the list lives until the recipe's `del logits` after the loss); the loss then runs
  `F.cross_entropy(chunk.float(), labels, reduction="sum")` per chunk. Eager, each chunk's
  log-softmax keeps its fp32 output for backward (so the fp32 copies all survive to the
  backward; only the transient upcast is per chunk). torchtune compiles
  `compute_cross_entropy` with the model: compiled, a chunk's CE saves its bf16 input and the
  per-token log-sum-exp, and its backward writes the bf16 logits grad directly.
* standard under compile: the upcast and CE compiled together save the bf16 logits and the
  log-sum-exp (no fp32 tensor of logits size survives the forward).
* fused_linear (Liger `LigerFusedLinearCrossEntropyLoss`): inside its forward, for chunks of
  `2^ceil(log2(ceil(T / ceil(V / h))))` tokens it computes the logits chunk, the CE and its
  gradient in place, and accumulates the input grad [T, h] and the weight grad [V, h] (weight
  dtype), which it saves; the backward only scales them. Logits never exist beyond one chunk.
* shifted (a loss the training step writes on the model's output, transformers < 4.46's GPT-2):
  `logits[..., :-1, :].contiguous()` copies the logits, `F.cross_entropy` runs log-softmax on the
  copy in its own dtype (under autocast, which lists log_softmax among its fp32 ops, on an fp32
  cast of it) and saves the log-probabilities; the caller's `logits` stays referenced until the
  loss returns (Lightning's `training_step` local, HF's output).
* fused_te (Megatron `--cross-entropy-loss-fusion --cross-entropy-fusion-impl te`): TE's
  parallel cross-entropy works on the bf16 logits in place (their grads overwrite them), no
  fp32 copy. `fused` (the native impl, megatron-core fusions/fused_cross_entropy.py) upcasts
  with `.float()`, runs exp in place and saves the fp32 exp-logits like the unfused
  vocab-parallel CE: the same memory as the standard Megatron path.
"""

from __future__ import annotations

from ..ir import dtype_bytes
from .tape import Tape


def _pow2_ceil(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def loss_from_hidden(g, tape: Tape, hn: str, sh, compiled: bool) -> str:
    """The loss tensor from the final-norm output `hn`, for sh.feat.loss in (chunked,
    fused_linear, fused_te) or a compiled standard CE. `g` is the head's layers._Gen."""
    loss_kind = sh.feat.loss
    if loss_kind == "fused_linear":
        return _fused_linear(g, tape, hn, sh)
    if loss_kind == "chunked":
        return _chunked(g, tape, hn, sh, compiled)
    (logits,) = g.column_linears(hn, "head", [("head.output", sh.vocab, False)])
    tape.fsdp_unit_end = len(tape.nodes)  # the loss runs outside the output layer's FSDP unit
    labels = g.act("labels", (sh.b, sh.s), "int64")
    tape.node("load_labels", (), (labels,))
    if loss_kind == "fused_te":
        loss = g.act("loss", (sh.s, sh.b), "fp32")
        tape.node(
            "te_parallel_cross_entropy",
            (logits, labels),
            (loss,),
            diff_inputs=(logits,),
            save_i=(logits, labels),
        )
        # the logits grads are written into the logits' own storage (in place)
        tape.tensors["d." + logits] = type(tape.tensors[logits])(
            "d." + logits, tape.tensors[logits].shape, tape.tensors[logits].dtype, storage=logits
        )
        return loss
    if g.conv.logits_fp32_in_model and sh.dt != "fp32":
        # torchtune's decoder returns `output(h).float()` (eager, outside the compiled loss): the
        # compiled CE receives, and saves, fp32 logits
        lf = g.act("logits_fp32", tape.tensors[logits].shape, "fp32")
        tape.node("to_fp32", (logits,), (lf,), diff_inputs=(logits,))
        logits = lf
    # standard CE compiled with its upcast
    return _compiled_ce(g, tape, logits, labels, (sh.s, sh.b), "")


def _compiled_ce(g, tape: Tape, logits: str, labels: str, tokens: tuple, tag: str) -> str:
    """`F.cross_entropy(logits.float(), labels)` as one compiled graph: saves the bf16 logits
    and the fp32 log-sum-exp per token; the backward graph writes the logits grad directly."""
    lse = g.act(f"lse{tag}", tokens, "fp32")
    loss = g.act(f"loss{tag}", tokens, "fp32")
    tape.node(
        "compiled_cross_entropy",
        (logits, labels),
        (loss, lse),
        diff_inputs=(logits,),
        save_i=(logits, labels, lse),
    )
    return loss


def _chunked(g, tape: Tape, hn: str, sh, compiled: bool) -> str:
    C = max(1, min(sh.feat.loss_chunks, sh.s))
    rows = -(-sh.s // C)
    sizes = [min(rows, sh.s - i * rows) for i in range(C) if sh.s - i * rows > 0]
    labels = g.act("labels", (sh.b, sh.s), "int64")
    tape.node("load_labels", (), (labels,))
    # h.chunk(C, dim=1): views of hn; their grads are concatenated by the split's backward
    parts = [
        g.act(f"hn.chunk{i}", (n, sh.b, sh.h), tape.tensors[hn].dtype, storage=hn)
        for i, n in enumerate(sizes)
    ]
    tape.node("chunk", (hn,), tuple(parts), diff_inputs=(hn,))
    w = tape.param("head.output.weight", (sh.vocab, sh.h), sh.dt)
    logits = []
    for i, (part, n) in enumerate(zip(parts, sizes)):
        if sh.b > 1:
            # torchtune chunks [b, s, h] along s: with b > 1 a chunk is not contiguous, and the
            # linear's reshape to 2-D copies it (the copy is what the weight grad keeps)
            flat = g.act(f"hn.chunk{i}.contiguous", (n, sh.b, sh.h), tape.tensors[hn].dtype)
            tape.node("contiguous", (part,), (flat,), diff_inputs=(part,), grad_alias=True)
            part = flat
        y = g.act(f"logits.chunk{i}", (n, sh.b, sh.vocab))
        tape.node("linear", (part, w), (y,), diff_inputs=(part,), params=(w,), save_w=(part,))
        logits.append(y)
    tape.fsdp_unit_end = len(tape.nodes)  # the model returns the chunks' logits; the loss is outside
    losses = []
    for i, (y, n) in enumerate(zip(logits, sizes)):
        if compiled:
            losses.append(_compiled_ce(g, tape, y, labels, (n, sh.b), f".chunk{i}"))
            continue
        lf = g.act(f"logits_fp32.chunk{i}", (n, sh.b, sh.vocab), "fp32")
        tape.node("to_fp32", (y,), (lf,), diff_inputs=(y,))
        logp = g.act(f"log_softmax.chunk{i}", (n, sh.b, sh.vocab), "fp32")
        tape.node("log_softmax", (lf,), (logp,), diff_inputs=(lf,), save_i=(logp,))
        li = g.act(f"loss.chunk{i}", (n, sh.b), "fp32")
        tape.node("nll_loss", (logp, labels), (li,), diff_inputs=(logp,), save_i=(labels,))
        losses.append(li)
    loss = g.act("loss", (1,), "fp32")
    # the sum over chunks; the recipe's list of logits lives until the loss is computed
    tape.node(
        "sum_chunk_losses", tuple(losses) + tuple(logits), (loss,), diff_inputs=tuple(losses), grad_alias=True
    )
    return loss


def _fused_linear(g, tape: Tape, hn: str, sh) -> str:
    T, V, h = sh.s * sh.b, sh.vocab, sh.h
    chunk = min(T, _pow2_ceil(-(-T // max(1, -(-V // h)))))
    w = tape.param("head.output.weight", (V, h), sh.dt)
    labels = g.act("labels", (sh.b, sh.s), "int64")
    tape.node("load_labels", (), (labels,))
    wgrad_dt = "fp32" if sh.autocast else sh.dt
    dinput = g.act("flce.grad_input", (sh.s, sh.b, h), g.dtype_of(hn))
    dweight = g.act("flce.grad_weight", (V, h), wgrad_dt)
    loss = g.act("loss", (1,), "fp32")
    # Liger >= 0.8.3 on CUDA (ops/fused_linear_cross_entropy.py): one logits buffer of a chunk,
    # reused by every chunk (its CE grads are written in place), the input-grad matmul writing
    # straight into grad_input and the weight grad accumulated in place; the per-token loss
    # [T] fp32 and target mask [T] bool live through the chunk loop
    ws = chunk * V * dtype_bytes(sh.dt) + 5 * T
    tape.node(
        "fused_linear_ce",
        (hn, w, labels),
        (loss, dinput, dweight),
        diff_inputs=(hn,),
        params=(w,),
        save_i=(dinput,),
        save_w=(dweight,),
        workspace_f=ws,
        wgrad_saved=dweight,
    )
    # backward scales the saved input grad in place (Liger's element_mul_kernel)
    tape.tensors["d." + hn] = type(tape.tensors[hn])(
        "d." + hn, tape.tensors[hn].shape, g.dtype_of(hn), storage=dinput
    )
    return loss


def shifted_cross_entropy(g, tape: Tape, logits: str, labels: str, vocab: int) -> str:
    """`F.cross_entropy(logits[..., :-1, :].contiguous().view(-1, V), labels[..., 1:].view(-1))`
    written by the training step (the one-token shift is not resolved: s, not s - 1)."""
    sh = g.sh
    shape = (sh.s, sh.b, vocab)
    shifted = g.act("logits_shifted", shape, g.dtype_of(logits))
    tape.node("shift_contiguous", (logits,), (shifted,), diff_inputs=(logits,))
    x = shifted
    if sh.autocast and g.dtype_of(shifted) != "fp32":
        # autocast runs log_softmax in fp32: a cast copy, read once (log_softmax saves its output)
        x = g.act("logits_autocast_fp32", shape, "fp32")
        tape.node("autocast_cast", (shifted,), (x,), diff_inputs=(shifted,))
    logp = g.act("log_softmax", shape, g.dtype_of(x))
    tape.node("log_softmax", (x,), (logp,), diff_inputs=(x,), save_i=(logp,))
    loss = g.act("loss", (sh.s, sh.b), "fp32")
    tape.node("nll_loss", (logp, labels, logits), (loss,), diff_inputs=(logp,), save_i=(labels,))
    return loss
