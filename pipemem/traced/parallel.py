"""Traced mode for parallel plans: stage jobs of a pipeline, and the step of one tensor- or
fully-sharded-data-parallel rank, traced on fake tensors with the model split and sharded as
torchtitan does it (pipemem.traced.stack). The results are the same stage jobs templates
produce, so `pipemem.estimate` replays them through the same schedule, runtime lowering and
replay (`estimate.per_rank`): `TracedStagePlan` is a `pipemem.jobs.StagePlan`.

Pipelines: for one stage (a `DecoderStack` slice), F, B, I and W are traced with the very
functions torch.distributed.pipelining calls (`stage_backward`, `stage_backward_input`,
`stage_backward_weight`, as `PipelineStage.backward_one_chunk` calls them), two microbatches
each, so the first backward of the step (which creates the parameters' grads) and the later
ones (which accumulate) are both known. The jobs follow pipemem.jobs' boundary convention: F
leaves the stage output y allocated, B / I leave the input grad dx allocated, and the input x
and output grad dy (receive buffers, the runtime's) are never freed by a job.

Tensor / FSDP ranks: rank 0 of the world runs its real Python under PyTorch's fake process
group (dist_capture.py), one step (forward, backward, optimizer) recorded and walked by
liveness. The ranks of a TP group or an FSDP group run the same program (FSDP2 pads uneven
shards), so rank 0 stands for all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache, partial

import torch

from ..errors import UserError
from ..ir import TensorKind
from ..jobs import JobMemory, StageJobs, StagePlan, StaticBytes
from ..liveness import analyze_sequence


@dataclass(frozen=True)
class StageSpec:
    """What shapes one traced pipeline stage (hashable: a cache key)."""

    model: str  # the HF config dict as JSON (sorted keys)
    total_layers: int
    attn: str
    dtype: str  # torch dtype name of the parameters
    stage: int
    num_stages: int
    layers: tuple
    micro_batch: int
    seq_len: int
    split: bool
    kernel_policy: str
    optimizer: str = "adamw"

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def _cfg(spec: StageSpec):
    from .hf import make_config

    return make_config(json.loads(spec.model), spec.attn, spec.total_layers)


@dataclass
class TracedStage:
    jobs: StageJobs  # F, later B / I / W
    first_grad: StageJobs  # the first B / W of the step (creates the param grads)
    param_bytes: int
    # (every microbatch's StageAllocs, the first backward's, the first backward's gradient
    # handle per parameter, each parameter's bytes), or why there are none (a str)
    allocs: object = None


@lru_cache(maxsize=256)
def trace_stage(spec: StageSpec) -> TracedStage:
    """Trace F/B (and I/W) of one stage for two microbatches (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import kernel_policy as policies
    from .stack import build_stack

    cfg = _cfg(spec)
    dtype = getattr(torch, spec.dtype)
    with FakeTensorMode(), policies.context(spec.kernel_policy):
        full = _trace_sequence(
            build_stack(cfg, spec.layers, spec.first, spec.last, spec.seq_len, dtype, init=False),
            cfg,
            spec,
            dtype,
            "FB",
        )
        split = (
            _trace_sequence(
                build_stack(cfg, spec.layers, spec.first, spec.last, spec.seq_len, dtype, init=False),
                cfg,
                spec,
                dtype,
                "FIW",
            )
            if spec.split
            else None
        )
    h, mb, seq = cfg.hidden_size, spec.micro_batch, spec.seq_len
    elem = torch.finfo(dtype).bits // 8
    act = mb * seq * h * elem
    bounds = dict(
        input_bytes=0 if spec.first else act,
        output_bytes=mb * seq * (cfg.vocab_size if spec.last else h) * elem,
        input_grad_bytes=0 if spec.first else act,
        output_grad_bytes=0 if spec.last else act,
    )
    layers = range(spec.layers[0], spec.layers[-1] + 1) if spec.layers else range(0)

    def jobs(mb: int) -> StageJobs:
        """The stage's jobs with microbatch `mb`'s backward: 0 the step's first (it creates the
        parameter grads), 1 every later one."""
        return StageJobs(
            spec.stage,
            F=full["F0"],
            B=full[f"B{mb}"],
            I=split["I0"] if split else None,
            W=split[f"W{mb}"] if split else None,
            layers=layers,
            **bounds,
        )

    allocs = _stage_allocs(full, split, bounds, spec.stage)
    return TracedStage(jobs(1), jobs(0), full["param_bytes"], allocs)


def _stage_allocs(full: dict, split: dict | None, bounds: dict, stage: int):
    """The stage's recorded jobs as `pipemem.jobs.StageAllocs` (pipemem.traced.allocs): microbatch
    1's forward and backward stand for every microbatch, microbatch 0's for the step's first
    (it creates the gradients). The stage boundary (x, y, dy, dx) takes the runtime's slots and
    parameter i's gradient handle 4 + i in both traces (B, and I then W), so the optimizer step
    frees the same handles whichever made them. Returns (every, first, the gradients' handles,
    the parameters' bytes), or why there are none (a str)."""
    from ..jobs import StageAllocs, StreamNotModelled
    from .allocs import DX, DY, SLOTS, Handles, X, Y, check_slot, program_rows

    def walk(trace: dict, m: int, kinds: str) -> tuple[dict, int]:
        r = trace["record"]
        slots = {r["x"]: X, r[f"y{m}"]: Y}
        for name, slot in ((r["gy"], DY), (r[f"dx{m}"], DX)):
            if name is not None:
                slots[name] = slot
        for i, g in enumerate(r["grads"]):
            if g is not None:
                slots[g] = SLOTS + i
        hs = Handles(slots, start=SLOTS + len(r["grads"]))
        rows = {}
        for kind in kinds:
            prog = r["programs"].get(f"{kind}{m}")
            rows[kind] = tuple(program_rows(*prog, hs, f"stage {stage}'s {kind}{m}")) if prog else ()
        return rows, hs.next

    def pair(m: int) -> StageAllocs:
        rows, width = walk(full, m, "FB")
        if split is not None:
            srows, swidth = walk(split, m, "FIW")
            if srows["F"] != rows["F"]:
                raise StreamNotModelled(f"stage {stage}: its two traces' forwards allocate differently")
            rows.update(I=srows["I"], W=srows["W"])
            width = max(width, swidth)
        check_slot(rows["F"], Y, bounds["output_bytes"], f"stage {stage}'s output")
        for kind in ("B", "I"):
            check_slot(rows.get(kind, ()), DX, bounds["input_grad_bytes"], f"stage {stage}'s input grad")
        return StageAllocs(width=width, **rows)

    try:
        every, first = pair(1), pair(0)
    except StreamNotModelled as e:
        return str(e)
    grads = tuple(SLOTS + i if g is not None else None for i, g in enumerate(full["record"]["grads"]))
    return every, first, grads, full["record"]["param_sizes"]


def _trace_sequence(module, cfg, spec: StageSpec, dtype, kinds: str) -> dict:
    """Two microbatches through `kinds` ("FB": F B F B, "FIW": F I W F I W), one phase each."""
    from torch.distributed.pipelining._backward import (
        stage_backward,
        stage_backward_input,
        stage_backward_weight,
    )

    from .dist_capture import DistStorageRecorder
    from .stack import causal_lm_loss

    first, last, mb, seq = spec.first, spec.last, spec.micro_batch, spec.seq_len
    if first:
        x = torch.empty((mb, seq), dtype=torch.long)
    else:
        x = torch.empty((mb, seq, cfg.hidden_size), dtype=dtype).requires_grad_()
    target = torch.empty((mb, seq), dtype=torch.long) if last else None
    gy = None if last else torch.empty((mb, seq, cfg.hidden_size), dtype=dtype)
    params = list(module.parameters())
    rec = DistStorageRecorder()
    rec.register(params, TensorKind.PARAM)
    rec.register(module.buffers(), TensorKind.BUFFER)
    rec.register([t for t in (x, target, gy) if t is not None], TensorKind.ACTIVATION)
    held = []  # what the runtime owns: y, dx, losses (freed after the trace)
    phases = []
    names = {"x": _one_name(rec, x), "gy": _one_name(rec, gy)}  # for pipemem.traced.allocs
    with rec:
        for m in range(2):
            rec.begin(f"F{m}")
            phases.append(f"F{m}")
            y = module(x)
            names[f"y{m}"] = _one_name(rec, y)
            loss = causal_lm_loss(y, target) if last else None
            held += [y, loss]
            stage_output = loss if last else (y,)
            output_grads = None if last else (gy,)
            inputs = [x]
            if kinds == "FB":
                rec.begin(f"B{m}")
                phases.append(f"B{m}")
                dx = stage_backward(stage_output, output_grads, inputs)
                held.append(dx)
            else:
                rec.begin(f"I{m}")
                phases.append(f"I{m}")
                if not first:
                    so = (stage_output,) if isinstance(stage_output, torch.Tensor) else stage_output
                    dx, groups = stage_backward_input(so, output_grads, inputs, iter(params))
                    held.append(dx)
                rec.begin(f"W{m}")
                phases.append(f"W{m}")
                if not first:
                    stage_backward_weight(iter(params), groups)
                    del groups, so
                else:  # the runtime defers the first stage's whole backward to W
                    stage_backward(stage_output, output_grads, inputs)
            dx_m = held[-1] if (kinds == "FB" or not first) else None  # stage_backward's input grads
            if isinstance(dx_m, (list, tuple)):
                dx_m = dx_m[0] if dx_m else None
            names[f"dx{m}"] = _one_name(rec, dx_m)
            del dx_m
            if m == 0:
                names["grads"] = [_one_name(rec, p.grad) for p in params]
            if last and not first:
                y.detach_()
            del y, loss, stage_output, output_grads
    programs = {p.name: p for p in rec.programs()}
    ordered = [programs.get(p) for p in phases]
    mem = iter(analyze_sequence([p for p in ordered if p is not None], live_on_entry=rec.entry_storages()))
    out = {}
    walked = {}
    for name, prog in zip(phases, ordered):
        r = next(mem) if prog is not None else None
        out[name] = JobMemory(r.net_bytes, r.peak_bytes) if r is not None else JobMemory(0, 0)
        if r is not None:
            walked[name] = (prog, r)
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    out["record"] = dict(names, programs=walked, param_sizes=[p.untyped_storage().nbytes() for p in params])
    return out


def _one_name(rec, t) -> str | None:
    """The recorded storage name of tensor `t` (None: no tensor, or not recorded)."""
    if not isinstance(t, torch.Tensor):
        return None
    got = rec.storage_names([t])
    return next(iter(got)) if got else None


@lru_cache(maxsize=256)
def trace_rank_optimizer(specs: tuple[StageSpec, ...]) -> tuple[JobMemory, int, object]:
    """`optimizer.step(); zero_grad(set_to_none=True)` over the params of a rank's stages, every
    param holding a gradient on entry. Returns (job, buffer bytes of the stage modules, its
    allocations: rows `(sign, bytes, ref)` with ref ("grad", j) for the gradient of the rank's
    j-th parameter, or why there are none)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import kernel_policy as policies
    from .dist_capture import DistStorageRecorder
    from .hf import optimizer_factory
    from .stack import build_stack

    spec0 = specs[0]
    cfg = _cfg(spec0)
    dtype = getattr(torch, spec0.dtype)
    make = optimizer_factory(spec0.optimizer)
    with FakeTensorMode():
        mods = [build_stack(cfg, s.layers, s.first, s.last, s.seq_len, dtype, init=False) for s in specs]
        params = [p for m in mods for p in m.parameters()]
        buffers = {id(b): b for m in mods for b in m.buffers()}
        buffer_bytes = sum(b.untyped_storage().nbytes() for b in buffers.values())
        if make is None:
            return JobMemory(0, 0), buffer_bytes, ()
        for p in params:
            p.grad = torch.empty_like(p)
        opt = make(params)
        policies.configure_optimizer(spec0.kernel_policy, opt)
        rec = DistStorageRecorder()
        rec.register(params, TensorKind.PARAM)
        rec.register([p.grad for p in params], TensorKind.GRAD)
        grad_names = [_one_name(rec, p.grad) for p in params]
        with rec:
            rec.begin("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
        progs = rec.programs()
        (r,) = analyze_sequence(progs, live_on_entry=rec.entry_storages())
        del opt
    return JobMemory(r.net_bytes, r.peak_bytes), buffer_bytes, _optimizer_rows(progs[0], r, grad_names)


def _optimizer_rows(program, result, grad_names: list):
    from ..jobs import StreamNotModelled
    from .allocs import Handles, program_rows

    refs = {g: ("grad", j) for j, g in enumerate(grad_names) if g is not None}
    try:
        return tuple(program_rows(program, result, Handles(start=0), "the optimizer step", refs))
    except StreamNotModelled as e:
        return str(e)


@dataclass
class TracedStagePlan(StagePlan):
    """Traced stage jobs of a pipeline plan: the program-source interface
    (`pipemem.jobs.StagePlan`) that templates' `pipemem.stages.StagePlan` implements too."""

    specs: dict[int, StageSpec]
    traced: dict[int, TracedStage]
    notes: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)

    @property
    def stages(self) -> dict[int, StageJobs]:
        return {s: t.jobs for s, t in self.traced.items()}

    @property
    def first_backward(self) -> dict[int, StageJobs]:
        """The first B / W of the step per stage (creates the parameters' gradients); replayed
        for the microbatch `Schedule.first_grad_microbatches` names."""
        return {s: t.first_grad for s, t in self.traced.items()}

    allocs = "recorded"  # pipemem.alloc_stream reads the traced programs' allocations

    def rank_static(self, stage_ids) -> StaticBytes:
        specs = tuple(self.specs[s] for s in sorted(stage_ids))
        buffers = trace_rank_optimizer(specs)[1]
        return StaticBytes(params=sum(self.traced[s].param_bytes for s in stage_ids), other=buffers)

    def rank_optimizer(self, stage_ids) -> JobMemory:
        return trace_rank_optimizer(tuple(self.specs[s] for s in sorted(stage_ids)))[0]

    def _allocs(self, stage: int) -> tuple:
        a = self.traced[stage].allocs
        if not isinstance(a, tuple):
            from ..jobs import StreamNotModelled

            raise StreamNotModelled(a or "the stage's allocations were not recorded")
        return a

    def stage_allocs(self, stage: int):
        every, first, _, _ = self._allocs(stage)
        return every, first

    def rank_static_allocs(self, rank: int, stage_ids) -> list[int]:
        """Each parameter as its own tensor (stages in order), the modules' buffers as one."""
        sizes = [b for s in sorted(stage_ids) for b in self._allocs(s)[3]]
        buffers = self.rank_static(stage_ids).other
        return [b for b in sizes + [buffers] if b > 0]

    def rank_optimizer_allocs(self, rank: int, stage_ids) -> tuple:
        """The traced optimizer step, its gradient frees named by the stage handle that made each."""
        from ..jobs import StreamNotModelled

        rows = trace_rank_optimizer(tuple(self.specs[s] for s in sorted(stage_ids)))[2]
        if isinstance(rows, str):
            raise StreamNotModelled(rows)
        owner = [(s, h) for s in sorted(stage_ids) for h in self._allocs(s)[2]]
        out = []
        for row in rows:
            ref = row[2]
            if isinstance(ref, tuple):
                s, h = owner[ref[1]]
                if h is None:
                    raise StreamNotModelled(
                        f"the optimizer step frees a gradient stage {s}'s backward did not make"
                    )
                ref = (s, h)
            out.append((row[0], row[1], ref) + tuple(row[3:]))
        return tuple(out)


