"""Each pipeline rank's allocation stream: the allocations and frees behind the allocated
bytes that replay reports, in execution order, as the CUDA caching allocator sees them.

The numbers `replay` walks are `{net, peak}` of jobs; behind each job is a list of
allocations and frees (`liveness.program_events` reads them back from the walk of each part
program: the bytes a kernel asks for, per tensor storage and per workspace). This module
strings them together the way the stage jobs and the replay do, so the stream's running sum
is the replay's allocated curve, byte for byte (tests/test_alloc_stream.py checks the peak
over many plans), and it is what `pipemem.allocator` needs to say how much the allocator
*reserves*:

* static state first, as the framework allocates it: one tensor per parameter, per
  optimizer state and per gradient (torch, FSDP), Megatron's contiguous grad buffer (and
  param buffer under the distributed optimizer) as one allocation, DDP's gradient buckets
  (25 MiB, `bucket_cap_mb`), runtime buffers as one each;
* per action of the lowered schedule (pipemem.runtime): a stage job's events, or a runtime
  memory action (a receive buffer allocated, a stage output or input grad freed);
* the optimizer step last (states the first step creates, its scratch, the gradients that
  zero_grad(set_to_none) frees).

Handles: every allocation gets an integer; a job's handles are local to its (stage,
microbatch) and offset per microbatch, so a microbatch's backward frees what its forward
saved. Slots 0-3 of each (stage, microbatch) are the stage boundary the runtime owns
(x, y, dy, dx). Streams: FSDP2's all-gather buffers are allocated on its all-gather stream
and its reduce-scatter output on the reduce-scatter stream (torch
distributed/fsdp/_fully_shard/_fsdp_collectives.py: `foreach_all_gather` and `foreach_reduce`
allocate them under `torch.cuda.stream(...)`); everything else on the compute stream
(pipeline receive buffers and DDP buckets are allocated with `torch.empty` on the current
stream).

Cost: one event list per stage and job kind (cached per distinct stage); a rank's stream is
a concatenation of those with offset handles (numpy), a few ms for the largest plans.
Where the stream cannot reproduce a stage job's {net, peak} exactly (a job adjustment not
expressed as allocations), `StreamNotModelled` says what, and the estimate reports reserved
as not modelled rather than a number from a different memory curve.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import jobs

COMPUTE, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2
OUTSIDE = -1  # counted in the walk, not an allocator block (see stage_stream)
X, Y, DY, DX = 0, 1, 2, 3  # boundary slots of a (stage, microbatch)
_SLOTS = 4
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # torch DistributedDataParallel bucket_cap_mb default
# FSDP2 (torch distributed/fsdp/_fully_shard/_fsdp_collectives.py, 2.13): foreach_all_gather makes
# the all-gather input and output under `stream(all_gather_copy_in_stream)`; foreach_reduce makes
# the reduce-scatter input on the current stream, its output under `stream(reduce_scatter_stream)`
_STREAM_OF_OP = {
    "fsdp_all_gather_copy_in": ALL_GATHER,
    "fsdp_all_gather": ALL_GATHER,
    "fsdp_reduce_scatter": REDUCE_SCATTER,
}
# Allocations and frees the allocator model replays per rank (about 3 us each in Python): beyond
# it reserved is not modelled (said, not guessed), so an estimate never waits more than ~1 s per rank
MAX_EVENTS = 400_000


# the plan uses something the allocation stream does not reproduce; the message says what
StreamNotModelled = jobs.StreamNotModelled


@dataclass(frozen=True, slots=True)
class Events:
    """Allocations (+1) and frees (-1) in order: bytes, handle, allocator stream."""

    sign: np.ndarray
    size: np.ndarray
    handle: np.ndarray
    stream: np.ndarray

    def __len__(self) -> int:
        return int(self.sign.size)

    def walk(self) -> tuple[int, int]:
        """(net, peak) of the running allocated bytes, from 0 (peak never below 0)."""
        if not self.sign.size:
            return 0, 0
        cur = np.cumsum(self.sign * self.size)
        return int(cur[-1]), max(0, int(cur.max()))

    def allocated_peak(self) -> int:
        return self.walk()[1]

    def problems(self, limit: int = 3) -> list[str]:
        """Frees of a handle not live or of another size, allocations of a live handle (a
        well-formed stream has none; tests check it)."""
        live: dict = {}
        out = []
        for i, (s, b, h, st) in enumerate(
            zip(self.sign.tolist(), self.size.tolist(), self.handle.tolist(), self.stream.tolist())
        ):
            if st == OUTSIDE:
                continue
            if s > 0:
                if h in live:
                    out.append(f"event {i}: handle {h} allocated again")
                live[h] = b
            elif live.pop(h, None) != b:
                out.append(f"event {i}: free of {b} B under handle {h}, not live at that size")
            if len(out) >= limit:
                break
        return out

    def as_tuples(self) -> list[tuple[int, int, int]]:
        """(signed bytes, stream, handle) per event: pipemem.allocator.simulate's input."""
        keep = self.stream != OUTSIDE
        return list(
            zip(
                (self.sign * self.size)[keep].tolist(), self.stream[keep].tolist(), self.handle[keep].tolist()
            )
        )


def _events(rows: list[tuple[int, int, int, int]]) -> Events:
    a = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    return Events(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy())


