"""GPT-OSS's attention with sinks, router and clamped SwiGLU experts, as HF transformers' modules
compute them (transformers 5.24 modeling_gpt_oss.py; the rest of the MoE block is
`_Gen._moe_hf_experts` in layers.py).

Attention: HF has no SDPA path for it (a sink logit per head joins each softmax); its eager
attention repeats k and v to every head (copies), multiplies q k^T, scales, adds the mask,
concatenates the head's sink as one more column, subtracts the row max (whose backward keeps
the argmax indices), takes the softmax in the logits' dtype (kept: [b, heads, s, s + 1]) and
multiplies the first s columns (a strided view; under autocast a cast copy) with v. A
sliding-window layer differs from a full one only in its mask: the same tensors are saved.

Router: linear with a bias, top-k of the logits (indices kept), softmax over the k values in
their dtype (kept). Experts: grouped GEMMs over the sorted tokens with per-expert biases
(gathered by expert id and added in place); the activation reads gate and up as the even and
odd columns of the first GEMM's output: gate clamped from above, up from both sides, then
(up + 1) * gate * sigmoid(alpha * gate): the first GEMM's output (the clamps'), the clamped
gate, the sigmoid, gate x sigmoid and up + 1 are kept, beside the product the second GEMM saves.
"""

from __future__ import annotations

from .moe import router_topk


def sink_attention(g, q: str, k: str, v: str, opt) -> str:
    """HF's eager attention with sinks -> the context [s, b, heads, d]."""
    sh = g.sh
    a, kv, d, s, b = sh.heads, sh.kv, sh.d, sh.s, sh.b
    ctx = g.act("attn.ctx", (s, b, a, d))
    q, k, v = (g.to_compute(q, "attn.q"), g.to_compute(k, "attn.k"), g.to_compute(v, "attn.v"))
    if kv < a:
        k, v = g._repeat_kv(k, v, (s, b, a, d))
    full, wide = (b, a, s, s), (b, a, s, s + 1)
    # under autocast the mask (built in the fp32 embeddings' dtype) and the fp32 sinks make the
    # logits fp32 from the mask add on
    ldt = "fp32" if sh.autocast else g.dt
    scores = g.act("attn.scores", full)
    g.t.node("bmm_qk", (q, k), (scores,), diff_inputs=(q, k), save_i=(q, k))
    scaled = g.act("attn.scaled", full)
    g.t.node("mul_scale", (scores,), (scaled,), diff_inputs=(scores,))
    masked = g.act("attn.masked", full, ldt)
    g.t.node("add_mask", (scaled,), (masked,), diff_inputs=(scaled,), grad_alias=ldt == g.dt)
    sinks = g.t.param(g.n("attn.sinks"), (a,), g.dt)
    comb = g.act("attn.with_sinks", wide, ldt)
    g.t.node("cat_sinks", (masked, sinks), (comb,), diff_inputs=(masked,), params=(sinks,))
    mx = g.act("attn.row_max", (b, a, s, 1), ldt)
    mxi = g.act("attn.row_argmax", (b, a, s, 1), "int64")
    g.t.node("max_dim", (comb,), (mx, mxi), diff_inputs=(comb,), save_i=(mxi,))
    shifted = g.act("attn.shifted", wide, ldt)
    g.t.node("sub", (comb, mx), (shifted,), diff_inputs=(comb, mx), grad_alias=(comb,))
    probs = g.act("attn.probs", wide, ldt)
    g.t.node("softmax", (shifted,), (probs,), diff_inputs=(shifted,), save_i=(probs,))
    pv = probs
    if ldt != g.dt:
        pv = g.act("attn.probs_cast", full)
        g.t.node("to_dtype", (probs,), (pv,), diff_inputs=(probs,))
    if opt.attn_dropout:
        pv = g.dropout(pv, "attn.dropout", full)
    g.t.node("bmm_pv", (pv, v), (ctx,), diff_inputs=(pv, v), save_i=(pv, v))
    return ctx


def topk_softmax_router(g, x: str, opt) -> tuple[str, str, str]:
    """GPT-OSS's router on `x` ([s_sp, b, h]) -> (routing weights [T, K], indices, dtype)."""
    sh = g.sh
    T, E, K, h = sh.s_sp * sh.b, sh.experts * sh.ep, sh.top_k, sh.h
    logits = g.linear(x, "moe.router", (T, E), h, True)
    ldt = g.dtype_of(logits)
    topv, topi = router_topk(g, logits, ldt)
    w = g.act("moe.topk_weights", (T, K), ldt)
    g.t.node("softmax", (topv,), (w,), diff_inputs=(topv,), save_i=(w,))
    return w, topi, ldt


def expert_bias(g, y: str, ids: str, name: str) -> str:
    """`y.add_(bias[expert_ids])`: the per-expert bias gathered by expert id (a transient [S, n])
    and added in place; its grad scatters back into the bias."""
    S, n = g.t.tensors[y].shape
    bias = g.t.param(g.n(name + ".bias"), (g.sh.experts, n), g.sh.dt)
    gathered = g.act(name + ".bias_gathered", (S, n))
    # its backward scatters the grad into the bias by the (kept) sorted expert ids
    g.t.node("index", (bias, ids), (gathered,), params=(bias,), save_w=(ids,))
    # in place on the GEMM's output, which nothing saves: counted as a new tensor the output's
    # storage is handed to (the same bytes alive after it; a transient [S, n] more inside)
    out = g.act(name + ".biased", (S, n))
    g.t.node("add_", (y, gathered), (out,), diff_inputs=(y,), grad_alias=True)
    return out


def clamped_swiglu(g, fc1: str, f: int) -> str:
    """GPT-OSS's `_apply_gate` over the first GEMM's output [S, 2f] -> [S, f]."""
    S = g.t.tensors[fc1].shape[0]
    shape = (S, f)
    gate = g.act("moe.experts.gate", shape, storage=fc1)
    up = g.act("moe.experts.up", shape, storage=fc1)
    g.t.node("strided_views", (fc1,), (gate, up), diff_inputs=(fc1,))
    gc = g.act("moe.experts.gate_clamped", shape)
    g.t.node("clamp", (gate,), (gc,), diff_inputs=(gate,), save_i=(gate,))
    uc = g.act("moe.experts.up_clamped", shape)
    g.t.node("clamp", (up,), (uc,), diff_inputs=(up,), save_i=(up,))
    ga = g.act("moe.experts.gate_alpha", shape)
    g.t.node("mul_scalar", (gc,), (ga,), diff_inputs=(gc,))
    sg = g.act("moe.experts.sigmoid", shape)
    g.t.node("sigmoid", (ga,), (sg,), diff_inputs=(ga,), save_i=(sg,))
    glu = g.act("moe.experts.glu", shape)
    g.t.node("mul", (gc, sg), (glu,), diff_inputs=(gc, sg), save_i=(gc, sg))
    u1 = g.act("moe.experts.up_plus_one", shape)
    g.t.node("add_scalar", (uc,), (u1,), diff_inputs=(uc,), grad_alias=True)
    act = g.act("moe.experts.act", shape)
    g.t.node("mul", (u1, glu), (act,), diff_inputs=(u1, glu), save_i=(u1, glu))
    return act
