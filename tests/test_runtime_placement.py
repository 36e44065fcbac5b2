"""Placement lives in the schedule; runtimes are lowerings of it.

* A `csv:` schedule whose placement is neither looped nor V puts its stages' parameters on
  the ranks that run them (rank 0 with stages 0, 1, 5 of 6 holds the embedding AND the head).
* For random valid schedules and layouts, the ranks' parameter bytes add up to the model's.
* The Megatron and torch runtime profiles, replayed on hand-made jobs, give the bytes derived
  by hand from megatron-core's 1F1B loop and torch.distributed.pipelining's Schedule1F1B.
"""

import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

import pipemem
from pipemem.jobs import JobMemory, StageJobs
from pipemem.replay import replay
from pipemem.runtime import lower
from pipemem.schedules import get_schedule
from pipemem.schedules.actions import Action, Schedule
from pipemem.schedules.check import check_schedule
from pipemem.schedules.csv_io import write_csv

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "num_hidden_layers": 6,
    "tie_word_embeddings": False,
}


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
        return pipemem.estimate(
            dict(TINY, num_hidden_layers=plan.pop("layers", 6)),
            pp=sched.pp,
            vpp=sched.vpp,
            microbatches=sched.microbatches,
            schedule=f"csv:{path}",
            **plan,
        )


def test_custom_placement_puts_embedding_and_head_on_the_rank_that_runs_them():
    sched = _forward_then_backward([0, 0, 1, 1, 1, 0], pp=2, m=2)
    est = _estimate_with(sched, convention="torchtitan", dtype="fp32")
    r0, r1 = est.ranks
    assert r0.stages == [0, 1, 5] and r1.stages == [2, 3, 4]
    h, v = TINY["hidden_size"], TINY["vocab_size"]
    embedding_and_head = (v * h + h + v * h) * 4  # embedding, final norm, output layer (fp32)
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
    est = _estimate_with(
        sched, layers=layers, pp_layout=layout, convention="torchtitan", dtype="fp32", master_weights=False
    )
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
    assert acts[0] == [
        "F0@s0",
        "FREE_Y0@s0",
        "F1@s0",
        "FREE_Y1@s0",
        "RECV_B0@s0",
        "B0@s0",
        "F2@s0",
        "FREE_Y2@s0",
        "RECV_B1@s0",
        "FREE_DY0@s0",
        "B1@s0",
        "RECV_B2@s0",
        "FREE_DY1@s0",
        "B2@s0",
        "FREE_DY2@s0",
    ]
    assert acts[1] == [
        "RECV_F0@s1",
        "F0@s1",
        "B0@s1",
        "FREE_Y0@s1",
        "RECV_F1@s1",
        "FREE_X0@s1",
        "F1@s1",
        "B1@s1",
        "FREE_Y1@s1",
        "FREE_DX0@s1",
        "RECV_F2@s1",
        "FREE_X1@s1",
        "F2@s1",
        "B2@s1",
        "FREE_Y2@s1",
        "FREE_DX1@s1",
        "FREE_X2@s1",
        "FREE_DX2@s1",
    ]
    after0 = [e for _, _, _, e in res.ranks[0].timeline]
    assert after0 == [100, 90, 190, 180, 190, 100, 200, 190, 200, 190, 100, 110, 100, 10, 0]
    assert res.ranks[0].peak_allocated_bytes == 220 and res.ranks[0].peak_at == "F2@s0"
    after1 = [e for _, _, _, e in res.ranks[1].timeline]
    assert after1 == [10, 60, 20, 20, 30, 20, 70, 30, 30, 20, 30, 20, 70, 30, 30, 20, 10, 0]
    assert res.ranks[1].peak_allocated_bytes == 85 and res.ranks[1].peak_at == "B1@s1"
    assert res.ranks[0].final_bytes == res.ranks[1].final_bytes == 0


