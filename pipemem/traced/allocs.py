"""Traced programs as allocation streams: the allocations and frees a traced step made, named
per (stage, microbatch) the way pipemem.alloc_stream strings a rank's stream together
(`pipemem.jobs.StageAllocs`), so the CUDA caching allocator model can say what the rank
reserves.

A traced program records every storage the step's kernels asked for with its real size (fake
tensors carry the shapes and dtypes of the real ones) and where the framework frees it:
`liveness.program_events` reads the walk behind each program's {net, peak} back as
allocations and frees, in order. Here each storage gets a handle: the stage boundary the
runtime owns gets its slot (x, y, dy, dx: `BOUNDARY`), the rest a number of the microbatch's
own. The rounding of each request is the allocator model's (pipemem.allocator), not done here.

No torch import: the traced modules hand over programs, their walks and storage names.
"""

from __future__ import annotations

from ..jobs import StageAllocs, StreamNotModelled
from ..liveness import compile_program, program_events

X, Y, DY, DX = 0, 1, 2, 3  # pipemem.alloc_stream's boundary slots of a (stage, microbatch)
SLOTS = 4
# pipemem.alloc_stream's allocator streams. FSDP2 (torch distributed/fsdp/_fully_shard/
# _fsdp_collectives.py) makes the all-gather buffer inside `all_gather_copy_in` under the
# all-gather copy-in stream and the reduce-scatter output under the reduce-scatter stream; the
# unsharded parameters (`alloc_all_gather_outputs`, in the copy-out) and the reduce-scatter
# input come from the current stream
COMPUTE, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2
_STREAM_OF_OP = {
    "all_gather_copy_in.default": ALL_GATHER,
    "_reduce_scatter_base_.default": REDUCE_SCATTER,
}  # (functional collectives, DTensor's under TP, allocate their outputs on the current stream)


def _streams(program) -> dict:
    """Storage name -> allocator stream, for the storages FSDP2's collectives make (module
    constants); the rest are the compute stream's."""
    out = {}
    for op in program.ops:
        st = _STREAM_OF_OP.get(op.type)
        if st is None:
            continue
        outs = op.outputs[-1:] if st == REDUCE_SCATTER else op.outputs  # the collective's output
        for n in outs:
            t = program.tensors.get(n)
            if t is not None:
                out[t.storage] = st
    return out


class Handles:
    """Storage names -> handles of one (stage, microbatch), boundary slots first."""

    def __init__(self, slots: dict | None = None, start: int = SLOTS):
        self.slots = dict(slots or {})  # storage name -> a fixed handle (Y, DX, a gradient)
        self.of: dict = {}  # storage name -> handle, once allocated
        self.next = start

    def new(self) -> int:
        h = self.next
        self.next += 1
        return h

    def alloc(self, name: str) -> int:
        if name in self.of:
            raise StreamNotModelled(f"storage {name} allocated twice")
        h = self.slots.get(name)
        if h is None:
            h = self.new()
        self.of[name] = h
        return h


def program_rows(program, result, handles: Handles, what: str, outside=None) -> list[tuple]:
    """(sign, bytes, handle) of one traced program's walk, an allocation on another stream than
    the compute stream with its stream fourth (`jobs.StageAllocs`). A free of a storage `handles` did not
    allocate is looked up in `outside` (name -> a ref the caller understands), else refused."""
    sign, size, sid, _ = program_events(program, result)
    names = compile_program(program).storage_names
    streams = _streams(program)
    rows: list = []
    ws = -1
    for s, b, i in zip(sign.tolist(), size.tolist(), sid.tolist()):
        if b == 0:  # nothing asked of the allocator (host-side storages, empty tensors)
            continue
        if i < 0:  # an op's workspace: allocated and freed around it
            if s > 0:
                ws = handles.new()
            rows.append((s, b, ws))
            continue
        name = names[i]
        if s > 0:
            st = streams.get(name, COMPUTE)
            rows.append((s, b, handles.alloc(name)) + ((st,) if st != COMPUTE else ()))
            continue
        h = handles.of.pop(name, None)
        if h is None:
            h = outside.get(name) if outside is not None else None
            if h is None:
                raise StreamNotModelled(f"{what} frees storage {name}, which the step allocated before it")
        rows.append((s, b, h))
    return rows


def check_slot(rows, slot: int, expected: int, what: str) -> None:
    """The boundary slot's allocation is the bytes the runtime frees for it."""
    got = [b for s, b, h in rows if s > 0 and h == slot]
    if got and got != [expected]:
        raise StreamNotModelled(f"{what}: its boundary tensor is {got[0]} B, the runtime frees {expected} B")


def one_step_allocs(programs, results, entry_sizes: list[int]) -> tuple[StageAllocs, tuple, list[int]]:
    """A whole traced step on one rank (forward, backward, optimizer programs of one recorder):
    stage 0's F and B of its one microbatch, the optimizer's rows (refs into the microbatch for
    what it frees: gradients, the loss) and the static tensors' sizes (those alive on entry)."""
    by = {p.name: (p, r) for p, r in zip(programs, results)}
    unknown = sorted(set(by) - {"forward", "backward", "optimizer"})
    if unknown:
        raise StreamNotModelled(f"the traced step has phases {', '.join(unknown)}")
    h = Handles()
    rows = {}
    for kind, phase in (("F", "forward"), ("B", "backward")):
        rows[kind] = tuple(program_rows(*by[phase], h, phase) if phase in by else ())
    opt = ()
    if "optimizer" in by:
        own = Handles()
        refs = {n: (0, k) for n, k in h.of.items()}
        opt = tuple(
            (x[0], x[1], x[2] if isinstance(x[2], tuple) else x[2] - SLOTS) + tuple(x[3:])
            for x in program_rows(*by["optimizer"], own, "the optimizer step", refs)
        )
    allocs = StageAllocs(F=rows["F"], B=rows["B"], width=h.next)
    return allocs, opt, [b for b in entry_sizes if b > 0]
