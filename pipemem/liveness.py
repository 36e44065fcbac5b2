"""Liveness over storages (layer 2 of the flow in DESIGN.md).

Rules, for one program given the storages alive on entry and those that must outlive it:

* a storage whose first touch is a write is allocated at that op, unless it is alive on
  entry; a storage first touched by a read was allocated before the program (entry);
* a storage is freed right after the op of its last touch (reads, writes and ``frees``),
  unless it is persistent (params, buffers, optimizer state) or must outlive the program;
* ``no_need_buffer`` reads do not touch;
* while an op runs, its new outputs and its workspace are live together with its inputs.

All numbers are bytes relative to the memory in use on entry. The walk is vectorised with
numpy (one pass to flatten the touches, then ufuncs): a million-op program takes under 2 s,
nearly all of it resolving tensor names (bench/bench_liveness.py); the flattened form is
cached on the program.

For a sequence of programs (forward, backward, optimizer, ...) a storage touched by program
k is retained past k if *any* later program touches it, and it is then alive on entry to
every program until its last user frees it.
"""

from __future__ import annotations

import gc
import operator
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import attrgetter
from typing import Callable, Iterable, Sequence

import numpy as np

from .ir import Program

# Touch order inside one op: its reads, then its writes, then the references it drops.
_READ, _WRITE, _FREE = 0, 1, 2
_UNTOUCHED = np.iinfo(np.int64).max
_ID = attrgetter("_id")


@dataclass(slots=True)
class CompiledProgram:
    """A program flattened to arrays: one row per storage, one entry per op."""

    storage_names: list[str]  # by id; ids that are no storage (views) are never touched
    sizes: np.ndarray  # int64 bytes per storage (largest tensor on it)
    persistent: np.ndarray  # bool per storage
    first_op: np.ndarray  # int64 op index of the first touch (-1 untouched)
    first_is_write: np.ndarray  # bool: first touch allocates
    last_op: np.ndarray  # int64 op index of the last touch (-1 untouched)
    touched: np.ndarray  # bool per storage
    workspace: np.ndarray  # int64 per op
    tensors: list = field(repr=False)  # the program's tensors, in id order
    by_name: dict = field(repr=False)  # the program's name -> tensor dict
    extra_storages: dict = field(repr=False)  # storage names no tensor is named after -> id

    def storage_id(self, name: str) -> int | None:
        """Id of the storage called `name` (storage ids are the ids of same-named tensors)."""
        t = self.by_name.get(name)
        if t is None:
            return self.extra_storages.get(name)
        i = t._id
        if not (0 <= i < len(self.tensors) and self.tensors[i] is t):
            # the id stamp was overwritten by another program sharing this tensor: restamp
            for k, u in enumerate(self.tensors):
                u._id = k
            i = t._id
        return i


def compile_program(program: Program) -> CompiledProgram:
    """Flatten `program` to arrays (cached on the program until it changes)."""
    cached = program._compiled
    if cached is None:
        # The flattening makes a few large lists and no cycles; with millions of live objects
        # around, the cyclic collector would rescan the heap several times meanwhile.
        paused = gc.isenabled()
        gc.disable()
        try:
            cached = program._compiled = _flatten(program)
        finally:
            if paused:
                gc.enable()
    return cached


