"""The framework rules give the same bytes as before they moved into pipemem/frameworks/:
tests/data/framework_baseline.json holds `pipemem.estimate` over ~290 plans (every convention
x pipeline / tensor / sequence / sharding / recompute / precision / optimizer / feature
variants x dense, Conv1D and MoE models: per-rank bytes, warnings, the resolved plan, the
suggestion levers, or the refusal's message) and one small `pipemem plan` search per
convention, written by bench/framework_baseline.py. It was first written with the code before
the move (the move reproduced it to the byte), then rewritten once for changes meant to move
numbers: the verdict judged on the device peak (headroom, fits, the plans a search lists), the
report row that shows gradients made in backward as grads, torchtitan's FSDP under pipelining,
the one first-backward rule (a stage's first B or W makes its gradients, never an I: the hf
ZB-H1 plan's rank 1 makes them in its fused B1, not in the deferred W0 at the end).
Rewrite it only for such a change, and review the diff."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = json.loads((ROOT / "tests" / "data" / "framework_baseline.json").read_text())


def _bench():
    path = ROOT / "bench" / "framework_baseline.py"
    spec = importlib.util.spec_from_file_location("framework_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()


def test_the_sample_is_the_one_the_script_makes():
    """The committed file covers exactly the plans the script lists (none dropped or added)."""
    listed = [{"model": c["model"], "kwargs": c["kwargs"]} for c in BENCH.cases()] + BENCH.plan_searches()
    stored = [{k: v for k, v in row.items() if k != "result"} for row in DATA]
    assert json.loads(json.dumps(listed)) == stored
    assert {r["kwargs"]["convention"] for r in DATA if "kwargs" in r} >= set(BENCH.CONVENTIONS)


def _as_stored(got, want):
    """`got` with only the keys the baseline stored: fields added since are not compared."""
    if isinstance(want, dict) and isinstance(got, dict):
        return {k: _as_stored(got.get(k), v) for k, v in want.items()}
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [_as_stored(g, w) for g, w in zip(got, want)]
    return got


@pytest.mark.parametrize("conv", ("megatron", "paddle", "torchtitan", "hf", "torchtune", "other"))
def test_estimates_are_unchanged(conv):
    """`other`: names in another case, names that are no convention, the other modes' refusals."""
    rows = [
        r
        for r in DATA
        if "kwargs" in r
        and (
            r["kwargs"]["convention"] == conv
            or conv == "other"
            and (r["kwargs"]["convention"] not in BENCH.CONVENTIONS or "mode" in r["kwargs"])
        )
    ]
    assert rows
    for row in rows:
        got = _as_stored(json.loads(json.dumps(BENCH.run_case(row))), row["result"])
        assert got == _as_stored(row["result"], row["result"]), f"{row['model']} {row['kwargs']}"


@pytest.mark.parametrize("conv", ("megatron", "paddle", "torchtitan", "hf", "torchtune"))
def test_plan_searches_are_unchanged(conv):
    row = next(r for r in DATA if r.get("search") == conv)
    assert json.loads(json.dumps(BENCH.run_search(row))) == row["result"]
