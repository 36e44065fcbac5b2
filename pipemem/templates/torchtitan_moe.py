"""torchtitan's MoE block, as its own modules run it (``--convention torchtitan``; torchtitan 0.3
models/common/moe.py `MoE`, `TokenChoiceTopKRouter`, `RoutedExperts`, `GroupedExperts`, and
token_dispatcher.py `LocalTokenDispatcher`), for every model that uses it: qwen3's MoE flavors and
deepseek_v3's (after its multi-head latent attention, `templates/mla.py`).

Router (`TokenChoiceTopKRouter.forward`): the gate linear under autocast to fp32 (an fp32 copy of
the input and of the weight, both kept for backward: `moe.fp32_router_logits`); sigmoid or softmax
scores in fp32 (the output kept); the choice adds the load-balancing expert bias (a buffer, always
there with the default `load_balance_coeff`), masks all but the `num_limited_groups` best expert
groups when the router has groups, and takes the top k: transients with no path to the loss. The
weights are the scores gathered at the chosen experts (the indices kept), divided by their sum
when `route_norm` (both operands kept) and multiplied by `route_scale` (always, a new tensor).
`MoE.forward` builds a bool routing map [T, E] and counts tokens per expert (no grad).

Dispatch (`LocalTokenDispatcher`, no expert parallelism): a stable argsort of the [T x K] expert
ids, the scores and the token indices put in that order (index ops keeping the sort's int64
output), the tokens gathered [T x K, h] (`index` keeps the token indices). Experts
(`GroupedExperts.forward`): three grouped GEMMs, `silu(x w1) * (x w3)` then `w2`, unfused (each
keeps its input; the silu its input, the product both factors). Combine: the expert output cast to
fp32, times the sorted scores (the product keeps both: the fp32 copy and the scores), cast back,
scatter-added into zeros [T, h] (the custom op keeps its index, a view of the token indices).
The shared experts (a FeedForward) run after the routed ones, and their output is added.

With expert parallelism the tokens travel in all-to-all buffers of the same size as the gathered
tokens (`AllToAllTokenDispatcher`), sized by `templates.moe.rank_load` for the rank's experts; not
held against a trace (torchtitan's all-to-all splits are data: a fake-tensor step cannot run it).
"""

from __future__ import annotations

import math
from dataclasses import replace

from .moe import TORCHTITAN_GROUP_MASK, fp32_router_logits, group_limited
from .tape import COMM


def _loaded(n: int, load: float) -> int:
    return n if load == 1.0 else math.ceil(n * load - 1e-9)