def param_dtype_name(plan) -> str:
    """Traced pipelines and sharded ranks run without autocast: fp32, or pure bf16 / fp16."""
    if plan.dtype == "fp32":
        return "float32"
    if plan.master_weights:
        raise UserError(
            f"traced mode with --pp/--tp/--fsdp/DDP: --dtype {plan.dtype} with master weights (autocast) "
            f"is not traced yet; use --dtype fp32 or --no-master-weights (pure {plan.dtype})"
        )
    return {"bf16": "bfloat16", "fp16": "float16"}[plan.dtype]


def check_stack_family(model_config: dict, what: str) -> None:
    """Pipelines and sharded ranks are traced on `stack.DecoderStack`: a slice of the family's
    own decoder layers, run without an attention mask. A family whose model does more than
    embedding -> layers -> norm -> head, or a config whose layers mask a sliding window, is
    refused by name (its whole-model step, one rank at --pp 1, runs transformers' own modules)."""
    from ..model import text_model_config
    from .stack import STACK_FAMILIES

    cfg = text_model_config(model_config)[0]
    mt = cfg.get("model_type")
    why = None
    if mt not in STACK_FAMILIES:
        why = f"model_type {mt!r} is not one of them"
    elif cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        why = f"its sliding window ({cfg['sliding_window']}) needs a mask the stack does not build"
    if why:
        raise UserError(
            f"traced mode traces {what} on a slice of the model's own decoder layers for "
            f"{', '.join(STACK_FAMILIES)}; {why}: trace its whole step on one rank (no --pp, --tp, "
            "--fsdp or DDP --grads), or use --mode templates"
        )


