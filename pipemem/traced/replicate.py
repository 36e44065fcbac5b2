"""Layer replication: the memory of an N-layer step from a trace of K layers (K = 4).

Decoder layers in the steady state are identical, so their forward and backward pieces have
identical memory timelines. We trace K layers, cut each phase's liveness timeline
(`analyze_sequence` of the K-layer programs) into pieces that end where a layer's ops end,
and repeat the piece of the template layer T (= 2: after the first two, before the last) so
that it stands for layers T .. N-K+T. Layers before and after T, the embedding, the head and
the loss keep their own pieces. Extrapolating the peak number alone would be wrong (the
peak moves, FINDINGS.md §4); walking the expanded pieces is exact.

The optimizer depends on every parameter at once (foreach kernels take them all), so it is
traced separately on the N-layer parameter list with gradients present (cheap: no model run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..ir import TensorKind
from ..jobs import JobMemory, compose_at
from ..liveness import analyze_sequence, compile_program, program_events, retention_sets
from . import kernel_policy as policies
from .step import PhaseMemory, TracedStep, step_summary, trace_step

TRACED_LAYERS = 4
TEMPLATE_LAYER = 2


class NotReplicable(Exception):
    """The traced layers do not run one after another; trace the full model instead."""


@dataclass
class Piece:
    layer: int | None  # the layer whose ops end this piece (None: embedding, head, tail)
    during: np.ndarray  # bytes while each op runs, relative to the piece's start
    after: np.ndarray  # bytes after each op, relative to the piece's start
    labels: list[str]
    template_frees: np.ndarray | None = None  # bytes of template-layer storages freed at each op


def _piece_slices(layers: list) -> list[tuple[int, int, int | None]]:
    """(start, end, layer) of the pieces of one phase: each ends with the last op of a layer."""
    last: dict[int, int] = {}
    first: dict[int, int] = {}
    for i, lay in enumerate(layers):
        if lay is not None:
            first.setdefault(lay, i)
            last[lay] = i
    order = sorted(last, key=lambda lay: first[lay])
    for a, b in zip(order, order[1:]):
        if last[a] >= first[b]:
            raise NotReplicable(f"ops of layers {a} and {b} interleave")
    out, start = [], 0
    for end, lay in [(last[lay], lay) for lay in order] + [(len(layers) - 1, None)]:
        if end >= start:
            out.append((start, end, lay))
            start = end + 1
    return out


def phase_pieces(step: TracedStep, template: int = TEMPLATE_LAYER) -> dict[str, list[Piece]]:
    """Per phase, the pieces of its liveness timeline.

    Most storages a layer allocates are freed by the same layer (or its neighbour, which is
    replicated with it). Some are freed all at once outside the layers: with autocast and
    checkpointing, the bf16 weight copies that autocast caches for each layer's forward live
    until autocast exits after the loss. A piece outside the layers that frees storages of the
    template layer must free them once per replicated layer: `template_frees` records them."""
    programs = step.programs
    results = analyze_sequence(programs, live_on_entry=step.entry_storages)
    keep = retention_sets(programs)
    entry = set(step.entry_storages)
    slices = {p.name: _piece_slices(step.op_layers.get(p.name, [])) for p in programs}

    def piece_layer(prog_name: str, op: int):
        for start, end, lay in slices[prog_name]:
            if start <= op <= end:
                return lay
        return None

    # Storages allocated by the template layer, and where (program, op) they are freed.
    allocated_by_template: set[str] = set()
    frees: dict[str, list[tuple[int, int]]] = {}
    for prog, kept in zip(programs, keep):
        c = compile_program(prog)
        for i, name in enumerate(c.storage_names):
            if (
                c.first_is_write[i]
                and name not in entry
                and piece_layer(prog.name, int(c.first_op[i])) == template
            ):
                allocated_by_template.add(name)
        for i, name in enumerate(c.storage_names):
            if name in allocated_by_template and c.touched[i] and not c.persistent[i] and name not in kept:
                frees.setdefault(prog.name, []).append((int(c.last_op[i]), int(c.sizes[i])))

    out: dict[str, list[Piece]] = {}
    for prog, res in zip(programs, results):
        pieces = []
        for start, end, lay in slices[prog.name]:
            base = int(res.after[start - 1]) if start > 0 else 0
            tf = None
            if lay is None:
                tf = np.zeros(end - start + 1, dtype=np.int64)
                for op, size in frees.get(prog.name, ()):
                    if start <= op <= end:
                        tf[op - start] += size
                if not tf.any():
                    tf = None
            pieces.append(
                Piece(
                    lay,
                    res.during[start : end + 1] - base,
                    res.after[start : end + 1] - base,
                    [op.label for op in prog.ops[start : end + 1]],
                    tf,
                )
            )
        out[prog.name] = pieces
    return out


def expand(pieces: list[Piece], n_layers: int, traced: int, template: int) -> PhaseMemory:
    """Walk the pieces with the template layer's piece repeated for the missing layers."""
    extra = n_layers - traced  # copies of the template beyond the one traced
    parts, labels = [], []
    for p in pieces:
        during, after = p.during, p.after
        if p.template_frees is not None and extra:
            freed = np.cumsum(p.template_frees)
            during = during - extra * (freed - p.template_frees)
            after = after - extra * freed
        k = int(during.argmax()) if len(during) else 0
        piece = JobMemory(int(after[-1]) if len(after) else 0, max(0, int(during[k])) if len(during) else 0)
        parts.append(piece.repeated(extra + 1) if p.layer == template else piece)
        labels.append(p.labels[k] if len(p.labels) else "")
    phase, at = compose_at(parts)
    return PhaseMemory("", phase.net_bytes, phase.peak_bytes, labels[at] if at >= 0 else "")