def concat(parts: list[Events]) -> Events:
    parts = [p for p in parts if len(p)]
    if not parts:
        return _events([])
    return Events(
        *(np.concatenate([getattr(p, f) for p in parts]) for f in ("sign", "size", "handle", "stream"))
    )


# ---------------------------------------------------------------- one program

_PROGRAM_EVENTS: dict = {}  # id(ProgramMemory) -> (it, rows)


def _program_rows(program, result) -> list[tuple[int, int, str | None, int]]:
    """(sign, bytes, storage name or None for a workspace, stream) of one analysed program."""
    hit = _PROGRAM_EVENTS.get(id(result))
    if hit is not None and hit[0] is result:
        return hit[1]
    from .liveness import compile_program, program_events

    sign, size, sid, op = program_events(program, result)
    c = compile_program(program)
    names = c.storage_names
    op_stream = [_STREAM_OF_OP.get(o.type, COMPUTE) for o in program.ops]
    rows = []
    for s, b, i, k in zip(sign.tolist(), size.tolist(), sid.tolist(), op.tolist()):
        if i < 0:
            rows.append((s, b, None, COMPUTE))
        else:
            rows.append((s, b, names[i], op_stream[k] if s > 0 else COMPUTE))
    if len(_PROGRAM_EVENTS) > 4096:
        _PROGRAM_EVENTS.clear()
    _PROGRAM_EVENTS[id(result)] = (result, rows)
    return rows


def _stand_in(nm: _Namer, rows: list, size: int, name: str) -> int:
    """A storage a part frees under a name no part allocated it by: a stand-in for what a later
    part handed on (FSDP2's root unit frees the output layer's gradients as `root.head_grads`,
    which the head's backward made under its own name, FSDP's padding apart): the latest live
    allocation of this job within 0.1 % of the size, if there is one."""
    freed = {h for s, _, h, _ in rows if s < 0}
    for s, b, h, _ in reversed(rows):
        if s > 0 and abs(b - size) <= size // 1000 and h >= _SLOTS and h not in freed:
            nm.shared[name] = h
            return h
    raise StreamNotModelled(f"a part frees storage {name!r} that no earlier job allocated")


def _grad_storages(program) -> frozenset:
    from .ir import TensorKind

    return frozenset(t.storage for t in program.tensors.values() if t.kind is TensorKind.GRAD)


# ---------------------------------------------------------------- one stage


@dataclass(frozen=True, slots=True)
class StageStream:
    """A stage's jobs as event templates; handles local to one (stage, microbatch)."""

    F: Events
    B: Events
    I: Events
    W: Events
    width: int  # handles one (stage, microbatch) uses
    # (handle, bytes) gradients the backward (B; I then W) creates and leaves for the optimizer
    # step to free (the step's first backward under --grads set-to-none / ddp-bucket)
    created_grads: tuple = ()
    created_grads_iw: tuple = ()

    def job(self, kind: str) -> Events:
        return getattr(self, kind)


class _Namer:
    """Handles of one (stage, microbatch). Part instance k (one copy of a layer, the embedding,
    the head) has its own storage names; its input is instance k-1's output and its output
    grad instance k+1's input grad; the first instance's input and the last one's output grad
    are the stage boundary slots the runtime owns."""

    def __init__(self, inst: list):
        self.inst = inst  # per instance (PartPrograms, x storage, y storage, dy storage)
        self.next = _SLOTS
        self.own: dict = {}
        self.shared: dict = {}  # storages parts hand each other by name (FSDP2's root unit)
        self.dx: dict = {}  # instance -> handle of its input grad
        self.sizes: dict = {}
        self.y_slot = False  # the last instance's output is the stage output y (slot Y)
        self.dx_slot = False  # the first instance's input grad is the stage's dx (slot DX)
        self.ws = -1

    def copy(self) -> "_Namer":
        n = _Namer(self.inst)
        n.next, n.own, n.shared, n.dx, n.sizes = (
            self.next,
            dict(self.own),
            dict(self.shared),
            dict(self.dx),
            dict(self.sizes),
        )
        return n

    def new(self, size: int) -> int:
        h = self.next
        self.next += 1
        self.sizes[h] = size
        return h

    def alloc(self, k: int, name: str, size: int, dx_names) -> int:
        if self.y_slot and k == len(self.inst) - 1 and name == self.inst[k][2]:
            h = Y
        elif self.dx_slot and k == 0 and name in dx_names:
            h = DX
        else:
            h = self.next
            self.next += 1
        self.sizes[h] = size
        self.own[(k, name)] = h
        self.shared[name] = h
        if name in dx_names:
            self.dx[k] = h
        return h

    def resolve(self, k: int, name: str) -> int:
        h = self.own.get((k, name))
        if h is not None:
            return h
        _, xs, ys, dys = self.inst[k]
        if name == xs:
            return X if k == 0 else self.resolve(k - 1, self.inst[k - 1][2])
        if name == dys:
            if k == len(self.inst) - 1:
                return DY
            h = self.dx.get(k + 1)
            if h is not None:
                return h
        h = self.shared.get(name)
        if h is None:
            raise StreamNotModelled(f"a part frees storage {name!r} that no earlier job allocated")
        return h


