"""The CPU allocator's events, as PyTorch's profiler records them (`profile_memory=True`), turned
into the bytes a process holds over time: what the validate targets that run a framework's own
step on the CPU measure (deepspeed_trace, hf_trainer_trace).

Ranges named `MARK + "step1"`, `MARK + "step2"` (and `MARK + "step2.forward"` / `.backward` /
`.step` where a target marks phases) delimit the steps; `Timeline.measure` reports the bytes alive
when step 2 starts, its peak and where. `gc_storages` is the independent count of what the garbage
collector reaches.
"""

from __future__ import annotations

import gc

PHASES = ("forward", "backward", "step")
MARK = "pipemem_ds:"


class Timeline:
    """The profiler's allocator events (each with its pointer and the operator it ran in) in time
    order, with the ranges of the marked phases."""

    def __init__(self, prof):
        res = prof.profiler.kineto_results
        self.mem = []  # (ns, ptr, signed bytes, op)
        stack = list(res.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if str(e.tag).endswith("Allocation"):
                f = e.extra_fields
                if f.device.type == "cpu":
                    self.mem.append(
                        (e.start_time_ns, f.ptr, f.alloc_size, e.parent.name if e.parent else "", e.start_tid)
                    )
        self.mem.sort(key=lambda t: t[0])
        self.marks = {
            e.name()[len(MARK) :]: (e.start_ns(), e.end_ns())
            for e in res.events()
            if e.name().startswith(MARK)
        }

    def phase_of(self, ts: int) -> str:
        for name in PHASES:
            s, e = self.marks.get("step2." + name, (0, -1))
            if s <= ts <= e:
                return name
        return "between"

    def measure(self, event_bytes: int, reached: dict | None = None) -> dict:
        """Bytes alive when step 2 starts, step 2's peak and where, each phase's peak, step 2's large
        allocations. The profiler sees the allocator only on threads it profiles: a tensor freed on
        another thread (a gloo worker dropping the last reference of a collective's buffer) leaves
        no event. Such a free shows as a new allocation at a pointer still alive (`missed_frees`:
        the old one is taken as freed there), and, with `reached` (data_ptr -> bytes of the storages
        the garbage collector reaches when step 2 starts), as an allocation alive then that no
        tensor holds: dropped there (`reconciled_bytes`, `reconciled`). The other way round, a storage the
        collector reaches that no event shows alive was allocated where the profiler does not look
        (before it started, or on such a thread): `unseen_reached_bytes`, so that
        `static_bytes + unseen_reached_bytes` is what the collector reaches."""
        s1, e1 = self.marks["step1"]
        s2, e2 = self.marks["step2"]
        live, cur = {}, 0
        static = end1 = None
        peak, peak_ev = -1, None
        phase_peaks, events, missed = {}, [], 0
        static_live = {}
        self.missed, self.reconciled = [], []
        for ts, ptr, nbytes, op, tid in self.mem:
            if static is None and ts >= s2:
                if reached is not None:
                    gone = [p for p in live if p not in reached]
                    self.reconciled = sorted(
                        ((live[p][0], live[p][1], self.where(live[p][2])) for p in gone), reverse=True
                    )
                    for p in gone:
                        cur -= live.pop(p)[0]
                static, static_live = cur, dict(live)
            if end1 is None and ts > e1:
                end1 = cur
            if nbytes > 0:
                if ptr in live:
                    missed += 1
                    self.missed.append(
                        (
                            live[ptr][0],
                            live[ptr][1],
                            self.where(live[ptr][2]),
                            live[ptr][3],
                            tid,
                            self.where(ts),
                        )
                    )
                    cur -= live[ptr][0]
                live[ptr] = (nbytes, op, ts, tid)
            elif ptr in live:
                live.pop(ptr)
            else:
                continue
            cur += nbytes
            if s2 <= ts <= e2:
                ph = self.phase_of(ts)
                phase_peaks[ph] = max(phase_peaks.get(ph, 0), cur)
                if cur > peak:
                    peak, peak_ev = cur, (ph, op)
                if abs(nbytes) >= event_bytes:
                    events.append({"phase": ph, "bytes": nbytes, "live_after": cur, "op": op})
        if static is None:
            static, static_live = cur, dict(live)
        self.static_live, self.end_live = static_live, live
        return {
            "static_bytes": static,
            "peak_bytes": max(peak, static),
            "peak_at": f"{peak_ev[0]}: {peak_ev[1]}" if peak_ev else "",
            "peak_phase": peak_ev[0] if peak_ev else "",
            "live_after_step1": end1,
            "live_after_step2": cur,
            "phase_peaks": phase_peaks,
            "missed_frees": missed,
            "reconciled_bytes": sum(r[0] for r in self.reconciled),
            "reconciled": [{"bytes": b, "op": op, "during": w} for b, op, w in self.reconciled[:6]],
            "unseen_reached_bytes": sum(b for p, b in (reached or {}).items() if p not in static_live),
            "events": events,
        }

    def unreached_at_end(self, reached: set) -> int:
        """Bytes the running count holds at the end that no tensor reached by gc holds (0 when
        every free was seen)."""
        return sum(b for p, (b, *_) in self.end_live.items() if p not in reached)

    def where(self, ts: int) -> str:
        inside = [(e - s, name) for name, (s, e) in self.marks.items() if s <= ts <= e]
        return min(inside)[1] if inside else ""


def gc_storages() -> dict:
    """data_ptr -> bytes of the distinct storages of every tensor (and nn.Parameter) the garbage
    collector reaches."""
    import torch

    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                st = obj.untyped_storage()
                if st.nbytes():
                    seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - a half-built object: skip it
            continue
    return seen


def profiled_run(prof, case: dict, reached_at_step2: dict, reached_at_end: dict) -> dict:
    """What a profiled two-step run measured: `Timeline.measure` (step 2's allocations of at least
    the case's `event_bytes` listed, default 256 KiB) and `unreached_at_end_bytes`.
    `reached_at_step2` / `reached_at_end` are `gc_storages()` taken then."""
    tl = Timeline(prof)
    return {
        **tl.measure(case.get("event_bytes", 1 << 18), reached_at_step2),
        "unreached_at_end_bytes": tl.unreached_at_end(set(reached_at_end)),
    }