def router(g, x: str, opt, T: int) -> tuple[str, str]:
    """`TokenChoiceTopKRouter` on `x` (T tokens) -> (weights [T, K] fp32, expert ids [T, K])."""
    sh, t = g.sh, g.t
    E, K = sh.experts * sh.ep, sh.top_k
    # its SelectiveAC recomputes the gate's matmul outside the count of matmuls it alternates
    # (per_op_sac_force_recompute_mm_shapes_by_fqns defaults to the router gate)
    saved, g.sh = sh, replace(sh, s_sp=T // sh.b)  # the gate's tokens
    try:
        logits = fp32_router_logits(g, x, op="router_gate")
    finally:
        g.sh = saved
    scores = g.act("moe.scores", (T, E), "fp32")
    kind = "sigmoid" if opt.router == "sigmoid_group" else "softmax"
    t.node(kind, (logits,), (scores,), diff_inputs=(logits,), save_i=(scores,))
    # the choice: scores + expert bias, the group mask, the top k (no path to the loss)
    choice = g.act("moe.choice.biased", (T, E), "fp32")
    t.node("add_expert_bias", (scores,), (choice,))
    if opt.router_groups > 1:
        choice = group_limited(g, choice, T, opt, 2, TORCHTITAN_GROUP_MASK)
    tval = g.act("moe.choice.topk_values", (T, K), "fp32")
    ids = g.act("moe.topk_idx", (T, K), "int64")
    t.node("topk", (choice,), (tval, ids))
    w = g.act("moe.topk_scores", (T, K), "fp32")
    t.node("gather", (scores, ids), (w,), diff_inputs=(scores,), save_i=(ids,))
    if opt.router_norm_topk:
        ssum = g.act("moe.topk_sum", (T, 1), "fp32")
        t.node("sum", (w,), (ssum,), diff_inputs=(w,))
        den = g.act("moe.topk_denominator", (T, 1), "fp32")
        t.node("add_scalar", (ssum,), (den,), diff_inputs=(ssum,))
        wn = g.act("moe.topk_normed", (T, K), "fp32")
        t.node("div", (w, den), (wn,), diff_inputs=(w, den), save_i=(w, den))
        w = wn
    scaled = g.act("moe.topk_scaled", (T, K), "fp32")
    t.node("mul_scalar", (w,), (scaled,), diff_inputs=(w,))
    # MoE.forward: the routing map and the per-expert counts (no grad)
    rmap = g.act("moe.routing_map", (T, E), "bool")
    t.node("zeros_scatter", (ids,), (rmap,))
    counts = g.act("moe.tokens_per_expert", (E,), "int64")
    t.node("sum", (rmap,), (counts,))
    return scaled, ids


def moe(g, x: str, opt) -> str:
    """torchtitan's `MoE.forward` on `x` ([s_sp, b, h]) -> its output [s_sp, b, h]."""
    sh, t = g.sh, g.t
    K, h, f = sh.top_k, sh.h, sh.expert_ffn
    x_in = x
    # tensor parallel without EP (moe_sharding.py `_moe_sharding_config`): the block's input is
    # made whole (all-gathered from the sequence shards), the router, dispatch and experts (split
    # over the TP axis) run on every token, and the output (partial sums) is reduce-scattered back
    whole = sh.tp > 1 and sh.ep == 1
    if whole and sh.sp:
        xg = g.act("moe.tp_allgather", (sh.s, sh.b, h), kind=COMM)
        t.node("all_gather", (x,), (xg,), diff_inputs=(x,))
        x = xg
    T = (sh.s if whole else sh.s_sp) * sh.b
    weights, ids = router(g, x, opt, T)
    N = T * K
    Nr = _loaded(N, sh.moe_load)  # the tokens this rank's experts receive
    order = g.act("moe.sort_idx", (N,), "int64")
    t.node("argsort", (ids,), (order,))
    sw = g.act("moe.sorted_scores", (N,), "fp32")
    t.node("index", (weights, order), (sw,), diff_inputs=(weights,), save_i=(order,))
    tok = g.act("moe.token_idx", (N,), "int64")
    t.node("floor_divide", (order,), (tok,))
    routed = g.act("moe.routed_input", (N, h))
    t.node("index", (x, tok), (routed,), diff_inputs=(x,), save_i=(tok,))
    if sh.ep > 1:  # AllToAllTokenDispatcher: the tokens sent to the experts' ranks
        recv = g.act("moe.dispatch_a2a", (Nr, h), kind=COMM)
        t.node("all_to_all", (routed,), (recv,), diff_inputs=(routed,))
        routed = recv
    M = Nr
    offs = g.act("moe.offsets", (sh.experts,), "int32")
    t.node("cumsum", (ids,), (offs,))
    h1 = g.grouped_linear(routed, offs, "moe.experts.w1", (M, f), h)
    act1 = g.act("moe.experts.silu", (M, f))
    t.node("silu", (h1,), (act1,), diff_inputs=(h1,), save_i=(h1,))
    h3 = g.grouped_linear(routed, offs, "moe.experts.w3", (M, f), h)
    prod = g.act("moe.experts.act", (M, f))
    t.node("mul", (act1, h3), (prod,), diff_inputs=(act1, h3), save_i=(act1, h3))
    out = g.grouped_linear(prod, offs, "moe.experts.w2", (M, h), f)
    if sh.ep > 1:
        back = g.act("moe.combine_a2a", (N, h), kind=COMM)
        t.node("all_to_all", (out,), (back,), diff_inputs=(out,))
        out = back
    # combine: (out.float() * scores).to(out dtype), scatter_add into zeros
    of = out
    if g.dtype_of(out) != "fp32":
        of = g.act("moe.combine_fp32", (N, h), "fp32")
        t.node("to_fp32", (out,), (of,), diff_inputs=(out,))
    wo = g.act("moe.combine_weighted", (N, h), "fp32")
    t.node("mul", (of, sw), (wo,), diff_inputs=(of, sw), save_i=(of, sw))
    if g.dtype_of(out) != "fp32":
        wc = g.act("moe.combine_cast", (N, h))
        t.node("to_dtype", (wo,), (wc,), diff_inputs=(wo,))
        wo = wc
    zeros = g.act("moe.combine_zeros", (T, h))
    t.node("zeros_like", (x,), (zeros,))
    y = g.act("moe.out", (T // sh.b, sh.b, h))
    t.node("scatter_add", (zeros, tok, wo), (y,), diff_inputs=(wo,), save_i=(tok,))
    if not whole:
        if sh.shared_ffn:
            shared = g.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
            y = g.add(y, shared, "moe.out_shared", (sh.s_sp, sh.b, h))
        return y
    if sh.shared_ffn:  # colwise w1 / w3 and rowwise w2 on the whole input: partial sums
        sf = sh.shared_ffn
        u1 = g.linear(x, "moe.shared.gate_proj", (sh.s, sh.b, sf), h, False)
        a1 = g.act("moe.shared.silu", (sh.s, sh.b, sf))
        t.node("silu", (u1,), (a1,), diff_inputs=(u1,), save_i=(u1,))
        u3 = g.linear(x, "moe.shared.up_proj", (sh.s, sh.b, sf), h, False)
        a = g.act("moe.shared.act", (sh.s, sh.b, sf))
        t.node("mul", (a1, u3), (a,), diff_inputs=(a1, u3), save_i=(a1, u3))
        shared = g.linear(a, "moe.shared.fc2", (sh.s, sh.b, h), sf, False)
        y = g.add(y, shared, "moe.out_shared", (sh.s, sh.b, h))
    if sh.sp:
        out = g.act("moe.tp_reduce_scatter", (sh.s_sp, sh.b, h), kind=COMM)
        t.node("reduce_scatter", (y,), (out,), diff_inputs=(y,))
    else:
        out = g.act("moe.tp_allreduce", (sh.s, sh.b, h), storage=y)
        t.node("all_reduce", (y,), (out,), diff_inputs=(y,), grad_alias=True)
    g.held_by_caller(x_in)
    return out
