"""Op-level programs of one rank for the parts of a decoder-only transformer.

`Shard` holds the local sizes of one rank under a plan (sequence after CP and SP, heads and
FFN after TP, experts after EP). The generators below describe each part as autograd nodes on
a `Tape` (pipemem.templates.tape), which writes the forward, backward and split-backward
programs. What each node saves follows the PyTorch / Megatron autograd functions on CUDA:

* linear: saves its input for the weight grad (the weight itself is a parameter);
* LayerNorm / RMSNorm (fused kernels): input + fp32 mean/rstd per token;
* GeLU / SiLU: their input; fused bias-SwiGLU: the fc1 output; product: both factors;
* dropout (native_dropout on CUDA): a bool mask; residual add: nothing;
* eager attention: q, k for QK^T, the softmax output, the dropout mask and output, v;
* flash attention: q, k, v, out and the fp32 logsumexp; backward allocates an fp32 dq
  accumulator and, with GQA, full-head dk/dv before reducing them (kernel workspace);
* collectives write comm_buffer tensors; Megatron's sequence-parallel linear keeps the
  sharded input and all-gathers it again in backward (the others: see conventions.py).

Layout is Megatron's [s, b, ...]; only sizes matter to memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..ir import dtype_bytes
from .conventions import Convention, padded_vocab
from .tape import COMM, BwdOp, Tape

MASK = "bool"
STAT = "fp32"


@dataclass(frozen=True, slots=True)
class Shard:
    """Local sizes of one rank. `s` = sequence after CP; `s_sp` = after SP as well."""

    s: int
    s_sp: int
    b: int
    h: int
    heads: int
    kv: int
    d: int
    ffn: int
    vocab: int          # local (padded) vocab shard
    tp: int
    sp: bool
    cp: int
    dt: str
    # MoE
    experts: int = 0    # local experts
    top_k: int = 0
    expert_ffn: int = 0  # local expert width (after etp)
    etp: int = 1
    ep: int = 1
    shared_ffn: int = 0  # local shared-expert width (after tp)


def make_shard(arch, plan, conv: Convention) -> Shard:
    tp, cp = plan.tp, plan.cp
    s = plan.seq_len // cp
    sp = bool(plan.sp) and tp > 1
    kv_local = arch.kv_heads // tp if arch.kv_heads >= tp else 1
    etp = plan.etp or 1
    return Shard(
        s=s, s_sp=s // tp if sp else s, b=plan.micro_batch, h=arch.hidden, heads=arch.heads // tp, kv=kv_local,
        d=arch.head_dim, ffn=arch.ffn // tp if arch.ffn else 0, vocab=padded_vocab(arch.vocab, tp, conv) // tp,
        tp=tp, sp=sp, cp=cp, dt=plan.dtype,
        experts=arch.experts // plan.ep if arch.experts else 0, top_k=arch.top_k,
        expert_ffn=arch.expert_ffn // etp if arch.experts else 0, etp=etp, ep=plan.ep,
        shared_ffn=(arch.shared_experts * arch.shared_ffn) // tp if arch.shared_experts else 0)


@dataclass(frozen=True, slots=True)
class LayerOptions:
    """Per-layer switches that change the program (a cache key together with Shard)."""

    norm: str
    activation: str
    moe: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    qk_norm: bool
    parallel_residual: bool
    attn_dropout: bool
    hidden_dropout: bool
    flash: bool
    recompute: str          # none | selective | core_attn | full_attn | full


def layer_options(arch, plan, index: int, recomputed: bool) -> LayerOptions:
    return _layer_options(arch, arch.is_moe_layer(index), plan.flash_attn, plan.recompute if recomputed else "none")


@lru_cache(maxsize=4096)
def _layer_options(arch, moe: bool, flash: bool, recompute: str) -> LayerOptions:
    return LayerOptions(
        norm=arch.norm, activation=arch.activation, moe=moe, qkv_bias=arch.qkv_bias,
        out_bias=arch.out_bias, mlp_bias=arch.mlp_bias, qk_norm=arch.qk_norm, parallel_residual=arch.parallel_residual,
        attn_dropout=arch.attn_dropout > 0, hidden_dropout=arch.hidden_dropout > 0, flash=flash,
        recompute=recompute)


# Building blocks --------------------------------------------------------------------------

class _Gen:
    """Helpers over one tape with the shard's sizes."""

    def __init__(self, tape: Tape, sh: Shard, conv: Convention, prefix: str):
        self.t = tape
        self.sh = sh
        self.conv = conv
        self.p = prefix
        self.dt = sh.dt

    def n(self, name: str) -> str:
        return f"{self.p}{name}"

    def act(self, name: str, shape, dtype: str | None = None, kind=None, storage: str = "") -> str:
        nm = self.n(name)
        if kind is None:
            self.t.t(nm, shape, dtype or self.dt, storage=storage)
        else:
            self.t.t(nm, shape, dtype or self.dt, kind, storage=storage)
        return nm

    # Norms --------------------------------------------------------------------------------
    def norm(self, x: str, name: str, kind: str, tokens_shape: tuple) -> str:
        h = tokens_shape[-1]
        w = self.t.param(self.n(name + ".weight"), (h,), self.dt)
        tok = tokens_shape[:-1]
        y = self.act(name + ".out", tokens_shape)
        if self.conv.fused_norm:
            rstd = self.act(name + ".rstd", tok, STAT)
            outs = (y, rstd)
            saves = (x, rstd, w)
            if kind == "layernorm":
                mean = self.act(name + ".mean", tok, STAT)
                outs = (y, mean, rstd)
                saves = (x, mean, rstd, w)
            self.t.node(kind, (x, w), outs, diff_inputs=(x,), save_i=saves)
            return y
        # Unfused RMSNorm as HF writes it: x.float(); var = x.pow(2).mean(); x * rsqrt(var + eps);
        # weight * x.to(dtype). Each op saves what its backward needs.
        xf = self.act(name + ".xf", tokens_shape, "fp32")
        self.t.node("to_fp32", (x,), (xf,), diff_inputs=(x,))
        var = self.act(name + ".var", tok + (1,), "fp32")
        self.t.node("pow_mean", (xf,), (var,), diff_inputs=(xf,), save_i=(xf,))
        rs = self.act(name + ".rsqrt", tok + (1,), "fp32")
        self.t.node("rsqrt", (var,), (rs,), diff_inputs=(var,), save_i=(rs,))
        xn = self.act(name + ".xn", tokens_shape, "fp32")
        self.t.node("mul", (xf, rs), (xn,), diff_inputs=(xf, rs), save_i=(xf, rs))
        xc = self.act(name + ".xc", tokens_shape)
        self.t.node("to_dtype", (xn,), (xc,), diff_inputs=(xn,))
        self.t.node("mul_weight", (xc, w), (y,), diff_inputs=(xc,), params=(w,), save_i=(w,), save_w=(xc,))
        return y

    # Linears ------------------------------------------------------------------------------
    def linear(self, x: str, name: str, out_shape: tuple, in_features: int, bias: bool) -> str:
        """y = x W^T (+ b), local shapes; saves x for the weight gradient."""
        w = self.t.param(self.n(name + ".weight"), (out_shape[-1], in_features), self.dt)
        params = (w,)
        if bias:
            params += (self.t.param(self.n(name + ".bias"), (out_shape[-1],), self.dt),)
        y = self.act(name + ".out", out_shape)
        self.t.node("linear", (x,) + params, (y,), diff_inputs=(x,), params=params, save_w=(x,))
        return y

    def column_linears(self, x: str, block: str, specs: list[tuple[str, int, bool]]) -> list[str]:
        """Column-parallel linears reading the same input `x` ([s_sp, b, h]); specs are
        (name, local out features, bias). Handles the sequence-parallel all-gather."""
        sh, conv = self.sh, self.conv
        full = (sh.s, sh.b, sh.h)
        if not sh.sp:
            return [self.linear(x, nm, (sh.s, sh.b, f), sh.h, bias) for nm, f, bias in specs]
        if conv.sp_save == "gathered" or (conv.sp_save == "shard+gathered" and conv.gather_once_per_block):
            xg = self.act(block + ".allgather", full, kind=COMM)
            self.t.node("all_gather", (x,), (xg,), diff_inputs=(x,), grad_via={x: "d." + xg},
                        post_i=(BwdOp("reduce_scatter", ("d." + xg,), ("d." + x,)),))
            return [self.linear(xg, nm, (sh.s, sh.b, f), sh.h, bias) for nm, f, bias in specs]
        outs = []
        for nm, f, bias in specs:
            w = self.t.param(self.n(nm + ".weight"), (f, sh.h), self.dt)
            params = (w,)
            if bias:
                params += (self.t.param(self.n(nm + ".bias"), (f,), self.dt),)
            xg = self.act(nm + ".allgather", full, kind=COMM)
            y = self.act(nm + ".out", (sh.s, sh.b, f))
            dfull = self.act(nm + ".dinput_full", full)
            rs = BwdOp("reduce_scatter", (dfull,), ("d." + x,))
            if conv.sp_save == "shard":
                # Megatron / Paddle recompute_allgather: keep the shard, gather again for dW.
                xg2 = self.act(nm + ".allgather_bwd", full, kind=COMM)
                self.t.node("linear_sp", (x,) + params, (y,), diff_inputs=(x,), params=params,
                            fwd_ops=(_op("all_gather", (x,), (xg,)), _op("matmul", (xg,) + params, (y,))),
                            grad_via={x: dfull}, post_i=(rs,), save_w=(xg2,),
                            pre_w=(BwdOp("all_gather", (x,), (xg2,)),), w_pre_first=True)
            else:
                # Paddle's SPInnerOverlapLinear: saves x and the gathered input.
                self.t.node("linear_sp", (x,) + params, (y,), diff_inputs=(x,), params=params,
                            fwd_ops=(_op("all_gather", (x,), (xg,)), _op("matmul", (xg,) + params, (y,))),
                            grad_via={x: dfull}, post_i=(rs,), save_i=(x,), save_w=(xg,))
            outs.append(y)
        return outs

    def row_linear(self, x: str, name: str, in_features: int, bias: bool) -> str:
        """Row-parallel linear to [s_sp, b, h]: all-reduce (no SP) or reduce-scatter (SP)."""
        sh = self.sh
        w = self.t.param(self.n(name + ".weight"), (sh.h, in_features), self.dt)
        partial = self.act(name + ".partial", (sh.s, sh.b, sh.h))
        self.t.node("linear", (x, w), (partial,), diff_inputs=(x,), params=(w,), save_w=(x,))
        y = partial
        if sh.tp > 1:
            if sh.sp:
                y = self.act(name + ".out", (sh.s_sp, sh.b, sh.h), kind=COMM)
                # backward of the reduce-scatter: all-gather of the output grad
                self.t.node("reduce_scatter", (partial,), (y,), diff_inputs=(partial,))
            else:
                y = self.act(name + ".out", (sh.s, sh.b, sh.h), storage=partial)
                self.t.node("all_reduce", (partial,), (y,), diff_inputs=(partial,), grad_alias=True)
        if bias:
            b = self.t.param(self.n(name + ".bias"), (sh.h,), self.dt)
            yb = self.act(name + ".biased", (sh.s_sp, sh.b, sh.h))
            self.t.node("add_bias", (y, b), (yb,), diff_inputs=(y,), params=(b,), grad_alias=True)
            y = yb
        return y

    def dropout(self, x: str, name: str, shape: tuple) -> str:
        mask = self.act(name + ".mask", shape, MASK)
        y = self.act(name + ".out", shape)
        self.t.node("dropout", (x,), (y, mask), diff_inputs=(x,), save_i=(mask,))
        return y

    def add(self, a: str, b: str, name: str, shape: tuple) -> str:
        y = self.act(name, shape)
        self.t.node("add", (a, b), (y,), diff_inputs=(a, b), grad_alias=True)
        return y

    # Attention ----------------------------------------------------------------------------
    def attention(self, x: str, opt: LayerOptions) -> str:
        sh, conv = self.sh, self.conv
        a, kv, d = sh.heads, sh.kv, sh.d
        s, b = sh.s, sh.b
        region = opt.recompute == "full_attn"
        if region:
            self.t.begin_region()
        if conv.fused_qkv:
            (qkv,) = self.column_linears(x, "attn", [("attn.qkv", (a + 2 * kv) * d, opt.qkv_bias)])
            q = self.act("attn.q", (s, b, a, d), storage=qkv)
            k = self.act("attn.k", (s, b, kv, d), storage=qkv)
            v = self.act("attn.v", (s, b, kv, d), storage=qkv)
            self.t.node("split_qkv", (qkv,), (q, k, v), diff_inputs=(qkv,))
        else:
            q2, k2, v2 = self.column_linears(x, "attn", [("attn.q_proj", a * d, opt.qkv_bias),
                                                         ("attn.k_proj", kv * d, opt.qkv_bias),
                                                         ("attn.v_proj", kv * d, opt.qkv_bias)])
            q = self.act("attn.q", (s, b, a, d), storage=q2)
            k = self.act("attn.k", (s, b, kv, d), storage=k2)
            v = self.act("attn.v", (s, b, kv, d), storage=v2)
            for src, dst in ((q2, q), (k2, k), (v2, v)):
                self.t.node("view", (src,), (dst,), diff_inputs=(src,), grad_alias=True)
        if opt.qk_norm:
            q = self.norm(q, "attn.q_norm", "rmsnorm", (s, b, a, d))
            k = self.norm(k, "attn.k_norm", "rmsnorm", (s, b, kv, d))
        if self._uses_rope:
            qr = self.act("attn.q_rope", (s, b, a, d))
            kr = self.act("attn.k_rope", (s, b, kv, d))
            self.t.node("rope", (q,), (qr,), diff_inputs=(q,))
            self.t.node("rope", (k,), (kr,), diff_inputs=(k,))
            q, k = qr, kr
        core = opt.recompute in ("selective", "core_attn")
        if core:
            self.t.begin_region()
        ctx = self.core_attention(q, k, v, opt)
        if core:
            self.t.end_region()
        out = self.row_linear(ctx, "attn.o_proj", a * d, opt.out_bias)
        if region:
            self.t.end_region()
        return out

    _uses_rope = True

    def core_attention(self, q: str, k: str, v: str, opt: LayerOptions) -> str:
        sh = self.sh
        a, kv, d, s, b = sh.heads, sh.kv, sh.d, sh.s, sh.b
        eb = dtype_bytes(self.dt)
        ctx = self.act("attn.ctx", (s, b, a, d))
        if opt.flash:
            lse = self.act("attn.lse", (b, a, s), STAT)
            kv_bytes = 2 * s * b * kv * d * eb
            ws_f = 2 * kv_bytes if sh.cp > 1 else 0       # ring: KV chunk in flight, double-buffered
            ws_i = s * b * a * d * 4 + b * a * s * 4      # fp32 dq accumulator + softmax_d
            if kv < a:
                ws_i += 2 * s * b * a * d * eb            # full-head dk, dv before the GQA sum
            if sh.cp > 1:
                ws_i += 4 * kv_bytes                      # KV and dKV chunks in flight
            self.t.node("flash_attn", (q, k, v), (ctx, lse), diff_inputs=(q, k, v), save_i=(q, k, v, ctx, lse),
                        workspace_f=ws_f, workspace_i=ws_i)
            return ctx
        if kv < a and self.conv.gqa_expand_eager:
            ke = self.act("attn.k_expand", (s, b, a, d))
            ve = self.act("attn.v_expand", (s, b, a, d))
            self.t.node("repeat_kv", (k,), (ke,), diff_inputs=(k,))
            self.t.node("repeat_kv", (v,), (ve,), diff_inputs=(v,))
            k, v = ke, ve
        scores = self.act("attn.scores", (b, a, s, s))
        self.t.node("bmm_qk", (q, k), (scores,), diff_inputs=(q, k), save_i=(q, k))
        probs = self.act("attn.probs", (b, a, s, s))
        self.t.node("scale_mask_softmax", (scores,), (probs,), diff_inputs=(scores,), save_i=(probs,))
        if opt.attn_dropout:
            probs = self.dropout(probs, "attn.dropout", (b, a, s, s))
        self.t.node("bmm_pv", (probs, v), (ctx,), diff_inputs=(probs, v), save_i=(probs, v))
        return ctx

    # MLP ----------------------------------------------------------------------------------
    def mlp(self, x: str, opt: LayerOptions, name: str = "mlp", width: int | None = None) -> str:
        sh, conv = self.sh, self.conv
        f = sh.ffn if width is None else width
        s, b = sh.s, sh.b
        if opt.activation in ("swiglu", "geglu"):
            if conv.fused_gate_up:
                (fc1,) = self.column_linears(x, name, [(name + ".fc1", 2 * f, opt.mlp_bias)])
                act = self.act(name + ".act", (s, b, f))
                self.t.node("bias_swiglu", (fc1,), (act,), diff_inputs=(fc1,), save_i=(fc1,))
            else:
                gate, up = self.column_linears(x, name, [(name + ".gate_proj", f, opt.mlp_bias),
                                                         (name + ".up_proj", f, opt.mlp_bias)])
                g = self.act(name + ".silu", (s, b, f))
                self.t.node("silu", (gate,), (g,), diff_inputs=(gate,), save_i=(gate,))
                act = self.act(name + ".act", (s, b, f))
                self.t.node("mul", (g, up), (act,), diff_inputs=(g, up), save_i=(g, up))
        else:
            (fc1,) = self.column_linears(x, name, [(name + ".fc1", f, opt.mlp_bias)])
            act = self.act(name + ".act", (s, b, f))
            self.t.node(opt.activation, (fc1,), (act,), diff_inputs=(fc1,), save_i=(fc1,))
        return self.row_linear(act, name + ".fc2", f, opt.mlp_bias)

    def moe(self, x: str, opt: LayerOptions) -> str:
        """Router, token permutation, all-to-all over ep, grouped expert FFN, and back.
        Routing is taken as balanced: each rank's experts receive top_k x its tokens."""
        sh = self.sh
        T = sh.s_sp * sh.b
        E = sh.experts * sh.ep
        h = sh.h
        # Router (replicated weight): logits, softmax / top-k probabilities.
        logits = self.linear(x, "moe.router", (sh.s_sp, sh.b, E), h, False)
        probs = self.act("moe.probs", (T, E), "fp32")
        self.t.node("router_softmax", (logits,), (probs,), diff_inputs=(logits,), save_i=(probs,))
        topk = self.act("moe.topk_probs", (T, sh.top_k), "fp32")
        idx = self.act("moe.topk_idx", (T, sh.top_k), "int64")
        self.t.node("topk", (probs,), (topk, idx), diff_inputs=(probs,), save_i=(idx,))
        N = T * sh.top_k
        perm = self.act("moe.permuted", (N, h))
        self.t.node("permute", (x, idx), (perm,), diff_inputs=(x,), save_i=(idx,))
        tokens = perm
        if sh.ep > 1:
            recv = self.act("moe.dispatch_a2a", (N, h), kind=COMM)
            self.t.node("all_to_all", (tokens,), (recv,), diff_inputs=(tokens,))
            tokens = recv
        M = N
        if sh.etp > 1 and sh.sp:
            M = N * sh.etp
            g = self.act("moe.etp_allgather", (M, h), kind=COMM)
            self.t.node("all_gather", (tokens,), (g,), diff_inputs=(tokens,))
            tokens = g
        f = sh.expert_ffn
        gated = opt.activation in ("swiglu", "geglu")
        fc1 = self.linear(tokens, "moe.experts.fc1", (M, 2 * f if gated else f), h, False)
        act = self.act("moe.experts.act", (M, f))
        self.t.node("bias_swiglu" if gated else opt.activation, (fc1,), (act,), diff_inputs=(fc1,), save_i=(fc1,))
        out = self.linear(act, "moe.experts.fc2", (M, h), f, False)
        if sh.etp > 1 and sh.sp:
            rs = self.act("moe.etp_reduce_scatter", (N, h), kind=COMM)
            self.t.node("reduce_scatter", (out,), (rs,), diff_inputs=(out,))
            out = rs
        elif sh.etp > 1:
            ar = self.act("moe.etp_allreduce", (N, h), storage=out)
            self.t.node("all_reduce", (out,), (ar,), diff_inputs=(out,), grad_alias=True)
            out = ar
        if sh.ep > 1:
            back = self.act("moe.combine_a2a", (N, h), kind=COMM)
            self.t.node("all_to_all", (out,), (back,), diff_inputs=(out,))
            out = back
        y = self.act("moe.out", (sh.s_sp, sh.b, h))
        self.t.node("unpermute_weighted", (out, topk, idx), (y,), diff_inputs=(out, topk), save_i=(out, topk, idx))
        if sh.shared_ffn:
            shared = self.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
            y = self.add(y, shared, "moe.out_shared", (sh.s_sp, sh.b, h))
        return y


