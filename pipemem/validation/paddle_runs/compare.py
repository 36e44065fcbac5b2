"""pipemem vs Paddle's own `PipelineMemoryEstimator` vs a measurement, on the same programs.

For one case: bind the dynamic dims, split the main program by op role, then
(a) pipemem: capture to IR and walk `analyze_sequence` (carrying what later sub-programs
    read, freeing everything else after its last use);
(b) Paddle: `paddle.distributed.passes.pass_utils.PipelineMemoryEstimator` on the very
    same sub-programs, with the one-method dist_context it needs;
(c) the measurement (`pipemem.validation.paddle_runs.measure`).
Rows: one per sub-program and quantity (net, peak).
"""

from __future__ import annotations

from ...liveness import analyze_sequence
from ...paddle.capture import resolve_shapes, to_ir
from ...paddle.split import SUB_PROGRAM_TYPES, split_backward_bw, split_program
from ..compare import CaseRow, rel_error

# Paddle's estimator asserts that a job typed "backward" keeps nothing for later jobs:
# true in its pipeline passes, where gradient merge makes the grads persistable, false
# in a plain step, where the optimizer reads the grads. The type names are only dict keys
# to it otherwise, so it gets these.
PADDLE_TYPE_KEYS = {"forward": "F", "backward": "B", "backward_b": "B", "backward_w": "W", "optimizer": "O"}


def paddle_row(
    name: str, measured: int | None, estimated: int, paddle_estimated: int | None, peak_op: str = "", **fields
) -> CaseRow:
    """A row of `validate paddle`: pipemem's estimate and Paddle's own (None where it has none)
    against the measurement (None where not measured), then the row's own `fields`."""
    return CaseRow(
        name,
        measured,
        estimated,
        {
            "paddle_estimated_bytes": paddle_estimated,
            "paddle_rel_error": rel_error(paddle_estimated, measured),
            "peak_op": peak_op,
            **fields,
        },
    )


def program_row(
    name: str,
    measured: int | None,
    estimated: int,
    paddle_estimated: int | None,
    peak_op: str = "",
    collector: str = "",
    trial_peaks: list[int] | None = None,
    lag_bytes: int | None = None,
) -> CaseRow:
    """A row of a Program case (legacy IR or PIR). A PIR peak adds how the measurement kept the
    collector ahead ("realtime" / "nice" / "none"), every trial's peak and the most the collector
    still held when a step returned."""
    return paddle_row(
        name,
        measured,
        estimated,
        paddle_estimated,
        peak_op,
        collector=collector,
        trial_peaks=trial_peaks,
        lag_bytes=lag_bytes,
    )


class _SerialDistOp:
    def __init__(self, op):
        self._op = op

    def get_serial_input(self, name):
        return self._op.block._var_recursive(name)

    get_serial_output = get_serial_input


class SerialDistContext:
    """The part of a dist_context Paddle's estimator calls, for a single-rank program."""

    def get_dist_op_for_program(self, op):
        return _SerialDistOp(op)


def paddle_estimates(sub_programs: dict) -> dict[str, tuple[int, int]]:
    """{type: (net, peak)} from Paddle's own PipelineMemoryEstimator."""
    from paddle.distributed.passes.pass_utils import PipelineMemoryEstimator

    est = PipelineMemoryEstimator()
    keyed = {PADDLE_TYPE_KEYS[t]: p for t, p in sub_programs.items()}
    est.set_program_skip_gc_vars(keyed, list(keyed))
    ctx = SerialDistContext()
    return {
        t: tuple(int(v) for v in est.estimate_memory(p, PADDLE_TYPE_KEYS[t], ctx))
        for t, p in sub_programs.items()
    }


def pipemem_estimates(sub_programs: dict, name_prefix: str = "") -> dict:
    """{type: ProgramMemory} from pipemem's liveness over the captured IR."""
    programs = to_ir(sub_programs, name_prefix=name_prefix)
    # Persistables (and fed inputs) are in the scope before the step: one first written by
    # a sub-program (gradient merge's condition flag) is not allocated there.
    static = {t.storage for p in programs for t in p.tensors.values() if t.persistent}
    return {p.type: r for p, r in zip(programs, analyze_sequence(programs, live_on_entry=static))}


