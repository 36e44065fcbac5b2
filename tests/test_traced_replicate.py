"""Layer replication (4 layers traced, the rest repeated) equals the full trace to the byte;
traced_estimate maps a plan and rejects what it cannot trace."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipemem.errors import UserError  # noqa: E402
from pipemem.plan import ParallelPlan  # noqa: E402
from pipemem.traced.hf import TINY, trace_hf_step  # noqa: E402
from pipemem.traced.replicate import trace_hf_replicated  # noqa: E402


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("llama", dict(dtype="bf16-autocast")),
        ("qwen2", dict(dtype="bf16-pure", recompute="full")),
        ("gpt2", dict(attn="eager", recompute="selective")),
        ("mistral", dict(dtype="fp32", attn="eager", recompute="full", kernel_policy="cpu")),
        # autocast + checkpointing: the cached bf16 weight copies of every layer are freed together
        # when autocast exits, outside the layers
        ("llama", dict(dtype="bf16-autocast", recompute="full")),
        ("mixtral", dict(dtype="bf16-pure", recompute="selective")),
    ],
)
def test_replicated_equals_full_trace(arch, kw):
    n = 7
    kw = {"kernel_policy": "cuda", **kw}
    rep = trace_hf_replicated(TINY[arch], 2, 64, n_layers=n, **kw)
    full = trace_hf_step(TINY[arch], 2, 64, layers=n, **kw)
    assert rep.traced.layers == 4 and full.layers == n
    assert rep.static == full.static
    assert [(p.name, p.net_bytes, p.peak_bytes) for p in rep.phases] == [
        (p.name, p.net_bytes, p.peak_bytes) for p in full.phases
    ]
    assert rep.peak_bytes == full.peak_bytes


def test_traced_estimate_maps_plan():
    from pipemem.traced import traced_estimate

    cfg = dict(TINY["llama"])
    est = traced_estimate(
        cfg,
        ParallelPlan(seq_len=64, micro_batch=2, dtype="fp32", layers=3, optimizer="sgd"),
        kernel_policy="cpu",
    )
    full = trace_hf_step(cfg, 2, 64, dtype="fp32", optimizer="sgd", kernel_policy="cpu")
    assert est.peak_allocated_bytes == full.peak_bytes
    assert est.jobs.F.net_bytes == full.net_after_forward
    assert est.static.params == full.static["params"]
    d = est.to_dict()
    assert d["ranks"][0]["jobs"]["B"]["peak_bytes"] == full.phase("backward").peak_bytes
    assert d["max_peak_allocated_bytes"] == full.peak_bytes


@pytest.mark.parametrize(
    "plan",
    [
        ParallelPlan(tp=2),
        ParallelPlan(pp=4),
        ParallelPlan(cp=2),
        ParallelPlan(recompute="core_attn"),
        ParallelPlan(optimizer="adam8bit"),
    ],
)
def test_traced_estimate_rejects(plan):
    from pipemem.traced import traced_estimate

    with pytest.raises(UserError):
        traced_estimate(dict(TINY["llama"]), plan)