def test_torch_1f1b_keeps_sends_until_its_variables_are_reassigned():
    acts, res = _walk(get_schedule("1F1B", 2, 3), "torch")
    assert acts[0] == [
        "RECV_B0@s0",
        "RECV_B1@s0",
        "RECV_B2@s0",
        "F0@s0",
        "F1@s0",
        "B0@s0",
        "F2@s0",
        "B1@s0",
        "FREE_Y1@s0",
        "FREE_Y0@s0",
        "B2@s0",
        "FREE_Y2@s0",
    ]
    after0 = [e for _, _, _, e in res.ranks[0].timeline]
    assert after0 == [10, 20, 30, 130, 230, 140, 240, 150, 140, 130, 40, 30]
    assert res.ranks[0].peak_allocated_bytes == 260
    # the receive buffers stay: 30 bytes of output-grad buffers after the step
    assert res.ranks[0].final_bytes == 30


def test_megatron_interleaved_follows_its_loop():
    # Rank 1 of VPP, pp 2, vpp 2 (stages 1 and 3; 3 is the last), 2 microbatches: every
    # microbatch in warm-up. Derived from forward_backward_pipelining_with_interleaving:
    # recv_forward before the loop; each warm-up forward receives the next forward's input
    # and then frees its output's data (the last stage has none); every backward pops its x
    # (and dy), which go when it returns, keeps dx in input_tensor_grad until the next
    # backward returns, and receives the next backward's dy after it.
    low = lower(get_schedule("VPP", 2, 2, 2), "megatron")
    assert [str(a) for a in low.ranks[1]] == [
        "RECV_F0@s1",
        "F0@s1",
        "RECV_F1@s1",
        "FREE_Y0@s1",
        "F1@s1",
        "RECV_F0@s3",
        "FREE_Y1@s1",
        "F0@s3",
        "RECV_F1@s3",
        "F1@s3",
        "B0@s3",
        "FREE_Y0@s3",
        "FREE_X0@s3",
        "B1@s3",
        "FREE_Y1@s3",
        "FREE_X1@s3",
        "FREE_DX0@s3",
        "RECV_B0@s1",
        "B0@s1",
        "FREE_X0@s1",
        "FREE_DY0@s1",
        "FREE_DX1@s3",
        "RECV_B1@s1",
        "B1@s1",
        "FREE_X1@s1",
        "FREE_DY1@s1",
        "FREE_DX0@s1",
        "FREE_DX1@s1",
    ]


def test_every_lowering_frees_what_it_holds_by_the_end():
    # Megatron and Paddle hold nothing past the step; torch keeps its receive buffers and
    # what V placement hands over locally.
    from pipemem.schedules.actions import MEMORY_KINDS

    for name, pp, m, v in (
        ("VPP", 4, 8, 2),
        ("1F1B", 4, 8, 1),
        ("ZBVZeroBubble", 2, 4, 2),
        ("InterleavedZeroBubble", 2, 4, 2),
    ):
        sched = get_schedule(name, pp, m, v)
        for runtime in ("megatron", "paddle"):
            for acts in lower(sched, runtime).ranks:
                held = {}
                for a in acts:
                    what, sign = MEMORY_KINDS.get(a.kind, (None, 0))
                    if a.kind in ("F", "B", "I"):  # made by the job: y by F, dx by B / I
                        what, sign = ("output_bytes", 1) if a.kind == "F" else ("input_grad_bytes", 1)
                        if (a.kind == "F" and a.stage == sched.num_stages - 1) or (
                            a.kind != "F" and a.stage == 0
                        ):
                            continue
                    if what:
                        key = (what, a.stage, a.microbatch)
                        held[key] = held.get(key, 0) + sign
                # the last stage's FREE_Y frees its (zero-byte) loss, made by F but not counted above
                assert {
                    k: n for k, n in held.items() if n and not (k[0] == "output_bytes" and n < 0)
                } == {}, (name, runtime)


def test_torch_runtime_keeps_the_step_state_and_adds_the_batch():
    # torchtitan: gradients created by the first backward (set-to-none) stay accounted; the
    # torch runtime adds the step's token ids and labels to every pipeline rank
    est = pipemem.estimate(
        TINY, convention="torchtitan", pp=2, microbatches=4, seq_len=64, grads="set-to-none"
    )
    # beside the batch, torchtitan 0.3's rope cache in each of the rank's 3 attentions:
    # complex64 [seq 64, head_dim 16 / 2]
    rope_caches = 3 * 64 * (16 // 2) * 8
    for r in est.ranks:
        assert r.static.grads_in_step > 0
        assert r.static.other == 2 * 8 * 4 * 64 + rope_caches
