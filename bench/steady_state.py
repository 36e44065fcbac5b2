"""Steady-state whole step: traced mode vs template mode (hf convention), every family of
pipemem/validation/steady_cases.py, fp32 and bf16 (mixed precision; MoE: pure bf16, as HF runs
its grouped_mm experts in the weights' dtype under autocast, which templates do not follow).

    python bench/steady_state.py

Both through `pipemem.estimate` (micro batch 2, seq 256, 4 layers, AdamW, default --grads
set-to-none, --step steady); rel_error = (templates - traced) / traced.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from pipemem.validation.steady_cases import FAMILIES, compare

    print(f"{'case':16s} {'traced':>12s} {'templates':>12s} {'rel_error':>10s}  traced peak at")
    worst = 0.0
    for family in FAMILIES:
        for dtype in ("bf16", "fp32"):
            r = compare(family, dtype)
            worst = max(worst, abs(r["rel_error"]))
            print(
                f"{r['name']:16s} {r['traced']:12d} {r['templates']:12d} {r['rel_error']:+10.2%}  "
                f"{r['traced_peak_at']}"
            )
    print(f"max |rel_error| {worst:.2%}")


if __name__ == "__main__":
    main()
