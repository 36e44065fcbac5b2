"""The one entry point of the validate workers that run a framework's own step in a subprocess
(`python -m pipemem.validation.<target>_trace CASE.json OUT.json`): read the case, measure it,
write what was measured. Each case runs in a fresh process so that it gets a fresh process group
and allocator; the harness (`rank_processes`, the target modules) reads OUT.json back.
"""

from __future__ import annotations

import json
import sys
from typing import Callable


def run_case_file(
    measure: Callable[[dict], dict], argv: list[str] | None = None, indent: int | None = None
) -> int:
    """`argv` (default: the command line's) is [CASE.json, OUT.json]: `measure` gets the case read
    from the first and its result is written to the second as JSON (`indent` as json.dump takes
    it). Returns the worker's exit status (0: an exception propagates, a traceback for the harness
    to show)."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        case = json.load(f)
    out = measure(case)
    with open(argv[1], "w") as f:
        json.dump(out, f, indent=indent)
    return 0
