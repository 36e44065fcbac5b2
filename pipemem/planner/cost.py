"""The planner's cost model: how long one training step of a plan takes, roughly, so that plans
that fit can be ranked. It never touches memory.

    step time = pipeline makespan + communication time

Pipeline makespan. The plan's schedule is simulated (`pipemem.schedules.check.simulate`, the
same as-soon-as-possible run every schedule check uses) with per-virtual-stage durations of
F, I (input-grad backward) and W (weight-grad backward) proportional to their FLOPs, per
token, from Qi et al. 2024 (Zero Bubble, Table 1), generalised to GQA / SwiGLU / MoE by
counting the layer's matmul weights:
    F = 2 P + 4 s A,   I = 2 P + 8 s A,   W = 2 P          (per token, per layer)
with P the weights a token multiplies (attention projections, MLP or top-k experts, router),
A = heads x head_dim and s the sequence length; the fused backward B = I + W. Recomputation
adds its forward to I: the whole F of a fully recomputed layer, 4 s A (core attention) for
selective. The last stage adds the output layer (2 h V for each of F, I and W). Durations are
divided by tp x cp (each rank does that share) and by the GPU's dense TFLOP/s. The bubble is
the idle share of all pipeline ranks over the makespan.

Communication time. Bytes each rank sends per step (ring collectives: an all-gather or
reduce-scatter over n ranks moves (n-1)/n of the full tensor, an all-reduce twice that),
per group, at the intra-node link speed when the group fits in one node and the inter-node
speed otherwise (ranks ordered tp, cp, dp, pp as Megatron lays them out; experts ep inside
dp x cp), added to the makespan without overlap:
    tp   per layer and microbatch: 4 all-gathers / reduce-scatters of the layer's activation
         (b s / cp x h, 2 bytes) in F and 4 in B (+4 when the layer's forward is recomputed);
         a Megatron MoE layer keeps the attention's 2 (and a shared expert's 2) per pass, and
         under expert tensor parallelism its dispatcher gathers / scatters the routed tokens
         (b s / (cp tp) x top-k x h per rank) over the etp ranks, 2 per pass;
    cp   per layer and microbatch: K and V of the local chunk passed cp-1 times around the
         ring in F, K, V and their grads in B;
    ep   per MoE layer and microbatch: dispatch and combine all-to-alls in F and in B of the
         rank's b s / (cp tp) tokens x top-k x h;
    pp   per microbatch and chunk: the stage's output sent in F and its grad in B;
    dp   gradients reduced over dp x cp: once per step (all-reduce; with ZeRO-1 / the
         distributed optimizer a reduce-scatter plus the parameters' all-gather); with
         sharded gradients (ZeRO-2) the reduce-scatter runs after every microbatch's
         backward; ZeRO-3 / FSDP also gathers the parameters in F and in B of every microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..errors import UserError
from ..ir import dtype_bytes

ACT_BYTES = 2  # bf16 activations on the wire


# ---------------------------------------------------------------- FLOPs per token


def matmul_weights(arch, index: int) -> int:
    """Weights one token multiplies in decoder layer `index` (top-k experts for MoE layers)."""
    h, d = arch.hidden, arch.head_dim
    attn = (arch.heads + 2 * arch.kv_heads) * d * h + h * arch.heads * d
    gated = 3 if arch.activation in ("swiglu", "geglu") else 2
    if arch.is_moe_layer(index):
        mlp = arch.experts * h + arch.top_k * gated * arch.expert_ffn * h
        mlp += arch.shared_experts * gated * arch.shared_ffn * h
    else:
        mlp = gated * arch.ffn * h
    return attn + mlp


def layer_flops(
    arch, index: int, seq_len: int, recompute: str = "none", adapters: int = 0
) -> tuple[float, float, float]:
    """(F, I, W) FLOPs per token of one decoder layer, unsharded (module docstring). `adapters`:
    the layer's LoRA adapter weights (pipemem.lora), whose matmuls add to F and I; the base is
    frozen, so the weight gradients (W) are the adapters' only."""
    p = matmul_weights(arch, index)
    core = 4.0 * seq_len * arch.heads * arch.head_dim
    f, i, w = 2.0 * p + core, 2.0 * p + 2 * core, 2.0 * p
    if adapters:
        f, i, w = f + 2.0 * adapters, i + 2.0 * adapters, 2.0 * adapters
    if recompute in ("full", "full_attn"):
        i += f
    elif recompute in ("selective", "core_attn"):
        i += core
    return f, i, w


