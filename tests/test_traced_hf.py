"""Traced mode vs real CPU training steps of tiny HF models (`pipemem validate cpu` cases):
Llama, Mistral, Qwen2, GPT-2, Mixtral; fp32, bf16/fp16 autocast, bf16 pure; SDPA and eager;
no / full / selective checkpointing. Measured with the profiler's allocation events."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipemem.validation.cpu import CASES, estimate, measure_real  # noqa: E402

TOL = 1e-3  # the acceptance: 0.1 %


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_traced_matches_real_cpu_step(case):
    est = estimate(case).ranks[0]  # pipemem.estimate(..., mode="traced")
    real = measure_real(case)
    assert est.static.total == real.static_bytes
    assert abs(est.peak_allocated_bytes - real.peak_bytes) <= TOL * real.peak_bytes
    net_after_forward = est.jobs["F"].net_bytes
    assert abs(net_after_forward - real.net_after_forward) <= TOL * real.net_after_forward


def test_cases_cover_the_matrix():
    archs = {c.arch for c in CASES}
    assert {"llama", "mistral", "qwen2", "gpt2", "mixtral"} <= archs
    assert {"none", "full", "selective"} <= {c.recompute for c in CASES}
    assert {"sdpa", "eager"} <= {c.attn for c in CASES}
    assert any("autocast" in c.dtype for c in CASES) and any("pure" in c.dtype for c in CASES)
