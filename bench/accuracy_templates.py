"""Template mode vs traced mode and vs Korthikanti et al. (Table 2), printed as tables.

    python bench/accuracy_templates.py

Traced: one HF training step of a 2-layer model on fake tensors (kernel policy cuda), layer 1's
forward-kept bytes and backward-segment peak (parameter grads counted as static, i.e. zero).
Templates: the `hf` convention, first step. Korthikanti: GPT layer, megatron convention, fp16,
s=64 b=2 h=64 a=4 t=2; the paper's formula plus the LayerNorm statistics it ignores.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    import test_templates_korthikanti as K
    import test_templates_traced as T

    print("Per decoder layer, template (hf convention) vs traced (--kernel-policy cuda), s=128 b=2 h=256")
    print(
        f"{'model':8s} {'dtype':10s} {'kept traced':>12s} {'kept tmpl':>12s} {'err':>8s} "
        f"{'bwd peak traced':>16s} {'bwd peak tmpl':>14s} {'err':>8s}"
    )
    for name in sorted(T.CASES):
        config, dtype = T.CASES[name]
        kept, peak = T.traced_layer1(config, dtype)
        m = T.template_layer(config, dtype)
        print(
            f"{name:8s} {dtype:10s} {kept:12d} {m.F.net_bytes:12d} {(m.F.net_bytes - kept) / kept:+8.4%} "
            f"{peak:16d} {m.B.peak_bytes:14d} {(m.B.peak_bytes - peak) / peak:+8.4%}"
        )
    print()
    print("Korthikanti et al. 2022 Table 2 (GPT layer, megatron convention): formula + LN stats vs template")
    for name, tp, sp, rc, formula, stat_tokens in K.CASES:
        got, _ = K.retained(tp, sp, rc)
        want = int(formula) + K.ln_stats(stat_tokens)
        print(f"{name:50s} formula {want:9d}  template {got:9d}  {'exact' if got == want else 'DIFFERS'}")


if __name__ == "__main__":
    main()
