"""Multi-head latent attention and DeepSeek's MoE router, as transformers' DeepseekV2 / DeepseekV3
modules run them (``--convention hf``; Kimi-K2 is DeepseekV3): op by op on the tape of
`templates.layers`, what each autograd node keeps for backward and what the forward holds
until the module returns.

Attention (transformers 5.24, models/deepseek_v3/modeling_deepseek_v3.py `DeepseekV3Attention`):

* query: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or one ``q_proj`` without ``q_lora_rank``),
  viewed per head and split into its no-position part and its rotary part (views);
* ``kv_a_proj_with_mqa(x)`` -> [kv_lora_rank + qk_rope_head_dim]: the latent (normalised by
  ``kv_a_layernorm``, an eager RMSNorm over a slice: its fp32 copy is what ``pow`` saves; in fp32
  the slice itself, which keeps the whole projection alive) and the shared rotary key;
* rotary embedding of q's and k's rotary parts: V3's interleaved form (even / odd slices, four
  products, a concat) or V2's complex form (fp32 copy, complex product, cast back); products by
  cos / sin save only cos / sin, so nothing of the activations is kept;
* ``query = cat(q_nope, q_rope)`` (a new tensor); ``kv_b_proj(latent)`` -> per head [nope + v],
  split into k_nope and V (views); ``key`` = a new tensor filled by two ``copy_`` (k_nope and the
  shared rotary key broadcast over the heads);
* SDPA: with V's head dim unlike the query's, CUDA's flash kernel does not run
  (sdp_utils.cpp, `check_head_dim_size_flash` wants equal head dims): the memory-efficient
  kernel does, and saves query, key, the value view (so the whole ``kv_b_proj`` output), the
  output and the fp32 logsumexp, rows padded to 32 (`_scaled_dot_product_efficient_attention`).
  Equal head dims in bf16 / fp16 take the flash kernel (the output and the logsumexp [b, a, s]).
  Without ``--flash-attn`` HF's eager attention (the [b, a, s, s] scores);
* ``o_proj`` over the [s, b, heads x v_head_dim] output.

The forward's locals (the query projection, the kv_a projection, the rotary outputs) stay alive
until the attention module returns.

Router (`DeepseekV3TopkRouter`, which GLM-4 MoE's copies): `templates/moe.py`
`sigmoid_group_router`, written out there. V2 (`DeepseekV2TopkRouter`): softmax scores, greedy
top-k or a group mask (kept by masked_fill for backward), never renormalised. Experts: HF's
grouped_mm path as in `moe_hf`; the shared experts' MLP runs after the routed experts
(`DeepseekV3MoE.forward`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..ir import dtype_bytes
from .moe import fp32_router_logits, sigmoid_group_router
from .tape import COMM

STAT = "fp32"


def check_mla_plan(arch, plan) -> None:
    """What the MLA templates hold: the conventions whose framework says `mla_templates` (hf:
    transformers' modules, as traced mode runs them); any other is refused by name, as are the
    features not checked against a trace of these modules (torch.compile's partitioner, activation
    offloading, fp8 linears)."""
    from .. import frameworks
    from ..model import refuse_unmodelled

    check_mla_convention(arch, plan.convention)
    if frameworks.get(plan.convention).mla_megatron and not plan.flash_attn:
        raise refuse_unmodelled(
            arch.name or arch.model_type,
            arch.model_type,
            "megatron-core's multi-head latent attention without --flash-attn (its unfused "
            "attention over unequal q / v head dims is not checked against a trace)",
        )
    for flag, on in (
        ("--compile", plan.compile),
        ("--activation-offload", plan.activation_offload),
        ("--fp8", plan.fp8),
    ):
        if on:
            raise refuse_unmodelled(
                arch.name or arch.model_type,
                arch.model_type,
                f"multi-head latent attention with {flag} (not checked against a trace)",
            )


def check_mla_convention(arch, convention: str) -> None:
    from .. import frameworks
    from ..model import refuse_unmodelled

    if not getattr(arch, "kv_lora_rank", 0) or frameworks.get(convention).mla_templates:
        return
    ok = ", ".join(f"--convention {f.name}" for f in frameworks.ALL.values() if f.mla_templates)
    what = (
        f"multi-head latent attention under --convention {convention} (held against the "
        f"framework's own modules only under {ok})"
    )
    raise refuse_unmodelled(arch.name or arch.model_type, arch.model_type, what)


def mla_warnings(arch, plan) -> list[str]:
    """What a DeepSeek plan's numbers leave out, said beside them."""
    from .. import frameworks

    out = []
    hf = not frameworks.get(plan.convention).mla_megatron
    if getattr(arch, "kv_lora_rank", 0) and hf and plan.flash_attn and arch.head_dim != arch.v_head_dim:
        out.append(
            "multi-head latent attention: the value head differs from the query's, so SDPA runs the "
            "memory-efficient kernel (not flash); its backward's internal workspace is not counted"
        )
    return out


def attention(g, arch, x: str, opt) -> str:
    """One rank's MLA block: the framework's own module (`Framework.mla_megatron`)."""
    if g.conv.framework.mla_megatron:
        return attention_megatron(g, arch, x, opt)
    return attention_hf(g, arch, x, opt)


def attention_megatron(g, arch, x: str, opt) -> str:
    """megatron-core 0.16.1's `MLASelfAttention` (transformer/multi_latent_attention.py) with its
    Transformer Engine layer spec (`get_gpt_layer_with_transformer_engine_spec(multi_latent_
    attention=True, qk_layernorm=True)`), on one rank; returns linear_proj's output.

    * down projections (`linear_q_down_proj`, `linear_kv_down_proj`: TELinear, duplicated over
      tp) read the layer's normed input as it is (the sequence shard under SP) and both save it;
    * the latents' norms are fused into the up projections (TELayerNormColumnParallelLinear):
      the norm saves its input and rstd, the column-parallel linear its (sequence-shard) output,
      gathered again in backward. The kv latent is a split view of kv_combined: TE's norm works
      on a contiguous copy, which it saves (kv_combined itself dies after the key's rope);
    * the shared rotary key is all-gathered over the sequence under SP;
    * rope (`--apply-rope-fusion`, TE's fused kernel) on q's and k's rotary parts: new tensors,
      nothing saved; `query = cat(q_no_pe, q_pos_emb)`, `key = cat(k_no_pe, k_pos_emb.expand)`
      (new tensors, nothing saved: the up projections' outputs die), `value.contiguous()` a copy
      of the strided split of the kv up projection;
    * core attention: TE's fused (cuDNN / flash) attention, which takes MLA's unequal q / v head
      dims: saves q, k, v, its output [s, b, heads x v_head_dim] and the fp32 softmax statistics;
    * linear_proj: row-parallel over heads x v_head_dim."""
    sh, t = g.sh, g.t
    s, b, a, h = sh.s, sh.b, sh.heads, sh.h
    dq, dr, dv, kr = arch.head_dim, arch.qk_rope_head_dim, arch.v_head_dim, arch.kv_lora_rank
    dn = dq - dr
    tok = (sh.s_sp, sh.b)
    region = opt.recompute == "full_attn"
    if region:
        t.begin_region()
    if arch.q_lora_rank:
        qr = arch.q_lora_rank
        qa = g.linear(x, "attn.q_down_proj", tok + (qr,), h, False)
        qn = g.norm(qa, "attn.q_layernorm", opt.norm, tok + (qr,))
        (q,) = g.column_linears(qn, "attn.q_up", [("attn.q_up_proj", a * dq, False)], in_features=qr)
    else:
        (q,) = g.column_linears(x, "attn.q", [("attn.q_proj", a * dq, False)])
    q_nope = g.act("attn.q_no_pe", (s, b, a, dn), storage=q)
    q_rot = g.act("attn.q_pos_emb", (s, b, a, dr), storage=q)
    t.node("split", (q,), (q_nope, q_rot), diff_inputs=(q,))
    ckv = g.linear(x, "attn.kv_down_proj", tok + (kr + dr,), h, False)
    lat = g.act("attn.kv_compressed", tok + (kr,), storage=ckv)
    k_rot = g.act("attn.k_pos_emb", tok + (1, dr), storage=ckv)
    t.node("split", (ckv,), (lat, k_rot), diff_inputs=(ckv,))
    latc = g.act("attn.kv_compressed_contiguous", tok + (kr,))
    t.node("contiguous", (lat,), (latc,), diff_inputs=(lat,))
    latn = g.norm(latc, "attn.kv_layernorm", opt.norm, tok + (kr,))
    if sh.sp:
        kg = g.act("attn.k_pos_emb_gathered", (s, b, 1, dr), kind=COMM)
        t.node("all_gather", (k_rot,), (kg,), diff_inputs=(k_rot,))
        k_rot = kg
    q_emb = g.act("attn.q_pos_emb_rope", (s, b, a, dr))
    t.node("rope", (q_rot,), (q_emb,), diff_inputs=(q_rot,))
    k_emb = g.act("attn.k_pos_emb_rope", (s, b, 1, dr))
    t.node("rope", (k_rot,), (k_emb,), diff_inputs=(k_rot,))
    query = g.act("attn.query", (s, b, a, dq))
    t.node("cat", (q_nope, q_emb), (query,), diff_inputs=(q_nope, q_emb))
    (kv,) = g.column_linears(latn, "attn.kv_up", [("attn.kv_up_proj", a * (dn + dv), False)], in_features=kr)
    k_nope = g.act("attn.k_no_pe", (s, b, a, dn), storage=kv)
    v = g.act("attn.value_view", (s, b, a, dv), storage=kv)
    t.node("split", (kv,), (k_nope, v), diff_inputs=(kv,))
    key = g.act("attn.key", (s, b, a, dq))
    t.node("cat_expand", (k_nope, k_emb), (key,), diff_inputs=(k_nope, k_emb))
    vc = g.act("attn.value", (s, b, a, dv))
    t.node("contiguous", (v,), (vc,), diff_inputs=(v,))
    core = opt.recompute in ("selective", "core_attn")
    if core:
        t.begin_region()
    ctx = g.act("attn.ctx", (s, b, a * dv))
    g.flash_attention(query, key, vc, ctx, a, dq)
    if core:
        t.end_region()
    out = g.row_linear(ctx, "attn.o_proj", a * dv, False)
    if region:
        t.end_region()
    g.held_by_caller(x)
    return out


def attention_hf(g, arch, x: str, opt) -> str:
    """One rank's MLA block (tp = 1), HF's DeepseekV2 / V3 attention; returns o_proj's output."""
    sh, t = g.sh, g.t
    s, b, a, h = sh.s, sh.b, sh.heads, sh.h
    dq, dr, dv, kr = arch.head_dim, arch.qk_rope_head_dim, arch.v_head_dim, arch.kv_lora_rank
    dn = dq - dr
    region = opt.recompute == "full_attn"
    if region:
        t.begin_region()
    if arch.q_lora_rank:
        qr = arch.q_lora_rank
        qa = g.linear(x, "attn.q_a_proj", (s, b, qr), h, False)
        qn = g.norm(qa, "attn.q_a_layernorm", opt.norm, (s, b, qr))
        q = g.linear(qn, "attn.q_b_proj", (s, b, a * dq), qr, False)
    else:
        q = g.linear(x, "attn.q_proj", (s, b, a * dq), h, False)
    q_nope = g.act("attn.q_nope", (s, b, a, dn), g.dtype_of(q), storage=q)
    q_rot = g.act("attn.q_rot", (s, b, a, dr), g.dtype_of(q), storage=q)
    t.node("split", (q,), (q_nope, q_rot), diff_inputs=(q,))
    ckv = g.linear(x, "attn.kv_a_proj_with_mqa", (s, b, kr + dr), h, False)
    lat = g.act("attn.kv_latent", (s, b, kr), g.dtype_of(ckv), storage=ckv)
    k_rot = g.act("attn.k_rot", (s, b, 1, dr), g.dtype_of(ckv), storage=ckv)
    t.node("split", (ckv,), (lat, k_rot), diff_inputs=(ckv,))
    latn = g.norm(lat, "attn.kv_a_layernorm", opt.norm, (s, b, kr))
    q_emb = _rope(g, arch, q_rot, "attn.q", (s, b, a, dr))
    k_emb = _rope(g, arch, k_rot, "attn.k", (s, b, 1, dr))
    # cat((q_nope, q_rope)): type promotion (an fp32 rotary part under autocast makes an fp32 query)
    qdt = "fp32" if "fp32" in (g.dtype_of(q_nope), g.dtype_of(q_emb)) else g.dtype_of(q_nope)
    query = g.act("attn.query", (s, b, a, dq), qdt)
    t.node("cat", (q_nope, q_emb), (query,), diff_inputs=(q_nope, q_emb), promote_grads=True)
    kvb = g.linear(latn, "attn.kv_b_proj", (s, b, a * (dn + dv)), kr, False)
    k_nope = g.act("attn.k_nope", (s, b, a, dn), g.dtype_of(kvb), storage=kvb)
    v = g.act("attn.v", (s, b, a, dv), g.dtype_of(kvb), storage=kvb)
    t.node("split", (kvb,), (k_nope, v), diff_inputs=(kvb,))
    kdt = "fp32" if "fp32" in (g.dtype_of(k_nope), g.dtype_of(k_emb)) else g.dtype_of(k_nope)
    key = g.act("attn.key", (s, b, a, dq), kdt)
    # new_empty + copy_ of both parts (CopySlices): nothing saved; k_rope's grad summed over heads
    t.node("new_empty_copy", (k_nope, k_emb), (key,), diff_inputs=(k_nope, k_emb), promote_grads=True)
    core = opt.recompute in ("selective", "core_attn") and not g.sac
    if core:
        t.begin_region()
    ctx = _core_attention(g, arch, query, key, v, opt)
    if core:
        t.end_region()
    out = g.row_linear(ctx, "attn.o_proj", a * dv, False)
    # the module's locals (q_states, compressed_kv, the rotary outputs) die when it returns
    t.held_until.setdefault(len(t.nodes) - 1, []).extend([q, ckv, q_emb, k_emb])
    if region:
        t.end_region()
    g.held_by_caller(x)
    return out


def _rope(g, arch, x: str, name: str, shape: tuple) -> str:
    """Rotary embedding of a rotary part (a strided view). The products with cos / sin save only
    cos / sin (no grad), so the output is the one tensor left; the rest is transient. Under
    autocast cos / sin are fp32 (the embedding's output dtype) and so is the output."""
    dt = "fp32" if g.sh.autocast else g.dtype_of(x)
    y = g.act(name + "_rope", shape, dt)
    n = math.prod(shape)
    eb = dtype_bytes(dt)
    style = g.conv.framework.mla_rope_style or arch.rope_style
    if style == "complex":
        # x.float().reshape(.., -1, 2) (an fp32 copy: the slice is not contiguous), view_as_complex,
        # * freqs_cis (a complex64 product, 8 bytes a pair), view_as_real, type_as(x) (a copy back
        # unless fp32); backward: the cast grad, the complex product's grad, the cast back
        wf = 4 * n + (4 * n if dt != "fp32" else 0)
        wi = 8 * n
    elif style == "interleave":
        # cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin]): at most two halves' products and a
        # difference beside the next sum (2 x the output), or both halves beside the concat
        wf, wi = n * eb, 2 * n * eb
    else:
        # x * cos + rotate_half(x) * sin: rotate_half's halves, its concat and the products
        wf, wi = 2 * n * eb, 2 * n * eb
    g.t.node("rope", (x,), (y,), diff_inputs=(x,), workspace_f=wf, workspace_i=wi, promote_grads=True)
    return y


def _core_attention(g, arch, q: str, k: str, v: str, opt) -> str:
    """SDPA over the MLA query / key / value; what the kernel HF's call reaches saves."""
    sh, t = g.sh, g.t
    s, b, a = sh.s, sh.b, sh.heads
    dq, dv = arch.head_dim, arch.v_head_dim
    if not opt.flash:
        # HF's eager attention: the scores path of `_Gen.core_attention` with V's head dim
        # matmul(probs, V) reshapes the strided value view to [b x a, s, dv]: a contiguous copy,
        # which the matmul saves (so the kv_b_proj output itself is freed)
        vc = g.act("attn.v_contiguous", (s, b, a, dv), g.dtype_of(v))
        t.node("contiguous", (v,), (vc,), diff_inputs=(v,))
        v = vc
        saved, g.sh = g.sh, replace(sh, d=dv)
        try:
            return g.core_attention(q, k, v, opt)
        finally:
            g.sh = saved
    q, k, v = g.to_compute(q, "attn.q"), g.to_compute(k, "attn.k"), g.to_compute(v, "attn.v")
    ctx = g.act("attn.ctx", (s, b, a, dv))
    flash = g.dt in ("bf16", "fp16") and dq == dv and dq <= 256
    if flash:
        g.flash_attention(q, k, v, ctx, a, dq)
    else:
        # memory-efficient attention: logsumexp rows padded to 32 (its CUDA kernel and meta
        # function, aten/src/ATen/native/transformers/cuda/attention.cu); its backward's own
        # workspace is not modelled (nor seen by a trace)
        lse = g.act("attn.lse", (b, a, -(-s // 32) * 32), STAT)
        t.node("efficient_attn", (q, k, v), (ctx, lse), diff_inputs=(q, k, v), save_i=(q, k, v, ctx, lse))
    if flash:
        # the flash kernel's output takes the query's layout (flash_api.cpp `mha_fwd`: empty_like
        # of the [b, s, a, d] view of q); MLA's query is a concat laid out [b, a, s, d], so HF's
        # transpose(1, 2).reshape(b, s, -1) copies the output, and o_proj saves that copy
        out = g.act("attn.ctx_contiguous", (s, b, a, dv))
        t.node("reshape_copy", (ctx,), (out,), diff_inputs=(ctx,))
        ctx = out
    return ctx


def moe(g, arch, x: str, opt) -> str:
    """DeepseekV2Moe / DeepseekV3MoE: router, HF's grouped_mm experts, then the shared experts."""
    sh = g.sh
    if arch.router == "sigmoid_group":  # V3
        topn, topi, sdt = sigmoid_group_router(g, x, opt)
    else:
        topn, topi, sdt = _v2_router(g, arch, x)
    y = _hf_grouped_experts(g, x, topn, topi, sdt, opt)
    if sh.shared_ffn:
        shared = g.mlp(x, opt, name="moe.shared", width=sh.shared_ffn)
        y = g.add(y, shared, "moe.out_shared", (sh.s_sp, sh.b, sh.h))
    return y


def _v2_router(g, arch, x: str) -> tuple[str, str, str]:
    """DeepseekV2's router: fp32 logits, softmax scores (kept), the top-k greedy or within the
    router_topk_groups best groups (a [T, E] mask masked_fill keeps), times routed_scaling_factor
    (never renormalised) -> (weights [T, K], indices [T, K], their dtype)."""
    sh, t = g.sh, g.t
    T, E, K = sh.s_sp * sh.b, sh.experts * sh.ep, sh.top_k
    logits = fp32_router_logits(g, x)
    sdt = "fp32"
    scores = g.act("moe.scores", (T, E), sdt)
    t.node("softmax", (logits,), (scores,), diff_inputs=(logits,), save_i=(scores,))
    eb = dtype_bytes(sdt)
    topi = g.act("moe.topk_idx", (T, K), "int64")
    if arch.router_groups > 1:
        # group maxima, group top-k, the [T, E] mask: masked_fill keeps its bool mask
        mask = g.act("moe.group_mask", (T, E), "bool")
        t.node("group_mask", (scores,), (mask,), workspace_f=(eb + 1) * T * E)
        masked = g.act("moe.masked_scores", (T, E), sdt)
        t.node("masked_fill", (scores, mask), (masked,), diff_inputs=(scores,), save_i=(mask,))
        topv = g.act("moe.topk_values", (T, K), sdt)
        t.node("topk", (masked,), (topv, topi), diff_inputs=(masked,), save_i=(topi,))
    else:
        topv = g.act("moe.topk_values", (T, K), sdt)
        t.node("topk", (scores,), (topv, topi), diff_inputs=(scores,), save_i=(topi,))
    scaled = g.act("moe.topk_scaled", (T, K), sdt)
    t.node("mul_scalar", (topv,), (scaled,), diff_inputs=(topv,))
    return scaled, topi, sdt


def _hf_grouped_experts(g, x: str, topn: str, topi: str, wdt: str, opt) -> str:
    """transformers' grouped_mm experts (integrations/moe.py), as `_Gen.moe_hf` writes them: tokens
    sorted by expert and gathered, grouped GEMMs, the routing weights applied in their dtype, the
    original order restored and the top-k copies summed, cast back to the hidden dtype."""
    sh, t = g.sh, g.t
    T, E, K, h = sh.s_sp * sh.b, sh.experts * sh.ep, sh.top_k, sh.h
    S = T * K
    f = sh.expert_ffn
    ids_g = g.act("moe.expert_ids_sorted", (S,), "int64")
    perm = g.act("moe.perm", (S,), "int64")
    t.node("sort", (topi,), (ids_g, perm))
    tok_idx = g.act("moe.token_idx", (S,), "int64")
    t.node("floor_divide", (perm,), (tok_idx,))
    hs_g = g.act("moe.permuted", (S, h), g.dtype_of(x))
    t.node(
        "index",
        (x, tok_idx),
        (hs_g,),
        diff_inputs=(x,),
        save_i=(tok_idx,),
        workspace_i=T * h * dtype_bytes(g.dtype_of(x)),
    )
    sw_g = g.act("moe.sample_weights", (S,), wdt)
    t.node("index", (topn, perm), (sw_g,), diff_inputs=(topn,), save_i=(perm,))
    offs = g.act("moe.offsets", (E,), "int32")
    t.node("histc_cumsum", (ids_g,), (offs,))
    gated = opt.activation in ("swiglu", "geglu")
    with g.hf_experts_dtype():  # the weights' dtype: fp32 under autocast (`_Gen.hf_experts_dtype`)
        hs_g = g.to_dtype(hs_g, "moe.permuted")
        fc1 = g.grouped_linear(hs_g, offs, "moe.experts.fc1", (S, 2 * f if gated else f), h)
        act = g.act("moe.experts.act", (S, f))
        if gated:
            gate = g.act("moe.experts.gate", (S, f), storage=fc1)
            up = g.act("moe.experts.up", (S, f), storage=fc1)
            t.node("chunk", (fc1,), (gate, up), diff_inputs=(fc1,))
            sg = g.act("moe.experts.silu", (S, f))
            t.node("silu", (gate,), (sg,), diff_inputs=(gate,), save_i=(gate,))
            t.node("mul", (sg, up), (act,), diff_inputs=(sg, up), save_i=(sg, up))
        else:
            t.node(opt.activation, (fc1,), (act,), diff_inputs=(fc1,), save_i=(fc1,))
        out = g.grouped_linear(act, offs, "moe.experts.fc2", (S, h), f)
    inv = g.act("moe.inv_perm", (S,), "int64")
    t.node("inverse_perm", (perm,), (inv,))
    odt = g.dtype_of(x)
    wdt = "fp32" if "fp32" in (wdt, g.dtype_of(out)) else wdt  # type promotion of the product
    wb = dtype_bytes(wdt)
    wout = g.act("moe.weighted", (S, h), wdt)
    t.node(
        "mul", (out, sw_g), (wout,), diff_inputs=(out, sw_g), save_i=(out, sw_g), workspace_i=2 * S * h * wb
    )
    wperm = g.act("moe.unpermuted", (S, h), wdt)
    t.node("index", (wout, inv), (wperm,), diff_inputs=(wout,), save_i=(inv,), workspace_i=S * h * wb)
    y = g.act("moe.out_" + wdt if wdt != odt else "moe.out", (sh.s_sp, sh.b, h), wdt)
    t.node("sum_topk", (wperm,), (y,), diff_inputs=(wperm,))
    if wdt != odt:
        yc = g.act("moe.out", (sh.s_sp, sh.b, h), odt)
        t.node("to_dtype", (y,), (yc,), diff_inputs=(y,))
        y = yc
    return y


def _op(type_: str, inputs, outputs):
    from ..ir import Op

    return Op(type_, tuple(inputs), tuple(outputs))