def layer_template_params(model: torch.nn.Module, prefix: str, n_layers: int, template: int):
    """(shape, dtype) of every parameter of the N-layer model, in `parameters()` order,
    layers missing from `model` given the template layer's parameters."""
    traced = len(model.get_submodule(prefix))
    specs = []
    tag = prefix + "."
    for name, p in model.named_parameters():
        if name.startswith(tag):
            layer = int(name[len(tag) :].split(".", 1)[0])
            copies = n_layers - traced + 1 if layer == template else 1
        else:
            copies = 1
        specs.extend([(tuple(p.shape), p.dtype)] * copies)
    return specs


def trace_optimizer(
    param_specs,
    optimizer_factory,
    kernel_policy: str,
    loss_dtype=torch.float32,
    zero_grad: bool = True,
    step: str = "steady",
    set_to_none: bool = True,
    detail: dict | None = None,
) -> tuple[PhaseMemory, dict]:
    """The optimizer phase of the step for parameters of these shapes, their gradients alive
    on entry (as after a backward) and the loss freed at the end (as `run_step` does).
    step="steady": the optimizer has stepped once before (its states exist on entry);
    set_to_none=False: the gradients are resident buffers (zeroed, not freed).
    Returns the phase and the bytes resident on entry: {"optimizer": states, "grads": kept grads}.
    `detail` (a dict) gets what the allocation stream needs: the optimizer program and its walk,
    the storage name of each parameter's gradient and of the loss, the states' sizes."""
    from .capture import StorageRecorder
    from .step import analyze_programs

    # Meta tensors, not fake ones: optimizers never branch on values or on meta-vs-cpu, and
    # FakeTensorMode's per-op cache keys cost O(#params) for every foreach op (16 s vs 1 s on
    # the 80-layer 70B model).
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dt, device="meta")) for shape, dt in param_specs]
    optimizer = optimizer_factory(params)
    policies.configure_optimizer(kernel_policy, optimizer)
    keep_grads = zero_grad and not set_to_none
    if step == "steady":  # the warm-up step: states created, grads left as zero_grad leaves them
        for p in params:
            p.grad = torch.empty_like(p)
        optimizer.step()
        if not keep_grads:
            for p in params:
                p.grad = None
    rec = StorageRecorder(cpu_scalars=(kernel_policy == "cpu"))
    rec.register(params, TensorKind.PARAM)
    states = rec.register(
        [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
        TensorKind.OPTIMIZER_STATE,
    )
    kept = rec.register([p.grad for p in params if p.grad is not None], TensorKind.GRAD)
    with rec:
        rec.begin("backward")  # what the backward leaves: grads and the loss
        for p in params:
            if p.grad is None:
                p.grad = torch.empty_like(p)
        loss = torch.empty((), dtype=loss_dtype, device="meta")
        if detail is not None:
            detail["grads"] = [next(iter(rec.storage_names([p.grad])), None) for p in params]
            detail["loss"] = next(iter(rec.storage_names([loss])), None)
        rec.begin("optimizer")
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad(set_to_none=set_to_none)
        del loss
    del optimizer
    phases = analyze_programs(rec.programs(), rec.entry_storages())
    if detail is not None:
        progs = rec.programs()
        walked = analyze_sequence(progs, live_on_entry=rec.entry_storages())
        detail["walk"] = next(((p, r) for p, r in zip(progs, walked) if p.name == "optimizer"), None)
        detail["states"] = [rec.storages[n].nbytes for n in dict.fromkeys(states)]
    resident = {
        "optimizer": sum(rec.storages[n].nbytes for n in set(states)),
        "grads": sum(rec.storages[n].nbytes for n in set(kept)),
    }
    return next(p for p in phases if p.name == "optimizer"), resident


@dataclass
class ReplicatedStep:
    """Same summary as `TracedStep` for an N-layer step built from a K-layer trace."""

    static: dict
    phases: list[PhaseMemory]
    layers: int
    traced: TracedStep = field(repr=False, default=None)
    replicated: bool = False  # False: `traced` is the whole step (its programs are the step's)
    stream: dict = field(repr=False, default=None)  # replicated: what `replicated_allocs` reads

    peak_bytes = TracedStep.peak_bytes
    peak_at = TracedStep.peak_at
    net_after_forward = TracedStep.net_after_forward
    phase = TracedStep.phase

    def summary(self) -> dict:
        return {**step_summary(self), "replicated_from_layers": self.traced.layers if self.traced else None}


def trace_replicated(
    build_model,
    set_layers,
    n_layers: int,
    example_inputs,
    loss_fn=None,
    optimizer_factory=None,
    kernel_policy: str = "cuda",
    *,
    traced_layers: int = TRACED_LAYERS,
    template: int = TEMPLATE_LAYER,
    **trace_kwargs,
) -> ReplicatedStep:
    """Trace `build_model()` after `set_layers(traced_layers)` and replicate to `n_layers`.

    build_model: zero-argument function building the model (on meta); set_layers(k): makes the
    next build have k layers. Other arguments as `trace_step`.
    """

    def full():
        set_layers(n_layers)
        step = trace_step(
            build_model, example_inputs, loss_fn, optimizer_factory, kernel_policy, **trace_kwargs
        )
        return ReplicatedStep(step.static, step.phases, n_layers, step)

    if n_layers <= traced_layers:
        return full()
    set_layers(traced_layers)
    loss_meta = {}

    def lf(out):
        from .step import default_loss

        loss = (loss_fn or default_loss)(out)
        loss_meta["dtype"] = loss.dtype
        loss_meta["bytes"] = loss.untyped_storage().nbytes()
        return loss

    step = trace_step(build_model, example_inputs, lf, None, kernel_policy, **trace_kwargs)
    if not step.layer_prefix or step.layers != traced_layers:
        return full()  # no list of identical layers to replicate
    try:
        pieces = phase_pieces(step, template)
    except NotReplicable:
        return full()
    phases = []
    for name in ("forward", "backward"):
        if name in pieces:
            pm = expand(pieces[name], n_layers, traced_layers, template)
            pm.name = name
            phases.append(pm)
    if optimizer_factory is not None and phases and phases[-1].name == "backward":
        # Traced without an optimizer, the step dropped the loss right after the backward;
        # with one it lives until the optimizer is done (trace_optimizer frees it there).
        phases[-1].net_bytes += loss_meta.get("bytes", 0)
    with torch.device("meta"):
        model = build_model()
    per_layer = sum(
        p.numel() * p.element_size() for p in model.get_submodule(step.layer_prefix)[template].parameters()
    )
    per_layer_buf = sum(
        b.numel() * b.element_size() for b in model.get_submodule(step.layer_prefix)[template].buffers()
    )
    extra = n_layers - traced_layers
    static = dict(step.static)
    static["params"] += extra * per_layer
    static["buffers"] += extra * per_layer_buf
    static["total"] += extra * (per_layer + per_layer_buf)
    if static.get("grads"):  # gradients kept resident (set_to_none=False): one per parameter
        static["grads"] += extra * per_layer
        static["total"] += extra * per_layer
    layer = model.get_submodule(step.layer_prefix)[template]
    stream = {  # what replicated_allocs needs
        "template": template,
        "extra": extra,
        "template_params": {id(p) for p in layer.parameters()},
        "params": [id(p) for p in model.parameters()],
        "static": [p.numel() * p.element_size() for p in layer.parameters()] * extra
        + [b.numel() * b.element_size() for b in layer.buffers()] * extra
        + ([p.numel() * p.element_size() for p in layer.parameters()] * extra if static.get("grads") else []),
        "optimizer": None,
    }
    if optimizer_factory is not None:
        specs = layer_template_params(model, step.layer_prefix, n_layers, template)
        detail: dict = {}
        opt, resident = trace_optimizer(
            specs,
            optimizer_factory,
            kernel_policy,
            loss_meta.get("dtype", torch.float32),
            trace_kwargs.get("zero_grad", True),
            trace_kwargs.get("step", "steady"),
            trace_kwargs.get("set_to_none", True),
            detail=detail,
        )
        stream["optimizer"] = detail
        phases.append(opt)
        static["optimizer"] = static.get("optimizer", 0) + resident["optimizer"]
        static["total"] += resident["optimizer"]
    out = ReplicatedStep(static, phases, n_layers, step, replicated=True)
    out.stream = stream
    return out


def trace_hf_replicated(
    model_config,
    batch: int,
    seq: int,
    n_layers: int | None = None,
    dtype: str = "fp32",
    attn: str = "sdpa",
    recompute: str = "none",
    optimizer: str = "adamw",
    kernel_policy: str = "cuda",
    master_weights: bool = True,
    compile: bool = False,
    **kw,
) -> ReplicatedStep:
    """`hf.trace_hf_step` for deep models: K layers traced, the rest replicated."""
    from .hf import (
        Precision,
        build_model,
        fake_tensor_quirks,
        hf_loss,
        make_config,
        optimizer_factory,
        step_inputs,
    )

    cfg = make_config(model_config, attn, n_layers)
    n = cfg.num_hidden_layers
    prec = Precision.parse(dtype, master_weights)
    if n > kw.get("traced_layers", TRACED_LAYERS):
        kw.update(_replication(cfg, build_model(cfg, prec.param_dtype), n))
    holder = {"cfg": cfg}

    def set_layers(k):
        holder["cfg"] = make_config(cfg, attn, k)

    return trace_replicated(
        lambda: build_model(holder["cfg"], prec.param_dtype),
        set_layers,
        n,
        step_inputs(cfg, batch, seq),
        hf_loss,
        optimizer_factory(optimizer),
        kernel_policy,
        autocast_dtype=prec.autocast_dtype,
        prepare=lambda m: _prepare(m, recompute, compile),
        patches=fake_tensor_quirks(),
        **kw,
    )


def _replication(cfg, model, n: int) -> dict:
    """Which layers to trace so that the template layer stands for identical ones: layers differ
    in kind (dense first layers of a MoE model, sliding-window / full / linear attention, NoPE,
    Mamba) by their modules, parameters, per-layer attributes or per-layer config entries. With
    a uniform run from layer s on, trace s + K layers, the template at s + T; else all n."""
    from .capture import find_layer_prefix
    from .hf import PER_LAYER_KEYS

    prefix = find_layer_prefix(model)
    if prefix is None or len(model.get_submodule(prefix)) != n:
        return {}
    per_layer = [getattr(cfg, k, None) for k in PER_LAYER_KEYS]
    sigs = [
        (layer_signature(layer), tuple(v[i] if v is not None and len(v) == n else None for v in per_layer))
        for i, layer in enumerate(model.get_submodule(prefix))
    ]
    start = n - 1
    while start > 0 and sigs[start - 1] == sigs[-1]:
        start -= 1
    if start == 0:
        return {}
    if start + TRACED_LAYERS >= n:
        return {"traced_layers": n}
    return {"traced_layers": start + TRACED_LAYERS, "template": start + TEMPLATE_LAYER}


_SCALARS = (int, float, str, bool, type(None))


def layer_signature(layer: torch.nn.Module) -> tuple:
    """What makes one decoder layer's step differ from another's: its modules' classes, their
    parameters' shapes and dtypes and their scalar attributes (a sliding window, a layer kind),
    its own index aside."""
    sig = []
    for name, mod in layer.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(mod).items()
                if isinstance(v, _SCALARS)
                and not k.startswith("_")
                and k != "training"
                and "layer_id" not in k
            )
        )
        params = tuple((k, tuple(p.shape), p.dtype) for k, p in mod.named_parameters(recurse=False))
        sig.append((name, type(mod).__name__, attrs, params))
    return tuple(sig)