def _walk_program(nm: _Namer, k: int, prog, res, kind: str, rows: list, created: list | None = None) -> None:
    pp = nm.inst[k][0]
    dx_names = pp.dx_storages[1 if kind == "I" else 0] if kind in ("B", "I") else frozenset()
    if kind in ("B", "I") and not dx_names and pp.dx_storages == (frozenset(), frozenset()):
        d = "d." + pp.input
        dx_names = frozenset({prog.tensors[d].storage}) if d in prog.tensors else frozenset()
    grads = _grad_storages(prog) if created is not None else frozenset()
    for s, b, name, stream in _program_rows(prog, res):
        if name is None:  # a workspace: allocated and freed by the same op
            if s > 0:
                nm.ws = nm.new(b)
            rows.append((s, b, nm.ws, stream))
            continue
        if s > 0:
            h = nm.alloc(k, name, b, dx_names)
            if name in grads:
                created.append(h)
        else:
            try:
                h = nm.resolve(k, name)
            except StreamNotModelled:
                h = _stand_in(nm, rows, b, name)
                held = nm.sizes[h]
                if held != b:
                    # the walk frees the stand-in's bytes: the allocator frees the block, the
                    # difference (FSDP's padding) stays in the walk only
                    rows.append((s, held, h, stream))
                    rows.append((1 if held > b else -1, abs(held - b), -1, OUTSIDE))
                    continue
        rows.append((s, b, h, stream))
    for name in dx_names:  # an input grad that is the output grad handed on (a residual add)
        if k not in nm.dx:
            try:
                nm.dx[k] = nm.resolve(k, name)
            except StreamNotModelled:
                pass


def _grad_storages(program) -> frozenset:
    from .ir import TensorKind

    return frozenset(t.storage for t in program.tensors.values() if t.kind is TensorKind.GRAD)


def _live(rows) -> dict:
    live: dict = {}
    for s, b, h, _ in rows:
        if s > 0:
            live[h] = b
        else:
            live.pop(h, None)
    return live


def _segments(arch, sh, conv, runs, first, last, seq_len):
    """The stage's parts as `stages._stage_jobs` strings them, in forward order:
    (PartPrograms, PartMemory, copies)."""
    from .stages import mtp_of, stage_layer_runs
    from .templates.programs import (
        embedding_memory,
        embedding_programs,
        head_memory,
        head_programs,
        layer_memory,
        layer_programs,
    )

    runs, prologue = stage_layer_runs(arch, sh, conv, runs)
    if prologue:
        raise StreamNotModelled("Paddle's per-stage causal mask")
    total = sum(n for _, n in runs)
    tied_head = first and last and bool(getattr(arch, "tied_embeddings", False))
    segs = []
    if first:

        class _P:  # the embedding tape reads only seq_len from the plan (templates.programs)
            pass

        p = _P()
        p.seq_len = seq_len
        segs.append(
            (
                embedding_programs(arch, sh, conv, p, tied_head),
                embedding_memory(arch, sh, conv, seq_len, tied_head),
                1,
            )
        )
    pos = 0
    for opt, n in runs:  # the same cuts as stages._layer_parts
        cuts = (
            ((pos, pos + 1), (pos + 1, pos + n - 1), (pos + n - 1, pos + n)) if n > 1 else ((pos, pos + 1),)
        )
        for a, b in cuts:
            if b <= a:
                continue
            keep_in, keep_dy = not first and a == 0, not last and b == total
            segs.append(
                (
                    layer_programs(arch, sh, conv, opt, keep_in, keep_dy),
                    layer_memory(arch, sh, conv, opt, keep_in, keep_dy),
                    b - a,
                )
            )
        pos += n
    if last:
        kw = dict(
            keep_input=not first and not total,
            tied_gathered=tied_head and sh.fsdp and not sh.fsdp_embed_reshard,
            mtp=mtp_of(arch, conv, runs),
        )
        segs.append((head_programs(arch, sh, conv, **kw), head_memory(arch, sh, conv, **kw), 1))
    return segs, total


def _backward_extras(bsegs, i: int, copy: int, kind: str, sh, last: bool) -> list[tuple[int, int]]:
    """Bytes `stages._stage_jobs` counts around one copy of backward segment i beyond the
    part's own programs, as blocks held across it: DeepSpeed ZeRO-1/2's reduce bucket, FSDP2's
    reduce-scatter input of the previous part (`linger` / `own`) and the next unit's all-gather
    buffer prefetched (the difference to this unit's)."""
    out = []
    if kind not in ("B", "I"):
        return out
    if sh.backward_bucket_bytes and not (last and i == 0):
        out.append((sh.backward_bucket_bytes, COMPUTE))
    pm, n = bsegs[i][1], bsegs[i][2]
    linger = bsegs[i - 1][1].rs_state_bytes if i > 0 else 0
    own = pm.rs_state_bytes
    nxt = bsegs[i + 1][1] if i + 1 < len(bsegs) else None
    prefetch = nxt.bwd_gather_bytes - pm.bwd_gather_bytes if (pm.bwd_gather_bytes and nxt is not None) else 0
    from .templates.programs import layer_prefetch

    prefetch += layer_prefetch(pm, nxt)
    if not (linger or own or prefetch):
        return out
    if n > 1:
        rs, pf = (linger, 0) if copy == 0 else (own, prefetch if copy == n - 1 else 0)
    else:
        rs, pf = linger, prefetch
    if pf < 0:
        raise StreamNotModelled("FSDP2's prefetch of a smaller all-gather buffer")
    out += [(rs, COMPUTE), (pf, ALL_GATHER)]  # a reduce-scatter input, an all-gather output
    return [(b, st) for b, st in out if b]


