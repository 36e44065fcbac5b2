"""Routers of the newer MoE families, as HF transformers' modules compute them (the rest of the
MoE block is `_Gen.moe_hf` in layers.py, or `mla.moe` for DeepSeek).

DeepSeek-V3 and GLM-4 MoE (transformers 5.24 modeling_deepseek_v3.py `DeepseekV3TopkRouter`,
modeling_glm4_moe.py `Glm4MoeTopkRouter`, the same code): the router's linear runs
in fp32 over an fp32 copy of its input and of its weight; sigmoid scores; the choice adds the
correction bias, scores each of `n_group` groups by its best two experts, keeps the best
`topk_group` groups (a mask filled with -inf) and takes the top k; the weights are the sigmoid
scores gathered at those experts, renormalised in place (`norm_topk_prob`) and scaled by
`routed_scaling_factor`. Only the gathered scores reach the loss: the choice's tensors (the
biased scores, the group top-2, the mask, the masked scores) are transients of the forward whose
autograd nodes die with them. Kept for backward: the fp32 input copy and weight copy (the
linear's), the sigmoid's output, the top-k indices (the gather's), the renormalisation's clone
and denominator.
"""

from __future__ import annotations


def router_topk(g, scores: str, dtype: str) -> tuple[str, str]:
    """`torch.topk(scores, top_k)` over a router's [T, E] scores -> the top-k values (in `dtype`)
    and the int64 expert indices, which the backward keeps to scatter the values' grad."""
    T, K = g.sh.s_sp * g.sh.b, g.sh.top_k
    topv = g.act("moe.topk_values", (T, K), dtype)
    topi = g.act("moe.topk_idx", (T, K), "int64")
    g.t.node("topk", (scores,), (topv, topi), diff_inputs=(scores,), save_i=(topi,))
    return topv, topi


def fp32_router_logits(g, x: str, op: str = "linear") -> str:
    """The router linear of HF's DeepSeek-style routers (DeepseekV2 / V3, GLM-4 MoE):
    `F.linear(x.type(float32), weight.type(float32))` -> logits [T, E]. Both casts are new
    tensors the fp32 linear keeps; under autocast F.linear runs in the compute dtype whatever
    the casts, so the logits are in it. `op`: the node's type (torchtitan's router gate is
    "router_gate": its op-level checkpointing recomputes it outside its count of matmuls)."""
    sh = g.sh
    T, E, h = sh.s_sp * sh.b, sh.experts * sh.ep, sh.h
    if sh.autocast:
        return g.linear(x, "moe.router", (T, E), h, False)
    xf = x
    if g.dtype_of(x) != "fp32":
        xf = g.act("moe.router.input_fp32", (T, h), "fp32")
        g.t.node("to_fp32", (x,), (xf,), diff_inputs=(x,))
    w = g.t.param(g.n("moe.router.weight"), (E, h), g.dt)
    wf = w
    if g.dt != "fp32":
        wf = g.act("moe.router.weight_fp32", (E, h), "fp32")
        g.t.node("weight_to_fp32", (w,), (wf,))
    logits = g.act("moe.router.out", (T, E), "fp32")
    g.t.node(
        op, (xf, wf), (logits,), diff_inputs=(xf,), params=(w,), save_i=(wf,) if wf != w else (), save_w=(xf,)
    )
    return logits


# The group limit of DeepSeek-V3's router choice (transformers' `n_group` / `topk_group`,
# megatron-core's `group_limited_topk`, torchtitan's `num_limited_groups`): the same steps in each
# framework but for the ops that turn the chosen group ids [T, TG] into the mask that masked_fill
# takes. Each framework's: (op, activation name after "moe.choice.", dtype, over the experts [T, E]
# rather than the groups [T, G]) per step.
# transformers: a zeros [T, G] scatter of ones, expanded to the experts, `.bool()`, then `~`
HF_GROUP_MASK = (
    ("zeros_scatter", "group_mask", "fp32", False),
    ("expand_reshape", "score_mask", "fp32", True),
    ("to_bool", "score_mask_bool", "bool", True),
    ("logical_not", "score_mask_not", "bool", True),
)
# megatron-core: the same, with `~` on the float mask (`~score_mask.bool()` fused)
MEGATRON_GROUP_MASK = (
    ("zeros_scatter", "group_mask", "fp32", False),
    ("expand_reshape", "score_mask", "fp32", True),
    ("logical_not", "score_mask_not", "bool", True),
)
# torchtitan: a bool [T, G] mask scattered at once, broadcast over each group's experts
TORCHTITAN_GROUP_MASK = (("ones_scatter", "group_mask", "bool", False),)


def group_limited(g, biased: str, T: int, opt, per: int, mask_steps) -> str:
    """The group limit on the choice's biased scores `biased` [T, E]: each of the `router_groups`
    groups scored by the sum of its best `per` experts, the best `router_topk_groups` groups
    kept and the experts of the others masked out (`mask_steps`: one of the *_GROUP_MASK) ->
    the masked scores [T, E]. Transients with no path to the loss."""
    t = g.t
    E, G, TG = g.sh.experts * g.sh.ep, opt.router_groups, opt.router_topk_groups
    gtop = g.act("moe.choice.group_topk", (T, G, per), "fp32")
    gtop_i = g.act("moe.choice.group_topk_idx", (T, G, per), "int64")
    t.node("topk", (biased,), (gtop, gtop_i))
    gsum = g.act("moe.choice.group_scores", (T, G), "fp32")
    t.node("sum", (gtop,), (gsum,))
    gsel = g.act("moe.choice.group_idx", (T, TG), "int64")
    gval = g.act("moe.choice.group_top", (T, TG), "fp32")
    t.node("topk", (gsum,), (gval, gsel))
    mask = gsel
    for op, name, dtype, over_experts in mask_steps:
        step = g.act("moe.choice." + name, (T, E if over_experts else G), dtype)
        t.node(op, (mask,), (step,))
        mask = step
    masked = g.act("moe.choice.masked", (T, E), "fp32")
    t.node("masked_fill", (biased, mask), (masked,))
    return masked


