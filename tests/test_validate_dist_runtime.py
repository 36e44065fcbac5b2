"""pipemem validate dist, the parts that need no process group: the pipelining runtime model
on hand-made jobs, the profiler repair of frees made on other threads, and the CLI's input
checks. Expected values are derived by hand from the rules stated in each test."""

import pytest

from pipemem.cli.main import main
from pipemem.jobs import JobMemory

torch = pytest.importorskip("torch")

from pipemem.validation.distributed.pipeline_jobs import TracedStageJobs  # noqa: E402
from pipemem.validation.distributed.pipeline_runtime import replay_rank  # noqa: E402
from pipemem.validation.dist_worker import repair_missed_frees  # noqa: E402

Y, DX, IN, GB = 100, 10, 10, 100   # bytes of y, dx, one input buffer, one output-grad buffer


def _stage(s, n, f_net=1000, f_peak=1200, b_net=-900, b_first_extra=50):
    """A stage whose F keeps f_net (y included), whose B frees f_net - Y and makes dx."""
    first, last = s == 0, s == n - 1
    dx = 0 if first else DX
    b_net_here = -(f_net - Y) + dx
    return TracedStageJobs(stage=s, F=JobMemory(f_net, f_peak),
                           B_first=JobMemory(b_net_here + b_first_extra, 300 + b_first_extra),
                           B=JobMemory(b_net_here, 300), param_bytes=0, y_bytes=Y, dx_bytes=dx,
                           input_bytes=0 if first else IN, output_grad_bytes=0 if last else GB,
                           first=first, last=last)


def test_gpipe_middle_stage_keeps_every_send_until_the_end():
    # Stage 1 of 3, M=2. Start: 2 input buffers + 2 grad buffers = 220. F0, F1 each +1000
    # (y sent, also held by the send list). B0 (first): peak 220+2000+350 = 2570. After B0:
    # 2220 - 900 + 10 + 50 = 1380 (y0 stays: held by the send list). B1: peak 1380 + 300.
    # End: sends released -> y0, y1, dx0, dx1 freed.
    jobs = {s: _stage(s, 3) for s in range(3)}
    r = replay_rank("GPipe", 3, 1, 2, 1, [1], jobs, static_bytes=0, optimizer=None)
    assert r.recv_buffer_bytes == 2 * IN + 2 * GB
    assert r.peak_bytes == 220 + 2000 + 350
    after_b1 = 1380 - 900 + 10
    assert r.final_bytes == after_b1 - 2 * Y - 2 * DX


def test_1f1b_last_stage_frees_logits_at_backward():
    # Last stage of 2 (no sends of y; dx sent). Warmup = 1: F0 B0 F1 B1.
    # Start 2 input buffers = 20. F0: 20+1200 peak, 1020. B0(first): peak 1020+350, then
    # 1020 - 900 + 10 + 50 = 180, y0 freed (fwd_cache only) -> 80. F1: peak 80+1200, 1080.
    # B1: peak 1080 + 300 = 1380, the highest.
    jobs = {s: _stage(s, 2) for s in range(2)}
    r = replay_rank("1F1B", 2, 1, 2, 1, [1], jobs, static_bytes=0, optimizer=JobMemory(5, 7))
    assert r.peak_bytes == max(20 + 1200, 1020 + 350, 80 + 1200, 1080 + 300)
    # After B1: 1080 - 900 + 10 = 190, y1 freed -> 90; the send variables release dx0
    # and dx1 at the end -> 70; the optimizer adds 5.
    assert r.final_bytes == 90 - 2 * DX + 5


def test_static_bytes_are_the_starting_point():
    jobs = {s: _stage(s, 2) for s in range(2)}
    a = replay_rank("GPipe", 2, 1, 2, 0, [0], jobs, static_bytes=0, optimizer=None)
    b = replay_rank("GPipe", 2, 1, 2, 0, [0], jobs, static_bytes=12345, optimizer=None)
    assert b.peak_bytes - a.peak_bytes == 12345


def test_missed_free_is_inserted_where_the_address_is_reused():
    # (time, bytes, address, op): block A (100 B) is freed on another thread (no event), then
    # its address is allocated again: a free must precede the new allocation.
    events = [(1, 100, 0xA, "x"), (2, 50, 0xB, "y"), (3, -50, 0xB, "y"), (4, 70, 0xA, "z")]
    out, missed = repair_missed_frees(events)
    assert missed == 100
    running, peak = 0, 0
    for _t, size, _p, _o in out:
        running += size
        peak = max(peak, running)
    assert running == 70 and peak == 150


def test_cli_rejects_unknown_case(capsys):
    assert main(["validate", "dist", "--cases", "pp2-Nope-m4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cases" in err[0]


def test_cli_lists_cases(capsys):
    assert main(["validate", "dist", "--list"]) == 0
    names = capsys.readouterr().out.split()
    for want in ("pp2-GPipe-m4", "pp4-ZBVZeroBubble-m8", "pp2-DualPipeV-m8", "tp2-llama", "fsdp2-llama"):
        assert want in names


@pytest.mark.parametrize("name,pp,m", [("Interleaved1F1B", 2, 4), ("Interleaved1F1B", 4, 8), ("ZBVZeroBubble", 2, 4),
                                       ("ZBVZeroBubble", 4, 8), ("DualPipeV", 4, 8)])
def test_pipemem_schedules_match_the_order_pytorch_runs(name, pp, m):
    # The replay walks PyTorch's own lowered action list; pipemem's generators must agree on
    # the compute order, rank by rank, for estimates made without torch.
    from torch.distributed.pipelining.schedules import _ComputationType as CT

    from pipemem.validation.distributed.pipeline_runtime import runtime_actions
    from pipemem.schedules import get_schedule
    kind = {CT.FORWARD: "F", CT.FULL_BACKWARD: "B", CT.BACKWARD_INPUT: "I", CT.BACKWARD_WEIGHT: "W"}
    ours = get_schedule(name, pp, m, 2)
    for r in range(pp):
        theirs = [(kind[a.computation_type], a.stage_index, a.microbatch_index)
                  for a in runtime_actions(name, pp, 2, m, r) if a.computation_type in kind]
        assert [(a.kind, a.stage, a.microbatch) for a in ours.ranks[r]] == theirs
