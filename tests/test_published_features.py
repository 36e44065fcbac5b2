"""Modern-trainer features against measured runs (records of bench/data/published_runs.jsonl):
torchtune's full_finetune_single_device memory table (Llama 3.2 3B, b2 s4096, cumulative rows:
compile + chunked CE, + activation checkpointing + optimizer in backward, + activation
offloading) and litgpt's compiled stablecode-3B step. The estimate comes from the same call
users make, the plan from the record's own fields; the bounds are the acceptance bar of the
published-runs check (docs/published_runs.md), not fitted to these rows."""

import pytest

from pipemem.validation import published as V

IDS = (
    "torchtune-3B-Chunked_Cross_Entropy",
    "torchtune-3B-Fuse_optimizer_step_into_backward",
    "torchtune-3B-Activation_Offloading",
    "thunder-1175-stablecode3b-1gpu-compile-seq8192",
)
RECORDS = [r for r in V.load_records() if r["id"] in IDS]
assert len(RECORDS) == len(IDS)


@pytest.mark.parametrize("rec", RECORDS, ids=[r["id"] for r in RECORDS])
def test_feature_rows_within_eight_percent(rec):
    row = V.evaluate(rec)
    assert row["status"] == "compared", row["note"]
    assert abs(row["rel_error"]) <= 0.08, (row["id"], row["rel_error"])