def sigmoid_group_router(g, x: str, opt) -> tuple[str, str, str]:
    """DeepSeek-V3's and GLM-4 MoE's router (`DeepseekV3TopkRouter`, which GLM's copies) on `x`
    ([s_sp, b, h]) -> (routing weights [T, K], expert indices [T, K] int64, the weights' dtype)."""
    sh = g.sh
    T, E, K = sh.s_sp * sh.b, sh.experts * sh.ep, sh.top_k
    logits = fp32_router_logits(g, x)
    sdt = g.dtype_of(logits)
    scores = g.act("moe.scores", (T, E), sdt)
    g.t.node("sigmoid", (logits,), (scores,), diff_inputs=(logits,), save_i=(scores,))
    # the choice: transients with no path to the loss
    biased = g.act("moe.choice.biased", (T, E), "fp32")
    g.t.node("add_bias", (scores,), (biased,))
    masked = group_limited(g, biased, T, opt, 2, HF_GROUP_MASK)
    tval = g.act("moe.choice.topk_values", (T, K), "fp32")
    topi = g.act("moe.topk_idx", (T, K), "int64")
    g.t.node("topk", (masked,), (tval, topi))
    topv = g.act("moe.topk_values", (T, K), sdt)
    g.t.node("gather", (scores, topi), (topv,), diff_inputs=(scores,), save_i=(topi,))
    if opt.router_norm_topk:
        ssum = g.act("moe.topk_sum", (T, 1), sdt)
        g.t.node("sum", (topv,), (ssum,), diff_inputs=(topv,))
        den = g.act("moe.topk_denominator", (T, 1), sdt)
        g.t.node("add_scalar", (ssum,), (den,), diff_inputs=(ssum,), grad_alias=True)
        orig = g.act("moe.topk_values_orig", (T, K), sdt)
        topn = g.act("moe.topk_weights", (T, K), sdt, storage=topv)
        g.t.node("div_", (topv, den), (orig, topn), diff_inputs=(topv, den), save_i=(orig, den))
        topv = topn
    scaled = g.act("moe.topk_weights_scaled", (T, K), sdt)
    g.t.node("mul_scalar", (topv,), (scaled,), diff_inputs=(topv,))
    return scaled, topi, sdt


# MoE load per expert-parallel rank ----------------------------------------------------------


def capacity_of(plan) -> tuple[float, bool]:
    """Megatron's --moe-expert-capacity-factor (0: dropless) and
    --moe-pad-expert-input-to-capacity, as the Megatron reader puts them in plan.extra."""
    extra = plan.extra or {}
    return float(extra.get("moe_capacity_factor") or 0.0), bool(extra.get("moe_pad_to_capacity", False))


def rank_load(arch, plan) -> float:
    """Tokens this rank's experts receive as a multiple of the balanced mean (top_k x the rank's
    tokens). With --ep 1 the rank holds every expert and receives exactly the mean whatever the
    routing; with --ep > 1 the busiest rank receives --moe-imbalance x the mean, at most every
    token of its expert-parallel group to min(top_k, local experts) of its experts. Megatron's
    capacity factor C drops tokens past C x the balanced share of each expert (the rank's
    experts: at most C x the mean) and, with padding to capacity, pads every expert's input to
    exactly that."""
    if not arch.experts:
        return 1.0
    ep = max(1, plan.ep)
    load = 1.0
    if ep > 1:
        local = arch.experts // ep
        cap = ep * min(arch.top_k, local) / arch.top_k
        load = min(float(plan.moe_imbalance or 1.0), cap)
    c, pad = capacity_of(plan)
    if c:
        load = c if pad else min(load, c)
    return load


def load_note(arch, plan) -> str | None:
    """What the estimate assumes about the MoE routing (said beside the numbers)."""
    if not arch.experts:
        return None
    c, pad = capacity_of(plan)
    load = rank_load(arch, plan)
    if c and pad:
        return (
            f"MoE load: each expert's input padded to capacity (--moe-expert-capacity-factor {c:g}): "
            f"the rank's experts hold {load:g} x the balanced tokens (top_k x its tokens)"
        )
    if plan.ep <= 1 and not c:
        return None  # every expert on the rank: the balanced count, whatever the routing
    what = (
        "balanced routing (each expert-parallel rank's experts receive top_k x its tokens)"
        if load == 1.0
        else f"the busiest expert-parallel rank's experts receive {load:g} x the balanced tokens"
    )
    if c:
        what += f", tokens past capacity dropped (--moe-expert-capacity-factor {c:g})"
    elif plan.moe_imbalance == 1.0:
        what += "; --moe-imbalance F sizes the busiest rank at F x"
    return "MoE load: " + what
