"""CUDA memory snapshots (`torch.cuda.memory._dump_snapshot`), read safely and replayed through the
allocator model.

Reading: a snapshot is a pickle of plain dicts, lists, strings and numbers. It is read with an
unpickler that refuses every global and persistent id, so a file that needs one (`os.system`
or any class) is refused in one line before anything in it runs. The JSON form (`.json`, or
gzip-compressed `.json.gz`) with the same keys is read too. What is used: `segments` (the
final state: address, total_size, stream, device, segment_type, is_expandable, blocks with
address, size, requested_size, state), `device_traces` (per device the events `alloc`,
`free_requested`, `free_completed`, `segment_alloc`, `segment_free`, `segment_map`,
`segment_unmap`, `oom`, each with addr, size, stream) and `allocator_settings`. A file with one
device's part of a snapshot (one trace, `source.device` naming its device) is read as that device.

Replaying (`replay_device`): the recorded allocs and frees go through `CachingAllocator` with the
snapshot's own settings, in order; the model makes its own segment events.
* A trace that starts mid-run begins from the state at its start, reconstructed from the final
  segments and the trace: the segments that existed (final ones not made in the trace, plus
  those the trace frees), the blocks live in them (those the trace frees without allocating,
  and those still allocated at the end that it never allocated; a block freed in the trace
  takes its rounded size, or its whole gap when the allocator would not have split the rest).
* Segments freed in the trace come from `release_cached_blocks` (the allocator has no other
  way with these settings). When they are followed by a new segment for the same request, a
  cudaMalloc failed: the device had room only for what the trace then reserved, and the
  model gets that limit for that request, so it runs its own release-and-retry. Otherwise
  the program called `torch.cuda.empty_cache()`, and the model does too.
* A recorded `oom` is a request that failed after the release; its `addr` field is the free
  device memory the driver reported, so the allocator's room was what it then reserved plus that
  (`oom_capacity`). A what-if replay runs under that room; without a recorded OOM the room is
  unknown (unlimited), and the cache is released where the program's allocator released it.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import zlib
from dataclasses import dataclass, field

from ..errors import UserError
from .config import AllocatorConfig
from .model import K_MIN_BLOCK, K_SMALL_BUFFER, K_SMALL_SIZE, AllocatorOOM, CachingAllocator, round_size

SEG_GROW = ("segment_alloc", "segment_map")
SEG_SHRINK = ("segment_free", "segment_unmap")
MAX_FILE_BYTES = 4 << 30
_MAX_ADDR = 1 << 60  # device addresses (48-bit today) and sizes the model's keys hold
_MAX_SIZE = 1 << 48
_SIZED = ("alloc", "free_requested", "free_completed", "oom") + SEG_GROW + SEG_SHRINK


class _RefuseGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it needs the global {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it needs a persistent id")


def load(path: str) -> dict:
    """Read a snapshot file (pickle, JSON or gzip of either); UserError in one line otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise UserError(f"snapshot {path}: cannot read it ({e.strerror or e})") from None
    return loads(raw, path)


def loads(raw: bytes, name: str = "snapshot") -> dict:
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"snapshot {name}: larger than {MAX_FILE_BYTES >> 30} GiB")
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise UserError(f"snapshot {name}: the gzip data is truncated or corrupt ({e})") from None
    head = raw.lstrip()[:1]
    if head in (b"{", b"["):
        try:
            snap = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise UserError(f"snapshot {name}: not valid JSON ({str(e)[:80]})") from None
    elif raw[:1] == b"\x80":
        try:
            snap = _RefuseGlobals(io.BytesIO(raw)).load()
        except pickle.UnpicklingError as e:
            raise UserError(
                f"snapshot {name}: refused, {e}; a memory snapshot holds only plain values"
            ) from None
        except (
            EOFError,
            ValueError,
            TypeError,
            IndexError,
            KeyError,
            AttributeError,
            OverflowError,
            MemoryError,
            RecursionError,
        ) as e:
            raise UserError(
                f"snapshot {name}: the pickle is truncated or corrupt ({type(e).__name__})"
            ) from None
    else:
        raise UserError(f"snapshot {name}: not a torch.cuda.memory._dump_snapshot pickle, nor its JSON form")
    return _one_device_extract(_check(snap, name))


