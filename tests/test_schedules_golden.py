"""Every built-in schedule's CLI JSON and estimates, held to the fingerprints the code gave before
the schedule registry (tests/data/schedules_golden.json, written by tests/schedules_golden.py):
same action lists, peaks, in-flight counts and refusals; same per-rank bytes in `estimate`. Rewritten
once on purpose: the one first-backward rule (a stage's first B or W makes its gradients) moved
the hf ZB-H1 estimates' ranks > 0, whose fused B makes them before the deferred W0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import schedules_golden as golden  # noqa: E402


def test_cli_and_estimates_match_golden():
    want = json.loads(golden.GOLDEN.read_text())
    got = golden.fingerprints()
    missing = sorted(set(want) - set(got))
    assert missing == []
    diff = {k: (want[k], got[k]) for k in want if got[k] != want[k]}
    assert diff == {}
