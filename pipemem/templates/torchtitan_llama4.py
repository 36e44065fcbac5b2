"""torchtitan 0.2.2's MoE block, as its llama4 runs it (``--convention torchtitan`` on a llama4
model: torchtitan 0.3 ships no llama4; 0.2.2 models/moe/moe.py `MoE`, `TokenChoiceTopKRouter`,
`TokenReorderer`, `GroupedExperts` and models/moe/utils.py `indices_padding_wrapper`).

Router: the gate linear in the compute dtype (FSDP2's bf16 parameters; no autocast), its logits
cast to fp32, sigmoid scores (the output kept); the choice adds the load-balancing expert bias and
takes the top k (transients with no path to the loss); the weights are the scores gathered at
the chosen experts (the indices kept) times `route_scale` (a new tensor); `histc` counts the tokens
per expert. Reorderer: a stable argsort of the [T x K] expert ids; the weights put in that order
(the index op keeps the sort's indices); the tokens gathered [T x K, h] (`index` keeps the token
indices). Scores before the experts (`score_before_experts`, llama4's default): the gathered
tokens cast to fp32 and multiplied by their weights (the product keeps both), cast back.
Experts on SM90 (grouped GEMMs): the tokens padded for `torch._grouped_mm` to
round_up(T x K + experts x 8, 8) rows (a zero row stacked on, then an index by the int32
permutation it fills: the index keeps it), three grouped GEMMs, `silu(x w1) * (x w3)` then `w2`,
unfused; the output put back in token order (`index_put` into an empty [T x K + 1, h]: its
backward gathers at the permutation). The shared expert (a FeedForward on the block's input) runs
next; the routed output is scattered back (`index_put` into zeros [T x K, h] at the sorted order)
and summed over the k choices, then added to it.

Held against 0.2.2's own step by `pipemem validate torchtitan` (llama4 cases), without tensor or
expert parallelism: under those the 0.3 module's sharding (templates/torchtitan_moe.py) is used.
"""

from __future__ import annotations

# torchtitan 0.2.2 models/moe/utils.py TOKEN_GROUP_ALIGN_SIZE_M (bf16)
ALIGN = 8


def padded_rows(tokens: int, experts: int) -> int:
    """The rows `indices_padding_wrapper` gives the grouped GEMMs: each expert's group padded to
    ALIGN rows (and at least ALIGN), bounded by round_up(tokens + experts x ALIGN, ALIGN)."""
    n = tokens + experts * ALIGN
    return -(-n // ALIGN) * ALIGN


def moe(g, x: str, opt) -> str:
    """torchtitan 0.2.2's `MoE.forward` on `x` ([s_sp, b, h]) -> its output [s_sp, b, h]."""
    sh, t = g.sh, g.t
    E, K, h, f = sh.experts, sh.top_k, sh.h, sh.expert_ffn
    T = sh.s_sp * sh.b
    N = T * K
    # TokenChoiceTopKRouter
    logits = g.linear(x, "moe.router", (sh.s_sp, sh.b, E), h, False)
    lf = g.act("moe.router.logits_fp32", (T, E), "fp32")
    t.node("to_fp32", (logits,), (lf,), diff_inputs=(logits,))
    scores = g.act("moe.scores", (T, E), "fp32")
    t.node("sigmoid", (lf,), (scores,), diff_inputs=(lf,), save_i=(scores,))
    choice = g.act("moe.choice.biased", (T, E), "fp32")
    t.node("add_expert_bias", (scores,), (choice,))
    tval = g.act("moe.choice.topk_values", (T, K), "fp32")
    ids = g.act("moe.topk_idx", (T, K), "int64")
    t.node("topk", (choice,), (tval, ids))
    w = g.act("moe.topk_scores", (T, K), "fp32")
    t.node("gather", (scores, ids), (w,), diff_inputs=(scores,), save_i=(ids,))
    scaled = g.act("moe.topk_scaled", (T, K), "fp32")
    t.node("mul_scalar", (w,), (scaled,), diff_inputs=(w,))
    counts = g.act("moe.tokens_per_expert", (E,), "int64")
    t.node("histc", (ids,), (counts,))
    # TokenReorderer
    order = g.act("moe.sort_idx", (N,), "int64")
    t.node("argsort", (ids,), (order,))
    sw = g.act("moe.sorted_scores", (N,), "fp32")
    t.node("index", (scaled, order), (sw,), diff_inputs=(scaled,), save_i=(order,))
    tok = g.act("moe.token_idx", (N,), "int64")
    t.node("floor_divide", (order,), (tok,))
    routed = g.act("moe.routed_input", (N, h))
    t.node("index", (x, tok), (routed,), diff_inputs=(x,), save_i=(tok,))
    # score_before_experts: (routed.float() * scores).to(x.dtype)
    rf = g.act("moe.routed_fp32", (N, h), "fp32")
    t.node("to_fp32", (routed,), (rf,), diff_inputs=(routed,))
    ws = g.act("moe.routed_weighted", (N, h), "fp32")
    t.node("mul", (rf, sw), (ws,), diff_inputs=(rf, sw), save_i=(rf, sw))
    wc = g.act("moe.routed_scored", (N, h))
    t.node("to_dtype", (ws,), (wc,), diff_inputs=(ws,))
    # GroupedExperts through indices_padding_wrapper
    M = padded_rows(N, E)
    perm = g.act("moe.permuted_indices", (M,), "int32")
    t.node("fill_indices", (counts,), (perm,))
    stacked = g.act("moe.padded_input", (N + 1, h))
    t.node("vstack", (wc,), (stacked,), diff_inputs=(wc,))
    xp = g.act("moe.permuted_input", (M, h))
    t.node("index", (stacked, perm), (xp,), diff_inputs=(stacked,), save_i=(perm,))
    offs = g.act("moe.offsets", (E,), "int32")
    t.node("cumsum", (counts,), (offs,))
    h1 = g.grouped_linear(xp, offs, "moe.experts.w1", (M, f), h)
    a1 = g.act("moe.experts.silu", (M, f))
    t.node("silu", (h1,), (a1,), diff_inputs=(h1,), save_i=(h1,))
    h3 = g.grouped_linear(xp, offs, "moe.experts.w3", (M, f), h)
    prod = g.act("moe.experts.act", (M, f))
    t.node("mul", (a1, h3), (prod,), diff_inputs=(a1, h3), save_i=(a1, h3))
    out = g.grouped_linear(prod, offs, "moe.experts.w2", (M, h), f)
    un = g.act("moe.unpermuted", (N + 1, h))
    t.node("index_put", (out, perm), (un,), diff_inputs=(out,), save_i=(perm,))
    # the shared expert on the block's input, then the routed output back in token order
    shared = g.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
    unsorted = g.act("moe.unsorted", (N, h))
    t.node("index_put", (un, order), (unsorted,), diff_inputs=(un,), save_i=(order,))
    experts = g.act("moe.out_experts", (sh.s_sp, sh.b, h))
    t.node("sum", (unsorted,), (experts,), diff_inputs=(unsorted,))
    return g.add(shared, experts, "moe.out", (sh.s_sp, sh.b, h))
