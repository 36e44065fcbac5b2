"""Placement lives in the schedule; runtimes are lowerings of it.

* A `csv:` schedule whose placement is neither looped nor V puts its stages' parameters on
  the ranks that run them (rank 0 with stages 0, 1, 5 of 6 holds the embedding AND the head).
* For random valid schedules and layouts, the ranks' parameter bytes add up to the model's.
* The Megatron and torch runtime profiles, replayed on hand-made jobs, give the bytes derived
  by hand from megatron-core's 1F1B loop and torch.distributed.pipelining's Schedule1F1B.
"""

import os
import tempfile

from hypothesis import given, settings, strategies as st

import pipemem
from pipemem.jobs import JobMemory, StageJobs
from pipemem.replay import replay
from pipemem.runtime import lower
from pipemem.schedules import get_schedule
from pipemem.schedules.actions import Action, Schedule
from pipemem.schedules.check import check_schedule
from pipemem.schedules.csv_io import write_csv

TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 6, "tie_word_embeddings": False}


def _forward_then_backward(stage_rank: list[int], pp: int, m: int) -> Schedule:
    """Every rank: the F of its stages in stage order for each microbatch, then the Bs in
    reverse: valid for any placement (each rank follows the global stage order)."""
    S = len(stage_rank)
    ranks = [[] for _ in range(pp)]
    for i in range(m):
        for s in range(S):
            ranks[stage_rank[s]].append(Action("F", s, i))
    for i in range(m):
        for s in reversed(range(S)):
            ranks[stage_rank[s]].append(Action("B", s, i))
    sched = Schedule("custom", pp, S // pp, m, ranks, stage_rank=stage_rank, placement="custom")
    check_schedule(sched)
    return sched


def _estimate_with(sched: Schedule, **plan):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "custom.csv")
        write_csv(sched, path)
        return pipemem.estimate(dict(TINY, num_hidden_layers=plan.pop("layers", 6)), pp=sched.pp, vpp=sched.vpp,
                                microbatches=sched.microbatches, schedule=f"csv:{path}", **plan)


def test_custom_placement_puts_embedding_and_head_on_the_rank_that_runs_them():
    sched = _forward_then_backward([0, 0, 1, 1, 1, 0], pp=2, m=2)
    est = _estimate_with(sched, convention="torchtitan", dtype="fp32")
    r0, r1 = est.ranks
    assert r0.stages == [0, 1, 5] and r1.stages == [2, 3, 4]
    h, v = TINY["hidden_size"], TINY["vocab_size"]
    embedding_and_head = (v * h + h + v * h) * 4          # embedding, final norm, output layer (fp32)
    assert r0.static.params - r1.static.params == embedding_and_head


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_rank_parameters_add_up_to_the_model(data):
    pp = data.draw(st.integers(1, 4), "pp")
    vpp = data.draw(st.integers(1, 3), "vpp") if pp > 1 else 1
    S = pp * vpp
    layers = data.draw(st.integers(S, S + 6), "layers")
    cuts = sorted(data.draw(st.lists(st.integers(0, layers), min_size=S - 1, max_size=S - 1), "cuts"))
    layout = [b - a for a, b in zip([0] + cuts, cuts + [layers])]
    owners = [r for r in range(pp) for _ in range(vpp)]
    stage_rank = data.draw(st.permutations(owners), "placement")
    sched = _forward_then_backward(list(stage_rank), pp, m=data.draw(st.integers(1, 3), "m"))
    est = _estimate_with(sched, layers=layers, pp_layout=layout, convention="torchtitan", dtype="fp32",
                         master_weights=False)
    arch = est.arch
    assert sum(r.static.params for r in est.ranks) == 4 * arch.param_count()
    for r in est.ranks:
        assert sorted(r.stages) == sorted(s for s in range(S) if stage_rank[s] == r.pp_rank)


def _toy_stages():
    # stage 0 (first): F keeps 90 of its own + its output y (10); B frees the 90.
    # stage 1 (last): F keeps 50; B frees them and makes the input grad dx (10).
    s0 = StageJobs(0, F=JobMemory(100, 120), B=JobMemory(-90, 5), output_bytes=10, output_grad_bytes=10)
    s1 = StageJobs(1, F=JobMemory(50, 60), B=JobMemory(-40, 15), input_bytes=10, input_grad_bytes=10)
    return {0: s0, 1: s1}


def _walk(sched, runtime):
    low = lower(sched, runtime)
    res = replay(low, _toy_stages(), [0, 0], simulate_time=False)
    return [[str(a) for a in acts] for acts in low.ranks], res


def test_megatron_1f1b_holds_what_its_loop_variables_hold():
    acts, res = _walk(get_schedule("1F1B", 2, 3), "megatron")
    assert acts[0] == ["F0@s0", "FREE_Y0@s0", "F1@s0", "FREE_Y1@s0", "RECV_B0@s0", "B0@s0", "F2@s0", "FREE_Y2@s0",
                       "RECV_B1@s0", "FREE_DY0@s0", "B1@s0", "RECV_B2@s0", "FREE_DY1@s0", "B2@s0", "FREE_DY2@s0"]
    assert acts[1] == ["RECV_F0@s1", "F0@s1", "B0@s1", "FREE_Y0@s1", "RECV_F1@s1", "FREE_X0@s1", "F1@s1", "B1@s1",
                       "FREE_Y1@s1", "FREE_DX0@s1", "RECV_F2@s1", "FREE_X1@s1", "F2@s1", "B2@s1", "FREE_Y2@s1",
                       "FREE_DX1@s1", "FREE_X2@s1", "FREE_DX2@s1"]
    after0 = [e for _, _, _, e in res.ranks[0].timeline]
    assert after0 == [100, 90, 190, 180, 190, 100, 200, 190, 200, 190, 100, 110, 100, 10, 0]
    assert res.ranks[0].peak_allocated_bytes == 220 and res.ranks[0].peak_at == "F2@s0"
    after1 = [e for _, _, _, e in res.ranks[1].timeline]
    assert after1 == [10, 60, 20, 20, 30, 20, 70, 30, 30, 20, 30, 20, 70, 30, 30, 20, 10, 0]
    assert res.ranks[1].peak_allocated_bytes == 85 and res.ranks[1].peak_at == "B1@s1"
    assert res.ranks[0].final_bytes == res.ranks[1].final_bytes == 0


def test_torch_1f1b_keeps_sends_until_its_variables_are_reassigned():
    acts, res = _walk(get_schedule("1F1B", 2, 3), "torch")
    assert acts[0] == ["RECV_B0@s0", "RECV_B1@s0", "RECV_B2@s0", "F0@s0", "F1@s0", "B0@s0", "F2@s0", "B1@s0",
                       "FREE_Y1@s0", "FREE_Y0@s0", "B2@s0", "FREE_Y2@s0"]
    after0 = [e for _, _, _, e in res.ranks[0].timeline]
    assert after0 == [10, 20, 30, 130, 230, 140, 240, 150, 140, 130, 40, 30]
    assert res.ranks[0].peak_allocated_bytes == 260
    # the receive buffers stay: 30 bytes of output-grad buffers after the step
    assert res.ranks[0].final_bytes == 30