def head_flops(arch, frozen: bool = False) -> tuple[float, float, float]:
    x = 2.0 * arch.hidden * arch.vocab
    return x, x, 0.0 if frozen else x


@lru_cache(maxsize=4096)
def stage_flops(
    arch,
    layout: tuple[int, ...],
    seq_len: int,
    recompute: str,
    recompute_layers: int | None,
    adapters: int = 0,
):
    """Per virtual stage (F, I, W) FLOPs per token: its layers (the first `recompute_layers`
    of each stage recomputed, all when None, as the memory model does) and the head on the last.
    `adapters` > 0: a LoRA plan's adapter weights per layer (`layer_flops`), the head frozen."""
    out, start = [], 0
    last = len(layout) - 1
    for s, n in enumerate(layout):
        k = n if recompute_layers is None else min(recompute_layers, n)
        f = i = w = 0.0
        for pos, idx in enumerate(range(start, start + n)):
            a, b, c = layer_flops(arch, idx, seq_len, recompute if pos < k else "none", adapters)
            f, i, w = f + a, i + b, w + c
        if s == last:
            a, b, c = head_flops(arch, frozen=adapters > 0)
            f, i, w = f + a, i + b, w + c
        out.append((f, i, w))
        start += n
    return tuple(out)


# ---------------------------------------------------------------- pipeline bubble


@dataclass(frozen=True)
class PipelineTime:
    makespan: float  # in the units of the durations given
    busy: float  # the busiest rank's work, same units
    bubble: float  # idle share of all ranks over the makespan


def pipeline_time(schedule, durations) -> PipelineTime:
    """Simulate `schedule` with per-stage (F, I, W) durations; B = I + W."""
    from ..schedules.check import TimeModel, simulate

    tf = [d[0] for d in durations]
    ti = [d[1] for d in durations]
    tw = [d[2] for d in durations]
    sim = simulate(schedule, TimeModel(F=tf, I=ti, W=tw))
    return PipelineTime(sim.makespan, max(sim.busy), sim.bubble_ratio)


_SCHEDULES: dict = {}
_TIMES: dict = {}


def schedule_for(name: str | None, pp: int, microbatches: int, vpp: int):
    """The named schedule (cached: plans of one search share few shapes); UserError when the
    schedule cannot run this many microbatches."""
    key = (name, pp, microbatches, vpp)
    hit = _SCHEDULES.get(key)
    if hit is None:
        from ..sources import named_schedule

        try:  # the estimates' own schedule object (sources' cache), not a second one built alike
            hit = named_schedule(name or "1F1B", pp, microbatches, vpp)
        except UserError as e:
            hit = e
        if len(_SCHEDULES) > 512:
            _SCHEDULES.clear()
        _SCHEDULES[key] = hit
    if isinstance(hit, UserError):
        raise hit
    return hit


def stage_pipeline_time(
    arch, layout, seq_len, recompute, recompute_layers, name, pp, microbatches, vpp, adapters: int = 0
):
    """PipelineTime of the plan's schedule in FLOPs-per-token units (cached)."""
    key = (arch, layout, seq_len, recompute, recompute_layers, name, pp, microbatches, vpp, adapters)
    hit = _TIMES.get(key)
    if hit is None:
        sched = schedule_for(name, pp, microbatches, vpp)
        hit = pipeline_time(sched, stage_flops(arch, layout, seq_len, recompute, recompute_layers, adapters))
        if len(_TIMES) > 20000:
            _TIMES.clear()
        _TIMES[key] = hit
    return hit


