"""The parts that make `pipemem plan` cheaper hold what they claim: an estimate makes no reference
cycle (so the search can pause the cyclic collector), the caches shared between plans give what
a fresh computation gives, and the search's listing is the same with and without them."""

from __future__ import annotations

import gc
import importlib
import itertools
import json
import random

import pytest

import pipemem
from pipemem.outside_allocator import outside_allocator
from pipemem.planner import SpaceOptions, Target, search_plans
from pipemem.planner.hardware import speeds_for
from pipemem.presets import gpu_info

E = importlib.import_module("pipemem.estimate")
ST = importlib.import_module("pipemem.stages")
PLAN = dict(tp=2, pp=4, vpp=2, microbatches=8, seq_len=1024, gpu="rtx3090", dist_opt=True, dp=2)


def test_an_estimate_is_freed_without_the_cyclic_collector():
    plan = dict(PLAN, micro_batch=2, microbatches=4)
    # the layer programs analysed once (a cache of each distinct shard's parts, which may hold
    # a cycle of its own: one per distinct shard, not per estimate)
    pipemem.estimate("llama3.2-1b", **plan)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        # the plan's estimate, stage plan and replay made afresh
        E._FAST.clear()
        E._REPLAYED.clear()
        ST._STAGE_PLANS.clear()
        est = pipemem.estimate("llama3.2-1b", **plan)
        assert len(est.ranks) == 4
        rank = est.ranks[1]
        del est
        assert gc.collect() == 0  # nothing was left for the collector: no cycle
        # a rank read after its estimate is gone still finds its reserved bytes
        again = pipemem.estimate("llama3.2-1b", **plan)
        assert rank.peak_reserved_bytes == again.ranks[1].peak_reserved_bytes > 0
    finally:
        if was:
            gc.enable()


def test_reserved_warning_reaches_the_estimate_once():
    """The ranks' shared source holds its estimate weakly, and still adds its warning to it (to
    the list the estimate holds when a rank is read, once)."""
    est = pipemem.estimate("llama3.2-1b", **dict(PLAN, convention="paddle", dist_opt=None))
    est.warnings = ["given first"] + list(est.warnings)  # as `pipemem estimate` does
    assert [r.peak_reserved_bytes for r in est.ranks] == [None] * 4
    said = [w for w in est.warnings if w.startswith("reserved memory is not modelled for this plan")]
    assert len(said) == 1 and est.warnings[0] == "given first"


@pytest.mark.parametrize("seed", range(3))
def test_shared_outside_allocator_is_the_ranks_own(seed):
    """Plans alike in their group sizes share each rank's OutsideAllocator: it is what
    outside_allocator gives for that plan and rank."""
    rng = random.Random(seed)
    combos = list(itertools.product((1, 2, 4), (1, 2), (1, 2, 4), (1, 2)))
    for tp, cp, pp, dp in rng.sample(combos, 6):
        kw = dict(tp=tp, cp=cp, pp=pp, dp=dp, seq_len=2048, microbatches=2 * pp, gpu="h100-80g")
        for mb in (1, 2):
            est = pipemem.estimate("llama3.2-1b", **kw, micro_batch=mb)
            for r in est.ranks:
                assert r.outside == outside_allocator(est.plan, True, r.pp_rank, "9.0")


def test_stage_jobs_shared_between_plans_are_fresh_ones():
    """The stage jobs a plan reads from the per-shard memo (filled by other plans) equal those
    built with every cache cleared."""
    plans = [
        dict(PLAN, recompute="full", recompute_layers=2),
        dict(PLAN, dp=4, recompute="full", recompute_layers=2),
        dict(PLAN, recompute="full"),
        dict(PLAN, pp=2, vpp=4, recompute="selective", grads="set-to-none", dist_opt=None),
    ]
    warm = [pipemem.estimate("llama3.2-1b", **p) for p in plans]
    ST.clear_caches()
    E._FAST.clear()
    E._REPLAYED.clear()
    for p, a in zip(plans, warm):
        ST.clear_caches()
        b = pipemem.estimate("llama3.2-1b", **p)
        sa, sb = a.reserved_inputs[0], b.reserved_inputs[0]
        assert sa.to_dict() == sb.to_dict()
        assert sa.first_backward == sb.first_backward
        assert [r.peak_allocated_bytes for r in a.ranks] == [r.peak_allocated_bytes for r in b.ranks]