def _one_device_extract(snap: dict) -> dict:
    """A file holding one device's part of a snapshot may carry its single trace at index 0 with
    `source.device` naming the device (its segments say the same): put the trace at that index,
    where torch writes it."""
    src = snap.get("source")
    dev = src.get("device") if isinstance(src, dict) else None
    traces = snap.get("device_traces") or []
    if (
        type(dev) is int
        and 0 < dev < 1024
        and len(traces) == 1
        and all(s.get("device", 0) == dev for s in snap.get("segments") or [])
    ):
        snap = dict(snap, device_traces=[[] for _ in range(dev)] + traces)
    return snap


def _check(snap, name: str) -> dict:
    if (
        not isinstance(snap, dict)
        or not isinstance(snap.get("segments", []), list)
        or not isinstance(snap.get("device_traces", []), list)
    ):
        raise UserError(
            f"snapshot {name}: expected a dict with 'segments' and 'device_traces' lists "
            "(what torch.cuda.memory._snapshot() returns)"
        )
    if "segments" not in snap and "device_traces" not in snap:
        raise UserError(f"snapshot {name}: it has neither 'segments' nor 'device_traces'")
    for t in snap.get("device_traces") or []:
        if not isinstance(t, list) or any(not isinstance(e, dict) for e in t):
            raise UserError(f"snapshot {name}: each device trace must be a list of event dicts")
        for e in t:
            a = e.get("action")
            if not isinstance(a, str):
                raise UserError(f"snapshot {name}: a trace event without an action")
            if a in _SIZED and not (
                _ints(e, ("size", "addr"), ("stream",))
                and 0 <= e["size"] < _MAX_SIZE
                and -1 <= e["addr"] < _MAX_ADDR
            ):
                raise UserError(f"snapshot {name}: a {a} event without an integer addr/size/stream in range")
    for s in snap.get("segments") or []:
        if not (
            _ints(s, ("address", "total_size"), ("device", "stream"))
            and isinstance(s.get("blocks", []), list)
        ):
            raise UserError(
                f"snapshot {name}: a segment without an integer address/total_size/device/"
                "stream, or without a blocks list"
            )
        if not (0 <= s["address"] < _MAX_ADDR and 0 <= s["total_size"] < _MAX_SIZE):
            raise UserError(f"snapshot {name}: a segment address or size out of range")
        for b in s.get("blocks") or []:
            if not (_ints(b, ("address", "size")) and 0 <= b["size"] < _MAX_SIZE):
                raise UserError(f"snapshot {name}: a block without an integer address/size")
    return snap


def _ints(d, required: tuple, optional: tuple = ()) -> bool:
    """Whether `d` is a dict with an int (not a bool) under each `required` key and under each
    `optional` key it has."""
    return (
        isinstance(d, dict)
        and all(type(d.get(k)) is int for k in required)
        and all(type(d.get(k, 0)) is int for k in optional)
    )


def devices(snap: dict) -> list[int]:
    """The devices with a non-empty trace, or with segments."""
    out = {d for d, t in enumerate(snap.get("device_traces") or []) if t}
    out |= {s.get("device", 0) for s in snap.get("segments") or []}
    return sorted(out)


def snapshot_config(snap: dict) -> AllocatorConfig:
    return AllocatorConfig.from_snapshot_settings(snap.get("allocator_settings"))


# -- what the trace recorded -------------------------------------------------------------------


@dataclass
class Recorded:
    start_reserved_bytes: int
    peak_reserved_bytes: int
    final_reserved_bytes: int
    segment_events: list
    n_final_segments: int
    ooms: int
    from_empty: bool
    final_segments: list  # sorted (size, allocated bytes) of each final segment
    expandable: bool
    n_events: int


def recorded(snap: dict, device: int) -> Recorded:
    trace = _trace(snap, device)
    segs = [s for s in snap.get("segments") or [] if s.get("device", 0) == device]
    final = sum(s["total_size"] for s in segs)
    events, cur, peak = [], 0, 0
    for e in trace:
        a = e["action"]
        if a in SEG_GROW:
            cur += e["size"]
            events.append((a, e["size"]))
        elif a in SEG_SHRINK:
            cur -= e["size"]
            events.append((a, e["size"]))
        peak = max(peak, cur)
    start = final - cur
    state = _start_state(snap, device)
    from_empty = start == 0 and not state.live and not state.segments and not state.runs
    expandable = any(s.get("is_expandable") for s in segs) or any(a == "segment_map" for a, _ in events)
    held = ("active_allocated", "active_pending_free")
    final_segs = sorted(
        (s["total_size"], sum(b["size"] for b in s.get("blocks") or [] if b.get("state") in held))
        for s in segs
    )
    ooms = sum(1 for e in trace if e["action"] == "oom")
    return Recorded(
        start, start + peak, final, events, len(segs), ooms, from_empty, final_segs, expandable, len(trace)
    )


