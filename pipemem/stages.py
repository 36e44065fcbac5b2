"""Stage jobs from template programs (layer 4 of DESIGN.md's flow).

A (virtual) pipeline stage is a range of decoder layers, plus the embedding on stage 0 and
the final norm, output layer and loss on the last stage. Each part's F / B / I / W programs
are analysed once per distinct shape by the liveness engine (pipemem.templates.programs);
a stage job composes its parts in run order:

    F: [recv input | embedding F] -> layer F ... -> [head F | send output]
    B: [head B | recv output grad] -> layer B (reverse) ... -> [embedding B | send input grad]

with `peak = max(peak, current + part.peak)`, `current += part.net` -- the same walk the
liveness engine does inside a program, lifted to parts that only hand tensors forward.
Pipeline conventions: a stage's received input is a new buffer (its first layer saves it);
Megatron and Paddle free a stage's output after sending it (deallocate_output_tensor);
the received output grad is a new buffer consumed by the last layer's backward; the input
grad is freed after it is sent.

Virtual stage s runs on pipeline rank `pipemem.plan.rank_of_stage(s, pp, vpp, style)`:
interleaved by default (s % pp); `style="v"` for V-shaped schedules (ZB-V, DualPipeV).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from .errors import UserError
from .ir import Op, Program, Tensor
from .jobs import JobMemory, StageJobs, StaticBytes
from .liveness import analyze_program
from .plan import ParallelPlan, rank_of_stage, stages_of_rank, validate_plan
from .units import fmt_bytes

__all__ = ["StagePlan", "build_stage_jobs", "layer_explain", "rank_of_stage", "stage_layer_ranges"]


@dataclass(slots=True)
class StagePlan:
    plan: ParallelPlan
    stages: dict[int, StageJobs]
    static: list[StaticBytes]              # per pipeline rank
    optimizer: list[JobMemory]             # per pipeline rank
    stage_layers: dict[int, tuple[int, ...]]
    style: str = "interleaved"
    notes: dict = field(default_factory=dict)
    # Jobs of each stage's first backward of the step (microbatch 0) when it creates the
    # gradients (--grads set-to-none / ddp-bucket); later microbatches accumulate into them.
    first_backward: dict[int, StageJobs] = field(default_factory=dict)

    def replay_jobs(self) -> dict:
        """`stages`, with the first-backward jobs keyed (stage, 0) as `replay` takes them."""
        jobs: dict = dict(self.stages)
        jobs.update({(s, 0): j for s, j in self.first_backward.items()})
        return jobs

    def stages_of_rank(self, rank: int) -> list[int]:
        return stages_of_rank(rank, self.plan.pp, self.plan.vpp, self.style)

    def to_dict(self) -> dict:
        return {"stages": {s: {k: getattr(j, k).to_dict() for k in ("F", "B", "I", "W") if getattr(j, k)}
                           for s, j in self.stages.items()},
                "static": [s.to_dict() for s in self.static],
                "optimizer": [o.to_dict() for o in self.optimizer],
                "stage_layers": {s: list(v) for s, v in self.stage_layers.items()}}


def stage_layer_ranges(plan: ParallelPlan) -> dict[int, tuple[int, ...]]:
    """Decoder layer indices of each virtual stage, from the validated plan's pp_layout
    (stage order: virtual stage 0 holds the first layers)."""
    out, start = {}, 0
    for s, n in enumerate(plan.pp_layout):
        out[s] = tuple(range(start, start + n))
        start += n
    return out


def _compose(parts, kinds: str, pre: int = 0, post: int = 0) -> JobMemory:
    """Walk parts in order: `pre` bytes allocated first (a recv), `post` bytes freed last (a send).
    In a backward, FSDP2's reduce-scatter input of one part is still alive while the next
    part runs (`PartMemory.rs_state_bytes`)."""
    cur = pre
    peak = max(0, pre)
    linger = 0
    for part in parts:
        j = getattr(part, kinds)
        peak = max(peak, cur + linger + j.peak_bytes)
        cur += j.net_bytes
        if kinds in ("B", "I"):
            linger = getattr(part, "rs_state_bytes", 0)
    cur -= post
    return JobMemory(cur, peak)


def _resolve(arch, plan):
    from .templates.conventions import convention_for
    from .templates.layers import make_shard
    if plan.pp_layout is None or plan.sp is None or plan.microbatches is None:
        plan = validate_plan(arch, plan)
    if plan.layers and plan.layers != arch.layers:
        arch = arch.with_layers(plan.layers)
    conv = convention_for(plan)
    return arch, plan, conv, make_shard(arch, plan, conv)


def _layer_opts(arch, plan, layers: tuple[int, ...]) -> tuple:
    return _layer_opts_cached(arch, plan.flash_attn, plan.recompute, plan.recompute_layers, layers)


@lru_cache(maxsize=65536)
def _layer_opts_cached(arch, flash: bool, recompute: str, recompute_layers, layers: tuple[int, ...]) -> tuple:
    """LayerOptions of each layer of a stage; the first `recompute_layers` are recomputed
    (Megatron's block method), all of them when None."""
    from .templates.layers import _layer_options
    k = len(layers) if recompute_layers is None else recompute_layers
    return tuple(_layer_options(arch, arch.is_moe_layer(i), flash, recompute if pos < k else "none")
                 for pos, i in enumerate(layers))


def build_stage_jobs(arch, plan: ParallelPlan, style: str = "interleaved") -> StagePlan:
    """Per virtual stage F/B/I/W jobs, per pipeline rank static bytes and optimizer job.
    `style` places virtual stages on ranks (see `rank_of_stage`); it only changes which
    stages' parameters each rank holds."""
    arch, plan, conv, sh = _resolve(arch, plan)
    return _build(arch, plan, conv, sh, style)


@lru_cache(maxsize=65536)
def _stage_jobs(arch, sh, conv, opts: tuple, first: bool, last: bool, seq_len: int, stage: int,
                layers: tuple[int, ...]) -> StageJobs:
    """Compose one stage's jobs from its parts (cached: equal stages of different plans share)."""
    from .templates.programs import embedding_memory, head_memory, layer_memory
    parts = [layer_memory(arch, sh, conv, o) for o in opts]
    free_output = conv.name in ("megatron", "paddle")
    act = sh.boundary_bytes
    fparts = ([embedding_memory(arch, sh, conv, seq_len)] if first else []) + parts + \
        ([head_memory(arch, sh, conv)] if last else [])
    bparts = fparts[::-1]
    recv = 0 if first else act
    send_out = act if (not last and free_output) else 0
    grad_in = 0 if last else act     # received output grad
    grad_out = 0 if first else act   # input grad sent and freed
    F = _compose(fparts, "F", pre=recv, post=send_out)
    B = _compose(bparts, "B", pre=grad_in, post=grad_out)
    I = _compose(bparts, "I", pre=grad_in, post=grad_out)
    W = _compose(bparts, "W")
    if not free_output and not last:
        # the stage output is kept until backward and released by it
        B = JobMemory(B.net_bytes - act, B.peak_bytes)
        I = JobMemory(I.net_bytes - act, I.peak_bytes)
    return StageJobs(stage=stage, F=F, B=B, I=I, W=W, layers=layers, notes={"embedding": first, "head": last})


def _build(arch, plan, conv, sh, style) -> StagePlan:
    from .templates.layers import first_backward_shard
    from .templates.static import static_bytes
    layout = stage_layer_ranges(plan)
    n_stages = plan.pp * plan.vpp
    stages: dict[int, StageJobs] = {}
    first: dict[int, StageJobs] = {}
    creates_grads = plan.grads in ("set-to-none", "ddp-bucket")
    sh_first = first_backward_shard(sh) if creates_grads else None
    for s in range(n_stages):
        args = (_layer_opts(arch, plan, layout[s]), s == 0, s == n_stages - 1, plan.seq_len, s, layout[s])
        stages[s] = _stage_jobs(arch, sh, conv, *args)
        if creates_grads:
            fj = _stage_jobs(arch, sh_first, conv, *args)
            first[s] = StageJobs(stage=s, F=stages[s].F, B=fj.B, I=fj.I, W=fj.W, layers=fj.layers, notes=fj.notes)
    static, optim = [], []
    for r in range(plan.pp):
        rs = stages_of_rank(r, plan.pp, plan.vpp, style)
        st = static_bytes(arch, plan, conv, layout, rs)
        if creates_grads:
            # the gradients the first backwards create, as the programs allocate them
            st = replace(st, grads_in_step=sum(first[s].B.net_bytes - stages[s].B.net_bytes for s in rs))
        static.append(st)
        optim.append(_optimizer_job(_optimizer_impl(conv.name, plan), plan.optimizer, st))
    return StagePlan(plan=plan, stages=stages, static=static, optimizer=optim, stage_layers=layout, style=style,
                     notes={"convention": conv.name, "shard": sh, "grads": plan.grads, "step": plan.step},
                     first_backward=first)


def _optimizer_impl(conv: str, plan) -> str:
    """The optimizer kernels a convention's trainer runs: Megatron and Paddle fused; torchtitan
    0.3 fused by default ([optimizer] implementation); HF-style loops PyTorch's CUDA default,
    foreach."""
    default = "foreach" if conv == "hf" else "fused"
    return str((plan.extra or {}).get("optimizer_impl", default))


@lru_cache(maxsize=4096)
def _optimizer_job(impl: str, optimizer: str, st: StaticBytes) -> JobMemory:
    """The optimizer step as a small program: fused kernels (Megatron, Paddle, torchtitan's
    default) need no scratch; PyTorch's foreach path (HF) materialises one fp32 temporary list
    the size of the local parameters (the denominator), freed inside the step. On the first step
    the optimizer creates its states before it updates (`optimizer_in_step`); with
    zero_grad(set_to_none=True) the gradients the step created are freed after it."""
    prog = Program("optimizer", type="optimizer")
    ws = 0
    if impl == "foreach" and optimizer != "sgd":
        ws = st.params if st.params else 0
    prog.add_tensor(Tensor("opt_state", (1,), "fp32", "optimizer_state"))
    prog.add_tensor(Tensor("grads", (), "uint8", "grad", bytes=st.grads_in_step))
    reads = ("opt_state", "grads")
    if st.optimizer_in_step:
        prog.add_tensor(Tensor("new_state", (), "uint8", "optimizer_state", bytes=st.optimizer_in_step))
        prog.add_op(Op("init_state", (), ("new_state",)))
        reads += ("new_state",)
    prog.add_op(Op("optimizer_step", reads, ("opt_state",), workspace_bytes=ws))
    prog.add_op(Op("zero_grad", ("grads",), (), frees=("grads",)))
    r = analyze_program(prog, live_on_entry=("grads",), keep=() if st.grads_in_step else ("grads",))
    return JobMemory(r.net_bytes, r.peak_bytes)


def layer_explain(arch, plan: ParallelPlan, layer: int | None = None) -> list[dict]:
    """What one decoder layer keeps for backward: rows {tensor, shape, dtype, bytes, why},
    largest first, then a row for the forward transient peak and one for the backward peak.
    `layer` defaults to the first layer of stage 0 (recomputed if the plan recomputes it)."""
    from .templates.layers import layer_options
    from .templates.programs import layer_programs
    arch, plan, conv, sh = _resolve(arch, plan)
    idx = 0 if layer is None else layer
    if not 0 <= idx < arch.layers:
        raise UserError(f"layer {idx} out of range: {arch.name} has {arch.layers} layers")
    k = plan.pp_layout[0] if plan.recompute_layers is None else plan.recompute_layers
    pos = idx - sum(plan.pp_layout[:_stage_of_layer(plan, idx)])
    opts = layer_options(arch, plan, idx, pos < k)
    pp = layer_programs(arch, sh, conv, opts)
    rf = pp.results["F"]
    rows = sorted(_kept_rows(pp).values(), key=lambda r: -r["bytes"])
    rows.append({"tensor": "(forward peak)", "shape": [], "dtype": "", "bytes": rf.peak_bytes,
                 "why": f"transient peak above the layer's start at op {rf.peak_op_label}"})
    rb = pp.results["B"]
    rows.append({"tensor": "(backward peak)", "shape": [], "dtype": "", "bytes": rb.peak_bytes,
                 "why": f"peak above the backward's start at op {rb.peak_op_label}"})
    if plan.recompute_allgather:
        rows += _regather_trade(arch, plan, conv, sh, opts, pp)
    return rows


def _kept_rows(pp) -> dict[str, dict]:
    """What a layer's forward leaves alive for its backward: storage -> explain row."""
    F, B = pp.F, pp.B
    readers: dict[str, list[str]] = {}
    for op in B.ops:
        label = ("recompute of " + op.type) if op.phase == "recompute" else op.type
        for n in op.inputs:
            st = B.tensors[n].storage
            readers.setdefault(st, [])
            if label not in readers[st]:
                readers[st].append(label)
    by_storage: dict[str, Tensor] = {}
    for t in F.tensors.values():
        if t.storage == t.name:
            by_storage[t.storage] = t
    rows = {}
    rf = pp.results["F"]
    kept = (rf.live_after - {F.tensors[pp.input].storage}) if pp.input in F.tensors else rf.live_after
    for st in kept:
        t = by_storage.get(st)
        if t is None:
            continue
        if st == F.tensors[pp.output].storage:
            why = "layer output: the next layer's input (its norm saves it)"
        else:
            why = "read in backward by " + ", ".join(readers.get(st, ["(kept)"]))
        rows[st] = {"tensor": st, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes, "why": why}
    return rows


def _regather_trade(arch, plan: ParallelPlan, conv, sh, opts, pp) -> list[dict]:
    """--recompute-allgather, per layer and microbatch: the tensors the layer no longer keeps
    for backward, what it keeps instead, and the all-gathers its backward runs in exchange
    (the same layer built without the switch, compared). None when the convention gathers
    again in backward anyway (Megatron)."""
    from dataclasses import replace

    from .templates.conventions import convention_for
    from .templates.programs import layer_programs
    base_conv = convention_for(replace(plan, recompute_allgather=False))
    if base_conv == conv:
        return []
    base = layer_programs(arch, sh, base_conv, opts)
    kept, kept_before = _kept_rows(pp), _kept_rows(base)
    dropped = [dict(r, why="no longer kept: " + r["why"]) for st, r in kept_before.items() if st not in kept]
    added = [dict(r, why="kept instead (this rank's sequence shard): " + r["why"])
             for st, r in kept.items() if st not in kept_before]
    gathers_before = {o for op in base.B.ops if op.type == "all_gather" for o in op.outputs}
    comm = []
    for op in pp.B.ops:
        if op.type == "all_gather" and op.phase == "backward" and not set(op.outputs) & gathers_before:
            t = pp.B.tensors[op.outputs[0]]
            comm.append({"tensor": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes,
                         "why": f"all-gather added to the backward of {op.module or 'the layer'}: "
                                f"{', '.join(op.inputs)} from the {plan.tp} tensor-parallel ranks"})
    net = sum(r["bytes"] for r in dropped) - sum(r["bytes"] for r in added)
    section = (f"--recompute-allgather trades memory for communication, per layer and microbatch: "
               f"{fmt_bytes(net)} less kept for backward, {len(comm)} all-gather(s) more in backward")
    return [dict(r, section=section) for r in sorted(dropped, key=lambda r: -r["bytes"]) + added + comm]


def _stage_of_layer(plan: ParallelPlan, idx: int) -> int:
    acc = 0
    for s, n in enumerate(plan.pp_layout):
        if idx < acc + n:
            return s
        acc += n
    return len(plan.pp_layout) - 1


def clear_caches() -> None:
    """Forget every cached analysis (tests, benchmarks)."""
    from .templates.programs import clear_caches as clear_parts
    clear_parts()
    _stage_jobs.cache_clear()
    _optimizer_job.cache_clear()
    _layer_opts_cached.cache_clear()


def format_explain(rows: list[dict]) -> str:
    """Plain-text table of `layer_explain` rows (for --explain)."""
    lines = [f"{'tensor':40s} {'shape':>24s} {'dtype':>6s} {'bytes':>12s}  why"]
    for r in rows:
        lines.append(f"{r['tensor'][:40]:40s} {str(r['shape']):>24s} {r['dtype']:>6s} {fmt_bytes(r['bytes']):>12s}  "
                     f"{r['why']}")
    return "\n".join(lines)
