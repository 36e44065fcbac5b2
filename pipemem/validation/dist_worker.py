"""One rank of `pipemem validate dist`: build a tiny model, run one real training step over
gloo on the CPU, and measure this rank's peak from profiler allocation events.

Launched by `pipemem.validation.dist` as ``python -m pipemem.validation.dist_worker CASES OUT``
with RANK / WORLD_SIZE / MASTER_ADDR=127.0.0.1 / MASTER_PORT in the environment. CASES is a
JSON list of case dicts (see `dist.py`); every rank runs every case in order and writes one
JSON line per case to OUT.<rank>.

Ground truth: measured = the bytes alive before the step (every CPU storage
Python can reach: params, buffers, inputs) + the highest running sum of the step's
`torch.profiler` allocation events (optimizer states, pipelining buffers, activations, gloo's
copies). `measured_step` explains the two repairs that gloo's worker threads make necessary.
PIPEMEM_DIST_DEBUG=PREFIX writes each rank's event timeline to PREFIX.<rank>.tsv.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..traced.step import run_step
from .distributed.models import (
    build_ddp_module,
    build_fsdp_model,
    build_stack,
    build_tp_model,
    local_tensor,
    loss_fn,
    make_batch,
    make_mesh,
    make_optimizer,
    model_config,
    param_dtype,
    split_layers,
)

STEP_MARK = "pipemem::step"


# ---- measurement ---------------------------------------------------------------------------


def allocation_events(prof):
    """From the profile: allocation events (time ns, bytes (+alloc / -free), address, op) in
    time order, the end times of collective waits, and the (start, end) of the step mark."""
    from torch._C._profiler import _EventType

    events, waits, mark = [], [], None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        if n.typed[0] == _EventType.Allocation:  # CPU-only run: every event is host memory
            events.append(
                (n.start_time_ns, n.typed[1].alloc_size, n.typed[1].ptr, n.parent.name if n.parent else "")
            )
        elif n.name == STEP_MARK:
            mark = (n.start_time_ns, n.end_time_ns)
        elif "wait_tensor" in n.name or n.name.endswith("::wait"):
            waits.append(n.end_time_ns)
        stack.extend(n.children)
    events.sort()
    waits.sort()
    return events, waits, mark


def repair_missed_frees(events, waits=(), at_reuse: bool = False):
    """The profiler records a free only on a thread that profiles. A block whose last reference
    dies on a gloo worker thread (a collective's input, output or internal copy, held by its
    Work until the worker lets go) is freed without an event. Such a block is freed at the end
    of the first collective wait after its allocation (the Work has completed) or, if earlier,
    when its address is allocated again (the allocator cannot hand out a block in use).
    With `at_reuse` each free goes where the address is allocated again, the latest it can have
    happened: what the events prove, an upper bound of the true running sum.
    Returns the events with those frees inserted, and the bytes repaired."""
    import bisect

    live: dict[int, tuple[int, int]] = {}
    inserted, missed = [], 0

    def repair(ptr: int, size: int, t_alloc: int, t_reuse: int) -> None:
        i = bisect.bisect_right(waits, t_alloc)
        t = min(waits[i], t_reuse) if i < len(waits) and not at_reuse else t_reuse
        inserted.append((t, -size, ptr, "<free on another thread>"))

    for t, size, ptr, _op in events:
        if size > 0:
            old = live.pop(ptr, None)
            if old is not None:
                repair(ptr, old[0], old[1], t)
                missed += old[0]
            live[ptr] = (size, t)
        else:
            live.pop(ptr, None)
    # (sorted: a repaired free at the reuse time goes before the reusing allocation)
    out = sorted(events + inserted, key=lambda e: (e[0], e[1] > 0))
    return out, missed


def _running_peak(events, t0: int) -> tuple[int, int, int]:
    """(peak, its time, end) of the running sum of `events` from `t0`: what was allocated before
    `t0` and is still alive (a runtime built inside the profile, e.g. DDP's buckets) is held when
    the step starts; its transients are not counted."""
    cur = sum(sz for t, sz, _ptr, _op in events if t < t0)
    peak, peak_t = cur, t0
    for t, sz, _ptr, _op in events:
        if t < t0:
            continue
        cur += sz
        if cur > peak:
            peak, peak_t = cur, t
    return peak, peak_t, cur


def peak_from_profile(prof, baseline: int) -> dict:
    """baseline + the highest running sum of the step's allocation events, with the frees missed
    on gloo's threads repaired (`measured_bytes`), as recorded (`raw_measured_bytes`: an upper
    bound, since a missing free can only raise a running sum) and with each missed free only
    where its address is reused (`proven_measured_bytes`: what the events prove). The repair
    lowers the peak by at most the bytes it frees (`missed_free_bytes`)."""
    raw_events, waits, mark = allocation_events(prof)
    events, missed = repair_missed_frees(raw_events, waits)
    t0 = mark[0] if mark else (events[0][0] if events else 0)
    debug = os.environ.get("PIPEMEM_DIST_DEBUG")
    if debug:  # the whole allocation timeline, to compare with a trace op by op
        with open(f"{debug}.{os.environ.get('RANK', 0)}.tsv", "a") as f:
            c = baseline
            for t, sz, ptr, op in events:
                c += sz
                f.write(f"{(t - t0) / 1e6:.3f}\t{sz}\t{c}\t{op}\t{ptr}\n")
    peak, peak_t, cur = _running_peak(events, t0)
    raw_peak = _running_peak(raw_events, t0)[0]
    proven_peak = _running_peak(repair_missed_frees(raw_events, waits, at_reuse=True)[0], t0)[0]
    return {
        "measured_bytes": int(baseline + peak),
        "raw_measured_bytes": int(baseline + raw_peak),
        "proven_measured_bytes": int(baseline + proven_peak),
        "baseline_bytes": int(baseline),
        "end_bytes": int(baseline + cur),
        "missed_free_bytes": int(missed),
        "n_alloc_events": len(events),
        "peak_at_ms": (peak_t - t0) / 1e6,
    }


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of every tensor Python can reach (a DTensor counts
    its local shard): what the rank holds before the step (params, buffers, inputs...)."""
    sizes: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        t = getattr(obj, "_local_tensor", obj)
        try:
            if t.device.type != "cpu":
                continue
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        n = st.nbytes()
        if n:
            sizes[st.data_ptr()] = max(sizes.get(st.data_ptr(), 0), n)
    return sum(sizes.values())


