"""pipemem validate dist, the parts that need no process group: the torch.distributed.pipelining
runtime profile (pipemem.runtime) on hand-made jobs, the profiler repair of frees made on other
threads, the CLI's input checks, and that validate dist takes every number from
`pipemem.estimate`. Expected values are derived by hand from the rules stated in each test."""

import ast
from pathlib import Path

import pytest

from pipemem.cli.main import main
from pipemem.jobs import JobMemory, StageJobs
from pipemem.replay import replay
from pipemem.runtime import lower
from pipemem.schedules import get_schedule

torch = pytest.importorskip("torch")

from pipemem.validation.dist_worker import repair_missed_frees  # noqa: E402

Y, DX, IN, GB = 100, 10, 10, 100  # bytes of y, dx, one input buffer, one output-grad buffer


def _stage(s, n, f_net=1000, f_peak=1200, b_first_extra=50):
    """A stage whose F keeps f_net (y included), whose B frees f_net - Y and makes dx; its
    first B (which creates the param grads) keeps b_first_extra more."""
    first, last = s == 0, s == n - 1
    dx = 0 if first else DX
    b_net = -(f_net - Y) + dx
    bounds = dict(
        output_bytes=Y,
        input_grad_bytes=dx,
        input_bytes=0 if first else IN,
        output_grad_bytes=0 if last else GB,
    )
    later = StageJobs(s, F=JobMemory(f_net, f_peak), B=JobMemory(b_net, 300), **bounds)
    first_b = StageJobs(
        s, F=JobMemory(f_net, f_peak), B=JobMemory(b_net + b_first_extra, 300 + b_first_extra), **bounds
    )
    return later, first_b


def _replay(name, pp, m, static=0, optimizer=None):
    sched = get_schedule(name, pp, m)
    jobs, over = {}, {}
    for s in range(pp):
        jobs[s], over[(s, 0)] = _stage(s, pp)
    jobs.update(over)
    opt = None if optimizer is None else [optimizer] * pp
    return replay(lower(sched, "torch"), jobs, [static] * pp, optimizer_jobs=opt, simulate_time=False)


def test_gpipe_middle_stage_keeps_every_send_until_the_end():
    # Stage 1 of 3, M=2. Start: 2 input buffers + 2 grad buffers = 220. F0, F1 each +1000
    # (y sent, also held by the send list). B0 (first): peak 220+2000+350 = 2570. After B0:
    # 2220 - 900 + 10 + 50 = 1380 (y0 stays: held by the send list). B1: peak 1380 + 300.
    # End: sends released -> y0, y1, dx0, dx1 freed; the receive buffers stay.
    r = _replay("GPipe", 3, 2).ranks[1]
    assert r.peak_allocated_bytes == 220 + 2000 + 350
    after_b1 = 1380 - 900 + 10
    assert r.final_bytes == after_b1 - 2 * Y - 2 * DX


def test_1f1b_last_stage_frees_logits_at_backward():
    # Last stage of 2 (no sends of y; dx sent). Warmup = 1: F0 B0 F1 B1.
    # Start 2 input buffers = 20. F0: 20+1200 peak, 1020. B0(first): peak 1020+350, then
    # 1020 - 900 + 10 + 50 = 180, y0 freed (fwd_cache only) -> 80. F1: peak 80+1200, 1080.
    # B1: peak 1080 + 300 = 1380, the highest.
    r = _replay("1F1B", 2, 2, optimizer=JobMemory(5, 7)).ranks[1]
    assert r.peak_allocated_bytes == max(20 + 1200, 1020 + 350, 80 + 1200, 1080 + 300)
    # After B1: 1080 - 900 + 10 = 190, y1 freed -> 90; the send variables release dx0
    # and dx1 at the end -> 70; the optimizer adds 5.
    assert r.final_bytes == 90 - 2 * DX + 5