def _op(type_: str, inputs, outputs):
    from ..ir import Op
    return Op(type_, tuple(inputs), tuple(outputs))


# Programs ---------------------------------------------------------------------------------

def decoder_layer_tape(arch, sh: Shard, conv: Convention, opt: LayerOptions, prefix: str = "") -> tuple[Tape, str, str]:
    """Tape of one decoder layer; returns (tape, input name, output name)."""
    tape = Tape(prefix)
    g = _Gen(tape, sh, conv, prefix)
    g._uses_rope = arch.position == "rope"
    tok = (sh.s_sp, sh.b, sh.h)
    x = g.act("input", tok)
    if opt.recompute == "full":
        tape.begin_region()
    h1 = g.norm(x, "input_norm", opt.norm, tok)
    tape.module = "attn"
    attn = g.attention(h1, opt)
    if opt.hidden_dropout:
        attn = g.dropout(attn, "attn.dropout_out", tok)
    tape.module = ""
    if opt.parallel_residual:
        h2 = g.norm(x, "post_attention_norm", opt.norm, tok)
    else:
        r1 = g.add(x, attn, "residual1", tok)
        h2 = g.norm(r1, "post_attention_norm", opt.norm, tok)
    tape.module = "mlp"
    m = g.moe(h2, opt) if opt.moe else g.mlp(h2, opt)
    if opt.hidden_dropout:
        m = g.dropout(m, "mlp.dropout_out", tok)
    tape.module = ""
    if opt.parallel_residual:
        r = g.add(x, attn, "residual_attn", tok)
        y = g.add(r, m, "output", tok)
    else:
        y = g.add(r1, m, "output", tok)
    if opt.recompute == "full":
        tape.end_region()
    return tape, x, y


