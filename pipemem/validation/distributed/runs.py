"""pipemem's per-rank estimate of the runs `pipemem validate dist` makes (a case dict: kind
pp / tp / fsdp, the model dict, micro_batch, seq_len, and for pp: schedule, pp, vpp,
microbatches). Every number comes from fake-tensor traces walked by liveness, plus the
pipelining runtime model; nothing is read from the real run."""

from __future__ import annotations

from functools import lru_cache
import json

from .models import split_layers, stage_ids_of_rank

SPLIT_BACKWARD = ("zbvzerobubble", "interleavedzerobubble", "dualpipev")
INT64 = 8


def estimate_case(case: dict) -> list[dict]:
    """[{rank, estimated_bytes, peak_at, static_bytes, ...}] for every rank of the case."""
    if case["kind"] == "pp":
        return estimate_pipeline(case)
    from .fake_ranks import trace_parallel_rank
    world = case["world"]
    out = []
    for r in range(world):
        t = trace_parallel_rank(case["kind"], case["model"], case["micro_batch"], case["seq_len"], r, world,
                                regather=case.get("regather", False))
        out.append({"rank": r, "estimated_bytes": t["peak_bytes"], "peak_at": t["peak_at"],
                    "static_bytes": t["static_bytes"]})
    return out


@lru_cache(maxsize=256)
def _stage_jobs(model_json: str, stage: int, num_stages: int, layers: tuple, mb: int, seq: int, split: bool):
    from .pipeline_jobs import trace_stage_jobs
    return trace_stage_jobs(json.loads(model_json), stage, num_stages, list(layers), mb, seq, split_backward=split)


def estimate_pipeline(case: dict) -> list[dict]:
    from .pipeline_jobs import trace_optimizer
    from .pipeline_runtime import replay_rank
    spec, pp, vpp, m = case["model"], case["pp"], case.get("vpp", 1), case["microbatches"]
    mb, seq, schedule = case["micro_batch"], case["seq_len"], case["schedule"]
    n = pp * vpp
    layout = split_layers(spec["layers"], n)
    split = schedule.lower() in SPLIT_BACKWARD
    key = json.dumps(spec, sort_keys=True)
    jobs = {s: _stage_jobs(key, s, n, tuple(layout[s]), mb, seq, split) for s in range(n)}
    inputs = 2 * mb * m * seq * INT64          # token ids and targets (every rank builds them)
    out = []
    for r in range(pp):
        stages = stage_ids_of_rank(schedule, r, pp, vpp)
        opt, buffers = trace_optimizer(spec, {s: layout[s] for s in stages}, n, seq)
        static = sum(jobs[s].param_bytes for s in stages) + buffers + inputs
        res = replay_rank(schedule, pp, vpp, m, r, stages, jobs, static, opt)
        out.append({"rank": r, "estimated_bytes": res.peak_bytes, "peak_at": res.peak_at,
                    "static_bytes": static, "recv_buffer_bytes": res.recv_buffer_bytes,
                    "stages": stages})
    return out
