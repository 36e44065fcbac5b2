"""`pipemem validate deepspeed` in CI: DeepSpeed's own ZeRO engine (bf16, AdamW) training a tiny HF
Llama over a real gloo group on the CPU, rank 0's allocations measured with PyTorch's profiler,
against `pipemem.estimate` for the CI cases; the full set runs as `pipemem validate deepspeed --full`."""

import json
import subprocess
import sys

import pytest

from pipemem.validation import TARGETS
from pipemem.validation.deepspeed import CI_CASES, TOLERANCE, all_cases, available, hf_config, plan_kwargs


def _has_deepspeed() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("deepspeed") is not None and available() is None
    except Exception:  # noqa: BLE001
        return False


needs_deepspeed = pytest.mark.skipif(not _has_deepspeed(), reason="deepspeed 0.19.8 not importable")


def test_target_registered_and_cases_are_valid_plans():
    import pipemem

    assert "deepspeed" in TARGETS
    names = [c["name"] for c in all_cases()]
    assert len(names) == len(set(names)) and set(CI_CASES) <= set(names)
    for case in all_cases():  # every case is a plan pipemem accepts, through the one path
        kw = plan_kwargs(case)
        assert kw["convention"] == "hf" and kw["zero"] == case["zero"] and kw["dp"] == case["world"]
        est = pipemem.estimate(hf_config(case), kernel_policy="cpu", **kw)
        assert est.ranks[0].peak_allocated_bytes > 0


def test_validate_help_lists_deepspeed():
    out = subprocess.run(
        [sys.executable, "-m", "pipemem", "validate", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "deepspeed" in out.stdout


def test_measurement_counts_every_allocation_once(tmp_path):
    """The profiler-based count, without DeepSpeed: a bf16 model with torch.optim.AdamW, one process.
    The bytes alive when step 2 starts equal the analytic count of parameters, buffers, AdamW's
    states and the batch, and what the garbage collector reaches; the step leaves nothing behind."""
    pytest.importorskip("transformers")
    case = dict(all_cases()[0], name="plain", world=1, zero=0)
    src, out = tmp_path / "case.json", tmp_path / "out.json"
    src.write_text(json.dumps(case))
    proc = subprocess.run(
        [sys.executable, "-m", "pipemem.validation.deepspeed_trace", "--plain", str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["static_bytes"] == d["plain_expected"]["total"] == d["check_gc_bytes"]
    assert (
        d["live_after_step2"] == d["static_bytes"] and d["missed_frees"] == 0 and d["reconciled_bytes"] == 0
    )
    assert d["peak_bytes"] > d["static_bytes"]


@needs_deepspeed
@pytest.mark.slow
def test_validate_deepspeed_ci_cases_agree():
    out = subprocess.run(
        [sys.executable, "-m", "pipemem", "validate", "deepspeed", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    d = json.loads(out.stdout)
    assert {r["case"] for r in d["cases"]} == set(CI_CASES)
    assert (d["truth"], d["tolerance"], d["passed"]) == ("measured", TOLERANCE, True)
    for r in d["cases"]:
        assert r["measured_bytes"] > 0 and abs(r["rel_error"]) <= TOLERANCE, r
        # the settings the plan assumes (read from the config, else pipemem's defaults) are the engine's
        assert r["settings_disagree"] == {}, r["settings_disagree"]
