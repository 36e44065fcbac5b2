"""One rank of `pipemem validate dist`: build a tiny model, run one real training step over
gloo on the CPU, and measure this rank's peak from profiler allocation events.

Launched by `pipemem.validate.dist` as ``python -m pipemem.validate.dist_worker CASES OUT``
with RANK / WORLD_SIZE / MASTER_ADDR=127.0.0.1 / MASTER_PORT in the environment. CASES is a
JSON list of case dicts (see `dist.py`); every rank runs every case in order and writes one
JSON line per case to OUT.<rank>.

Ground truth (FINDINGS.md §4): the profiler is started *before* the model is built, so every
byte the case owns (params, optimizer states, pipelining buffers, activations) appears as an
allocation event; the measured peak is the running sum of those events, taken over the
window of the training step.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ..traced.step import run_step
from ..distributed.models import (build_fsdp_model, build_stack, build_tp_model, local_tensor, loss_fn,
                                  make_batch, make_mesh, make_optimizer, model_config, split_layers, stage_ids_of_rank)

STEP_MARK = "pipemem::step"


# ---- measurement ---------------------------------------------------------------------------

def peak_from_profile(prof) -> dict:
    """Running sum of allocation events; peak over the step window (record_function mark)."""
    from torch._C._profiler import _EventType
    allocs, marks = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        if n.typed[0] == _EventType.Allocation:
            allocs.append((n.start_time_ns, n.typed[1].alloc_size))  # CPU-only run: all host
        elif n.name == STEP_MARK:
            marks.append((n.start_time_ns, n.end_time_ns))
        stack.extend(n.children)
    allocs.sort()
    t0, t1 = marks[0] if marks else (allocs[0][0], allocs[-1][0])
    cur = 0
    at_start = None
    peak = 0
    peak_t = t0
    for t, sz in allocs:
        if t >= t0 and at_start is None:
            at_start = cur
            peak = cur
        cur += sz
        if t0 <= t <= t1 and cur > peak:
            peak, peak_t = cur, t
    return {"measured_bytes": int(peak), "step_start_bytes": int(at_start or 0),
            "end_bytes": int(cur), "n_alloc_events": len(allocs), "peak_at_ms": (peak_t - t0) / 1e6}


def profiled(fn):
    """Run fn(mark) under the memory profiler; fn wraps its step in `mark()`."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        info = fn(lambda: record_function(STEP_MARK))
    res = peak_from_profile(prof)
    res.update(info or {})
    return res


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
    group = None

    def body(mark):
        stages, params = [], []
        for s in stage_ids_of_rank(case["schedule"], rank, pp, vpp):
            mod = build_stack(cfg, layout[s], s == 0, s == n_stages - 1, seq, seed=s)
            params += list(mod.parameters())
            stages.append(PipelineStage(mod, s, n_stages, torch.device("cpu"), group=group))
        opt = make_optimizer(params)
        ids, target = make_batch(spec, mb * m, seq)
        if len(stages) == 1 and vpp == 1:
            sched = sched_cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
        else:
            sched = sched_cls(stages, n_microbatches=m, loss_fn=loss_fn)
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        dist.barrier(group=group)
        with mark():
            args = (ids,) if has_first else ()
            kw = {"target": target, "losses": []} if has_last else {}
            sched.step(*args, return_outputs=False, **kw)
            opt.step()
            opt.zero_grad(set_to_none=True)
        dist.barrier(group=group)
        return {"param_bytes": sum(p.numel() * p.element_size() for p in params),
                "stages": [s.stage_index for s in stages]}

    return profiled(body)


def run_data_model(case: dict, rank: int, world: int) -> dict:
    """One step of a TP (same batch on every rank) or FSDP (a batch per rank) model."""
    spec, seq, mb = case["model"], case["seq_len"], case["micro_batch"]
    cfg = model_config(spec)
    build = build_tp_model if case["kind"] == "tp" else build_fsdp_model

    def body(mark):
        model = build(cfg, seq, make_mesh(world))
        opt = make_optimizer(model.parameters())
        ids, target = make_batch(spec, mb, seq, seed=1 if case["kind"] == "tp" else 1 + rank)
        dist.barrier()
        with mark():   # the same step the estimator traces (pipemem.traced.step.run_step)
            run_step(model, (ids,), {}, lambda out: loss_fn(out, target), opt)
        dist.barrier()
        return {"param_bytes": sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())}

    return profiled(body)


CASES = {"pp": run_pipeline, "tp": run_data_model, "fsdp": run_data_model}


def main(argv: list[str]) -> int:
    cases = json.loads(open(argv[0]).read())
    out_path = argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
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
