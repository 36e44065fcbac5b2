"""A sample of `pipemem plan` outputs held to the byte (tests/data/plan_golden.json, written by
tests/plan_golden.py before the search, the estimate and the allocator replay were made faster):
the same listed plans, per-rank peaks, costs, device peaks, verdicts and per-rank reserved."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_golden as golden  # noqa: E402

WANT = json.loads(golden.GOLDEN.read_text())


@pytest.mark.parametrize("case", golden.CASES, ids=[c[0] for c in golden.CASES])
def test_plan_search_matches_golden(case):
    want = WANT[case[0]]
    got = golden.run_case(case)
    assert got["stats"] == want["stats"]
    assert [p["flags"] for p in got["plans"]] == [p["flags"] for p in want["plans"]]
    assert got["judged"] == want["judged"]
    assert got == want


def test_judging_in_two_processes_gives_the_same():
    case = golden.CASES[1]
    assert golden.run_case(case, jobs=2) == WANT[case[0]]
