"""The seed's API on IR programs, and one test per seed defect (FINDINGS.md §1a) showing our
result is right where Paddle's estimator is not."""

import pytest

from pipemem import PipelineMemoryEstimator
from pipemem.errors import UserError
from pipemem.ir import Op, Program, Tensor


def make(name, tensors, ops):
    p = Program(name)
    for t in tensors:
        p.add_tensor(t)
    for op in ops:
        p.add_op(op)
    return p


def stage():
    """forward keeps `h` for backward and `stat` for the optimizer (not used by backward)."""
    t = {
        "x": Tensor("x", (100,), "fp32"),
        "w": Tensor("w", (100,), "fp32", "param"),
        "h": Tensor("h", (200,), "fp32"),
        "stat": Tensor("stat", (50,), "fp32"),
        "y": Tensor("y", (10,), "fp32"),
        "dw": Tensor("dw", (100,), "fp32", "grad"),
        "m": Tensor("m", (100,), "fp32", "optimizer_state"),
    }
    fwd = make(
        "forward",
        [t[n] for n in ("x", "w", "h", "stat", "y")],
        [Op("linear", ("x", "w"), ("h",)), Op("stat", ("h",), ("stat",)), Op("head", ("h",), ("y",))],
    )
    bwd = make("backward", [t[n] for n in ("x", "h", "y", "dw")], [Op("wgrad", ("x", "h", "y"), ("dw",))])
    opt = make(
        "optimizer",
        [t[n] for n in ("w", "dw", "m", "stat")],
        [Op("adam", ("w", "dw", "m", "stat"), ("w", "m"))],
    )
    return {"forward": fwd, "backward": bwd, "optimizer": opt}


def test_skip_gc_vars_against_all_later_programs():
    est = PipelineMemoryEstimator()
    progs = stage()
    est.set_program_skip_gc_vars(progs, ["forward", "backward", "optimizer"])
    # forward keeps x, h, y for backward and stat for the optimizer (two programs later)
    assert set(est.type_to_skip_gc_vars["forward"]) == {"x", "h", "y", "stat"}
    assert est.type_to_skip_gc_vars["forward"]["stat"] == 200
    assert set(est.type_to_skip_gc_vars["backward"]) == {"dw"}
    assert est.get_program_param_size("forward") == 400
    assert est.get_increase_memory("forward") == 400 + 800 + 40 + 200


def test_defect_non_adjacent_carry():
    """Seed: only the adjacent previous program's vars count as already allocated, so `stat`
    (made in forward, read in the optimizer) would be allocated a second time there."""
    est = PipelineMemoryEstimator()
    progs = stage()
    est.set_program_skip_gc_vars(progs, ["forward", "backward", "optimizer"])
    assert est.estimate_memory(progs["forward"], "forward") == (800 + 200 + 40, 800 + 200 + 40)
    # backward: dw (400) allocated; x, h, y (400 + 800 + 40) die after their last use
    assert est.estimate_memory(progs["backward"], "backward") == (400 - 1240, 400)
    # optimizer: stat and dw are carried in (no allocation) and die there
    assert est.estimate_memory(progs["optimizer"], "optimizer") == (-200 - 400, 0)


def test_defect_estimating_twice_gives_the_same_answer():
    """Seed: the walk decrements the stored per-var sizes, so a second call differs."""
    est = PipelineMemoryEstimator()
    progs = stage()
    est.set_program_skip_gc_vars(progs, ["forward", "backward", "optimizer"])
    first = [est.estimate_memory(progs[t], t) for t in ("forward", "backward", "optimizer")]
    again = [est.estimate_memory(progs[t], t) for t in ("forward", "backward", "optimizer")]
    assert first == again


def test_defect_dynamic_dims_are_not_one():
    """Seed: -1 dims are taken as 1 (a [-1, 4096] activation becomes 16 KiB)."""
    p = make(
        "forward", [Tensor("x", (-1, 4096), "bf16"), Tensor("y", (8,), "fp32")], [Op("f", ("x",), ("y",))]
    )
    est = PipelineMemoryEstimator()
    with pytest.raises(UserError, match="'x'.*unknown dimension"):
        est.set_program_skip_gc_vars({"forward": p}, ["forward"])


def test_defect_bool_is_one_byte():
    """Seed: dtypes outside its table (bool) count 4 bytes."""
    p = make(
        "forward",
        [Tensor("x", (10,), "fp32"), Tensor("mask", (1000,), "bool")],
        [Op("dropout_mask", ("x",), ("mask",))],
    )
    est = PipelineMemoryEstimator()
    est.set_program_skip_gc_vars({"forward": p}, ["forward"])
    net, peak = est.estimate_memory(p, "forward")
    assert peak == 1000 and net == -40  # the mask dies after its op: nothing later reads it


def test_defect_views_and_inplace_share_storage():
    """Seed: every var name is its own allocation, so a reshape or an in-place op doubles."""
    t = [
        Tensor("x", (10,), "fp32"),
        Tensor("h", (1000,), "fp32"),
        Tensor("h_view", (10, 100), "fp32", storage="h"),
        Tensor("h_act", (1000,), "fp32", storage="h"),
        Tensor("y", (1,), "fp32"),
    ]
    p = make(
        "forward",
        t,
        [
            Op("fc", ("x",), ("h",)),
            Op("reshape", ("h",), ("h_view",)),
            Op("relu_", ("h_view",), ("h_act",)),
            Op("sum", ("h_act",), ("y",)),
        ],
    )
    est = PipelineMemoryEstimator()
    est.set_program_skip_gc_vars({"forward": p}, ["forward"])
    # one 4000 B storage for h, its view and its in-place result; x (40 B) and y die
    assert est.estimate_memory(p, "forward") == (-40, 4000)


def test_defect_workspaces_and_comm_buffers_count():
    """Seed: no op workspaces, no collective buffers."""
    t = [
        Tensor("x", (100,), "bf16"),
        Tensor("gathered", (400,), "bf16", "comm_buffer"),
        Tensor("y", (100,), "bf16"),
    ]
    p = make(
        "forward",
        t,
        [Op("all_gather", ("x",), ("gathered",)), Op("matmul", ("gathered",), ("y",), workspace_bytes=4096)],
    )
    est = PipelineMemoryEstimator()
    est.set_program_skip_gc_vars({"forward": p}, ["forward"])
    net, peak = est.estimate_memory(p, "forward")
    assert peak == 800 - 200 + 200 + 4096  # x freed after the gather; y + workspace during matmul
    assert net == -200  # gathered and y die too (no later program); x (200 B) was freed


def test_defect_allocator_rounding_available():
    """Seed: exact bytes only; the CUDA caching allocator rounds blocks up to 512 B."""
    p = make("forward", [Tensor("x", (1,), "fp32"), Tensor("y", (3,), "fp32")], [Op("f", ("x",), ("y",))])
    est = PipelineMemoryEstimator(granularity=512)
    est.set_program_skip_gc_vars({"forward": p}, ["forward"])
    assert est.estimate_memory(p, "forward")[1] == 512


def test_unknown_program_type():
    est = PipelineMemoryEstimator()
    with pytest.raises(UserError):
        est.estimate_memory(Program("f"), "forward")