def clear_caches() -> None:
    _SCHEDULES.clear()
    _TIMES.clear()
    stage_flops.cache_clear()


# ---------------------------------------------------------------- communication


@dataclass(frozen=True)
class Comm:
    group: str
    bytes: float  # sent per rank per step
    crosses_nodes: bool
    seconds: float


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def group_spans(plan) -> dict[str, int]:
    """Consecutive ranks each group spans in Megatron's order (tp fastest, then cp, dp, pp;
    expert groups inside): a group crosses nodes when its span exceeds the node."""
    tp, cp, dp, pp = plan.tp, plan.cp, plan.dp, plan.pp
    etp = plan.etp or tp
    return {"tp": tp, "cp": tp * cp, "ep": etp * plan.ep, "dp": tp * cp * dp, "pp": tp * cp * dp * pp}


def communication(
    arch, plan, rank_stages: list[int], rank_params: tuple[int, int], gpus_per_node: int, speeds
) -> list[Comm]:
    """Per-group bytes per rank per step for a validated plan (module docstring), for the
    pipeline rank holding virtual stages `rank_stages` and (dense, expert) parameter elements
    `rank_params`."""
    b, s, h = plan.micro_batch, plan.seq_len, arch.hidden
    m = plan.microbatches
    tp, cp, ep, dp, pp = plan.tp, plan.cp, plan.ep, plan.dp, plan.pp
    starts = [sum(plan.pp_layout[:st]) for st in range(len(plan.pp_layout) + 1)]
    layers = [i for st in rank_stages for i in range(starts[st], starts[st + 1])]
    layers_rank = len(layers)
    moe_rank = sum(1 for i in layers if arch.is_moe_layer(i))
    recomputed: list[int] = []  # the layers whose forward runs again in B
    if plan.recompute in ("full", "full_attn"):
        k = plan.recompute_layers
        for st in rank_stages:
            n = plan.pp_layout[st]
            recomputed += range(starts[st], starts[st] + (n if k is None else min(k, n)))
    act = b * (s // cp) * h * ACT_BYTES  # one microbatch's activation, gathered
    tokens = b * s // (cp * tp)
    # Megatron's alltoall dispatcher under expert tensor parallelism (etp > 1) gathers the tokens
    # the all-to-all brought (about tokens x top-k) over the etp ranks and reduce-scatters the
    # experts' output (token_dispatcher.py, MoEAlltoAllTokenDispatcher): its MoE layers move
    # top-k times a dense MLP's activation there, and only the attention (and a shared expert, a
    # dense tensor-parallel MLP) gather [b, s, h] over tp; with etp 1 the experts need no tp
    # collective. Other conventions split experts as a dense MLP (the MLP's own two).
    etp = plan.etp or tp
    folded = plan.convention == "megatron" and arch.is_moe

    def h_collectives(i: int) -> int:  # per forward of layer i over tp, of [b, s, h]
        if folded and arch.is_moe_layer(i):
            return 2 + (2 if arch.shared_experts else 0)
        return 4

    def e_collectives(i: int) -> int:  # per forward of layer i over etp, of tokens x top-k x h
        return 2 if folded and arch.is_moe_layer(i) and etp > 1 else 0

    out: dict[str, float] = {}
    passes = [(i, 2) for i in layers] + [(i, 1) for i in recomputed]  # F + B, and a recomputed F
    out["tp"] = m * _ring(tp) * act * sum(n * h_collectives(i) for i, n in passes)
    routed = (etp - 1) * tokens * max(1, arch.top_k) * h * ACT_BYTES  # sent per rank per collective
    out["tp"] += m * routed * sum(n * e_collectives(i) for i, n in passes)
    kv = 2 * b * (s // cp) * (max(1, arch.kv_heads // tp)) * arch.head_dim * ACT_BYTES
    out["cp"] = m * layers_rank * 3 * (cp - 1) * kv if cp > 1 else 0.0
    out["ep"] = m * moe_rank * 4 * _ring(ep) * tokens * max(1, arch.top_k) * h * ACT_BYTES if ep > 1 else 0.0
    boundary = act / (tp if plan.sp else 1)
    out["pp"] = m * plan.vpp * 2 * boundary if pp > 1 else 0.0
    dense, expert = rank_params
    grad = dtype_bytes(plan.main_grad_dtype or plan.dtype)
    param = dtype_bytes(plan.dtype)
    edp = plan.edp
    vol = 0.0
    # LoRA: only the adapters have gradients and optimizer states (ZeRO-3 / FSDP still gathers
    # the frozen base in F and B)
    trained = lora_adapters(arch, plan) * layers_rank if plan.lora_rank else None
    for n, group in ((dense, dp * cp), (expert, edp)):
        if group <= 1 or n == 0:
            continue
        t = n if trained is None else trained
        if plan.zero >= 3:
            vol += _ring(group) * m * (t * grad + 2 * n * param)
        elif plan.zero == 2:
            vol += _ring(group) * t * (m * grad + param)
        elif plan.zero == 1 or plan.dist_opt:
            vol += _ring(group) * t * (grad + param)
        else:
            vol += 2 * _ring(group) * t * grad
    out["dp"] = vol
    spans = group_spans(plan)
    res = []
    for g, v in out.items():
        if v <= 0:
            continue
        cross = spans[g] > gpus_per_node
        bw = (speeds.inter_gbps if cross else speeds.intra_gbps) * 1e9
        res.append(Comm(g, v, cross, v / bw))
    return res


# ---------------------------------------------------------------- the step


@dataclass
class Cost:
    makespan_s: float
    bubble: float
    comm: list[Comm] = field(default_factory=list)

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes for c in self.comm)

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.comm)

    @property
    def step_s(self) -> float:
        return self.makespan_s + self.comm_s

    @property
    def crosses_nodes(self) -> list[str]:
        return [c.group for c in self.comm if c.crosses_nodes]

    def to_dict(self) -> dict:
        return {
            "step_seconds": self.step_s,
            "pipeline_seconds": self.makespan_s,
            "bubble": self.bubble,
            "comm_seconds": self.comm_s,
            "comm_bytes": self.comm_bytes,
            "comm": {
                c.group: {"bytes": c.bytes, "crosses_nodes": c.crosses_nodes, "seconds": c.seconds}
                for c in self.comm
            },
        }