def _flatten(program: Program) -> CompiledProgram:
    by_name = program.tensors
    tensors = list(by_name.values())
    n_tensors = len(tensors)
    # Ids: tensor i has id i (stamped on the tensor for the duration of this call, so a touch
    # resolves with one lookup in the program's own dict); a storage's id is the id of the
    # tensor of the same name (most tensors are their own storage), or a new id after the
    # tensors when no tensor has its name. Ids that are nobody's storage stay untouched and
    # are ignored. Per-tensor and per-touch work goes through map()/numpy: this runs over
    # millions of tensors.
    for i, t in enumerate(tensors):
        t._id = i
    names = list(by_name)
    tensor_storages = list(map(attrgetter("storage"), tensors))
    tensor_storage = np.arange(n_tensors, dtype=np.int64)
    moved = np.flatnonzero(
        ~np.fromiter(map(operator.eq, tensor_storages, names), dtype=bool, count=n_tensors)
    )
    extra: dict[str, int] = {}
    if moved.size:  # views and in-place results: their base's id
        moved_storages = [tensor_storages[i] for i in moved.tolist()]
        bases = list(map(by_name.get, moved_storages))
        if any(map(operator.is_, bases, repeat(None))):  # storages named after no tensor: new ids
            for st, base in zip(moved_storages, bases):
                if base is None and st not in extra:
                    extra[st] = len(names)
                    names.append(st)
            ids = [extra[st] if base is None else base._id for st, base in zip(moved_storages, bases)]
        else:
            ids = list(map(_ID, bases))
        tensor_storage[moved] = ids
    try:
        tensor_bytes = np.fromiter(map(attrgetter("_nbytes"), tensors), dtype=np.int64, count=n_tensors)
    except TypeError:  # a size is not cached: compute each (raises on an unknown dimension)
        tensor_bytes = np.asarray([t.nbytes for t in tensors], dtype=np.int64)
    # A storage is as large as its largest tensor (a view is never larger than its base) and
    # persistent if any tensor on it is.
    n_storages = len(names)
    sizes = np.zeros(n_storages, dtype=np.int64)
    np.maximum.at(sizes, tensor_storage, tensor_bytes)
    persistent = np.zeros(n_storages, dtype=bool)
    persistent[
        tensor_storage[np.fromiter(map(attrgetter("persistent"), tensors), dtype=bool, count=n_tensors)]
    ] = True

    ops = program.ops
    n_ops = len(ops)
    reads = list(map(attrgetter("inputs"), ops))
    if any(map(attrgetter("no_need_buffer"), ops)):
        reads = [
            op.inputs if not op.no_need_buffer else tuple(n for n in op.inputs if n not in op.no_need_buffer)
            for op in ops
        ]
    writes = list(map(attrgetter("outputs"), ops))
    frees = list(map(attrgetter("frees"), ops)) if any(map(attrgetter("frees"), ops)) else None
    op_ids = np.arange(n_ops, dtype=np.int64)
    sids, keys = [], []
    for kind, groups in ((_READ, reads), (_WRITE, writes), (_FREE, frees)):
        if groups is None:
            continue
        counts = np.fromiter(map(len, groups), dtype=np.int64, count=n_ops)
        total = int(counts.sum())
        try:
            tids = np.fromiter(
                map(_ID, map(by_name.__getitem__, chain.from_iterable(groups))), dtype=np.int64, count=total
            )
        except KeyError:
            program.validate()  # names the op and the undeclared tensor
            raise
        sids.append(tensor_storage[tids])
        keys.append(np.repeat(op_ids, counts) * 3 + kind)
    sid_all = np.concatenate(sids)
    key_all = np.concatenate(keys)

    first_key = np.full(n_storages, _UNTOUCHED, dtype=np.int64)
    last_key = np.full(n_storages, -1, dtype=np.int64)
    np.minimum.at(first_key, sid_all, key_all)
    np.maximum.at(last_key, sid_all, key_all)
    touched = last_key >= 0

    compiled = CompiledProgram(
        storage_names=names,
        sizes=sizes,
        persistent=persistent,
        first_op=np.where(touched, first_key // 3, -1),
        first_is_write=touched & (first_key % 3 == _WRITE),
        last_op=np.where(touched, last_key // 3, -1),
        touched=touched,
        workspace=np.fromiter(map(attrgetter("workspace_bytes"), ops), dtype=np.int64, count=n_ops),
        tensors=tensors,
        by_name=by_name,
        extra_storages=extra,
    )
    return compiled


@dataclass(slots=True)
class ProgramMemory:
    """What one program does to memory, relative to the bytes in use on entry."""

    name: str
    net_bytes: int
    peak_bytes: int
    peak_op: int  # index of the op at the peak (-1: empty program)
    peak_op_label: str
    live_after: frozenset[str]  # storages alive when the program ends (entry ones included)
    retained: frozenset[str]  # storages this program keeps for later programs
    during: np.ndarray = field(repr=False)  # bytes while op i runs
    after: np.ndarray = field(repr=False)  # bytes after op i
    # the walk's boundary, kept so the allocation stream can be read back (program_events)
    entry: tuple = field(repr=False, default=())
    keep: tuple = field(repr=False, default=())

    def phase_row(self) -> dict:
        """The program as a `phases` row (traced steps, the validate workers): its peak op by label."""
        return {
            **{k: getattr(self, k) for k in ("name", "net_bytes", "peak_bytes")},
            "peak_op": self.peak_op_label,
        }

    def to_dict(self) -> dict:
        return {**self.phase_row(), "peak_op_index": self.peak_op}


def analyze_program(
    program: Program, live_on_entry: Iterable[str] = (), keep: Iterable[str] = (), granularity: int = 1
) -> ProgramMemory:
    """Net change and peak of `program`.

    live_on_entry: storages already allocated when it starts (carried from earlier programs);
    keep: storages that must outlive it (later programs use them);
    granularity: round every storage up to a multiple of this many bytes (allocator blocks).
    """
    c = compile_program(program)
    n_ops = len(program.ops)
    live_on_entry = list(live_on_entry)
    entry = np.zeros(len(c.storage_names), dtype=bool)
    _mark(entry, c, live_on_entry)
    kept = c.persistent.copy()
    keep = tuple(keep)
    _mark(kept, c, keep)

    sizes = c.sizes if granularity <= 1 else -(-c.sizes // granularity) * granularity
    allocated = c.first_is_write & ~entry
    freed = c.touched & ~kept
    alloc_at = np.bincount(c.first_op[allocated], weights=sizes[allocated], minlength=n_ops).astype(np.int64)
    free_at = np.bincount(c.last_op[freed], weights=sizes[freed], minlength=n_ops).astype(np.int64)
    after = np.cumsum(alloc_at - free_at)
    during = after + free_at + c.workspace

    if n_ops:
        peak_op = int(np.argmax(during))
        peak = max(0, int(during[peak_op]))
        net = int(after[-1])
    else:
        peak_op, peak, net = -1, 0, 0
    if peak == 0:
        peak_op = -1
    names = c.storage_names
    # Only the (usually few) storages alive on entry or kept need names: no set over all.
    live_after = {n for n in live_on_entry if (i := c.storage_id(n)) is None or not freed[i]}
    live_after.update(names[i] for i in np.flatnonzero(allocated & ~freed))
    return ProgramMemory(
        name=program.name,
        net_bytes=net,
        peak_bytes=peak,
        peak_op=peak_op,
        peak_op_label=program.ops[peak_op].label if peak_op >= 0 else "",
        live_after=frozenset(live_after),
        retained=frozenset(names[i] for i in np.flatnonzero(c.touched & kept & ~c.persistent)),
        during=during,
        after=after,
        entry=tuple(live_on_entry),
        keep=keep,
    )


def program_events(program: Program, result: ProgramMemory) -> tuple[np.ndarray, ...]:
    """The allocations and frees behind `result` (an `analyze_program` of `program`), in the
    order the walk counts them: per op, the storages it allocates, its workspace (allocated and
    freed), then the storages whose last touch it is. Returns (sign +1/-1, bytes, storage id,
    op index) arrays; a workspace has storage id -1. The walk's `during[i]` is the running sum
    just after op i's workspace is allocated, so the peaks agree to the byte."""
    c = compile_program(program)
    entry = np.zeros(len(c.storage_names), dtype=bool)
    _mark(entry, c, result.entry)
    kept = c.persistent.copy()
    _mark(kept, c, result.keep)
    alloc = np.flatnonzero(c.first_is_write & ~entry)
    free = np.flatnonzero(c.touched & ~kept)
    ws = np.flatnonzero(c.workspace)
    key = np.concatenate([c.first_op[alloc] * 4, ws * 4 + 1, ws * 4 + 2, c.last_op[free] * 4 + 3])
    sign = np.concatenate(
        [
            np.ones(alloc.size, np.int64),
            np.ones(ws.size, np.int64),
            -np.ones(ws.size, np.int64),
            -np.ones(free.size, np.int64),
        ]
    )
    size = np.concatenate([c.sizes[alloc], c.workspace[ws], c.workspace[ws], c.sizes[free]])
    sid = np.concatenate([alloc, -np.ones(2 * ws.size, np.int64), free])
    order = np.argsort(key, kind="stable")
    return sign[order], size[order], sid[order], key[order] // 4


def _mark(mask: np.ndarray, c: CompiledProgram, names: Iterable[str]) -> None:
    for n in names:
        i = c.storage_id(n)
        if i is not None:
            mask[i] = True


def touched_storages(program: Program) -> set[str]:
    """Non-persistent storages whose data the program needs (persistent ones are never freed,
    so they need no retention; one created in a program is carried in `live_after`), and
    those its ops name in `retain_reads` (kept for it by earlier programs)."""
    c = compile_program(program)
    out = {c.storage_names[i] for i in np.flatnonzero(c.touched & ~c.persistent)}
    for op in program.ops:
        for n in op.retain_reads:
            t = program.tensors[n]
            if not t.persistent:
                out.add(t.storage)
    return out


def retention_sets(programs: Sequence[Program]) -> list[set[str]]:
    """For each program, the storages it touches that *any* later program touches too."""
    touched = [touched_storages(p) for p in programs]
    later: set[str] = set()
    out: list[set[str]] = [set() for _ in programs]
    for k in range(len(programs) - 1, -1, -1):
        out[k] = touched[k] & later
        later |= touched[k]
    return out


def analyze_sequence(
    programs: Sequence[Program], live_on_entry: Iterable[str] = (), granularity: int = 1
) -> list[ProgramMemory]:
    """Walk programs in order, carrying what later programs need from one to the next."""
    keep = retention_sets(programs)
    live = frozenset(live_on_entry)
    results = []
    for prog, k in zip(programs, keep):
        r = analyze_program(prog, live_on_entry=live, keep=k, granularity=granularity)
        results.append(r)
        live = r.live_after
    return results


def sequence_starts(results: Sequence[ProgramMemory]) -> list[int]:
    """The bytes above the sequence's entry when each program starts: the net bytes of the
    programs before it (each program's numbers are relative to its own start)."""
    starts, cur = [], 0
    for r in results:
        starts.append(cur)
        cur += r.net_bytes
    return starts


def sequence_peak(
    results: Sequence[ProgramMemory], counted: Callable[[str], bool] | None = None
) -> tuple[int, str]:
    """The highest bytes above the sequence's entry that a program reaches (its peak on top of
    its start) and where ("program: op"); (0, "") when none rises above the entry. `counted`
    (a program name -> bool) limits the peak to some programs, e.g. one step of two: the others
    still move the running count. The first program to reach the highest value names it."""
    peak, at = 0, ""
    for r, start in zip(results, sequence_starts(results)):
        if (counted is None or counted(r.name)) and start + r.peak_bytes > peak:
            peak, at = start + r.peak_bytes, f"{r.name}: {r.peak_op_label}"
    return peak, at
