"""What every `pipemem validate` target says about its numbers: its truth (measured or traced),
its tolerance, and a verdict that fails beyond it (validation/compare.py)."""

import importlib
import json

import pytest

from pipemem.validation import TARGETS
from pipemem.validation.compare import (
    TRUTHS,
    CaseRow,
    beyond_tolerance,
    exit_code,
    header_line,
    report,
    verdict_line,
)

# a real run measured by the allocator or profiler, or the framework's code on fake tensors
EXPECTED_TRUTH = {
    "cpu": "measured",
    "dist": "measured",
    "paddle": "measured",
    "cuda": "measured",
    "deepspeed": "measured",
    "hf_trainer": "measured",
    "allocator": "measured",
    "megatron": "traced",
    "torchtitan": "traced",
    "torchtune": "traced",
    "features": "traced",
}


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_states_its_truth_and_tolerance(target):
    mod = importlib.import_module(f"pipemem.validation.{target}")
    assert mod.TRUTH == EXPECTED_TRUTH[target]
    assert 0 < mod.TOLERANCE < 0.1


def test_rows_beyond_tolerance_fail_the_target():
    rows = [CaseRow("exact", 1000, 1000), CaseRow("close", 1000, 1009), CaseRow("off", 1000, 1011)]
    assert beyond_tolerance(rows, 0.01) == ["off"] and exit_code(rows, 0.01) == 1
    assert beyond_tolerance(rows[:2], 0.01) == [] and exit_code(rows[:2], 0.01) == 0
    # low is as wrong as high
    assert beyond_tolerance([CaseRow("low", 1000, 989)], 0.01) == ["low"]


def test_a_row_tolerance_a_known_gap_and_an_unreliable_measurement():
    own = CaseRow("own", 1000, 1040, {"tolerance": 0.05})
    gap = CaseRow("gap", 1000, 650, {"known_gap": "template low: not modelled"})
    doubt = CaseRow("doubt", 1000, 1000, {"unreliable": "repair beyond its bound"})
    assert beyond_tolerance([own, gap], 0.01) == []
    assert beyond_tolerance([CaseRow("own", 1000, 1060, {"tolerance": 0.05})], 0.01) == ["own"]
    assert beyond_tolerance([doubt], 0.01) == ["doubt"]  # exact, but the measurement is in doubt
    text = verdict_line([own, gap, doubt], 0.01)
    assert text.startswith("FAIL: 1 of 2 rows") and "known gap: gap: template low" in text and "doubt" in text


def test_a_measured_zero_against_a_nonzero_estimate_fails():
    assert beyond_tolerance([CaseRow("z", 0, 8)], 0.5) == ["z"]
    assert beyond_tolerance([CaseRow("zz", 0, 0)], 0.0) == []
    as_dict = {"name": "d", "measured_bytes": 0, "estimated_bytes": 8, "rel_error": None}
    assert beyond_tolerance([as_dict], 0.5) == ["d"]


def test_report_carries_truth_tolerance_and_verdict():
    rows = [CaseRow("a", 100, 100), CaseRow("b", 100, 150, {"known_gap": "why"}), CaseRow("c", 100, 103)]
    doc = json.loads(json.dumps(report("x", "traced", 0.02, rows, extra_field=1)))
    assert (doc["truth"], doc["tolerance"], doc["extra_field"]) == ("traced", 0.02, 1)
    assert doc["truth_means"] == TRUTHS["traced"]
    assert doc["beyond_tolerance"] == ["c"] and doc["passed"] is False and doc["known_gaps"] == ["b"]
    assert [c["name"] for c in doc["cases"]] == ["a", "b", "c"]
    with pytest.raises(ValueError):
        report("x", "guessed", 0.02, rows)
    assert "truth traced" in header_line("x", "traced", 0.02) and "2.00%" in header_line("x", "traced", 0.02)


def test_dist_rows_show_the_repair_and_fail_beyond_its_bound():
    from pipemem.validation.dist import REPAIR_BOUND, check_repair

    # the unproven part of the repair (proven - repaired) is what the bound limits
    top = 1000 + int(REPAIR_BOUND * 1000)
    small = CaseRow("r0", 1000, 1000, {"raw_measured_bytes": 2000, "proven_measured_bytes": top})
    large = CaseRow("r1", 1000, 1000, {"raw_measured_bytes": 2000, "proven_measured_bytes": top + 1})
    for r in (small, large):
        check_repair(r)
    assert (
        small.extra["assumed_repair_rel"] == pytest.approx(REPAIR_BOUND) and "unreliable" not in small.extra
    )
    assert small.extra["repair_rel"] == pytest.approx(1.0)
    assert "unreliable" in large.extra and beyond_tolerance([small, large], 0.01) == ["r1"]


def test_dist_raw_peak_is_the_recorded_one_and_the_repair_lowers_it_by_at_most_the_missed_bytes():
    torch = pytest.importorskip("torch")  # noqa: F841
    from pipemem.validation.dist_worker import _running_peak, repair_missed_frees

    # two blocks at one address with no free between (the free was on another thread), a wait at t=15
    events = [(10, 100, 1, "a"), (20, 50, 2, "b"), (30, 100, 1, "c"), (40, -100, 1, "d"), (50, -50, 2, "e")]
    repaired, missed = repair_missed_frees(events, waits=[15])
    proven = _running_peak(repair_missed_frees(events, waits=[15], at_reuse=True)[0], 0)[0]
    raw_peak = _running_peak(events, 0)[0]
    peak = _running_peak(repaired, 0)[0]
    assert (raw_peak, missed) == (250, 100)
    assert peak == 150 and raw_peak - missed <= peak <= proven <= raw_peak
    assert proven == 150  # freed at t=30, when its address is handed out again