def _trace(snap: dict, device: int) -> list:
    traces = snap.get("device_traces") or []
    return traces[device] if device < len(traces) else []


@dataclass
class _StartState:
    segments: dict = field(default_factory=dict)  # address -> (size, stream, expandable)
    live: dict = field(default_factory=dict)  # address -> (block_size or None, requested, stream)
    runs: list = field(default_factory=list)  # mapped expandable stretches:
    #                                                    [start, end, stream, small]
    alloc_at: list = field(default_factory=list)  # (address, trace index) of every alloc, sorted


_STATE_CACHE: list = []  # [(snap, device, state)]: recorded() and replay_device() share it


def _start_state(snap: dict, device: int) -> _StartState:
    for s, d, st in _STATE_CACHE:
        if s is snap and d == device:
            return st
    st = _compute_start_state(snap, device)
    _STATE_CACHE.insert(0, (snap, device, st))
    del _STATE_CACHE[4:]
    return st


def _compute_start_state(snap: dict, device: int) -> _StartState:
    trace = _trace(snap, device)
    st = _StartState()
    runs = []  # mapped stretches of expandable segments: [start, end, stream, small]
    for s in snap.get("segments") or []:
        if s.get("device", 0) != device:
            continue
        if s.get("is_expandable"):
            runs.append(
                [
                    s["address"],
                    s["address"] + s["total_size"],
                    s.get("stream", 0),
                    s.get("segment_type") == "small",
                ]
            )
        else:
            st.segments[s["address"]] = (s["total_size"], s.get("stream", 0), False)
    for e in reversed(trace):
        a = e["action"]
        if a == "segment_alloc":
            st.segments.pop(e["addr"], None)
        elif a == "segment_free":
            st.segments[e["addr"]] = (e["size"], e.get("stream", 0), False)
        elif a == "segment_map":
            runs = _cut(runs, e["addr"], e["addr"] + e["size"])
        elif a == "segment_unmap":
            near = [r for r in runs if r[2] == e.get("stream", 0)]
            small = near[0][3] if near and all(r[3] == near[0][3] for r in near) else False
            runs.append([e["addr"], e["addr"] + e["size"], e.get("stream", 0), small])
    st.runs = _merge(runs)
    live_in_trace = set()
    for n, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            live_in_trace.add(e["addr"])
            st.alloc_at.append((e["addr"], n))
        elif a == "free_requested":
            if e["addr"] in live_in_trace:
                live_in_trace.discard(e["addr"])
            elif e["addr"] not in st.live:
                st.live[e["addr"]] = (None, e["size"], e.get("stream", 0), n)
    st.alloc_at.sort()
    for s in snap.get("segments") or []:
        if s.get("device", 0) != device:
            continue
        for b in s.get("blocks") or []:
            if (
                b.get("state") in ("active_allocated", "active_pending_free")
                and b.get("address") not in live_in_trace
                and b.get("address") not in st.live
            ):
                st.live[b["address"]] = (
                    b["size"],
                    b.get("requested_size", b["size"]),
                    s.get("stream", 0),
                    None,
                )
    return st


def _cut(runs, lo, hi):
    out = []
    for a, b, stream, small in runs:
        if b <= lo or a >= hi:
            out.append([a, b, stream, small])
            continue
        if a < lo:
            out.append([a, lo, stream, small])
        if b > hi:
            out.append([hi, b, stream, small])
    return out


def _merge(runs):
    out = []
    for r in sorted(runs):
        if out and out[-1][1] == r[0] and out[-1][2:] == r[2:]:
            out[-1][1] = r[1]
        else:
            out.append(list(r))
    return out


# -- the replay --------------------------------------------------------------------------------


@dataclass
class Modelled:
    peak_reserved_bytes: int
    final_reserved_bytes: int
    allocated_at_peak_bytes: int
    peak_allocated_bytes: int
    segment_events: list
    n_final_segments: int
    ooms: int
    at_peak: dict
    notes: list
    final_segments: list = field(default_factory=list)  # sorted (size, allocated bytes)