def embedding_tape(arch, sh: Shard, conv: Convention, plan) -> tuple[Tape, str, str]:
    """Token ids -> vocab-parallel embedding (+ learned positions, dropout): the first stage's
    extra work. Returns (tape, ids name, output name)."""
    tape = Tape("emb.")
    g = _Gen(tape, sh, conv, "emb.")
    ids = g.act("input_ids", (sh.b, sh.s), "int64")
    tape.node("load_batch", (), (ids,))
    w = tape.param("emb.word.weight", (sh.vocab, sh.h), sh.dt)
    full = (sh.s, sh.b, sh.h)
    tok = (sh.s_sp, sh.b, sh.h)
    partial = g.act("lookup", full)
    tape.node("embedding", (ids, w), (partial,), diff_inputs=(), params=(w,), save_w=(ids,))
    y = partial
    if sh.tp > 1:
        if sh.sp:
            y = g.act("reduce_scatter", tok, kind=COMM)
            tape.node("reduce_scatter", (partial,), (y,), diff_inputs=(partial,))
        else:
            y = g.act("all_reduce", full, storage=partial)
            tape.node("all_reduce", (partial,), (y,), diff_inputs=(partial,), grad_alias=True)
    if arch.position == "learned":
        pw = tape.param("emb.position.weight", (max(arch.max_positions, plan.seq_len), sh.h), sh.dt)
        pos = g.act("positions", tok)
        tape.node("embedding", (pw,), (pos,), params=(pw,))
        y = g.add(y, pos, "with_positions", tok)
    if arch.embd_dropout > 0:
        y = g.dropout(y, "dropout", tok)
    return tape, ids, y


