"""Jobs in units of one microbatch's retained activations (for charts, tests and the scheduler).

A rank's v chunks each hold 1/v of its layers, so F of one chunk keeps 1/v of a microbatch.
A fused backward frees it; a split backward's I frees all but the weight-gradient inputs,
w = M_W / M_B of it (Qi et al. 2024: dM(F) = M_B, dM(I) = M_W - M_B, dM(W) = -M_W), and W frees
the rest. Peaks above the start of a job are taken at its end (F) or zero (B, I, W).
"""

from __future__ import annotations

from fractions import Fraction

from ..jobs import JobMemory, StageJobs

# M_W / M_B per layer with 2-byte activations: 32sbh / (34sbh) when the 5as^2b attention-score
# term is gone (flash attention); Qi et al. 2024, FINDINGS.md §2.
DEFAULT_W_RATIO = Fraction(32, 34)


def unit_jobs(num_stages: int, vpp: int = 1, w_ratio: float | Fraction = DEFAULT_W_RATIO,
              times: tuple[float, float, float] = (1.0, 1.0, 1.0), unit=1) -> dict[int, StageJobs]:
    """StageJobs for every virtual stage: F = +unit/v, B = -unit/v, I = (w-1)·unit/v, W = -w·unit/v.
    `times` = (T_F, T_I, T_W); T_B = T_I + T_W. Exact (Fraction) unless floats are passed."""
    tf, ti, tw = times
    if not isinstance(w_ratio, Fraction) and not isinstance(unit, float):
        w_ratio = Fraction(w_ratio).limit_denominator(10**6)
    u = Fraction(unit) / vpp if not isinstance(unit, float) else unit / vpp
    out = {}
    for s in range(num_stages):
        out[s] = StageJobs(stage=s, F=JobMemory(u, u, tf), B=JobMemory(-u, 0, ti + tw),
                           I=JobMemory((w_ratio - 1) * u, 0, ti), W=JobMemory(-w_ratio * u, 0, tw))
    return out