def replay_device(
    snap: dict,
    device: int,
    config: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
    driver_addresses: bool = True,
) -> Modelled:
    """Replay one device's trace. `config` None: the snapshot's own settings, with the device
    limits the trace shows at each release-and-retry (see the module doc). A `config` given
    (a what-if) replays the same requests under it, with `capacity_bytes` as the device's room
    for the allocator (None: unlimited) and the program's own empty_cache calls kept.
    driver_addresses False: new segments get the model's own addresses, not the trace's."""
    what_if = config is not None
    cfg = config if what_if else snapshot_config(snap)
    ops, notes = _ops(snap, device, what_if)
    a, handles = _start(snap, device, cfg, capacity_bytes if what_if else None, notes, driver_addresses)
    peak_at = _run(a, ops, handles, what_if, stop=None)
    at_peak = {}
    if peak_at is not None:
        b, h2 = _start(snap, device, cfg, capacity_bytes if what_if else None, [], driver_addresses)
        _run(b, ops, h2, what_if, stop=peak_at)
        at_peak = b.cache_summary()
    # allocated when reserved first reached its peak (the request that made it included)
    alloc_at_peak = at_peak.get("allocated_bytes", a.allocated_at_peak_reserved)
    return Modelled(
        a.peak_reserved_bytes,
        a.reserved_bytes,
        alloc_at_peak,
        a.peak_allocated_bytes,
        list(a.segment_events),
        len(a.segments()),
        a.num_ooms,
        at_peak,
        notes,
        sorted((s["size"], s["allocated"]) for s in a.segments()),
    )


def _driver_addresses(snap, device):
    """cudaMalloc's addresses as the trace shows them: the model's k-th segment event, when the
    recorded k-th is a segment_alloc of the same size, gets that segment's address (addresses
    are the driver's choice; they decide ties between free blocks of equal size)."""
    seg = [e for e in _trace(snap, device) if e["action"] in SEG_GROW or e["action"] in SEG_SHRINK]
    box = {}

    def source(size):
        a = box["a"]
        k = len(a.segment_events)
        if k < len(seg) and seg[k]["action"] == "segment_alloc" and seg[k]["size"] == size:
            return seg[k]["addr"]  # the model checks that the range is free
        return None

    return source, box


def _start(snap, device, cfg, capacity, notes, driver_addresses=True):
    source, box = _driver_addresses(snap, device)
    a = CachingAllocator(cfg, capacity_bytes=capacity, address_source=source if driver_addresses else None)
    box["a"] = a
    st = _start_state(snap, device)
    handles = {}
    import bisect

    spans = [(seg, seg + size, False) for seg, (size, _, _) in st.segments.items()]
    spans += [(r[0], r[1], True) for r in st.runs]
    spans.sort()
    kept, end = [], None
    for sp in spans:  # a trace that lost events can imply overlaps: keep the first
        if end is None or sp[0] >= end:
            kept.append(sp)
            end = sp[1]
    if len(kept) < len(spans):
        notes.append(f"{len(spans) - len(kept)} segment(s) the trace implies overlap others: left out")
        keep = {sp[0] for sp in kept}
        st = _StartState(
            {k: v for k, v in st.segments.items() if k in keep},
            st.live,
            [r for r in st.runs if r[0] in keep],
            st.alloc_at,
        )
    spans = kept
    starts = [x[0] for x in spans]
    inside: dict[int, list] = {x[0]: [] for x in spans}
    for addr, info in st.live.items():
        k = bisect.bisect_right(starts, addr) - 1
        if k >= 0 and addr < spans[k][1]:
            inside[spans[k][0]].append((addr, info))

    def live_blocks(lo, hi, small):
        blocks = sorted(inside[lo])
        out = []
        for j, (addr, (bsize, req, _, freed_at)) in enumerate(blocks):
            end = blocks[j + 1][0] if j + 1 < len(blocks) else hi
            if bsize is None:
                end = min(end, _next_start(st.alloc_at, addr + round_size(req, cfg), freed_at, end))
                bsize = _block_size(req, end - addr, small, cfg)
            out.append((addr, min(bsize, end - addr), req))
        return out

    for seg in sorted(st.segments):
        size, stream, _ = st.segments[seg]
        live = live_blocks(seg, seg + size, size == K_SMALL_BUFFER)
        for (addr, _, _), h in zip(live, a.adopt_segment(seg, size, stream, live)):
            handles[addr] = h
    groups: dict = {}
    for lo, hi, stream, small in st.runs:
        groups.setdefault((stream, small), []).append((lo, hi - lo, live_blocks(lo, hi, small)))
    for (stream, small), runs in groups.items():
        hs = a.adopt_expandable(stream, small, runs)
        for (addr, _, _), h in zip([b for r in runs for b in r[2]], hs):
            handles[addr] = h
    return a, handles


def _next_start(alloc_at, lo, before, default):
    """The lowest address >= lo where the trace allocates a block before index `before`: a
    block boundary while the block at lo's left was live."""
    import bisect

    k = bisect.bisect_left(alloc_at, (lo, -1))
    best = default
    for addr, n in alloc_at[k : k + 64]:
        if addr >= best:
            break
        if n < before:
            best = addr
            break
    return best


