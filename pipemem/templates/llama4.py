"""Llama 4's text layers as HF transformers' modules compute them (transformers 5.24
modeling_llama4.py): what differs from a Llama layer.

* q/k norm (rope layers, `use_qk_norm`): an L2 norm without weight after the rope, in fp32 over
  an fp32 copy (`x.float()`, kept with its rsqrt), cast back;
* NoPE layers (`no_rope_layers` 0): no rope, no q/k norm; with `attn_temperature_tuning` the
  queries are multiplied by a per-position fp32 scale (kept, [s]) and cast back;
* MoE layers: the router's top-k logits are scattered into a -inf [T, E] tensor, its sigmoid
  taken in fp32 (kept) and cast; every token goes to every local expert: the hidden states
  repeated E times (kept), scaled by the [E, T] scores (a copy, kept) into the batched GEMMs'
  input (kept), gate_up [E, T, 2f] (kept by the SiLU and the product), SiLU and product (kept),
  the down GEMM's output summed over the experts, added in place to the shared expert's output
  (a Llama MLP `intermediate_size` wide, run after the experts).
"""

from __future__ import annotations

from .moe import router_topk


def l2_norm(g, x: str, name: str) -> str:
    """`x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)`, cast to x's dtype."""
    shape = g.t.tensors[x].shape
    tok = shape[:-1]
    x_dt = g.dtype_of(x)
    xf = x
    if x_dt != "fp32":
        xf = g.act(name + ".xf", shape, "fp32")
        g.t.node("to_fp32", (x,), (xf,), diff_inputs=(x,))
    var = g.act(name + ".var", tok + (1,), "fp32")
    g.t.node("pow_mean", (xf,), (var,), diff_inputs=(xf,), save_i=(xf,))
    rs = g.act(name + ".rsqrt", tok + (1,), "fp32")
    g.t.node("rsqrt", (var,), (rs,), diff_inputs=(var,), save_i=(rs,))
    y = g.act(name + ".xn" if x_dt != "fp32" else name + ".out", shape, "fp32")
    g.t.node("mul", (xf, rs), (y,), diff_inputs=(xf, rs), save_i=(xf, rs))
    if x_dt == "fp32":
        return y
    out = g.act(name + ".out", shape, x_dt)
    g.t.node("to_dtype", (y,), (out,), diff_inputs=(y,))
    return out


def temperature_scaled_query(g, q: str) -> str:
    """NoPE layers: `(q * attn_scales).to(q.dtype)`, attn_scales an fp32 [s] from the positions."""
    shape = g.t.tensors[q].shape
    scales = g.act("attn.temperature_scales", (g.sh.s,), "fp32")
    g.t.node("position_scales", (), (scales,))
    qf = g.act("attn.q_scaled_fp32", shape, "fp32")
    g.t.node("mul", (q, scales), (qf,), diff_inputs=(q,), save_i=(scales,))
    if g.dt == "fp32":
        return qf
    out = g.act("attn.q_scaled", shape)
    g.t.node("to_dtype", (qf,), (out,), diff_inputs=(qf,))
    return out


def sigmoid_scatter_router(g, x: str, opt) -> str:
    """Llama4Router on `x` -> the [E, T] routing scores (the transposed copy the experts read)."""
    sh = g.sh
    T, E, h = sh.s_sp * sh.b, sh.experts * sh.ep, sh.h
    logits = g.linear(x, "moe.router", (T, E), h, False)
    ldt = g.dtype_of(logits)
    topv, topi = router_topk(g, logits, ldt)
    full = g.act("moe.scores_scattered", (T, E), ldt)
    g.t.node("full_scatter", (topv, topi), (full,), diff_inputs=(topv,), save_i=(topi,))
    sf = full
    if ldt != "fp32":
        sf = g.act("moe.scores_fp32", (T, E), "fp32")
        g.t.node("to_fp32", (full,), (sf,), diff_inputs=(full,))
    sig = g.act("moe.scores_sigmoid", (T, E), "fp32")
    g.t.node("sigmoid", (sf,), (sig,), diff_inputs=(sf,), save_i=(sig,))
    sc = sig
    if ldt != "fp32":
        sc = g.act("moe.scores", (T, E), ldt)
        g.t.node("to_dtype", (sig,), (sc,), diff_inputs=(sig,))
    # router_scores.transpose(0, 1).reshape(-1, 1): a copy of this rank's experts' rows
    st = g.act("moe.scores_t", (sh.experts, T), ldt)
    g.t.node("transpose_copy", (sc,), (st,), diff_inputs=(sc,))
    return st


def _expert_weight(g, name: str, shape: tuple) -> tuple[str, str]:
    """An expert weight and what the batched GEMM reads: under autocast its low-precision copy,
    which the GEMM keeps for the input grad (as a linear's)."""
    w = g.t.param(g.n(name + ".weight"), shape, g.dt)
    if not g.sh.autocast:
        return w, w
    wc = g.act(name + ".weight_bf16", shape)
    g.t.node("autocast_weight", (w,), (wc,))
    return w, wc


def dense_experts(g, x: str, scores: str, opt) -> str:
    """Every token through each local expert, then the shared expert and the in-place sum."""
    sh = g.sh
    T, E, h, f = sh.s_sp * sh.b, sh.experts, sh.h, sh.expert_ffn
    rdt = g.dtype_of(scores)
    rep = g.act("moe.repeated", (E * T, h), g.dtype_of(x))
    g.t.node("repeat", (x,), (rep,), diff_inputs=(x,))
    win = g.act("moe.weighted_input", (E * T, h), rdt if rdt == "fp32" else None)
    g.t.node("mul", (rep, scores), (win,), diff_inputs=(rep, scores), save_i=(rep, scores))
    w1, w1c = _expert_weight(g, "moe.experts.fc1", (E, h, 2 * f))
    gu = g.act("moe.experts.gate_up", (E, T, 2 * f))
    g.t.node("bmm", (win, w1c), (gu,), diff_inputs=(win,), params=(w1,), save_i=(w1c,), save_w=(win,))
    gate = g.act("moe.experts.gate", (E, T, f), storage=gu)
    up = g.act("moe.experts.up", (E, T, f), storage=gu)
    g.t.node("chunk", (gu,), (gate, up), diff_inputs=(gu,))
    sg = g.act("moe.experts.silu", (E, T, f))
    g.t.node("silu", (gate,), (sg,), diff_inputs=(gate,), save_i=(gate,))
    act = g.act("moe.experts.act", (E, T, f))
    g.t.node("mul", (up, sg), (act,), diff_inputs=(up, sg), save_i=(up, sg))
    w2, w2c = _expert_weight(g, "moe.experts.fc2", (E, f, h))
    out = g.act("moe.experts.out", (E, T, h))
    g.t.node("bmm", (act, w2c), (out,), diff_inputs=(act,), params=(w2,), save_i=(w2c,), save_w=(act,))
    routed = g.act("moe.routed_sum", (sh.s_sp, sh.b, h))
    g.t.node("sum_experts", (out,), (routed,), diff_inputs=(out,))
    shared = g.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
    y = g.act("moe.out", (sh.s_sp, sh.b, h), storage=shared)
    g.t.node("add_", (shared, routed), (y,), diff_inputs=(shared, routed), grad_alias=True)
    return y