def _prepare(model, recompute: str, compile: bool) -> None:
    """Checkpointing first, then torch.compile of each layer (torchtitan's order)."""
    from .hf import enable_recompute

    enable_recompute(model, recompute)
    if compile:
        from .compiled import compile_layers

        compile_layers(model)


replicate_step = trace_replicated


# ---------------------------------------------------------------- the allocation stream


def replicated_allocs(rs: ReplicatedStep) -> tuple:
    """The replicated step's allocations as `pipemem.jobs.RankPlan.recorded` wants them: the
    K-layer trace's forward and backward events, the template layer's piece repeated for the
    layers it stands for, and the optimizer step traced on the N-layer parameters.

    The N-layer step is read as virtual layers: layers before the template keep their index,
    copy c of the template is layer T + c, later layers move up by the copies added; the
    backward runs the copies last to first. A storage the template's piece allocates is one
    storage per copy; a free names the storage of the virtual layer at the same distance as in
    the trace (a layer's backward frees what its own forward saved; the template's input is
    the previous copy's output), matched across layers by the order in which each layer's own
    ops allocate (identical layers allocate alike; a mismatch raises StreamNotModelled). A free
    outside the layers of a storage of the template (autocast's weight copies) frees every
    copy, as `expand` counts them."""
    from ..jobs import StageAllocs, StreamNotModelled
    from .allocs import SLOTS

    t, info = rs.traced, rs.stream
    T, extra = info["template"], info["extra"]
    results = analyze_sequence(t.programs, live_on_entry=t.entry_storages)
    events, alloc_layer, own_seq, own_pos = {}, {}, {}, {}
    for p, r in zip(t.programs, results):
        if p.name not in ("forward", "backward"):
            raise StreamNotModelled(f"the traced step has a {p.name} phase")
        sign, size, sid, op = program_events(p, r)
        names = compile_program(p).storage_names
        owners = t.op_layers.get(p.name, [])
        piece = [None] * len(p.ops)
        slices = _piece_slices(owners)
        for a, b, lay in slices:
            piece[a : b + 1] = [lay] * (b - a + 1)
        rows = []
        for sg, b, i, o in zip(sign.tolist(), size.tolist(), sid.tolist(), op.tolist()):
            if b == 0:
                continue
            n = names[i] if i >= 0 else None
            rows.append((sg, b, n, o))
            if sg > 0 and n is not None:
                alloc_layer[n] = piece[o]
                if owners and owners[o] is not None and owners[o] == piece[o]:
                    lst = own_seq.setdefault((owners[o], p.name), [])
                    own_pos[n] = (p.name, len(lst), b)
                    lst.append(n)
        events[p.name] = (rows, slices)

    def equiv(n: str, a: int, b: int) -> str:
        if a == b:
            return n
        pos = own_pos.get(n)
        lst = own_seq.get((b, pos[0])) if pos is not None else None
        if lst is None or pos[1] >= len(lst) or own_pos[lst[pos[1]]][2] != pos[2]:
            raise StreamNotModelled(f"layers {a} and {b} of the traced step allocate differently")
        return lst[pos[1]]

    def freed(n: str, lay, v) -> list:
        a = alloc_layer.get(n, "entry")
        if a == "entry":
            raise StreamNotModelled(f"the traced step frees storage {n}, which existed before it")
        if lay is None:
            return [(n, T + c) for c in range(extra + 1)] if a == T else [(n, None)]
        if a is None:
            return [(n, None)]
        w = v + (a - lay)
        if T <= w <= T + extra:
            return [(equiv(n, a, T), w)]
        return [(equiv(n, a, w if w < T else w - extra), None)]

    def _order(ident) -> int:
        n, v = ident
        if v is not None:
            return v
        a = alloc_layer.get(n)
        return -1 if a is None else a if a < T else a + extra

    handles: dict = {}

    def handle(ident) -> int:
        h = handles.get(ident)
        if h is None:
            h = handles[ident] = SLOTS + len(handles)
        return h

    loss = t.loss_storage
    job_rows: dict = {}
    ws = 0
    for phase, kind in (("forward", "F"), ("backward", "B")):
        rows, slices = events.get(phase, ([], []))
        out = []
        by_op: dict = {}
        for row in rows:
            by_op.setdefault(row[3], []).append(row)
        for a, b, lay in slices:
            if lay == T:
                copies = range(extra + 1) if phase == "forward" else range(extra, -1, -1)
                views = [T + c for c in copies]
            else:
                views = [lay if lay is None or lay < T else lay + extra]
            for v in views:
                for o in range(a, b + 1):
                    op_out = []  # (order, row): outside the layers, frees go in virtual-layer order
                    for sg, size, n, _ in by_op.get(o, ()):
                        if n is None:  # an op's workspace
                            if sg > 0:
                                ws += 1
                            op_out.append((-2, (sg, size, handle(("ws", ws)))))
                        elif sg > 0:
                            op_out.append((-2, (sg, size, handle((n, v if lay == T else None)))))
                        elif phase == "backward" and n == loss:
                            continue  # traced without an optimizer: the optimizer step frees it
                        else:
                            op_out += [(_order(i), (sg, size, handle(i))) for i in freed(n, lay, v)]
                    if lay is None:  # as a trace of every layer frees them (autocast's cache)
                        op_out.sort(key=lambda x: x[0])
                    out += [row for _, row in op_out]
        job_rows[kind] = tuple(out)
    opt_rows: tuple = ()
    detail = info.get("optimizer")
    static = list(t.entry_sizes) + list(info["static"])
    if detail is not None:
        if detail.get("walk") is None:
            raise StreamNotModelled("the optimizer step was not recorded")
        grads = {}
        k_grads = t.grad_storages
        j = 0
        for k, pid in enumerate(info["params"]):
            copies = extra + 1 if pid in info["template_params"] else 1
            g = k_grads[k] if k < len(k_grads) else None
            for c in range(copies):
                name = detail["grads"][j] if j < len(detail["grads"]) else None
                j += 1
                if name is None or g is None or g not in alloc_layer:
                    continue  # no gradient, or one resident from before the step (not freed)
                if copies > 1 and alloc_layer[g] != T:
                    raise StreamNotModelled("a template parameter's gradient is made outside its layer")
                grads[name] = (0, handle((g, T + c if copies > 1 else None)))
        if detail.get("loss") is not None and loss is not None:
            grads[detail["loss"]] = (0, handle((loss, None)))
        from .allocs import Handles, program_rows

        opt_rows = tuple(program_rows(*detail["walk"], Handles(start=0), "the optimizer step", grads))
        static += detail.get("states", [])
    return StageAllocs(F=job_rows["F"], B=job_rows["B"], width=SLOTS + len(handles)), opt_rows, static
