"""Megatron-core's multi-token prediction (``--mtp-num-layers D``), as megatron-core 0.16.1 runs
it on the last pipeline stage (transformer/multi_token_prediction.py `MultiTokenPredictionBlock`,
models/gpt/gpt_model.py `GPTModel._postprocess`), op by op on the head's tape.

After the decoder's final norm, each depth k (1..D):

* the input ids rolled by k (`roll_tensor`: a new int64 [b, s]) through the model's own word
  embedding (`self.embedding`: on the last stage too; a stage without the first stage's
  embedding holds a copy of its weight, tied by an all-reduce of their grads);
* `enorm` of that embedding and `hnorm` of the previous depth's output (the decoder's for k = 1):
  fused norms saving their inputs and statistics; their outputs concatenated to [s, b, 2h] (a
  new tensor, nothing saved) and projected back to h by `eh_proj` (a column-parallel linear
  saving the concatenation; under tp its output gathered over the last dim and, under SP,
  scattered over the sequence again: the rank's rows are a view of the gathered tensor, which
  the layer's input therefore keeps whole);
* one transformer layer of the decoder's last layer kind (its spec), then its own final norm.

The decoder's output and every depth's are then concatenated along the sequence (a new
[(1 + D) s, b, h] tensor) and chunked back (views): the main head reads chunk 0, depth k's head
chunk k. Per depth, the shared output layer (its logits [s, b, V/tp]) and Megatron's
vocab-parallel cross entropy on rolled labels (a clone of the labels, a ones loss mask, each
rolled again); the loss masked and scaled by `--mtp-loss-scaling-factor / D`, handed to the
main hidden states by `MTPLossAutoScaler` (which saves it: its backward starts the depth's
backward). The last depth's bf16 logits stay referenced until `_postprocess` returns, through
the main head's loss.

The cases of `pipemem validate megatron` hold this against megatron-core's own step; what a
plan uses around it that they do not hold (MTP with full recompute, its fused cross entropy,
FSDP) is refused by the framework's checks.
"""

from __future__ import annotations

from .tape import COMM


def mtp_block(tape, arch, sh, conv, mtp, h: str, ops) -> tuple[str, list[str]]:
    """The MTP block and its heads on the head's tape, from the decoder's normed output `h`
    -> (the main head's hidden states, tensors held until the head's loss is returned). `ops`:
    layers.py's (op generator class, decoder layer body, Megatron's cross entropy)."""
    _Gen, _layer_body, megatron_cross_entropy = ops
    depths, opt = mtp
    s, b, hid = sh.s, sh.b, sh.h
    tok = (sh.s_sp, b, hid)
    outs, prev = [h], h
    for k in range(depths):
        g = _Gen(tape, sh, conv, f"head.mtp{k}.")
        g._uses_rope = arch.position == "rope"
        g.norm_weight_first = opt.norm_weight_first or conv.norm_weight_first
        ids = g.act("input_ids_rolled", (b, s), "int64")
        tape.node("roll", (), (ids,))
        w = tape.param("emb.word.weight", (sh.vocab, hid), sh.dt)
        e = g.embed_lookup(ids, w)
        en = g.norm(e, "enorm", opt.norm, tok)
        hn = g.norm(prev, "hnorm", opt.norm, tok)
        cat = g.act("eh_cat", (sh.s_sp, b, 2 * hid))
        tape.node("cat", (en, hn), (cat,), diff_inputs=(en, hn))
        if sh.tp == 1:
            x = g.linear(cat, "eh_proj", tok, 2 * hid, False)
        else:
            (p,) = g.column_linears(cat, "eh", [("eh_proj", hid // sh.tp, False)], in_features=2 * hid)
            x = g.act("eh_proj.gathered", (s, b, hid), kind=COMM)
            tape.node("all_gather_last_dim", (p,), (x,), diff_inputs=(p,))
            if sh.sp:
                # scatter_to_sequence_parallel_region: `input_[rank's rows].contiguous()` of a
                # contiguous tensor is a view, so the layer's input keeps the whole gathered
                # tensor; its backward all-gathers the grad
                xs = g.act("eh_proj.scattered", tok, storage=x)
                tape.node("split_sequence", (x,), (xs,), diff_inputs=(x,))
                x = xs
        _, y = _layer_body(g, arch, sh, conv, opt, x)
        prev = g.norm(y, "final_layernorm", opt.norm, tok)
        outs.append(prev)
    # torch.cat of every depth's hidden states, chunked back: one storage per chunk here
    g = _Gen(tape, sh, conv, "head.mtp.")
    chunks = [g.act(f"hidden_chunk{i}", tok, sh.res_dt) for i in range(depths + 1)]
    tape.node("cat_chunk", tuple(outs), tuple(chunks), diff_inputs=tuple(outs))
    labels = g.act("labels_clone", (b, s), "int64")
    tape.node("load_labels_clone", (), (labels,))
    main = chunks[0]
    hold: list[str] = []
    for k in range(depths):
        g = _Gen(tape, sh, conv, f"head.mtp{k}.")
        (logits,) = g.column_linears(
            chunks[k + 1], "head", [("head.output", sh.vocab, False)], gathered_by_linear=True
        )
        rolled = g.act("labels_rolled", (b, s), "int64")
        tape.node("roll", (labels,), (rolled,))
        mask = g.act("loss_mask_rolled", (b, s), "int64")
        tape.node("roll", (), (mask,))
        lf = logits
        if sh.dt != "fp32":
            lf = g.act("logits_fp32", (s, b, sh.vocab), "fp32")
            tape.node("to_fp32", (logits,), (lf,), diff_inputs=(logits,))
        loss = g.act("loss", (s, b), "fp32")
        loss_bs = megatron_cross_entropy(g, logits, lf, rolled, loss)
        masked = g.act("loss_masked", (b, s), "fp32")
        tape.node("mul_mask", (loss_bs, mask), (masked,), diff_inputs=(loss_bs,), save_i=(mask,))
        scaled = g.act("loss_scaled", (b, s), "fp32")
        tape.node("scale", (masked,), (scaled,), diff_inputs=(masked,))
        scaled_n = g.act("loss_per_token", (b, s), "fp32")
        tape.node("div_tokens", (scaled,), (scaled_n,), diff_inputs=(scaled,))
        nxt = g.act("hidden_autoscaled", tok, sh.res_dt, storage=main)
        tape.node(
            "mtp_loss_autoscaler",
            (main, scaled_n),
            (nxt,),
            diff_inputs=(main, scaled_n),
            save_i=(scaled_n,),
            grad_alias=(main,),
        )
        main = nxt
        hold = [logits]  # `mtp_logits`: rebound each depth, the last one held to the return
    return main, hold