def _block_size(requested: int, gap: int, small: bool, cfg: AllocatorConfig) -> int:
    """The size a block of `requested` bytes had when the gap up to the next known block is
    `gap`: its rounded size, or the whole gap when the rest would not have been split off."""
    size = round_size(requested, cfg)
    rest = gap - size
    if rest <= 0:
        return gap
    split = (
        rest >= K_MIN_BLOCK
        if (small or cfg.expandable_segments)
        else (rest > K_SMALL_SIZE and size < cfg.max_split_size)
    )
    return size if split else gap


def _ops(snap, device, what_if):
    """The trace as replay operations: ('alloc', addr, size, stream, limit), ('free_req', addr),
    ('free_done', addr), ('empty_cache',), ('oom', size, stream)."""
    rec = recorded(snap, device)
    level = rec.start_reserved_bytes
    ops, buf, notes = [], [], []
    for e in _trace(snap, device):
        a = e["action"]
        if a in SEG_GROW or a in SEG_SHRINK:
            buf.append(e)
            level += e["size"] if a in SEG_GROW else -e["size"]
            continue
        if a not in ("alloc", "free_requested", "free_completed", "oom"):
            continue
        shrinks = bool(buf) and any(x["action"] in SEG_SHRINK for x in buf)
        grows = shrinks and any(x["action"] in SEG_GROW for x in buf)
        limit = None
        if shrinks and a == "alloc" and grows:
            limit = level  # a failed cudaMalloc: the device had room for this much
        elif shrinks:
            ops.append(("empty_cache",))
        buf = []
        if a == "alloc":
            ops.append(("alloc", e["addr"], e["size"], e.get("stream", 0), limit))
        elif a == "free_requested":
            ops.append(("free_req", e["addr"]))
        elif a == "free_completed":
            ops.append(("free_done", e["addr"]))
        else:
            ops.append(("oom", e["size"], e.get("stream", 0)))
    if any(x["action"] in SEG_SHRINK for x in buf):
        ops.append(("empty_cache",))
    return ops, notes


def _run(a: CachingAllocator, ops, handles, what_if, stop):
    """Apply ops; returns the index of the op after which reserved peaked (or None)."""
    peak, peak_at = a.peak_reserved_bytes, None
    for n, op in enumerate(ops):
        if stop is not None and n > stop:
            break
        kind = op[0]
        if kind == "alloc":
            _, addr, size, stream, limit = op
            if limit is not None and what_if:
                # the program's allocator released its cache here; under other settings, with
                # the device's room known the model decides itself, otherwise it releases too
                if a.capacity is None or a.would_reuse(size, stream):
                    a.empty_cache()
                limit = None
            if limit is not None and a.would_reuse(size, stream):
                a.empty_cache()  # the cache was released before a request it could serve
                limit = None
            if limit is not None:
                saved, a.capacity = a.capacity, limit
                try:
                    h = a.malloc(size, stream)
                except AllocatorOOM:
                    a.capacity = None  # the model needed more room than the trace shows
                    h = a.malloc(size, stream)
                a.capacity = saved
            else:
                try:
                    h = a.malloc(size, stream)
                except AllocatorOOM:
                    continue
            handles[addr] = h
        elif kind == "free_req":
            h = handles.get(op[1])
            if h is not None and a.is_live(h):  # a trace may repeat or lose events
                a.free_requested(h)
        elif kind == "free_done":
            h = handles.pop(op[1], None)
            if h is not None and a.is_pending(h):
                a.free_completed(h)
        elif kind == "empty_cache":
            a.empty_cache()
        elif kind == "oom" and what_if:
            try:
                h = a.malloc(op[1], op[2])
                a.free(h)
            except AllocatorOOM:
                pass
        if a.peak_reserved_bytes > peak:
            peak, peak_at = a.peak_reserved_bytes, n
    return peak_at


def oom_capacity(snap: dict, device: int) -> int | None:
    """The device room the allocator had, as a recorded OOM shows it: reserved at the OOM (after
    the release) plus the free memory the driver reported (the `oom` event's addr field)."""
    level = recorded(snap, device).start_reserved_bytes
    for e in _trace(snap, device):
        a = e["action"]
        if a in SEG_GROW:
            level += e["size"]
        elif a in SEG_SHRINK:
            level -= e["size"]
        elif a == "oom":
            return level + max(0, e.get("addr", 0))
    return None