def stage_stream(
    arch,
    sh,
    conv,
    runs: tuple,
    first: bool,
    last: bool,
    seq_len: int,
    stage: int,
    expected,
    check_forward: bool = True,
) -> StageStream:
    """Event templates of one stage's F / B / I / W (cached per distinct stage), checked against
    `expected` (the stage's StageJobs): a template whose walk is not its job's {net, peak}
    raises StreamNotModelled. `check_forward=False`: the first-backward jobs, whose forward is
    the stage's ordinary one (stage_streams checks that it is)."""
    sig = _sig(expected)
    if not check_forward:
        sig = (None,) + sig[1:]
    try:
        return _stage_stream(arch, sh, conv, runs, first, last, seq_len, sig)
    except StreamNotModelled as e:
        raise StreamNotModelled(f"stage {stage}: {e}") from None


def _sig(sj) -> tuple:
    out = []
    for k in ("F", "B", "I", "W"):
        j = getattr(sj, k, None)
        out.append((j.net_bytes, j.peak_bytes) if j is not None else None)
    return tuple(out)


@lru_cache(maxsize=4096)
def _stage_stream(arch, sh, conv, runs, first, last, seq_len, expected) -> StageStream:
    segs, total = _segments(arch, sh, conv, runs, first, last, seq_len)
    if not total and not (first and last):
        raise StreamNotModelled("a pipeline stage without layers")
    per_mb = sum(
        n * sum(len(_program_rows(getattr(pp, k), pp.results[k])) for k in "FB") for pp, _, n in segs
    )
    if per_mb > MAX_EVENTS:
        raise StreamNotModelled(
            f"{per_mb:,} allocations and frees per microbatch on one stage, more than the allocator model "
            f"replays in reasonable time ({MAX_EVENTS:,} per rank)"
        )
    inst, seg_of = [], []
    for j, (pp, _, n) in enumerate(segs):
        st = lambda prog, nm_: prog.tensors[nm_].storage if nm_ in prog.tensors else nm_  # noqa: E731
        for c in range(n):
            inst.append((pp, st(pp.F, pp.input), st(pp.F, pp.output), st(pp.B, "d." + pp.output)))
            seg_of.append((j, c))
    nm = _Namer(inst)
    nm.y_slot = not last
    rows: list = []
    for k, ins in enumerate(inst):
        _walk_program(nm, k, ins[0].F, ins[0].results["F"], "F", rows)
    F = _events(rows)
    bsegs = segs[::-1]
    act = sh.boundary_bytes

    def backward(kinds) -> tuple[list[list], tuple]:
        b = nm.copy()
        b.dx_slot = True
        out: list[list] = []
        created: list = []
        via = segs[-1][0].grad_passes_through[1 if kinds[0] == "I" else 0] if (not last and total) else False
        for kind in kinds:
            krows: list = []
            extra = None
            if via and kind in ("B", "I"):
                # the runtime keeps dy, so autograd writes the last layer's input grad to a new
                # buffer (stages._stage_jobs counts it from the start): the grad the layer
                # before receives, instead of dy
                extra = b.new(act)
                krows.append((1, act, extra, COMPUTE))
            for k in range(len(inst) - 1, -1, -1):
                j, c = seg_of[k]
                held = [
                    (x, st_, b.new(x))
                    for x, st_ in _backward_extras(bsegs, len(segs) - 1 - j, c, kind, sh, last)
                ]
                krows += [(1, x, h, st_) for x, st_, h in held]
                pp = inst[k][0]
                _walk_program(b, k, getattr(pp, kind), pp.results[kind], kind, krows, created)
                krows += [(-1, x, h, st_) for x, st_, h in held]
                if extra is not None and k == len(inst) - 1:
                    b.dx[k] = extra
            out.append(krows)
        # the stage's input grad is slot DX (the runtime frees it) however it was made
        dx0 = b.dx.get(0)
        if not last or not first:
            made = {r[2] for krows in out for r in krows if r[0] > 0}
            if DX not in made and dx0 is not None and dx0 >= _SLOTS and dx0 in made:
                out = [[(s_, x, DX if h == dx0 else h, st_) for s_, x, h, st_ in krows] for krows in out]
                created = [DX if h == dx0 else h for h in created]
        if last:
            # the loss's seed gradient: the walk frees it at the backward's end, though no job
            # allocated it (a few KiB): kept in the walk, outside the allocator (stream -1)
            out = [
                [(s_, x, h, OUTSIDE if (h == DY and s_ < 0) else st_) for s_, x, h, st_ in krows]
                for krows in out
            ]
        live = _live([r for krows in out for r in krows])
        return out, tuple((h, live[h]) for h in created if h in live), b.next

    (b_rows,), grads, nb = backward(("B",))
    (i_rows, w_rows), grads_iw, niw = backward(("I", "W"))
    ss = StageStream(
        F=F,
        B=_events(b_rows),
        I=_events(i_rows),
        W=_events(w_rows),
        width=max(nb, niw),
        created_grads=grads,
        created_grads_iw=grads_iw,
    )
    got = (ss.F.walk(), ss.B.walk(), ss.I.walk(), ss.W.walk())
    for kind, g, e in zip("FBIW", got, expected):
        if e is not None and g != e:
            raise StreamNotModelled(f"its {kind} job's allocation stream walks to {g}, the job is {e}")
    _check_handles(ss)
    return ss