def lora_adapters(arch, plan) -> int:
    """A LoRA plan's adapter weights per decoder layer on one tensor-parallel rank (0 without
    LoRA)."""
    if not plan.lora_rank:
        return 0
    from ..lora import adapter_elems, parse_targets

    return adapter_elems(arch, parse_targets(plan.lora_targets), plan.lora_rank, plan.tp)


def plan_cost(
    arch, plan, schedule_name: str | None, rank_stages, rank_params, gpus_per_node: int, speeds
) -> Cost:
    """Cost of a validated plan run with `schedule_name` (None: no pipeline); communication is
    counted for the pipeline rank with `rank_stages` and `rank_params` (the busiest one)."""
    pt = stage_pipeline_time(
        arch,
        plan.pp_layout,
        plan.seq_len,
        plan.recompute,
        plan.recompute_layers,
        schedule_name,
        plan.pp,
        plan.microbatches,
        plan.vpp,
        lora_adapters(arch, replace(plan, tp=1)) if plan.lora_rank else 0,
    )
    tokens_per_rank = plan.micro_batch * plan.seq_len / (plan.tp * plan.cp)
    seconds = pt.makespan * tokens_per_rank / (speeds.tflops * 1e12)
    return Cost(
        seconds, pt.bubble, communication(arch, plan, rank_stages, rank_params, gpus_per_node, speeds)
    )