def traced_stage_plan(model_config: dict, plan, split_backward: bool, kernel_policy: str) -> TracedStagePlan:
    """Trace every virtual stage of a validated pipeline plan (layers from plan.pp_layout)."""
    check_stack_family(model_config, "pipelines (--pp)")
    _check_pipeline(plan)
    model = json.dumps(model_config, sort_keys=True, default=str)
    attn = "sdpa" if plan.flash_attn else "eager"
    n = plan.pp * plan.vpp
    specs, start = {}, 0
    for s, k in enumerate(plan.pp_layout):
        specs[s] = StageSpec(
            model,
            plan.layers,
            attn,
            param_dtype_name(plan),
            s,
            n,
            tuple(range(start, start + k)),
            plan.micro_batch,
            plan.seq_len,
            split_backward,
            kernel_policy,
            plan.optimizer,
        )
        start += k
    return TracedStagePlan(specs, {s: trace_stage(sp) for s, sp in specs.items()})


def _check_pipeline(plan) -> None:
    bad = [f"--{k} {getattr(plan, k)}" for k in ("tp", "cp", "ep") if getattr(plan, k) != 1]
    if bad or plan.zero or plan.fsdp:
        raise UserError(
            f"traced mode traces pipelines of unsharded stages; {', '.join(bad) or '--zero/--fsdp'} "
            "with --pp is not traced yet: use --mode templates"
        )
    if plan.recompute != "none":
        raise UserError(
            "traced mode with --pp: --recompute is not traced for pipeline stages yet; use --mode templates"
        )


