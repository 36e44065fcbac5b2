"""The per-rank action walker of `pipemem validate cuda`, run on CPU with tiny modules.

Expectations come from outside the walker: plain autograd on the unsplit model (gradients),
the pipeline literature (1F1B holds min(m, p - r) microbatches on rank r), and hand-written
action lists.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pipemem.errors import UserError  # noqa: E402
from pipemem.validation.stage_emulation import Action, RankEmulator, normalize_actions, stages_of_rank  # noqa: E402

HIDDEN, BATCH, VOCAB = 8, 3, 11


class Embed(torch.nn.Module):  # stage 0: token ids -> hidden
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids):
        return torch.tanh(self.lin(self.emb(ids)))


class Middle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h):
        return torch.tanh(self.lin(h)) + h


class Head(torch.nn.Module):  # last stage: hidden -> scalar loss
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, h):
        return torch.nn.functional.cross_entropy(self.lin(h), torch.arange(BATCH) % VOCAB)


def make_stages(n: int, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [Embed()] + [Middle() for _ in range(n - 2)] + [Head()]


def tokens(mb: int) -> torch.Tensor:
    return (torch.arange(BATCH) * (mb + 2)) % VOCAB


def recv_spec(stage: int):
    return (BATCH, HIDDEN), torch.float32


def emulator(stage_modules: dict, num_stages: int, **kw) -> RankEmulator:
    return RankEmulator(stage_modules, num_stages, tokens, recv_spec, device="cpu", **kw)


def grads(modules) -> list[torch.Tensor]:
    return [p.grad.clone() for m in modules for p in m.parameters()]


def reference_grads(modules, microbatches: int) -> list[torch.Tensor]:
    """Plain autograd through the unsplit model, summed over microbatches."""
    for m in modules:
        m.zero_grad(set_to_none=True)
    for mb in range(microbatches):
        h = tokens(mb)
        for m in modules:
            h = m(h)
        h.backward()
    return grads(modules)


def one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    """1F1B as the papers describe it: p - r - 1 warm-up forwards, then one forward and one
    backward alternately, then the remaining backwards."""
    warm = min(pp - rank - 1, m)
    acts = [Action("F", rank, i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            acts.append(Action("F", rank, f))
            f += 1
        acts.append(Action("B", rank, b))
        b += 1
    return acts


# Gradients: an all-local pipeline is the unsplit model ------------------------------------


def test_all_stages_on_one_rank_give_the_unsplit_gradients():
    mods = make_stages(4)
    want = reference_grads(mods, 3)
    for m in mods:
        m.zero_grad(set_to_none=True)
    acts = [Action("F", s, mb) for mb in range(3) for s in range(4)]
    acts += [Action("B", s, mb) for mb in range(3) for s in reversed(range(4))]
    run = emulator(dict(enumerate(mods)), 4).run(acts)
    got = grads(mods)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
    assert run.received_activations == [] and run.received_grads == []  # everything local
    assert run.sent_activations == 0 and run.sent_grads == 0
    assert run.max_held_forwards == 12


def test_split_backward_gives_the_same_gradients_as_full_backward():
    mods = make_stages(3)
    want = reference_grads(mods, 2)
    for m in mods:
        m.zero_grad(set_to_none=True)
    acts = [Action("F", s, mb) for mb in range(2) for s in range(3)]
    acts += [Action("I", s, mb) for mb in range(2) for s in reversed(range(3))]
    emu = emulator(dict(enumerate(mods)), 3)
    # Before any W, no weight gradient of a non-first stage exists.
    emu.run(acts + [Action("W", s, mb) for mb in range(2) for s in range(3)])
    got = grads(mods)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))


def test_input_pass_leaves_weight_grads_to_the_weight_pass():
    mods = make_stages(3)
    for m in mods:
        m.zero_grad(set_to_none=True)
    seen = {}

    def probe():
        seen[len(seen)] = mods[2].lin.weight.grad is None
        return 0

    acts = [
        Action("F", 0, 0),
        Action("F", 1, 0),
        Action("F", 2, 0),
        Action("I", 2, 0),
        Action("I", 1, 0),
        Action("I", 0, 0),
        Action("W", 2, 0),
        Action("W", 1, 0),
        Action("W", 0, 0),
    ]
    run = emulator(dict(enumerate(mods)), 3, probe=probe).run(acts)
    assert seen[3] is True and seen[6] is False  # after 2I0: none; after 2W0: there
    assert [r.held_weight_grads for r in run.records] == [0, 0, 0, 1, 2, 3, 2, 1, 0]


# One rank of a real pipeline: receives at true shapes, sends dropped ------------------------


@pytest.mark.parametrize("pp,m", [(4, 6), (4, 2), (2, 5)])
def test_1f1b_holds_min_m_p_minus_r_microbatches(pp, m):
    for rank in range(pp):
        mods = make_stages(pp)
        run = emulator({rank: mods[rank]}, pp).run(one_f_one_b(rank, pp, m))
        assert run.max_held_forwards == min(m, pp - rank)
        # Every forward of a non-first stage receives its input; every backward of a
        # non-last stage receives its output gradient; the rest is sent and dropped.
        assert len(run.received_activations) == (m if rank > 0 else 0)
        assert len(run.received_grads) == (m if rank < pp - 1 else 0)
        assert run.sent_activations == (m if rank < pp - 1 else 0)
        assert run.sent_grads == (m if rank > 0 else 0)
        assert all(
            shape == (BATCH, HIDDEN) and dtype == "torch.float32"
            for _, _, shape, dtype in run.received_activations + run.received_grads
        )
        assert all(p.grad is not None for p in mods[rank].parameters())


def test_v_schedule_turnaround_is_local_on_the_last_rank():
    # pp=2, V placement: rank 1 holds stages 1 and 2; stage 2's input is stage 1's output.
    assert stages_of_rank(1, 2, 2, "v") == [1, 2]
    mods = make_stages(4)
    acts = [
        Action("F", 1, 0),
        Action("F", 2, 0),
        Action("I", 2, 0),
        Action("I", 1, 0),
        Action("W", 2, 0),
        Action("W", 1, 0),
    ]
    run = emulator({1: mods[1], 2: mods[2]}, 4).run(acts)
    assert [s for s, *_ in run.received_activations] == [1]  # stage 2 received nothing
    # stage 2's output grad comes from stage 3 (remote); stage 1's from stage 2 (local)
    assert [s for s, *_ in run.received_grads] == [2]
    assert run.sent_grads == 1 and run.sent_activations == 1


def test_torch_schedules_run_on_every_rank():
    pipelining = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    pp, m = 2, 4
    for name, vpp, style in (
        ("Interleaved1F1B", 2, "loop"),
        ("ZBVZeroBubble", 2, "v"),
        ("DualPipeV", 2, "v"),
    ):
        per_rank = pipelining.get_schedule_ops(name, pp, m, num_stages_per_rank=vpp)
        for rank, acts in enumerate(per_rank):
            mods = make_stages(pp * vpp)
            owned = stages_of_rank(rank, pp, vpp, style)
            run = emulator({s: mods[s] for s in owned}, pp * vpp).run(acts)
            computes = normalize_actions(acts)
            assert {a.stage for a in computes} == set(owned)
            assert len([a for a in computes if a.kind == "F"]) == vpp * m
            assert all(p.grad is not None for s in owned for p in mods[s].parameters())
            assert len(run.records) == len(computes)


# Action spellings ------------------------------------------------------------------------


def test_normalize_reads_torch_actions_and_expands_overlap():
    from torch.distributed.pipelining.schedules import _Action
    from torch.distributed.pipelining.schedules import _ComputationType as CT

    acts = [
        None,
        _Action(0, CT.FORWARD, 1),
        _Action(0, CT.SEND_F, 1),
        _Action(3, CT.OVERLAP_F_B, None, (_Action(0, CT.FORWARD, 2), _Action(3, CT.FULL_BACKWARD, 0))),
        _Action(3, CT.BACKWARD_INPUT, 1),
        _Action(3, CT.BACKWARD_WEIGHT, 1),
        ("b", 2, 5),
    ]
    assert normalize_actions(acts) == [
        Action("F", 0, 1),
        Action("F", 0, 2),
        Action("B", 3, 0),
        Action("I", 3, 1),
        Action("W", 3, 1),
        Action("B", 2, 5),
    ]


def test_unreadable_action_is_a_user_error():
    with pytest.raises(UserError, match="compute action"):
        normalize_actions([("X", 0, 0)])


# Schedules that cannot run are reported, not crashed on ------------------------------------


@pytest.mark.parametrize(
    "acts,match",
    [
        ([Action("B", 0, 0)], "without a pending forward"),
        ([Action("F", 0, 0)], "without a finished backward"),
        ([Action("F", 0, 0), Action("F", 0, 0)], "runs twice"),
        ([Action("F", 0, 0), Action("W", 0, 0)], "without its input-gradient pass"),
        ([Action("F", 1, 0)], "not on this rank"),
    ],
)
def test_bad_schedules_are_user_errors(acts, match):
    mods = make_stages(2)
    with pytest.raises(UserError, match=match):
        emulator({0: mods[0]}, 2).run(acts)


def test_local_handover_before_the_producer_is_an_error():
    mods = make_stages(2)
    with pytest.raises(UserError, match="before the forward of stage 0"):
        emulator({0: mods[0], 1: mods[1]}, 2).run([Action("F", 1, 0)])


def test_stage_placement():
    assert stages_of_rank(1, 4, 2) == [1, 5]
    assert stages_of_rank(0, 4, 2, "v") == [0, 7]
    with pytest.raises(UserError):
        stages_of_rank(4, 4, 1)


# Memory: what a rank holds after each action, counted by a live-storage tracker ---------------


class LiveStorages:
    """Bytes of the distinct tensor storages alive that were created while the mode was active
    (a TorchDispatchMode seeing every op's outputs, a weakref finalizer per storage)."""

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        tracker = self
        self.live = 0
        self.seen = seen = WeakIdKeyDictionary()

        def free(n):
            tracker.live -= n

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.ops.aten.lift_fresh.default:
                    return out  # a Python constant made a tensor (torch internals keep one), not data
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        if st not in seen:
                            seen[st] = weakref.finalize(st, free, st.nbytes())
                            tracker.live += st.nbytes()
                return out

        self.mode = Mode()

    def ignore(self, *tensors):
        """Storages that exist already (parameters): never counted, even when an op views them."""
        for t in tensors:
            self.seen[t.untyped_storage()] = None


def test_1f1b_middle_rank_holds_three_tensors_per_microbatch_and_drops_sends():
    # Middle stage: y = tanh(h W^T + b) + h. Kept for backward per microbatch: the received h
    # (read by the matmul's backward), tanh's result, and the output y (kept until the
    # microbatch's backward, as the pipelining runtime does): 3 * b * hidden fp32 values.
    pp, rank, m = 3, 1, 4
    per_mb = 3 * BATCH * HIDDEN * 4
    grads_bytes = (HIDDEN * HIDDEN + HIDDEN) * 4
    mods = make_stages(pp)
    tracker = LiveStorages()
    tracker.ignore(*mods[rank].parameters())
    emu = emulator({rank: mods[rank]}, pp, probe=lambda: tracker.live)
    acts = one_f_one_b(rank, pp, m)
    with tracker.mode:
        run = emu.run(acts)
    before, first_b = 0, True
    for rec in run.records:
        delta = rec.bytes_after - before
        if rec.action.kind == "F":
            assert delta == per_mb, rec.action
        else:
            # The received output gradient and the sent input gradient are both gone after B;
            # the first B also allocates the weight gradients.
            assert delta == -per_mb + (grads_bytes if first_b else 0), rec.action
            first_b = False
        before = rec.bytes_after
    # The high-water mark: min(m, p - r) microbatches held, once weight gradients exist (m > p - r).
    assert max(r.bytes_after for r in run.records) == min(m, pp - rank) * per_mb + grads_bytes
    assert run.records[-1].bytes_after == grads_bytes


def test_split_backward_keeps_what_the_runtime_keeps_until_w():
    # Same middle stage. After I (stage_backward_input), until W the runtime keeps: the input h
    # and its gradient (h.grad), the detached output y, the received output gradient, and the
    # gradient at the linear's output captured for dW (tanh's result is freed with y's graph):
    # 5 tensors of b * hidden fp32 values. W frees them all and adds the weight gradients.
    unit = BATCH * HIDDEN * 4
    grads_bytes = (HIDDEN * HIDDEN + HIDDEN) * 4
    mods = make_stages(3)
    tracker = LiveStorages()
    tracker.ignore(*mods[1].parameters())
    emu = emulator({1: mods[1]}, 3, probe=lambda: tracker.live)
    acts = [
        Action("F", 1, 0),
        Action("F", 1, 1),
        Action("I", 1, 0),
        Action("W", 1, 0),
        Action("I", 1, 1),
        Action("W", 1, 1),
    ]
    with tracker.mode:
        run = emu.run(acts)
    assert [r.bytes_after for r in run.records] == [
        3 * unit,
        6 * unit,
        8 * unit,
        3 * unit + grads_bytes,
        5 * unit + grads_bytes,
        grads_bytes,
    ]


def test_every_pipeline_case_of_the_matrix_walks_on_every_rank():
    """The action lists `validate cuda` will run on a GPU, walked here with tiny stages: every
    rank finishes its step, runs m forwards per stage it holds, and 1F1B ranks hold
    min(m, p - r) microbatches."""
    from pipemem.validation.cuda import rank_actions
    from pipemem.validation.cuda_cases import get_cases

    cases = [c for c in get_cases("full") + get_cases("small") if c.pp > 1]
    assert cases
    # Precision and attention do not change the action lists: one case per schedule shape.
    for case in {(c.schedule, c.pp, c.vpp, c.microbatches): c for c in cases}.values():
        mods = make_stages(case.num_stages)
        owned_all = []
        for rank in range(case.pp):
            acts, owned, _ = rank_actions(case, rank)
            owned_all += owned
            run = emulator({s: mods[s] for s in owned}, case.num_stages).run(acts)
            fwd = [r.action for r in run.records if r.action.kind == "F"]
            assert sorted((a.stage, a.microbatch) for a in fwd) == sorted(
                (s, m) for s in owned for m in range(case.microbatches)
            ), case.name
            if case.schedule == "1F1B":
                assert run.max_held_forwards == min(case.microbatches, case.pp - rank), case.name
        assert sorted(owned_all) == list(range(case.num_stages)), case.name
