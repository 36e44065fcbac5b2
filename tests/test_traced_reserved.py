"""Reserved memory of traced estimates: each rank's allocation stream read from the recorded
programs (pipemem.traced.allocs: the sizes the kernels asked for, freed where the framework
freed them), strung through the schedule replay (pipemem.alloc_stream) and replayed through
the caching allocator model, as templates' streams are.

The reference is the templates' stream of the same model and plan: two independent accounts
of the same step (one generated, one recorded) that agree on allocated bytes. Both hold each
parameter as the HF module does (q, k, v, o; gate, up, down: separate tensors;
templates/static.rank_param_tensor_elems): lumping a layer's q/k/v into one tensor moved the
reserved bytes of a parameter-heavy rank by whole segments (pp 2 rank 0 below: 1.49 GB lumped,
1.28 GB as HF holds them). What the comparison checks is that the activations, gradients,
temporaries and optimizer step the two streams allocate leave the allocator with the same
reservations.

Tolerance: |reserved difference| <= |allocated difference| + 20 MiB. The allocated bytes of the
two streams are compared by other tests; on top of them the allocator reserves whole
segments, and requests under 10 MiB share 20 MiB large-pool segments (2 MiB small-pool ones
under 1 MiB): two streams that hold the same tensors but order a few temporaries differently
may end one such segment apart, no more (measured here: 6 MB at pp 1; 4 and 2 MB at pp 2, whose
last stage's allocated peaks differ by 29 MB: the traced stage keeps its logits beside the
loss's saved log-softmax).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import pipemem  # noqa: E402
from pipemem import alloc_stream as A  # noqa: E402
from pipemem.runtime import lower  # noqa: E402

CFG = {
    "model_type": "llama",
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 4,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
# the first step, fp32: the plan both modes model alike (traced pipelines trace the first step)
PLAN = dict(dtype="fp32", seq_len=1024, micro_batch=1, step="first")
PLANS = {"pp1": dict(PLAN), "pp2": dict(PLAN, pp=2, microbatches=4)}
SEGMENT = 20 << 20  # the large pool's segment for requests under 10 MiB (pipemem.allocator)

_TRACED: dict = {}


def traced(name: str):
    if name not in _TRACED:
        _TRACED[name] = pipemem.estimate(dict(CFG), mode="traced", **PLANS[name])
    return _TRACED[name]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_stream_is_the_traced_walk(name):
    """The recorded stream walks to each rank's allocated peak, to the byte, every free names a
    live allocation of its size, and the allocator reserves at least that peak."""
    e = traced(name)
    sp, sched = e.reserved_inputs
    low = lower(sched, e.runtime)
    first_mb = {s: m for s, m in sp.first_backward_overrides(sched)}
    for r in e.ranks:
        ev = A.rank_stream(sp, low, r.pp_rank, r.static, r.source[2], sp.stages, first_mb)
        assert ev.problems() == []
        assert ev.allocated_peak() == r.peak_allocated_bytes
        assert r.peak_reserved_bytes >= r.peak_allocated_bytes
    assert not any("reserved memory" in w for w in e.warnings)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_traced_and_templates_reserve_alike(name):
    t = traced(name)
    m = pipemem.estimate(dict(CFG), convention="hf", **PLANS[name])
    assert len(t.ranks) == len(m.ranks)
    for rt, rm in zip(t.ranks, m.ranks):
        d_alloc = abs(rt.peak_allocated_bytes - rm.peak_allocated_bytes)
        d_res = abs(rt.peak_reserved_bytes - rm.peak_reserved_bytes)
        assert d_res <= d_alloc + SEGMENT, (rt.pp_rank, rt.peak_reserved_bytes, rm.peak_reserved_bytes)


def test_verdict_and_json_use_traced_reserved(capsys, tmp_path):
    """The JSON carries each rank's reserved peak, the device peak is reserved + outside the
    allocator, the verdict takes the modelled margin; the CLI's report shows the column."""
    from pipemem.cli.main import main
    from pipemem.estimate import judge

    e = traced("pp2")
    gpu = 2 * e.max_device_peak_bytes
    d = e.to_dict()
    assert all(isinstance(r["peak_reserved_bytes"], int) for r in d["ranks"])
    assert d["max_peak_reserved_bytes"] == max(r["peak_reserved_bytes"] for r in d["ranks"])
    for r in e.ranks:
        assert r.device_peak_bytes == r.peak_reserved_bytes + r.outside.total_bytes
        assert r.verdict(gpu) == judge(r.device_peak_bytes, gpu, reserved_modelled=True) == "fits"
    assert e.reserved_modelled
    # a GPU with room for the allocated peak but not for what the allocator reserves: not FITS
    r0 = e.ranks[0]
    between = (
        r0.peak_allocated_bytes
        + r0.outside.total_bytes
        + (r0.peak_reserved_bytes - r0.peak_allocated_bytes) // 2
    )
    assert r0.peak_reserved_bytes > r0.peak_allocated_bytes and r0.verdict(between) == "oom"

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CFG))
    flags = ["--dtype", "fp32", "--seq-len", "1024", "--step", "first", "--pp", "2", "--microbatches", "4"]
    base = ["estimate", "--model", str(path), "--mode", "traced", *flags]
    assert main(base + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["peak_reserved_bytes"] for r in out["ranks"]] == [r.peak_reserved_bytes for r in e.ranks]
    assert not any("reserved memory" in w for w in out["warnings"])
    assert main(base + ["--wide", "--gpu", "h100-80g"]) == 0
    text = capsys.readouterr()
    assert "reserved" in text.out and "reserved not modelled" not in text.out
    assert "reserved memory" not in text.err


