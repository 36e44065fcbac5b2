"""CSV export/import (PyTorch's format) and import of PyTorch's own orders."""

from __future__ import annotations

from unittest import mock

import pytest

from pipemem.errors import UserError
from pipemem.schedules import Action, get_schedule
from pipemem.schedules.csv_io import from_csv_text, read_csv, to_csv_text, write_csv

NAMED = [
    ("GPipe", 1),
    ("1F1B", 1),
    ("Eager1F1B", 1),
    ("ZBH1", 1),
    ("ZBH2", 1),
    ("Interleaved1F1B", 2),
    ("VPP", 3),
    ("LoopedBFS", 2),
    ("InterleavedZeroBubble", 2),
    ("ZBVZeroBubble", 2),
    ("DualPipeV", 2),
    ("VHalf", 2),
    ("VMin", 2),
    ("auto", 2),
]


@pytest.mark.parametrize("name,v", NAMED)
def test_csv_round_trip_is_identical(name, v, tmp_path):
    sched = get_schedule(name, 4, 8, v)
    path = tmp_path / "s.csv"
    write_csv(sched, path)
    back = read_csv(path)
    assert back == sched
    assert back.ranks == sched.ranks and back.stage_rank == sched.stage_rank
    assert (back.pp, back.vpp, back.microbatches, back.placement) == (sched.pp, sched.vpp, 8, sched.placement)


def test_csv_cells_are_pytorch_action_strings():
    text = to_csv_text(get_schedule("1F1B", 2, 2))
    assert text.splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"]
    torch_sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    for line in text.splitlines():
        for cell in line.split(","):
            a = torch_sched._Action.from_str(cell)
            assert str(a) == cell


@pytest.mark.parametrize(
    "name,v",
    [
        ("ZBVZeroBubble", 2),
        ("Interleaved1F1B", 2),
        ("auto", 2),
        ("1F1B", 1),
        ("ZBH1", 1),
        ("VHalf", 2),
        ("DualPipeV", 2),
    ],
)
def test_pytorch_runtime_loads_and_simulates_our_csv(name, v, tmp_path):
    """PyTorch's _PipelineScheduleRuntime._load_csv reads our file, infers the stage placement,
    lowers it with sends/receives, and its own simulator runs it without deadlock."""
    pytest.importorskip("torch.distributed.pipelining")
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import PipelineStage

    from pipemem.schedules.torch_import import torch_actions

    pp, m = 4, 8
    sched = get_schedule(name, pp, m, v)
    path = tmp_path / "s.csv"
    write_csv(sched, path)
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, pp, None, pp * v
    runtime = _PipelineScheduleRuntime([stage] * v, m)
    runtime._load_csv(str(path))
    assert [torch_actions(runtime.pipeline_order[r]) for r in range(pp)] == sched.ranks
    assert [runtime.stage_index_to_group_rank[s] for s in range(pp * v)] == sched.stage_rank
    # PyTorch's comm/compute simulator (it does not know the FSDP UNSHARD/RESHARD/REDUCE_GRAD
    # actions the lowering adds, so those are left out) must finish every rank without deadlock
    from torch.distributed.pipelining.schedules import _simulate_comms_compute

    lowered = {
        r: [
            a
            for a in acts
            if a is None or a.computation_type.value not in ("UNSHARD", "RESHARD", "REDUCE_GRAD")
        ]
        for r, acts in runtime.pipeline_order_with_comms.items()
    }
    _simulate_comms_compute(lowered, lambda s: runtime.stage_index_to_group_rank[s], pp * v)


def test_import_reads_overlap_and_skips_comms():
    text = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,(1F0;1B0)OVERLAP_F_B,1SEND_B0\n"
    sched = from_csv_text(text)
    assert sched.ranks == [[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]


def test_import_accepts_our_cell_form_and_bubbles():
    sched = from_csv_text("F0@s0,,B0@s0\nF0@s1,B0@s1\n")
    assert sched.pp == 2 and sched.num_stages == 2 and sched.microbatches == 1


def test_import_names_the_first_violation():
    with pytest.raises(UserError, match=r"rank 1 action #0 B0@s1 .*F must come before B"):
        from_csv_text("0F0,0B0\n1B0,1F0\n")
    with pytest.raises(UserError, match=r"row 2 column 1: '0F1' runs stage 0, which row 1 also runs"):
        from_csv_text("0F0,0B0\n0F1\n")
    with pytest.raises(UserError, match="cannot read 'X3'"):
        from_csv_text("0F0,X3\n")
    with pytest.raises(UserError, match="never runs"):
        from_csv_text("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n")


def test_csv_name_via_get_schedule(tmp_path):
    path = tmp_path / "zb.csv"
    write_csv(get_schedule("ZBH1", 4, 8), path)
    assert get_schedule(f"csv:{path}", 4, 8).ranks == get_schedule("ZBH1", 4, 8).ranks
    with pytest.raises(UserError, match="--pp 2"):
        get_schedule(f"csv:{path}", 2, 8)


def test_torch_import_matches_generators():
    pytest.importorskip("torch.distributed.pipelining")
    for name, v in [("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 2), ("1F1B", 1)]:
        assert get_schedule(f"torch:{name}", 4, 8, v).ranks == get_schedule(name, 4, 8, v).ranks
    with pytest.raises(UserError, match="PyTorch refuses"):
        get_schedule("torch:DualPipeV", 4, 4, 2)
