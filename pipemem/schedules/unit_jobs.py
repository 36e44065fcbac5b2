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


def unit_jobs(
    num_stages: int,
    vpp: int = 1,
    w_ratio: float | Fraction = DEFAULT_W_RATIO,
    times: tuple[float, float, float] = (1.0, 1.0, 1.0),
    unit=1,
) -> dict[int, StageJobs]:
    """StageJobs for every virtual stage: F = +unit/v, B = -unit/v, I = (w-1)·unit/v, W = -w·unit/v.
    `times` = (T_F, T_I, T_W); T_B = T_I + T_W. Exact (Fraction) unless floats are passed."""
    tf, ti, tw = times
    if not isinstance(w_ratio, Fraction) and not isinstance(unit, float):
        w_ratio = Fraction(w_ratio).limit_denominator(10**6)
    u = Fraction(unit) / vpp if not isinstance(unit, float) else unit / vpp

    def num(x):  # whole numbers as int (integer replay), the rest stay exact Fractions
        return int(x) if isinstance(x, Fraction) and x.denominator == 1 else x

    out = {}
    for s in range(num_stages):
        out[s] = StageJobs(
            stage=s,
            F=JobMemory(num(u), num(u), tf),
            B=JobMemory(num(-u), 0, ti + tw),
            I=JobMemory(num((w_ratio - 1) * u), 0, ti),
            W=JobMemory(num(-w_ratio * u), 0, tw),
        )
    return out


def integer_unit_jobs(
    num_stages: int,
    vpp: int = 1,
    w_ratio=DEFAULT_W_RATIO,
    times: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> tuple[dict[int, StageJobs], int]:
    """`unit_jobs` in integers: (jobs, units per microbatch). With w = a/b (to 1e-6), one
    microbatch is vpp*b units, so every job is a whole number and replay stays in int64
    (exact and vectorised); divide replayed numbers by the scale for microbatch units."""
    w = w_ratio if isinstance(w_ratio, Fraction) else Fraction(w_ratio).limit_denominator(10**6)
    scale = vpp * w.denominator
    return unit_jobs(num_stages, vpp, w, times, unit=scale), scale