def test_replicated_layers_reserve_as_the_whole_trace(monkeypatch):
    """A step of more layers than traced repeats the template layer's piece of the recorded stream
    for the layers it stands for (traced.replicate.replicated_allocs): the same reserved bytes as
    a trace of every layer."""
    import functools

    from pipemem.traced import replicate

    cfg = dict(CFG, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    kw = dict(dtype="fp32", seq_len=64, step="first", convention="hf")
    calls = []
    real = replicate.replicated_allocs
    monkeypatch.setattr(replicate, "replicated_allocs", lambda step: calls.append(step) or real(step))
    rep = pipemem.estimate(dict(cfg, num_hidden_layers=5), mode="traced", **kw)
    assert rep.ranks[0].peak_reserved_bytes is not None and not any(
        "reserved memory" in w for w in rep.warnings
    )
    assert len(calls) == 1 and calls[0].traced.layers == 4  # 4 layers traced, the 5th repeated
    whole = functools.partial(replicate.trace_hf_replicated, traced_layers=64)
    monkeypatch.setattr(replicate, "trace_hf_replicated", whole)
    full = pipemem.estimate(dict(cfg, num_hidden_layers=5), mode="traced", **kw)
    assert full.ranks[0].peak_reserved_bytes is not None and len(calls) == 1  # every layer traced
    assert full.ranks[0].peak_allocated_bytes == rep.ranks[0].peak_allocated_bytes
    assert full.ranks[0].peak_reserved_bytes == rep.ranks[0].peak_reserved_bytes


def test_sharded_ranks_have_reserved_on_their_streams():
    """One traced TP rank and one FSDP2 rank: their recorded streams walk to the allocated peak;
    FSDP2's all-gather buffers are allocated on the all-gather stream and its reduce-scatter
    outputs on the reduce-scatter stream (pipemem.traced.allocs), one per unit and phase."""
    cfg = dict(CFG, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    cfg["num_hidden_layers"] = 2  # FSDP2 units: 2 layers and the root
    for kw, ag, rs in ((dict(tp=2), 0, 0), (dict(dp=2, fsdp=True), 2 + 1 + 2, 2 + 1)):
        e = pipemem.estimate(dict(cfg), mode="traced", dtype="fp32", seq_len=64, step="first", **kw)
        r = e.ranks[0]
        sp, sched = e.reserved_inputs
        ev = A.rank_stream(sp, lower(sched, e.runtime), 0, r.static, r.source[2], sp.stages, {})
        assert ev.problems() == [] and ev.allocated_peak() == r.peak_allocated_bytes
        assert r.peak_reserved_bytes >= r.peak_allocated_bytes
        allocs = ev.stream[ev.sign > 0].tolist()
        assert (allocs.count(A.ALL_GATHER), allocs.count(A.REDUCE_SCATTER)) == (ag, rs), kw


def test_split_backward_stream_is_the_traced_walk():
    """ZBVZeroBubble (two chunks per rank, V placement, I and W split): every rank's recorded stream
    walks to its allocated peak, the gradients' handles the same in B and in I / W."""
    cfg = dict(CFG, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    e = pipemem.estimate(
        dict(cfg),
        mode="traced",
        pp=2,
        microbatches=4,
        schedule="ZBVZeroBubble",
        dtype="fp32",
        seq_len=64,
        step="first",
    )
    sp, sched = e.reserved_inputs
    low = lower(sched, e.runtime)
    first_mb = {s: m for s, m in sp.first_backward_overrides(sched)}
    assert sched.split_backward and any(a.kind == "I" for a in low.ranks[0])
    for r in e.ranks:
        ev = A.rank_stream(sp, low, r.pp_rank, r.static, r.source[2], sp.stages, first_mb)
        assert ev.problems() == [] and ev.allocated_peak() == r.peak_allocated_bytes
        assert r.peak_reserved_bytes >= r.peak_allocated_bytes
