"""Generate a part's programs (embedding, decoder layer, head) and run liveness on them.

Each part is analysed once per distinct shape (`functools.lru_cache` on a hashable key made
of the frozen ArchSpec, Shard, Convention and LayerOptions), so a 126-layer model with one
layer shape costs one analysis, and plans that share shapes share analyses.

Boundary rules of a part's programs (what is alive on entry, what must outlive them):
* F: its input is alive on entry (allocated by the previous part or the pipeline recv); it
  keeps what its backward reads and its output (the next part's input).
* B: entry = what F left alive + the output grad; it frees the saved tensors and the input
  (which this part's norm saved) and keeps the input grad.
* I / W: as B, but I also keeps what W reads (linear inputs and output grads) until W.
So F.net = saved bytes incl. its output; B.net = -(saved bytes incl. its input).

On a pipeline stage boundary the runtime owns the stage input x and the received output
grad dy (pipemem.runtime frees them): `keep_input` / `keep_out_grad` analyse a part that
never frees them (the first / last part of a stage).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..jobs import JobMemory
from ..liveness import analyze_program, touched_storages
from .chunked_loss import chunked_head_programs
from .conventions import Convention
from .layers import LayerOptions, Shard, causal_mask_tape, decoder_layer_tape, embedding_tape, head_tape


@dataclass(frozen=True, slots=True)
class PartMemory:
    F: JobMemory
    B: JobMemory
    I: JobMemory
    W: JobMemory
    input_bytes: int  # bytes of the part's input (recv buffer on a stage boundary)
    output_bytes: int  # bytes of its output
    f_peak_op: str
    b_peak_op: str
    # (B, I) hand the output grad's storage on as the input grad (a residual add)
    grad_passes_through: tuple = (False, False)
    rs_state_bytes: int = 0  # FSDP2's reduce-scatter input, alive until the next part's reduce-scatter
    bwd_gather_bytes: int = 0  # FSDP2's all-gather output buffer of a backward that starts by gathering
    # a decoder layer's FSDP2 backward all-gather (its copy-in and output buffers, both alive while
    # it runs; the tape gathers where the first parameter is needed, FSDP2's pre-backward hook
    # before any of the layer's backward runs): the layer after it in the forward prefetches it
    # (layer_prefetch: layers of unequal sizes)
    layer_gather_bytes: int = 0


@dataclass(slots=True)
class PartPrograms:
    F: object
    B: object
    I: object
    W: object
    input: str
    output: str
    results: dict
    grad_passes_through: tuple = (False, False)
    # storages holding the input's grad at the end of B and of I (what the previous part's
    # backward receives as its output grad: pipemem.alloc_stream follows it across parts)
    dx_storages: tuple = (frozenset(), frozenset())


@dataclass(frozen=True, slots=True)
class _Programs:
    """A part's four programs and the storages each backward program reads: what does not
    depend on which boundary tensors the part owns (`_results` takes those)."""

    F: object
    B: object
    I: object
    W: object
    x: str
    y: str
    out_grad_of: str
    dx_name_i: str  # the tensor holding the input's grad at the end of I
    tb: frozenset
    ti: frozenset
    tw: frozenset
    # tensors parts hand each other beyond the activations (FSDP2's root unit, tape.py): alive
    # when the forward / backward starts (made by an earlier part), or left for a later one
    f_entry: frozenset = frozenset()
    f_keep: frozenset = frozenset()
    b_entry: frozenset = frozenset()
    b_keep: frozenset = frozenset()


def _programs(tape, x: str, y: str, out_grad_of: str) -> _Programs:
    F = tape.forward("F")
    (B,) = tape.backward((out_grad_of,), name="B")
    storages = lambda prog, names: frozenset(prog.tensors[n].storage for n in names)  # noqa: E731
    b_keep = storages(B, tape.handed_on_b())
    I, W = tape.backward((out_grad_of,), name="I", split=True)
    return _Programs(
        F,
        B,
        I,
        W,
        x,
        y,
        out_grad_of,
        tape.grad_name(x),
        frozenset(touched_storages(B)),
        frozenset(touched_storages(I)),
        frozenset(touched_storages(W)),
        storages(F, tape.entry_f),
        storages(F, tape.handed_on_f),
        storages(B, tape.entry_b),
        b_keep,
    )


def _results(p: _Programs, keep_input: bool = False, keep_out_grad: bool = False) -> PartPrograms:
    F, B, I, W, x, out_grad_of = p.F, p.B, p.I, p.W, p.x, p.out_grad_of
    dx_name_i = p.dx_name_i
    st = lambda prog, n: prog.tensors[n].storage if n in prog.tensors else n  # noqa: E731
    xs = st(F, x)
    ys = st(F, p.y)
    # The input is alive on entry unless F creates it (the embedding loads its token ids).
    entry = set() if any(x in op.outputs for op in F.ops) else {xs}
    owned_x = {xs} if keep_input and entry else set()
    rf = analyze_program(F, live_on_entry=entry | p.f_entry, keep=(p.tb | p.ti) | {ys} | owned_x | p.f_keep)
    dy = st(B, "d." + out_grad_of)
    dy_i = st(I, "d." + out_grad_of)
    dx_b = {st(B, "d." + x)} if ("d." + x) in B.tensors else set()
    rb = analyze_program(
        B,
        live_on_entry=rf.live_after | {dy} | p.b_entry,
        keep=dx_b | owned_x | ({dy} if keep_out_grad else set()) | p.b_keep,
    )
    dx_i = {st(I, dx_name_i)} if dx_name_i in I.tensors else set()
    owned_i = owned_x | ({dy_i} if keep_out_grad else set())
    ri = analyze_program(
        I, live_on_entry=rf.live_after | {dy_i} | p.b_entry, keep=p.tw | dx_i | owned_i | p.b_keep
    )
    # The input grad may share storage with an output grad W still reads (a residual add
    # hands the same grad to both branches): it belongs to the previous part, W must not free it.
    rw = analyze_program(W, live_on_entry=ri.live_after, keep=dx_i | owned_i | p.b_keep)
    out = PartPrograms(F, B, I, W, x, p.y, {"F": rf, "B": rb, "I": ri, "W": rw})
    out.grad_passes_through = (bool(dx_b) and dx_b == {dy}, bool(dx_i) and dx_i == {dy_i})
    out.dx_storages = (frozenset(dx_b), frozenset(dx_i))
    return out


def _analyze(
    tape, x: str, y: str, out_grad_of: str, keep_input: bool = False, keep_out_grad: bool = False
) -> PartPrograms:
    return _results(_programs(tape, x, y, out_grad_of), keep_input, keep_out_grad)


def _part_memory(pp: PartPrograms, in_bytes: int, out_bytes: int) -> PartMemory:
    r = pp.results
    jm = lambda k: JobMemory(r[k].net_bytes, r[k].peak_bytes)  # noqa: E731
    rs = sum(t.nbytes for n, t in pp.B.tensors.items() if n.endswith("fsdp.rs_in"))
    # the backward's all-gather output buffer, when the gather is the backward's first step (a
    # layer: its pre-backward hook runs before anything of it; the head gathers after the loss)
    ag = (
        sum(t.nbytes for n, t in pp.B.tensors.items() if n.endswith("params_bwd.ag_out"))
        if (pp.B.ops and pp.B.ops[0].type.startswith("fsdp_all_gather"))
        else 0
    )
    return PartMemory(
        jm("F"),
        jm("B"),
        jm("I"),
        jm("W"),
        in_bytes,
        out_bytes,
        r["F"].peak_op_label,
        r["B"].peak_op_label,
        pp.grad_passes_through,
        rs,
        ag,
    )


@lru_cache(maxsize=64)
def _layer_programs(arch, sh: Shard, conv: Convention, opt: LayerOptions) -> _Programs:
    """A stage's first, middle and last layers of one setting are the same programs analysed
    with other boundary owners: generated once (a few in cache: a stage asks for them in a row)."""
    tape, x, y = decoder_layer_tape(arch, sh, conv, opt)
    return _programs(tape, x, y, y)


def layer_programs(
    arch,
    sh: Shard,
    conv: Convention,
    opt: LayerOptions,
    keep_input: bool = False,
    keep_out_grad: bool = False,
) -> PartPrograms:
    return _results(_layer_programs(arch, sh, conv, opt), keep_input, keep_out_grad)


def embedding_programs(arch, sh: Shard, conv: Convention, plan, tied_head: bool = False) -> PartPrograms:
    tape, ids, y = embedding_tape(arch, sh, conv, plan, tied_head)
    return _analyze(tape, ids, y, y)


def head_programs(
    arch, sh: Shard, conv: Convention, keep_input: bool = False, tied_gathered: bool = False, mtp=None
) -> PartPrograms:
    # torchtitan 0.3's ChunkedLossWrapper: its default head, and what `--loss chunked` means under
    # the torchtitan convention; the other losses (pipemem.templates.losses: torchtune's chunked
    # CE under hf, Liger's, Megatron's) and a compiled loss take the tape
    if (
        conv.framework.chunked_loss_wrapper
        and sh.loss_chunks > 1
        and sh.feat.loss in ("standard", "chunked")
        and not sh.feat.compile_loss
    ):
        F, B, W, x, y, results = chunked_head_programs(arch, sh, keep_input)
        return PartPrograms(F, B, B, W, x, y, results)
    tape, x, loss = head_tape(arch, sh, conv, tied_gathered, mtp)
    return _analyze(tape, x, loss, loss, keep_input)


def _act_bytes(sh: Shard) -> int:
    return sh.boundary_bytes


@lru_cache(maxsize=4096)
def layer_memory(
    arch,
    sh: Shard,
    conv: Convention,
    opt: LayerOptions,
    keep_input: bool = False,
    keep_out_grad: bool = False,
) -> PartMemory:
    """A decoder layer's F/B/I/W memory; `keep_input` / `keep_out_grad` when it is the first /
    last layer of a pipeline stage (the runtime owns its input and its output grad)."""
    n = _act_bytes(sh)
    pp = layer_programs(arch, sh, conv, opt, keep_input, keep_out_grad)
    pm = _part_memory(pp, n, n)
    gather = [
        t.nbytes for k, t in pp.B.tensors.items() if k.endswith(("params_bwd.ag_out", "params_bwd.ag_in"))
    ]
    if gather:
        pm = replace(pm, layer_gather_bytes=sum(gather))
    return pm


def layer_prefetch(p, nxt) -> int:
    """FSDP2 prefetches the next decoder layer's all-gather output (the one before it in the
    forward) during a layer's backward, where the tape counts the layer's own: with layers of
    unequal sizes (llama4's MoE layers interleaved with dense ones, DeepSeek's dense first
    layers) a smaller layer's backward holds the larger buffer, the difference counted here; a
    larger layer keeps its own count (the smaller one prefetched is not subtracted)."""
    if nxt is None or not (p.layer_gather_bytes and nxt.layer_gather_bytes):
        return 0
    return max(0, nxt.layer_gather_bytes - p.layer_gather_bytes)


@lru_cache(maxsize=4096)
def layer_offload_count(arch, sh: Shard, conv: Convention, opt: LayerOptions) -> int:
    """How many saved tensors the layer sends to the CPU under --activation-offload."""
    from .offload import pack_count

    tape, _, _ = decoder_layer_tape(arch, sh, conv, opt)
    return pack_count(tape)


@lru_cache(maxsize=1024)
def embedding_memory(arch, sh: Shard, conv: Convention, seq_len: int, tied_head: bool = False) -> PartMemory:
    """tied_head: the stage also holds the output layer and it shares the word embedding (one
    parameter, whose .grad the head's backward creates first: see `embedding_tape`)."""

    class _P:  # the embedding tape reads only seq_len from the plan
        pass

    p = _P()
    p.seq_len = seq_len
    return _part_memory(embedding_programs(arch, sh, conv, p, tied_head), 0, _act_bytes(sh))


@lru_cache(maxsize=1024)
def head_memory(
    arch, sh: Shard, conv: Convention, keep_input: bool = False, tied_gathered: bool = False, mtp=None
) -> PartMemory:
    """`keep_input`: the head is the first part of its stage (a last stage without layers);
    `tied_gathered`: its weight is the stage's word embedding, held gathered by the embedding's
    part (`head_tape`); `mtp`: (depths, LayerOptions) of Megatron's multi-token prediction
    block before it (`stages.mtp_of`)."""
    return _part_memory(head_programs(arch, sh, conv, keep_input, tied_gathered, mtp), _act_bytes(sh), 0)


@lru_cache(maxsize=1024)
def causal_mask_memory(sh: Shard, keep: bool) -> PartMemory:
    """A stage's causal-mask part (paddle convention without flash attention)."""
    tape, x, y = causal_mask_tape(sh, keep)
    return _part_memory(_analyze(tape, x, y, y), 0, 0)


def clear_caches() -> None:
    causal_mask_memory.cache_clear()
    layer_memory.cache_clear()
    _layer_programs.cache_clear()
    layer_offload_count.cache_clear()
    embedding_memory.cache_clear()
    head_memory.cache_clear()