# ---------------------------------------------------------------- one TP / FSDP rank


def trace_sharded_rank(model_config: dict, plan, kind: str, kernel_policy: str, rank: int = 0) -> dict:
    """One training step of rank `rank` of a tensor-parallel (`kind="tp"`, world = tp), FSDP2
    (`kind="fsdp"`, world = dp) or DistributedDataParallel (`kind="ddp"`, every rank alike)
    run of the whole `DecoderStack` model. Returns
    {static: StaticBytes, F, B, optimizer: JobMemory, peak_at, param_bytes}."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import kernel_policy as policies
    from .dist_capture import fake_process_group
    from .hf import make_config
    from .stack import build_fsdp_model, build_tp_model, make_mesh

    check_stack_family(model_config, f"{kind.upper()} ranks")
    if kind == "ddp":
        return _trace_ddp_rank(model_config, plan, kernel_policy)
    build = {"tp": build_tp_model, "fsdp": build_fsdp_model}[kind]
    if kind == "tp" and plan.recompute_allgather:
        # torchtitan convention: the column-parallel linears keep their sequence shard and
        # all-gather it again in backward (pipemem.torch_tp.RegatherColwiseParallel)
        build = partial(build_tp_model, regather=True)
    world = plan.tp if kind == "tp" else plan.dp
    cfg = make_config(model_config, "sdpa" if plan.flash_attn else "eager", plan.layers)
    dtype = getattr(torch, param_dtype_name(plan))
    if plan.recompute not in ("none", "full") or (kind == "fsdp" and plan.recompute != "none"):
        raise UserError(
            f"traced mode with --{kind}: --recompute {plan.recompute} is not traced yet; use "
            + ("none or full" if kind == "tp" else "none")
            + ", or --mode templates"
        )
    with fake_process_group(rank, world):
        mesh = make_mesh(world)  # device meshes cannot be built under FakeTensorMode
        with FakeTensorMode(), policies.context(kernel_policy):
            model = build(cfg, plan.seq_len, mesh, init=False, dtype=dtype)
            if plan.recompute == "full":  # torchtitan's full activation checkpointing, per decoder layer
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

                for k in list(model.layers):
                    model.layers[k] = checkpoint_wrapper(model.layers[k])
            return _trace_model_step(model, plan, kernel_policy)


def _trace_ddp_rank(model_config: dict, plan, kernel_policy: str) -> dict:
    """The first step of a DistributedDataParallel rank (`--grads ddp-bucket` or
    `ddp-bucket-view`): the whole model's step with DDP's memory modelled on it
    (pipemem.traced.ddp: its resident buckets, the buffer broadcast at forward start, the copy
    into the buckets as each gradient is ready, a bucket-view .grad swap). No collective
    allocates (the all-reduce is in place), so no process group is needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import kernel_policy as policies
    from .ddp import DDPBuckets
    from .hf import make_config
    from .stack import build_stack

    if plan.recompute not in ("none", "full"):
        raise UserError(
            f"traced mode with DDP (--grads {plan.grads}): --recompute {plan.recompute} is not traced "
            "yet; use none or full, or --mode templates"
        )
    cfg = make_config(model_config, "sdpa" if plan.flash_attn else "eager", plan.layers)
    dtype = getattr(torch, param_dtype_name(plan))
    with FakeTensorMode(), policies.context(kernel_policy):
        model = build_stack(cfg, range(cfg.num_hidden_layers), True, True, plan.seq_len, dtype, init=False)
        if plan.recompute == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for k in list(model.layers):
                model.layers[k] = checkpoint_wrapper(model.layers[k])
        ddp = DDPBuckets(model, max(plan.dp, 1), plan.grads == "ddp-bucket-view")
        out = _trace_model_step(model, plan, kernel_policy, resident_grads=ddp.buckets)
        ddp.remove()
    out["ddp_buckets"] = ddp.bucket_bytes
    # the .grad tensors backward creates beside the buckets (none as bucket views): the
    # report's "in step" gradients, not activations
    from dataclasses import replace

    out["static"] = replace(out["static"], grads_in_step=0 if ddp.as_view else sum(ddp.bucket_bytes))
    return out


