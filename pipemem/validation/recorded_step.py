"""What the traced validate workers (torchtune_trace, torchtitan_trace, megatron_trace) share
around pipemem's recorder: the default dtype a framework's model is built in, and the walk of
the step the recorder holds into the numbers every worker reports.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def default_dtype(dtype):
    """torch's default dtype set to `dtype` while a model is built (modules that make their
    tensors with torch's defaults get the dtype the framework would cast them to: fake or meta
    parameters cannot be cast in place afterwards), then restored."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def recorded_peak(rec, by_kind: bool = False) -> dict:
    """The recorded step walked with liveness from what is alive when it starts: `peak_bytes`
    (those static bytes plus the highest the phases reach above them), `static_bytes`, with
    `by_kind` the static bytes per tensor kind (`static_by_kind`), `peak_at` and each phase's
    row (`phases`)."""
    from ..liveness import analyze_sequence, sequence_peak

    programs = rec.programs()  # first: it closes the recording that entry_storages reads
    entry = rec.entry_storages()
    static = sum(rec.storages[n].nbytes for n in entry)
    out = {"peak_bytes": None, "static_bytes": static}
    if by_kind:
        kinds: dict[str, int] = {}
        for n in entry:
            k = rec.storages[n].kind.value if rec.storages[n].kind is not None else "other"
            kinds[k] = kinds.get(k, 0) + rec.storages[n].nbytes
        out["static_by_kind"] = kinds
    results = analyze_sequence(programs, live_on_entry=entry)
    peak, out["peak_at"] = sequence_peak(results)
    out["peak_bytes"] = static + peak
    out["phases"] = [r.phase_row() for r in results]
    return out