def _check_handles(ss: StageStream) -> None:
    """Every free names a live handle of the same size (F then B, and F then I then W)."""
    for seq in ((ss.F, ss.B), (ss.F, ss.I, ss.W)):
        live: dict = {}
        for ev in seq:
            for s, b, h, st in zip(
                ev.sign.tolist(), ev.size.tolist(), ev.handle.tolist(), ev.stream.tolist()
            ):
                if st == OUTSIDE:
                    continue
                if s > 0:
                    live[h] = b
                elif h in (X, DY) and h not in live:
                    continue  # the runtime's receive buffers, allocated outside the job
                elif live.pop(h, None) != b:
                    raise StreamNotModelled(f"a job frees {b} B under a handle holding {live.get(h)}")


# ---------------------------------------------------------------- static state


def _param_elems(stage_plan, rank_stages) -> list[int]:
    from .templates.static import rank_param_tensor_elems

    return rank_param_tensor_elems(
        stage_plan.arch, stage_plan.plan, stage_plan.conv, stage_plan.stage_layers, rank_stages
    )


def _split(total: int, weights: np.ndarray, parts: int = 1) -> list[int]:
    """`total` bytes as `parts` tensors per weight, in proportion to the weights (summing to
    `total` exactly: the rounding goes to the last)."""
    if total <= 0:
        return []
    if not weights.size:
        return [total]
    w = np.repeat(weights.astype(np.float64), parts)
    sizes = np.floor(w / w.sum() * total).astype(np.int64)
    sizes[-1] += total - int(sizes.sum())
    return [int(x) for x in sizes if x > 0]


def _buckets(total: int, cap: int) -> list[int]:
    n, rest = divmod(total, cap)
    return [cap] * n + ([rest] if rest else [])


def static_sizes(stage_plan, rank_stages, static) -> list[int]:
    """The rank's static bytes as the framework allocates them (module docstring)."""
    plan, conv = stage_plan.plan, stage_plan.conv
    w = np.asarray(_param_elems(stage_plan, rank_stages), dtype=np.int64)
    fw = conv.framework
    deepspeed_flat = fw.zero_is_deepspeed and plan.zero in (1, 2)  # DeepSpeed ZeRO-1/2's flat buffers
    flat_params = (fw.has_dist_opt and plan.dist_opt) or deepspeed_flat
    grads_mode = str(plan.grads or "").lower()
    sizes = [static.params] if flat_params else _split(static.params, w)
    if fw.contiguous_grad_buffer:
        sizes += [static.grads] if static.grads else []  # the contiguous grad buffer
    elif grads_mode.startswith("ddp-bucket"):
        sizes += _buckets(static.grads, DDP_BUCKET_BYTES)
    else:
        sizes += _split(static.grads, w)
    if deepspeed_flat:
        states = 3 if plan.master_weights else 2
        sizes += _split(static.optimizer, np.ones(states, dtype=np.int64))  # DeepSpeed's flat partitions
    else:
        per = (1 if plan.master_weights else 0) + (1 if plan.optimizer == "sgd" else 2)
        sizes += _split(static.optimizer, w, max(1, per))
    sizes += [static.other] if static.other else []
    return [x for x in sizes if x > 0]


# ---------------------------------------------------------------- a rank

_MEMORY_SLOT = {
    "RECV_F": (X, 1, "input_bytes"),
    "FREE_X": (X, -1, "input_bytes"),
    "FREE_Y": (Y, -1, "output_bytes"),
    "RECV_B": (DY, 1, "output_grad_bytes"),
    "FREE_DY": (DY, -1, "output_grad_bytes"),
    "FREE_DX": (DX, -1, "input_grad_bytes"),
}


def stage_streams(stage_plan, stage_ids) -> tuple[dict, dict]:
    """({stage: StageStream}, {stage: StageStream of the step's first backward}) for the stages a
    rank holds."""
    from .stages import stage_runs
    from .templates.layers import first_backward_shard

    arch, plan, conv = stage_plan.arch, stage_plan.plan, stage_plan.conv
    sh = stage_plan.notes["shard"]
    n = plan.pp * plan.vpp
    if not conv.framework.pytorch_allocator:
        raise StreamNotModelled(f"the {conv.name} convention: {conv.framework.allocator_note}")
    normal, first = {}, {}
    for s in stage_ids:
        args = (stage_runs(arch, plan, stage_plan.stage_layers[s]), s == 0, s == n - 1, plan.seq_len, s)
        normal[s] = stage_stream(arch, sh, conv, *args, stage_plan.stages[s])
        if s in stage_plan.first_backward:
            f = stage_stream(
                arch,
                first_backward_shard(sh, plan),
                conv,
                *args,
                stage_plan.first_backward[s],
                check_forward=False,
            )
            if not (
                np.array_equal(f.F.size, normal[s].F.size) and np.array_equal(f.F.handle, normal[s].F.handle)
            ):
                # e.g. torchtitan's chunked loss makes the output layer's gradient in its forward
                raise StreamNotModelled(
                    f"stage {s}: the step's first forward allocates differently from the later ones "
                    "(the gradients set to None are created in it)"
                )
            first[s] = f
    return normal, first