def _trace_model_step(model, plan, kernel_policy: str, resident_grads=()) -> dict:
    """`run_step` (the step the real ranks run) of a fake `DecoderStack`, its forward /
    backward / optimizer programs walked by liveness, params, buffers and inputs live on entry
    (and `resident_grads`: gradient storage held across steps, e.g. DDP's buckets)."""
    from . import kernel_policy as policies
    from .dist_capture import DistStorageRecorder
    from .hf import optimizer_factory
    from .stack import causal_lm_loss, local_tensor
    from .step import run_step

    make = optimizer_factory(plan.optimizer)
    opt = make(model.parameters()) if make is not None else None
    policies.configure_optimizer(kernel_policy, opt)
    ids = torch.empty((plan.micro_batch, plan.seq_len), dtype=torch.long)
    target = torch.empty((plan.micro_batch, plan.seq_len), dtype=torch.long)
    rec = DistStorageRecorder()
    params = rec.register([local_tensor(p) for p in model.parameters()], TensorKind.PARAM)
    buffers = rec.register([local_tensor(b) for b in model.buffers()], TensorKind.BUFFER)
    rec.register([ids, target], TensorKind.ACTIVATION)
    grads = rec.register(list(resident_grads), TensorKind.GRAD)

    def on_phase(phase: str) -> None:
        if phase != "end":
            rec.begin(phase)

    with rec.fsdp_resizes(), rec:
        run_step(model, (ids,), {}, lambda out: causal_lm_loss(out, target), opt, on_phase=on_phase)
    del opt
    programs = rec.programs()
    entry = rec.entry_storages()
    sizes = rec.storages
    param_bytes = sum(sizes[n].nbytes for n in set(params))
    buffer_bytes = sum(sizes[n].nbytes for n in set(buffers) - set(params))
    grad_bytes = sum(sizes[n].nbytes for n in set(grads))
    total = sum(sizes[n].nbytes for n in entry)
    walked = analyze_sequence(programs, live_on_entry=entry)
    results = {r.name: r for r in walked}

    def job(name):
        r = results.get(name)
        return JobMemory(r.net_bytes, r.peak_bytes) if r is not None else JobMemory(0, 0)

    peak_op = {name: f"{name}: {r.peak_op_label}" for name, r in results.items()}
    return {
        "static": StaticBytes(params=param_bytes, grads=grad_bytes, other=total - param_bytes - grad_bytes),
        "F": job("forward"),
        "B": job("backward"),
        "optimizer": job("optimizer"),
        "peak_op": peak_op,
        "param_bytes": param_bytes,
        "buffer_bytes": buffer_bytes,
        "recorded": partial(_recorded_rank, programs, walked, [sizes[n].nbytes for n in entry]),
    }


def _recorded_rank(programs, walked, entry_sizes):
    """The rank's step as `RankPlan.recorded` (pipemem.traced.allocs: FSDP2's all-gather and
    reduce-scatter buffers on their own streams), or why not."""
    from ..jobs import StreamNotModelled
    from .allocs import one_step_allocs

    try:
        return one_step_allocs(programs, walked, entry_sizes)
    except StreamNotModelled as e:
        return str(e)
