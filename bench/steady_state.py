"""Steady-state whole step: traced mode vs template mode (hf convention), every family of
pipemem/validation/steady_cases.py, fp32 and bf16 (mixed precision; MoE: pure bf16, and mixed
precision as an extra row, where HF runs its grouped_mm experts in the fp32 weights' dtype).

    python bench/steady_state.py

Both through `pipemem.estimate` (micro batch 2, seq 256, 4 layers, AdamW, default --grads
set-to-none, --step steady); rel_error = (templates - traced) / traced.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from pipemem.validation.steady_cases import FAMILIES, MOE, compare

    print(f"{'case':16s} {'traced':>12s} {'templates':>12s} {'rel_error':>10s}  traced peak at")
    worst = 0.0
    for family in FAMILIES:
        runs = [("bf16", {}), ("fp32", {})]
        if family in MOE:  # bf16 is pure there; autocast over fp32 weights too
            runs.insert(1, ("bf16", {"master_weights": True}))
        for dtype, extra in runs:
            r = compare(family, dtype, **extra)
            worst = max(worst, abs(r["rel_error"]))
            print(
                f"{r['name']:16s} {r['traced']:12d} {r['templates']:12d} {r['rel_error']:+10.2%}  "
                f"{r['traced_peak_at']}"
            )
    print(f"max |rel_error| {worst:.2%}")


if __name__ == "__main__":
    main()