def recorded_streams(stage_plan, stage_ids) -> tuple[dict, dict]:
    """stage_streams for a source that records its jobs' allocations (`jobs.StageAllocs`,
    traced programs): each template checked against its stage job's {net, peak}."""
    normal, first = {}, {}
    for s in stage_ids:
        a, f = stage_plan.stage_allocs(s)
        normal[s] = _from_allocs(a, stage_plan.stages[s], s)
        if f is not None:
            if f.F != a.F:
                raise StreamNotModelled(f"stage {s}: the step's first forward allocates differently")
            first[s] = _from_allocs(f, stage_plan.first_backward[s], s)
    return normal, first


def _from_allocs(a, expected, stage: int) -> StageStream:
    def ev(rows):
        return _events([(r[0], r[1], r[2], r[3] if len(r) > 3 else COMPUTE) for r in rows or ()])

    ss = StageStream(F=ev(a.F), B=ev(a.B), I=ev(a.I), W=ev(a.W), width=max(a.width, _SLOTS))
    for kind in "FBIW":
        j = getattr(expected, kind, None)
        if j is not None and ss.job(kind).walk() != (j.net_bytes, j.peak_bytes):
            raise StreamNotModelled(
                f"stage {stage}: its {kind} job's allocation stream walks to {ss.job(kind).walk()}, "
                f"the job is {(j.net_bytes, j.peak_bytes)}"
            )
    _check_handles(ss)
    return ss


def _recorded_optimizer(rows, handle_of, job) -> Events:
    """The optimizer step as the source recorded it, its refs made the rank's handles; checked
    against its job."""
    ev = _events([(x[0], x[1], handle_of(x[2]), x[3] if len(x) > 3 else COMPUTE) for x in rows])
    want = (job.net_bytes, job.peak_bytes) if job is not None else (0, 0)
    if ev.walk() != want:
        raise StreamNotModelled(f"the optimizer step walks to {ev.walk()}, its job is {want}")
    return ev


def rank_stream(
    stage_plan, lowered, rank: int, static, optimizer, stage_jobs: dict, first_mb: dict
) -> Events:
    """Rank `rank`'s allocation stream: its static state, then its lowered actions (`lowered`:
    runtime.lower's schedule), then the optimizer step. `stage_jobs`: {stage: StageJobs} (the
    boundary bytes); `first_mb`: {stage: microbatch} whose backward is the step's first (it
    creates the gradients: StagePlan.first_backward_overrides)."""
    return rank_stream_period(stage_plan, lowered, rank, static, optimizer, stage_jobs, first_mb)[0]


_KINDS = {}  # action kind -> a small int (the period search compares actions as ints)
_COUNT_IN: dict = {}  # id(Events) -> (the Events, its events the allocator sees)


def _count_in(ev: Events) -> int:
    hit = _COUNT_IN.get(id(ev))
    if hit is not None and hit[0] is ev:
        return hit[1]
    n = int(np.count_nonzero(ev.stream != OUTSIDE))
    if len(_COUNT_IN) > 65536:
        _COUNT_IN.clear()
    _COUNT_IN[id(ev)] = (ev, n)
    return n