def test_cost_model_and_estimate_share_the_schedule():
    from pipemem.planner.cost import schedule_for
    from pipemem.sources import schedule_of

    est = pipemem.estimate("llama3.2-1b", **dict(PLAN, schedule="interleaved-1f1b"))
    p = est.plan
    assert schedule_for(p.schedule, p.pp, p.microbatches, p.vpp) is schedule_of(p)


def test_search_restores_the_collector_and_lists_as_with_it_on():
    """The search pauses the cyclic collector and gives it back as it was; with the collector on
    throughout (the search run under its default thresholds), the listing is the same."""
    target = Target(8, gpu_info("rtx3090")["bytes"], 0, speeds_for("rtx3090"), gpu="rtx3090")
    opts = SpaceOptions(micro_batches=(1, 2), max_vpp=2)
    import pipemem.planner.search as S

    assert gc.isenabled()
    a = search_plans("llama3.2-1b", target, 2048, 32, opts)
    assert gc.isenabled()
    paused = S._fewer_collections
    S._fewer_collections = _collector_on
    try:
        ST.clear_caches()
        E._FAST.clear()
        E._REPLAYED.clear()
        b = search_plans("llama3.2-1b", target, 2048, 32, opts)
    finally:
        S._fewer_collections = paused
    assert a.plans and json.dumps([p.to_dict() for p in a.plans]) == json.dumps(
        [p.to_dict() for p in b.plans]
    )
    assert a.stats.estimates == b.stats.estimates


class _collector_on:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("seed", range(4))
def test_replay_on_integers_walks_as_on_python_numbers(seed):
    """The integer replay (levels over all ranks in a row, each rank's less what came before)
    gives what the walk on Python numbers (each rank's levels from zero) gives."""
    from fractions import Fraction

    from pipemem.jobs import JobMemory, StageJobs
    from pipemem.replay import replay
    from pipemem.runtime import lower
    from pipemem.schedules import get_schedule

    rng = random.Random(seed)
    name, pp, m, vpp = rng.choice([("1F1B", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2), ("ZB-H1", 3, 6, 1)])
    sched = lower(get_schedule(name, pp, m, vpp=vpp), "megatron" if name != "ZB-H1" else "torch")
    ints, fracs = {}, {}
    for s in range(pp * vpp):
        f, b = rng.randint(0, 90), rng.randint(-90, 0)
        i, w = rng.randint(-40, 40), rng.randint(-50, 0)
        peaks = [rng.randint(90, 200) for _ in range(4)]
        io = [rng.randint(1, 9) for _ in range(4)]
        for out, one in ((ints, int), (fracs, Fraction)):
            out[s] = StageJobs(
                s,
                F=JobMemory(one(f), one(peaks[0])),
                B=JobMemory(one(b), one(peaks[1])),
                I=JobMemory(one(i), one(peaks[2])),
                W=JobMemory(one(w), one(peaks[3])),
                input_bytes=io[0],
                output_bytes=io[1],
                input_grad_bytes=io[2],
                output_grad_bytes=io[3],
            )
    statics = [rng.randint(0, 1000) for _ in range(pp)]
    a = replay(sched, ints, statics, simulate_time=False)
    b = replay(sched, fracs, statics, simulate_time=False)
    assert a.ranks[0]._net.dtype != object and b.ranks[0]._net.dtype == object
    for x, y in zip(a.ranks, b.ranks):
        assert (x.peak_allocated_bytes, x.peak_at, x.peak_action_index) == (
            y.peak_allocated_bytes,
            y.peak_at,
            y.peak_action_index,
        )
        assert (x.activation_hwm_bytes, x.final_bytes) == (y.activation_hwm_bytes, y.final_bytes)


@pytest.mark.parametrize(
    "name, pp, m, vpp, runtime",
    [("1F1B", 4, 8, 1, "megatron"), ("interleaved-1f1b", 4, 8, 2, "megatron"), ("ZB-H1", 3, 6, 1, "torch")],
)
def test_inflight_from_codes_counts_as_the_walk(name, pp, m, vpp, runtime):
    from pipemem.replay import _codes, _inflight_from_codes, inflight_counts
    from pipemem.runtime import lower
    from pipemem.schedules import get_schedule

    sched = lower(get_schedule(name, pp, m, vpp=vpp), runtime)
    walked = inflight_counts(sched)  # the action walk (cached on the schedule)
    sched.cache.pop("inflight")
    codes, bounds = _codes(sched)
    assert _inflight_from_codes(sched, codes, bounds) == walked
    assert max(walked) > 1