def head_tape(arch, sh: Shard, conv: Convention) -> tuple[Tape, str, str]:
    """Final norm, vocab-parallel output linear, fp32 logits and cross entropy (last stage).
    Returns (tape, input name, loss name)."""
    tape = Tape("head.")
    g = _Gen(tape, sh, conv, "head.")
    tok = (sh.s_sp, sh.b, sh.h)
    x = g.act("input", tok)
    hn = g.norm(x, "final_norm", arch.norm, tok)
    (logits,) = g.column_linears(hn, "head", [("head.output", sh.vocab, False)])
    labels = g.act("labels", (sh.b, sh.s), "int64")
    tape.node("load_labels", (), (labels,))
    lf = g.act("logits_fp32", (sh.s, sh.b, sh.vocab), "fp32")
    tape.node("to_fp32", (logits,), (lf,), diff_inputs=(logits,))
    loss = g.act("loss", (sh.s, sh.b), "fp32")
    if conv.ce_inplace:
        # Megatron's vocab-parallel CE: max/sub/exp/div in place on the fp32 copy, which it
        # saves as the softmax; backward edits it in place into the logits grad.
        soft = g.act("softmax", (sh.s, sh.b, sh.vocab), "fp32", storage=lf)
        tape.node("vocab_parallel_cross_entropy", (lf, labels), (soft, loss), diff_inputs=(lf,),
                  save_i=(soft, labels), workspace_f=3 * sh.s * sh.b * 4)
        tape.tensors["d." + lf] = type(tape.tensors[lf])("d." + lf, (sh.s, sh.b, sh.vocab), "fp32", storage=lf)
    else:
        logp = g.act("log_softmax", (sh.s, sh.b, sh.vocab), "fp32")
        tape.node("log_softmax", (lf,), (logp,), diff_inputs=(lf,), save_i=(logp,))
        tape.node("nll_loss", (logp, labels), (loss,), diff_inputs=(logp,), save_i=(labels,))
    return tape, x, loss