def rank_stream_period(
    stage_plan, lowered, rank: int, static, optimizer, stage_jobs: dict, first_mb: dict
) -> tuple[Events, AllocatorInput, object]:
    """rank_stream; the stream as the allocator reads it; and the stretch of that which repeats
    (`pipemem.allocator.Period`, or None): see `find_period`."""
    acts = lowered.ranks[rank]
    stage_ids = lowered.stages_of_rank(rank)
    recorded = getattr(stage_plan, "allocs", None) == "recorded"
    if recorded:
        normal, first = recorded_streams(stage_plan, stage_ids)
        statics = [int(b) for b in stage_plan.rank_static_allocs(rank, stage_ids)]
        if 0 < static.total - sum(statics) == static.total - stage_plan.static_per_rank(lowered)[rank].total:
            # what the estimate holds beside the source's static state (the runtime's batch on
            # every pipeline rank: estimate.batch_bytes), one block as templates count `other`
            statics.append(static.total - sum(statics))
        if sum(statics) != static.total:
            raise StreamNotModelled(
                f"rank {rank}'s static tensors sum to {sum(statics)} B, its static bytes are {static.total} B"
            )
    elif getattr(stage_plan, "allocs", None) == "templates":
        normal, first = stage_streams(stage_plan, stage_ids)
        statics = static_sizes(stage_plan, stage_ids, static)
    else:
        raise StreamNotModelled("the program source records no allocations")
    n0 = len(statics)
    width = max([ss.width for ss in normal.values()] + [ss.width for ss in first.values()] + [_SLOTS])
    local = {s: i for i, s in enumerate(stage_ids)}
    M = lowered.microbatches
    _count_or_refuse(acts, normal, first, first_mb, n0, rank)
    memory: dict = {}  # (kind, stage) -> the one event of a runtime memory action, or None
    pieces: list = []  # per action that makes events: its template
    bases: list = []  # and its handle offset
    codes: list = []  # per action: its (kind, stage) as an int, its microbatch, its events seen
    mbs: list = []
    seen: list = []
    created: list = []
    total = n0
    nst = len(stage_ids) + 1
    for kind, s, m in acts:
        base = n0 + (local[s] * M + m) * width
        code = _KINDS.get(kind)
        if code is None:
            code = _KINDS[kind] = len(_KINDS)
        codes.append(code * nst + local[s])
        mbs.append(m)
        slot = _MEMORY_SLOT.get(kind)
        if slot is not None:
            ev = memory.get((kind, s), False)
            if ev is False:
                h, sign, attr = slot
                b = int(getattr(stage_jobs[s], attr, 0) or 0)
                ev = memory[(kind, s)] = (
                    Events(*(np.asarray([x], np.int64) for x in (sign, b, h, COMPUTE))) if b else None
                )
            if ev is None:
                seen.append(0)
            else:
                pieces.append(ev)
                bases.append(base)
                seen.append(1)
            continue
        ss = first[s] if (s in first and first_mb.get(s) == m and kind != "F") else normal[s]
        ev = ss.job(kind)
        pieces.append(ev)
        bases.append(base)
        seen.append(_count_in(ev))
        if ss is not normal[s]:
            grads = ss.created_grads if kind == "B" else ss.created_grads_iw if kind == "W" else ()
            created += [(base + h, b) for h, b in grads]
        total += len(ev)
        if total > MAX_EVENTS:
            raise StreamNotModelled(
                f"more than {MAX_EVENTS:,} allocations and frees on rank {rank}, more than the allocator "
                "model replays in reasonable time"
            )
    static_ev = Events(
        np.ones(n0, np.int64),
        np.asarray(statics, np.int64),
        np.arange(n0, dtype=np.int64),
        np.zeros(n0, np.int64),
    )
    opt_base = n0 + len(stage_ids) * M * width
    if recorded:

        def handle_of(ref):
            if isinstance(ref, tuple):  # (stage, handle) of the microbatch that made the gradients
                s, h = ref
                return n0 + (local[s] * M + first_mb.get(s, 0)) * width + h
            return opt_base + ref

        opt = _recorded_optimizer(
            stage_plan.rank_optimizer_allocs(rank, stage_ids) if optimizer is not None else (),
            handle_of,
            optimizer,
        )
    else:
        weights = np.asarray(_param_elems(stage_plan, stage_ids), dtype=np.int64)
        per_param = (stage_plan.plan.optimizer_impl or "fused") != "for-loop"
        opt = _optimizer_events(optimizer, static, created, opt_base, weights, per_param)
    if pieces:
        lens = np.fromiter((len(p) for p in pieces), np.int64, len(pieces))
        body = Events(
            np.concatenate([p.sign for p in pieces]),
            np.concatenate([p.size for p in pieces]),
            np.concatenate([p.handle for p in pieces]) + np.repeat(np.asarray(bases, np.int64), lens),
            np.concatenate([p.stream for p in pieces]),
        )
    else:
        body = _events([])
    ev = concat([static_ev, body, opt])
    period, inp = find_period(
        ev, np.asarray(codes, np.int64), np.asarray(mbs, np.int64), np.asarray(seen, np.int64), n0, width
    )
    return ev, inp, period


def _count_or_refuse(acts, normal: dict, first: dict, first_mb: dict, n0: int, rank: int) -> None:
    """The count of the rank's events that the loop of rank_stream_period adds up (its job
    actions' templates), made first from the templates' lengths alone, so that a stream over
    MAX_EVENTS is refused before it is built (the same refusal the loop would reach: the count
    only grows). Where a template cannot be read here the loop decides, as before."""
    lens: dict = {}
    total = n0
    try:
        for kind, s, m in acts:
            if kind in _MEMORY_SLOT:
                continue
            f = s in first and first_mb.get(s) == m and kind != "F"
            k = (kind, s, f)
            n = lens.get(k)
            if n is None:
                n = lens[k] = len((first[s] if f else normal[s]).job(kind))
            total += n
    except (KeyError, AttributeError, TypeError):
        return
    if total > MAX_EVENTS:
        raise StreamNotModelled(
            f"more than {MAX_EVENTS:,} allocations and frees on rank {rank}, more than the allocator "
            "model replays in reasonable time"
        )


class AllocatorInput:
    """An Events stream as pipemem.allocator.simulate reads it (`Events.as_tuples`: (signed
    bytes, stream, handle), events outside the allocator left out), converted to tuples only for
    the slices asked for (a periodic replay skips most of the stream)."""

    def __init__(self, ev: Events):
        keep = ev.stream != OUTSIDE
        self.signed = (ev.sign * ev.size)[keep]
        self.stream = ev.stream[keep]
        self.handle = ev.handle[keep]

    def __len__(self) -> int:
        return int(self.signed.size)

    def __getitem__(self, sl: slice) -> list[tuple[int, int, int]]:
        return list(zip(self.signed[sl].tolist(), self.stream[sl].tolist(), self.handle[sl].tolist()))


_MAX_PERIOD_TRIES = 24