@contextlib.contextmanager
def measured_step(result: dict, setup=None):
    """Measure the step run inside: the bytes alive before it (`live_tensor_bytes`, after a
    pause that lets gloo workers drop finished Works) plus the peak of its allocation events
    (`torch.profiler`). Fills `result`. `setup()` runs inside the profile but
    before the step (it yields its result): what it leaves allocated, e.g. DDP's buckets that
    C++ holds out of Python's reach, counts as held when the step starts."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    time.sleep(0.05)
    gc.collect()
    baseline = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ready = setup() if setup is not None else None
        with record_function(STEP_MARK):
            yield ready
    result.update(peak_from_profile(prof, baseline))


def repeated(run_once, repeat: int) -> dict:
    """Run a measurement `repeat` times (fresh model each time): gloo worker threads may hold
    a finished collective's buffers a little longer in one run than another, so the measured
    peak of a tensor-parallel step varies by a block or two; report the lowest (the program's
    own order of frees) and the spread. On a loaded machine every one of `repeat` runs can be
    late somewhere, so with repeat > 1 the runs go on (up to 2 x repeat, every rank alike) until
    each rank has measured its lowest peak twice."""
    runs = [run_once() for _ in range(max(1, repeat))]
    while 1 < repeat and len(runs) < 2 * repeat and _any_rank(_lowest_seen_once(runs)):
        runs.append(run_once())
    best = min(runs, key=lambda r: r["measured_bytes"])
    best = dict(best, measured_max_bytes=max(r["measured_bytes"] for r in runs), repeats=len(runs))
    return best


# Runs whose peaks differ by less than this differ by a few 0-dim scalars (docs/ACCURACY.md),
# not by a late-freed collective buffer (whole activation blocks, kilobytes here).
SCALAR_SLACK = 256


def _lowest_seen_once(runs: list[dict]) -> bool:
    low = min(r["measured_bytes"] for r in runs)
    return sum(r["measured_bytes"] - low < SCALAR_SLACK for r in runs) < 2


def _any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any (the ranks must run the same steps)."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ---- cases ---------------------------------------------------------------------------------


def run_pipeline(case: dict, rank: int, world: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    spec, pp, vpp, m = case["model"], case["pp"], case.get("vpp", 1), case["microbatches"]
    mb, seq = case["micro_batch"], case["seq_len"]
    cfg = model_config(spec)
    n_stages = pp * vpp
    layout = split_layers(spec["layers"], n_stages)
    sched_cls = get_schedule_class(case["schedule"])
    if world != pp:
        raise ValueError(f"pipeline case {case['name']}: world size {world} != pp {pp}")

    def once() -> dict:
        res: dict = {}
        stages, params = [], []
        from ..schedules import get_schedule

        placed = get_schedule(case["schedule"], pp, m, vpp).stages_of_rank(rank)  # placement: the schedule's
        for s in placed:
            mod = build_stack(cfg, layout[s], s == 0, s == n_stages - 1, seq, param_dtype(cfg), seed=s)
            params += list(mod.parameters())
            stages.append(PipelineStage(mod, s, n_stages, torch.device("cpu")))
        opt = make_optimizer(params)
        ids, target = make_batch(spec, mb * m, seq)
        if len(stages) == 1 and vpp == 1:
            sched = sched_cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
        else:
            sched = sched_cls(stages, n_microbatches=m, loss_fn=loss_fn)
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        dist.barrier()
        with measured_step(res):
            args = (ids,) if has_first else ()
            kw = {"target": target, "losses": []} if has_last else {}
            sched.step(*args, return_outputs=False, **kw)
            opt.step()
            opt.zero_grad(set_to_none=True)
        dist.barrier()
        return dict(
            res,
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            stages=[s.stage_index for s in stages],
        )

    return repeated(once, case.get("repeat", 1))


class SettleCollectives(TorchDispatchMode):
    """The profiler records allocator events of the main thread only. A gloo worker thread
    keeps a reference to a collective's Work (its input and output tensors) for a moment after
    completing it; if the main thread drops the tensors first, they are freed on the gloo
    thread and the free event is lost. Pausing after every wait (functional collectives'
    `_c10d_functional.wait_tensor`, from Python or from autograd's C++: hence a dispatch mode;
    and `Work.wait()`, which FSDP2 calls) lets the worker let go first, so frees happen, and
    are recorded, where the program drops the tensor; each `Work.wait()` is also marked in
    the profile as "c10d::wait" for `repair_missed_frees`. Memory semantics are unchanged;
    only timing."""

    def __init__(self, pause_s: float = 0.003):
        super().__init__()
        self.pause_s = pause_s
        self.wait = torch.ops._c10d_functional.wait_tensor.default
        self._work_wait = None

    def __enter__(self):
        from torch._C._distributed_c10d import Work
        from torch.autograd.profiler import record_function

        orig, pause = Work.wait, self.pause_s

        def wait(work, *args, **kwargs):
            with record_function("c10d::wait"):
                out = orig(work, *args, **kwargs)
            time.sleep(pause)
            return out

        self._work_wait = orig
        Work.wait = wait
        return super().__enter__()

    def __exit__(self, *exc):
        from torch._C._distributed_c10d import Work

        Work.wait = self._work_wait
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is self.wait:
            time.sleep(self.pause_s)
        return out


def run_data_model(case: dict, rank: int, world: int) -> dict:
    """One step of a TP (same batch on every rank) or FSDP (a batch per rank) model."""
    spec, seq, mb = case["model"], case["seq_len"], case["micro_batch"]
    cfg = model_config(spec)
    build = build_fsdp_model
    if case["kind"] == "tp":
        build = partial(build_tp_model, regather=case.get("regather", False))

    def once() -> dict:
        res: dict = {}
        model = build(cfg, seq, make_mesh(world), dtype=param_dtype(cfg))
        opt = make_optimizer(model.parameters())
        ids, target = make_batch(spec, mb, seq, seed=1 if case["kind"] == "tp" else 1 + rank)
        dist.barrier()
        with measured_step(res), SettleCollectives():  # the step the estimator traces (run_step)
            run_step(model, (ids,), {}, lambda out: loss_fn(out, target), opt)
        dist.barrier()
        return dict(
            res, param_bytes=sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        )

    return repeated(once, case.get("repeat", 1))


def run_ddp(case: dict, rank: int, world: int) -> dict:
    """One step of the model in DistributedDataParallel (a batch per rank). DDP is built inside
    the measurement (its Reducer's buckets are C++-held tensors `live_tensor_bytes` cannot see),
    before the step mark, so its construction's transients are not the step's. Every rank
    builds the same weights (same seed), so DDP's initial broadcast is skipped
    (`init_sync=False`): its flat copy of the parameters, held by the gloo Work, was sometimes
    freed on a gloo thread, where the profiler loses the free, reading a whole parameter copy
    high. The step itself (the forward's buffer broadcast included) is DDP's default."""
    spec, seq, mb = case["model"], case["seq_len"], case["micro_batch"]
    cfg = model_config(spec)

    def once() -> dict:
        res: dict = {}
        model = build_stack(cfg, range(cfg.num_hidden_layers), True, True, seq, param_dtype(cfg))
        opt = make_optimizer(model.parameters())
        ids, target = make_batch(spec, mb, seq, seed=1 + rank)
        mesh = make_mesh(world)
        dist.barrier()
        wrap = partial(
            build_ddp_module,
            model,
            mesh,
            case.get("bucket_view", False),
            case.get("bucket_cap_mb"),
            init_sync=False,
        )
        with SettleCollectives(), measured_step(res, setup=wrap) as ddp:
            run_step(ddp, (ids,), {}, lambda out: loss_fn(out, target), opt)
        dist.barrier()
        return dict(res, param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))

    return repeated(once, case.get("repeat", 1))


CASES = {"pp": run_pipeline, "tp": run_data_model, "fsdp": run_data_model, "ddp": run_ddp}


def main(argv: list[str]) -> int:
    cases = json.loads(open(argv[0]).read())
    out_path = argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # A short timeout: a rank whose peer died fails in minutes (the launcher kills it anyway).
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    try:
        with open(f"{out_path}.{rank}", "w") as out:
            for case in cases:
                t = time.perf_counter()
                res = CASES[case["kind"]](case, rank, world)
                res.update(name=case["name"], rank=rank, seconds=round(time.perf_counter() - t, 3))
                out.write(json.dumps(res) + "\n")
                out.flush()
                gc.collect()
                dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
