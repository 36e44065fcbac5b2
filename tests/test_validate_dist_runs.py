"""pipemem validate dist end to end: real gloo processes on 127.0.0.1 (pipelines, tensor-parallel,
FSDP2 and DistributedDataParallel runs, world 2), each rank measured by the profiler, against the
per-rank estimate. One launch for all CI cases (about two minutes on two cores)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipemem.cli.main import main  # noqa: E402
from pipemem.validation.dist import CI_CASES, LLAMA  # noqa: E402


def test_tp_rank_holds_its_shard_of_every_sharded_weight():
    # Hand count for torchtitan's plan at tp=2: embedding (vocab-sharded), q/k/v/o, gate/up/down
    # and lm_head are split in two; the three kinds of RMSNorm weights are replicated.
    import pipemem
    from pipemem.validation.distributed.models import hf_config

    spec = dict(LLAMA, layers=2)
    h, f, v, kv = spec["hidden"], spec["ffn"], spec["vocab"], spec["kv_heads"]
    hd = h // spec["heads"]
    layer_sharded = h * h + 2 * h * kv * hd + h * h + 3 * h * f
    sharded = v * h + spec["layers"] * layer_sharded + v * h
    replicated = spec["layers"] * 2 * h + h
    est = pipemem.estimate(
        hf_config(spec),
        mode="traced",
        kernel_policy="cpu",
        convention="torchtitan",
        step="first",
        dtype="fp32",
        tp=2,
        seq_len=16,
    )
    assert est.ranks[0].static.params == 4 * (sharded // 2 + replicated)


@pytest.mark.slow
def test_ci_cases_match_measured_peaks_per_rank(capsys):
    assert main(["validate", "dist", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["cases"]
    assert {r["case"] for r in rows} == set(CI_CASES)
    assert {r["case"].split("-")[0][:2] for r in rows} >= {"pp", "tp", "fs", "dd"}
    for r in rows:
        assert r["measured_bytes"] > 0 and r["estimated_bytes"] > 0
        assert r["rel_error"] == pytest.approx(
            (r["estimated_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
        )
        assert abs(r["rel_error"]) <= 0.01, r
    # both ranks of every case were measured on their own
    assert len(rows) == 2 * len(CI_CASES)
    # RegatherColwiseParallel's saving, measured and estimated, per rank
    savings = [r for r in rows if r["case"] == "tp2-llama-regather"]
    assert len(savings) == 2
    for r in savings:
        assert r["saving_measured_bytes"] > 0, r
        assert (
            abs(r["saving_estimated_bytes"] - r["saving_measured_bytes"]) <= 0.01 * r["saving_measured_bytes"]
        ), r