def find_period(ev: Events, codes, mbs, seen, n0: int, width: int):
    """The stretch of a rank's stream that repeats, as (`pipemem.allocator.Period` or None, the
    `AllocatorInput` it refers to).

    The steady phase of a pipeline schedule repeats a pattern of actions (1F1B: one forward and
    one backward, with their runtime memory actions) with the microbatches moved by a constant
    (one, or pp microbatches for the interleaved orders), and a microbatch's handles are its
    stage's template moved by `width` per microbatch. The search takes the action in the middle
    of the rank's list, tries the next few actions of the same kind and stage as the period's
    end (`codes`: kind and stage as one int, `mbs`: the microbatches), and keeps the period
    whose run of repeating actions covers the most. Then it checks, on the event arrays
    themselves, that each window is the one before with every handle moved by the microbatch
    shift x width (the step's first backward, which creates the gradients, differs: the windows
    are the longest run that repeats exactly), and lists the `fixed` handles: those the stream
    allocates before the windows and no window names (static state, gradients kept for the
    optimizer step); they are renamed below zero in the input, so that no handle moved by any
    number of windows is one of them."""
    n = int(codes.size)
    inp = AllocatorInput(ev)
    if n < 16:
        return None, inp
    i0 = n // 2
    best = None
    cands = np.flatnonzero(codes[i0 + 1 : i0 + 1 + n // 3] == codes[i0]) + 1
    for P in cands[:_MAX_PERIOD_TRIES].tolist():
        d = int(mbs[i0 + P] - mbs[i0])
        if d <= 0:
            continue
        eq = (codes[P:] == codes[:-P]) & (mbs[P:] - mbs[:-P] == d)
        off = np.flatnonzero(~eq)
        k = int(np.searchsorted(off, i0))
        if k < off.size and off[k] == i0:
            continue
        lo = int(off[k - 1]) + 1 if k > 0 else 0
        hi = int(off[k]) if k < off.size else int(eq.size)
        count = (hi + P - lo) // P
        if count >= 3 and (best is None or count * P > best[0]):
            best = (count * P, P, d, lo, count)
    if best is None:
        return None, inp
    _, P, d, lo, count = best
    act_off = n0 + np.concatenate([[0], np.cumsum(seen)])
    start = int(act_off[lo])
    length = int(act_off[lo + P] - start)
    shift = d * width
    end = start + count * length
    if length <= 0 or end > len(inp):
        return None, inp
    h = inp.handle[start:end].reshape(count, length)
    if int(h.min()) < n0:
        return None, inp  # a static handle inside the windows: not a repetition
    sz = inp.signed[start:end].reshape(count, length)
    st = inp.stream[start:end].reshape(count, length)
    ok = (
        (sz[1:] == sz[:-1]).all(axis=1)
        & (st[1:] == st[:-1]).all(axis=1)
        & (h[1:] == h[:-1] + shift).all(axis=1)
    )
    # the longest run of windows each the one before moved: windows t0 .. t0 + run
    best_run, t0, cur = 0, 0, 0
    for u, good in enumerate(ok.tolist()):
        cur = cur + 1 if good else 0
        if cur > best_run:
            best_run, t0 = cur, u - cur + 1
    if best_run < 2:
        return None, inp
    count = best_run + 1
    start += t0 * length
    end = start + count * length
    from .allocator import Period

    before = inp.handle[:start][inp.signed[:start] > 0]
    fixed = before[~np.isin(before, inp.handle[start:end])]
    # the fixed handles are renamed below zero, so that no moved handle (all >= n0, moved up)
    # is ever one of them; handles are only names to the allocator: the result is the same
    inp.handle = np.where(np.isin(inp.handle, fixed), -1 - inp.handle, inp.handle)
    return Period(start, length, count, shift, frozenset((-1 - fixed).tolist())), inp


def _optimizer_events(job, static, created: list, base: int, weights, per_param: bool = True) -> Events:
    """The optimizer step (stages._optimizer_job): states the first step creates (two per
    parameter), its scratch (torch's foreach step makes one temporary per parameter, the
    for-loop step two of the largest one at a time: one block), then zero_grad(set_to_none)
    frees the gradients the step's first backwards created."""
    if job is None:
        return _events([])
    rows = []
    h = base
    for b in _split(static.optimizer_in_step, weights, 2):
        rows.append((1, b, h, COMPUTE))
        h += 1
    ws = job.peak_bytes - static.optimizer_in_step
    if ws > 0:
        temps = _split(ws, weights) if per_param else [ws]
        rows += [(1, b, h + i, COMPUTE) for i, b in enumerate(temps)]
        rows += [(-1, b, h + i, COMPUTE) for i, b in enumerate(temps)]
    if static.grads_in_step and job.net_bytes == static.optimizer_in_step - static.grads_in_step:
        found = sum(b for _, b in created)
        if found > static.grads_in_step:
            raise StreamNotModelled(
                f"the first backward creates {found} B of gradients, the step frees {static.grads_in_step} B"
            )
        rows += [(-1, b, h, COMPUTE) for h, b in created]
        if found < static.grads_in_step:
            # gradients the stream made under other kinds (FSDP2's root unit's reduce-scatter
            # outputs): freed last in the step, after every allocation, so which blocks they are
            # cannot change the peak reserved; the walk frees their bytes
            rows.append((-1, static.grads_in_step - found, -1, OUTSIDE))
    ev = _events(rows)
    if ev.walk() != (job.net_bytes, job.peak_bytes):
        raise StreamNotModelled(
            f"the optimizer step walks to {ev.walk()}, its job is {(job.net_bytes, job.peak_bytes)}"
        )
    return ev


def clear_caches() -> None:
    """Forget the cached event lists (tests, benchmarks)."""
    _PROGRAM_EVENTS.clear()
    _stage_stream.cache_clear()