def test_static_bytes_are_the_starting_point():
    a = _replay("GPipe", 2, 2).ranks[0]
    b = _replay("GPipe", 2, 2, static=12345).ranks[0]
    assert b.peak_allocated_bytes - a.peak_allocated_bytes == 12345


def test_validate_dist_takes_every_number_from_pipemem_estimate(monkeypatch):
    """The route: the estimate of a case is `pipemem.estimate(...)`'s per-rank peak, nothing else."""
    import pipemem
    from pipemem.validation import dist

    seen = []

    class Rank:
        def __init__(self, r):
            self.pp_rank, self.peak_allocated_bytes, self.peak_at = r, 1000 + r, f"at{r}"
            self.static = type("S", (), {"total": 7})()

    def spy(model, **kw):
        seen.append(kw)
        return type("E", (), {"ranks": [Rank(r) for r in range(kw.get("pp", 1))]})()

    monkeypatch.setattr(pipemem, "estimate", spy)
    by_name = {c["name"]: c for c in dist.all_cases()}
    for name in ("pp2-1F1B-m4", "tp2-llama", "tp2-llama-regather", "fsdp2-llama", "ddp2-llama"):
        est = dist.estimate_case(by_name[name])
        assert seen[-1]["mode"] == "traced"
        assert len(est) == by_name[name]["world"]
        for r, row in est.items():
            assert row["estimated_bytes"] == (1000 + r if name.startswith("pp") else 1000)
    # and no module of validate dist reaches into the engine's memory code, however imported
    # (`from ..replay import replay`, `from .. import replay`, `import pipemem.replay`, ...)
    root = Path(dist.__file__).parent
    engine = {
        f"pipemem.{m}"
        for m in (
            "replay",
            "liveness",
            "runtime",
            "stages",
            "jobs",
            "pipeline_estimator",
            "traced.parallel",
            "traced.step",
            "traced.estimate",
            "traced.dist_capture",
        )
    }
    for path in [
        root / "dist.py",
        root / "compare.py",
        root / "progress.py",
        *sorted((root / "distributed").glob("*.py")),
    ]:
        parts = ("pipemem",) + path.relative_to(root.parent).with_suffix("").parts
        pkg = parts[:-1]  # the package a relative import starts from
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = list(pkg[: len(pkg) - (node.level - 1)]) if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = {mod} | {f"{mod}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets = {a.name for a in node.names}
            else:
                continue
            hit = {t for t in targets for e in engine if t == e or t.startswith(e + ".")}
            assert not hit, f"{path.name} imports {sorted(hit)}"


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


@pytest.mark.parametrize(
    "name,pp,m",
    [
        ("Interleaved1F1B", 2, 4),
        ("Interleaved1F1B", 4, 8),
        ("ZBVZeroBubble", 2, 4),
        ("ZBVZeroBubble", 4, 8),
        ("DualPipeV", 4, 8),
    ],
)
def test_pipemem_schedules_match_the_order_pytorch_runs(name, pp, m):
    # pipemem's generators must agree with PyTorch's own lowered action lists (what
    # _PipelineScheduleRuntime executes) on the compute order, rank by rank.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _ComputationType as CT

    kind = {CT.FORWARD: "F", CT.FULL_BACKWARD: "B", CT.BACKWARD_INPUT: "I", CT.BACKWARD_WEIGHT: "W"}
    ours = get_schedule(name, pp, m, 2)
    ops = get_schedule_ops(name, pp, m, num_stages_per_rank=2, with_comms=True)
    for r in range(pp):
        flat = []
        for a in ops[r]:
            if a is not None:
                flat += list(a.sub_actions) if a.computation_type == CT.OVERLAP_F_B else [a]
        theirs = [
            (kind[a.computation_type], a.stage_index, a.microbatch_index)
            for a in flat
            if a.computation_type in kind
        ]
        assert [(a.kind, a.stage, a.microbatch) for a in ours.ranks[r]] == theirs