def estimate(main_program, batch: int | None = None, seq: int | None = None, feed_shapes=None) -> dict:
    """pipemem's {type: ProgramMemory} for a Paddle legacy training program: dynamic dims
    bound (`capture.resolve_shapes`), split by op role, captured, walked in order.
    `net_bytes` / `peak_bytes` are relative to the start of each sub-program; parameters,
    optimizer states and fed inputs are static and not included."""
    resolved = resolve_shapes(main_program, batch=batch, seq=seq, feed_shapes=feed_shapes)
    return pipemem_estimates(split_program(resolved, SUB_PROGRAM_TYPES))


def compare_case(case, measure: bool = True) -> list[CaseRow]:
    from .measure import measure_step

    feed_shapes = {n: list(a.shape) for n, a in case.feeds.items()}
    resolved = resolve_shapes(case.main, feed_shapes=feed_shapes)
    subs = split_program(resolved, SUB_PROGRAM_TYPES)
    if getattr(case, "split_bw", False):
        subs = split_backward_bw(subs)
    ours = pipemem_estimates(subs, name_prefix=f"{case.name}/")
    theirs = paddle_estimates(subs)
    measured = {m.type: m for m in measure_step(case.startup, subs, case.feeds)} if measure else {}
    rows = []
    for t in subs:
        r = ours[t]
        for quantity, est, pest in (("net", r.net_bytes, theirs[t][0]), ("peak", r.peak_bytes, theirs[t][1])):
            m = measured.get(t)
            meas = (m.net_bytes if quantity == "net" else m.peak_bytes) if m else None
            peak_op = r.peak_op_label if quantity == "peak" else ""
            rows.append(program_row(f"{case.name}/{t}/{quantity}", meas, est, pest, peak_op))
    return rows


def compare(names=None) -> list[CaseRow]:
    from .models import CASES

    names = list(names or CASES)
    rows = []
    for n in names:
        rows.extend(compare_case(CASES[n]()))
    return rows


# PIR programs ----------------------------------------------------------------------------
# A PIR step is compared whole (pipemem.validation.paddle_runs.pir_measure explains why): its peak, its net
# change once the garbage collector has drained, and, with garbage collection off, the
# bytes it allocates in all. Paddle's estimator has no number here: it reads `op.type` /
# `op.desc` of legacy ops and fails on PIR operations (AttributeError).

PIR_QUANTITIES = ("peak", "net", "allocated-no-gc")


def compare_pir_case(case, trials: int = 5) -> list[CaseRow]:
    from ...paddle.pir_capture import allocated_total, capture, whole_step
    from .pir_measure import measure_no_gc, measure_step

    captured = capture(case.main, case.sizes, name_prefix=f"{case.name}/")
    peak, net, label = whole_step(captured)
    m = measure_step(case.main, case.startup, case.feeds, trials=trials)
    allocated = measure_no_gc(case.main, case.startup, case.feeds)
    rows = []
    for quantity, est, meas in (
        ("peak", peak, m.peak_bytes),
        ("net", net, m.net_bytes),
        ("allocated-no-gc", allocated_total(captured), allocated),
    ):
        peak = quantity == "peak"
        rows.append(
            program_row(
                f"{case.name}/step/{quantity}",
                meas,
                est,
                None,
                peak_op=label if peak else "",
                collector=m.policy if peak else "",
                trial_peaks=m.peaks if peak else None,
                lag_bytes=m.lag_bytes if peak else None,
            )
        )
    return rows


def compare_pir(names=None, trials: int = 5) -> list[CaseRow]:
    from .pir_models import CASES as PIR_CASES

    rows = []
    for n in list(names or PIR_CASES):
        rows.extend(compare_pir_case(PIR_CASES[n](), trials=trials))
    return rows
