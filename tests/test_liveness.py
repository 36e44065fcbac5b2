"""Liveness engine: exact bytes on hand-derived programs, and properties on random ones."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipemem.errors import UserError
from pipemem.ir import Op, Program, Tensor
from pipemem.liveness import analyze_program, analyze_sequence, retention_sets


def make(name, tensors, ops):
    p = Program(name)
    for t in tensors:
        p.add_tensor(t)
    for op in ops:
        p.add_op(op)
    return p


def act(name, n, **kw):
    """A 1-D fp32 activation of n elements (4n bytes)."""
    return Tensor(name, (n,), "fp32", **kw)


def test_reuse_after_free():
    # a (400 B) -> b (800 B) -> c (400 B): a dies after op 1, so c reuses its space.
    p = make(
        "f",
        [act("x", 10), act("a", 100), act("b", 200), act("c", 100)],
        [Op("f", ("x",), ("a",)), Op("g", ("a",), ("b",)), Op("h", ("b",), ("c",))],
    )
    r = analyze_program(p)
    # x (40 B) is an input alive on entry; it dies after op 0.
    assert list(r.during) == [400, 400 - 40 + 800, 800 - 40 + 400]
    assert r.peak_bytes == 1160 and r.peak_op == 1  # first op reaching the peak
    assert r.net_bytes == -40  # everything freed, including the input


def test_view_keeps_base_alive():
    base = act("base", 100)
    view = Tensor("view", (10, 10), "fp32", storage="base")
    p = make(
        "f",
        [act("x", 1), base, view, act("y", 50), act("z", 1)],
        [
            Op("make", ("x",), ("base",)),
            Op("reshape", ("base",), ("view",)),
            Op("other", ("x",), ("y",)),
            Op("use_view", ("view", "y"), ("z",)),
        ],
    )
    r = analyze_program(p)
    # The view costs nothing, and the base's 400 B live until the view's last use (op 3).
    assert list(r.during) == [400, 400, 600, 604 - 4]  # x (4 B) freed after op 2
    assert r.peak_bytes == 600


def test_inplace_costs_nothing():
    p = make(
        "f",
        [act("x", 100), Tensor("x_relu", (100,), "fp32", storage="x"), act("y", 100)],
        [Op("relu_", ("x",), ("x_relu",)), Op("copy", ("x_relu",), ("y",))],
    )
    r = analyze_program(p, keep={"y"})
    assert list(r.during) == [0, 400]
    assert r.net_bytes == 0  # x freed (400) after op 1, y kept (400)


def test_no_need_buffer_does_not_extend_life():
    # A shape-only read of `big` at op 2 must not keep its 4000 B alive.
    p = make(
        "f",
        [act("x", 1), act("big", 1000), act("s", 1), act("t", 1)],
        [
            Op("make", ("x",), ("big",)),
            Op("use", ("big",), ("s",)),
            Op("zeros_like", ("big", "s"), ("t",), no_need_buffer=("big",)),
        ],
    )
    r = analyze_program(p, keep={"t"})
    assert list(r.after) == [4000 - 4, 4000 - 4 + 4 - 4000, 0]  # big freed right after op 1
    assert r.peak_bytes == 4000


def test_multi_output_op():
    p = make(
        "f",
        [act("x", 10), act("out", 100), act("lse", 5), act("y", 10)],
        [Op("attention", ("x",), ("out", "lse")), Op("proj", ("out",), ("y",))],
    )
    r = analyze_program(p, keep={"y"})
    # Both outputs are allocated together; lse is never read so it dies right away.
    assert r.during[0] == 420 and r.after[0] == 420 - 40 - 20
    assert r.peak_bytes == 420


def test_workspace_counts_only_inside_the_op():
    p = make("f", [act("x", 10), act("y", 10)], [Op("gemm", ("x",), ("y",), workspace_bytes=1000)])
    r = analyze_program(p, keep={"y"})
    assert r.peak_bytes == 1040 and r.net_bytes == 0


def test_forward_tensor_used_by_non_adjacent_program():
    # fwd makes `keep_me`, bwd ignores it, opt reads it: it must stay alive through bwd.
    t = {n: act(n, k) for n, k in [("x", 1), ("keep_me", 100), ("g", 10), ("o", 1)]}
    fwd = make("forward", [t["x"], t["keep_me"]], [Op("f", ("x",), ("keep_me",))])
    bwd = make("backward", [t["g"]], [Op("b", (), ("g",))])
    opt = make("optimizer", [t["keep_me"], t["g"], t["o"]], [Op("step", ("keep_me", "g"), ("o",))])
    assert retention_sets([fwd, bwd, opt]) == [{"keep_me"}, {"g"}, set()]
    rf, rb, ro = analyze_sequence([fwd, bwd, opt])
    assert rf.net_bytes == 400 - 4  # x is freed, keep_me kept
    assert "keep_me" in rb.live_after
    assert rb.net_bytes == 40
    # optimizer: o (4 B) allocated; keep_me (400) and g (40) were carried in and now die
    assert ro.peak_bytes == 4 and ro.net_bytes == 4 - 4 - 400 - 40


def test_persistent_created_in_program_is_never_freed():
    # Lazily created optimizer state: allocated where created, never freed.
    p = make(
        "opt",
        [Tensor("w", (10,), "fp32", "param"), Tensor("m", (10,), "fp32", "optimizer_state")],
        [Op("init_state", ("w",), ("m",))],
    )
    r = analyze_program(p)
    assert r.net_bytes == 40 and r.peak_bytes == 40


def test_unknown_dimension_is_an_error_naming_the_tensor():
    p = make("f", [Tensor("act_q", (None, 128), "bf16"), act("y", 1)], [Op("f", ("act_q",), ("y",))])
    with pytest.raises(UserError, match="act_q"):
        analyze_program(p)


def test_symbolic_dimension_bound_or_explicit_bytes():
    from pipemem.ir import resolve_dims

    p = make(
        "f",
        [Tensor("h", ("batch", 128), "bf16"), Tensor("z", (None,), "fp32", bytes=64)],
        [Op("f", (), ("h",)), Op("g", ("h",), ("z",))],
    )
    resolve_dims([p], {"batch": 3})
    r = analyze_program(p, keep={"z"})
    assert r.peak_bytes == 3 * 128 * 2 + 64


def test_empty_program():
    r = analyze_program(Program("empty"))
    assert (r.net_bytes, r.peak_bytes, r.peak_op) == (0, 0, -1)


def test_granularity_rounds_each_storage():
    p = make(
        "f", [act("x", 1), act("y", 1), act("z", 200)], [Op("f", ("x",), ("y",)), Op("g", ("y",), ("z",))]
    )
    r = analyze_program(p, keep={"z"}, granularity=512)
    # x is an input: 512 rounded, freed after op 0; y 512; z 800 -> 1024.
    assert list(r.during) == [512, 1024 + 512 - 512]
    assert r.net_bytes == 1024 - 512


# --- random programs ------------------------------------------------------------------------


def reference_walk(program, live_on_entry=(), keep=()):
    """A deliberately simple, op-by-op reimplementation of the rules in liveness.py."""
    storage_of = {n: t.storage for n, t in program.tensors.items()}
    size = {}
    for t in program.tensors.values():
        size[t.storage] = max(size.get(t.storage, 0), t.nbytes)
    persistent = {t.storage for t in program.tensors.values() if t.persistent}
    last = {}
    for i, op in enumerate(program.ops):
        for n in [x for x in op.inputs if x not in op.no_need_buffer] + list(op.outputs) + list(op.frees):
            last[storage_of[n]] = i
    live = set(live_on_entry)
    seen = set(live_on_entry)
    cur = peak = 0
    during = []
    for i, op in enumerate(program.ops):
        for n in op.inputs:
            if n not in op.no_need_buffer:
                s = storage_of[n]
                if s not in seen:  # first touch is a read: it was there on entry
                    seen.add(s)
                    live.add(s)
        for n in op.frees:
            s = storage_of[n]
            if s not in seen:
                seen.add(s)
                live.add(s)
        for n in op.outputs:
            s = storage_of[n]
            if s not in seen:
                seen.add(s)
                live.add(s)
                cur += size[s]
        during.append(cur + op.workspace_bytes)
        peak = max(peak, cur + op.workspace_bytes)
        for s, li in last.items():
            if li == i and s not in persistent and s not in keep and s in live:
                live.discard(s)
                cur -= size[s]
    return cur, peak, during


@st.composite
def random_program(draw):
    n_tensors = draw(st.integers(1, 12))
    tensors = []
    for i in range(n_tensors):
        kind = draw(st.sampled_from(["activation", "activation", "temp", "grad", "param", "optimizer_state"]))
        n = draw(st.integers(0, 50))
        storage = f"t{draw(st.integers(0, i))}" if draw(st.booleans()) and i > 0 else f"t{i}"
        tensors.append(
            Tensor(f"t{i}", (n,), draw(st.sampled_from(["fp32", "bf16", "bool"])), kind, storage=storage)
        )
    names = [t.name for t in tensors]
    ops = []
    for _ in range(draw(st.integers(0, 15))):
        ins = tuple(draw(st.lists(st.sampled_from(names), max_size=3, unique=True)))
        outs = tuple(draw(st.lists(st.sampled_from(names), max_size=2, unique=True)))
        nnb = tuple(x for x in ins if draw(st.booleans()) and draw(st.booleans()))
        frees = tuple(draw(st.lists(st.sampled_from(names), max_size=1)))
        ops.append(
            Op("op", ins, outs, no_need_buffer=nnb, frees=frees, workspace_bytes=draw(st.integers(0, 30)))
        )
    entry = draw(st.lists(st.sampled_from([t.storage for t in tensors]), max_size=3, unique=True))
    keep = draw(st.lists(st.sampled_from([t.storage for t in tensors]), max_size=3, unique=True))
    return make("rand", tensors, ops), entry, keep


@given(random_program())
def test_matches_reference_walk(case):
    prog, entry, keep = case
    r = analyze_program(prog, live_on_entry=entry, keep=keep)
    net, peak, during = reference_walk(prog, entry, keep)
    assert (r.net_bytes, r.peak_bytes) == (net, peak)
    assert list(r.during) == during


@given(random_program())
def test_peak_bounds_and_no_negative_live_bytes(case):
    prog, entry, keep = case
    r = analyze_program(prog, live_on_entry=entry, keep=keep)
    assert r.peak_bytes >= max(r.net_bytes, 0)
    sizes = {}
    for t in prog.tensors.values():
        sizes[t.storage] = max(sizes.get(t.storage, 0), t.nbytes)
    # the largest single storage this program allocates fits under the peak
    allocated = set()
    seen = set(entry)
    for op in prog.ops:
        for n in (*[x for x in op.inputs if x not in op.no_need_buffer], *op.frees):
            seen.add(prog.tensors[n].storage)
        for n in op.outputs:
            s = prog.tensors[n].storage
            if s not in seen:
                allocated.add(s)
            seen.add(s)
    assert r.peak_bytes >= max((sizes[s] for s in allocated), default=0)
    # live bytes = what was there on entry + the change; never below zero
    entry_bytes = sum(sizes[s] for s in seen if s not in allocated)
    assert all(entry_bytes + a >= 0 for a in r.after)


@given(random_program(), st.randoms(use_true_random=False))
def test_independent_of_dict_and_set_order(case, rnd):
    prog, entry, keep = case
    r1 = analyze_program(prog, live_on_entry=entry, keep=keep)
    items = list(prog.tensors.items())
    rnd.shuffle(items)
    shuffled = make("rand", [t for _, t in items], prog.ops)
    r2 = analyze_program(shuffled, live_on_entry=list(reversed(entry)), keep=set(keep))
    assert (r1.net_bytes, r1.peak_bytes, r1.peak_op) == (r2.net_bytes, r2.peak_bytes, r2.peak_op)
    assert list(r1.during) == list(r2.during)


def test_compiled_form_is_cached_and_invalidated():
    p = make("f", [act("x", 1), act("y", 10)], [Op("f", ("x",), ("y",))])
    assert analyze_program(p, keep={"y"}).net_bytes == 40 - 4
    p.add_tensor(act("z", 100))
    p.add_op(Op("g", ("y",), ("z",)))
    assert analyze_program(p, keep={"z"}).net_bytes == 400 - 4


def test_sequence_is_deterministic_over_runs():
    rnd = random.Random(0)
    tensors = [act(f"t{i}", rnd.randint(1, 100)) for i in range(30)]
    progs = []
    for k in range(4):
        ops = [Op("op", (f"t{rnd.randrange(30)}",), (f"t{rnd.randrange(30)}",)) for _ in range(20)]
        progs.append(make(f"p{k}", tensors, ops))
    a = [(r.net_bytes, r.peak_bytes) for r in analyze_sequence(progs)]
    b = [(r.net_bytes, r.peak_bytes) for r in analyze_sequence(progs)]
    assert a == b


def test_retain_reads_are_kept_by_earlier_programs_and_never_freed_by_the_reader():
    # Paddle's pipeline skip_gc rule: a value a later job reads only as part of a
    # no_need_buffer vector is kept by the job that wrote it, and the reader never frees it.
    h, x, g = act("h", 100), act("x", 10, persistent=True), act("g", 10)

    def programs(retain: bool):
        f = make("F", [h, x], [Op("slice", ("x",), ("h",))])
        b = make(
            "B",
            [h, g],
            [Op("concat_grad", ("h",), ("g",), no_need_buffer=("h",), retain_reads=("h",) if retain else ())],
        )
        return f, b

    f, b = analyze_sequence(programs(True))
    assert f.net_bytes == 400 and "h" in f.retained
    assert b.net_bytes == 0 and "h" in b.live_after  # h never freed (else -400)
    f, b = analyze_sequence(programs(False))
    assert f.net_bytes == 0 and "h" not in b.live_after  # a plain no_need_buffer read keeps nothing


def test_retain_reads_must_be_no_need_buffer_and_survive_json():
    from pipemem.ir import programs_from_json, programs_to_json

    p = make(
        "B",
        [act("h", 4), act("g", 4)],
        [Op("concat_grad", ("h",), ("g",), no_need_buffer=("h",), retain_reads=("h",))],
    )
    assert programs_from_json(programs_to_json([p]))[0].ops[0].retain_reads == ("h",)
    bad = make("B", [act("h", 4), act("g", 4)], [Op("concat_grad", ("h",), ("g",), retain_reads=("h",))])
    with pytest.raises(UserError, match="retain_reads"):
        bad.validate()


def test_phase_row_names_the_peak_op_by_label():
    # as in test_reuse_after_free: op 0 peaks at 400 B, and the input (40 B) dies with the rest
    p = make("fwd", [act("x", 10), act("a", 100)], [Op("f", ("x",), ("a",))])
    res = analyze_program(p)
    row = res.phase_row()
    assert row == {"name": "fwd", "net_bytes": -40, "peak_bytes": 400, "peak_op": res.peak_op_label}
    assert list(row) == ["name", "net_bytes", "peak_bytes", "peak_op"]
    assert res.to_dict() == {**row, "peak_op_index": 0}
