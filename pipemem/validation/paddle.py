"""`pipemem validate paddle`: Paddle static programs - pipemem vs Paddle's own estimator.

Each case is a small Paddle legacy-IR training program (MLP; GPT- and Llama-style 2-layer
decoders, with and without Paddle's static `RecomputeOptimizer`). Its main program is
split by op role into forward / backward / optimizer (the -zb cases further split the
backward into backward_b / backward_w, zero-bubble style), and for each sub-program and
quantity (net change, peak above its start) three numbers are put side by side:
pipemem's liveness over the captured program, Paddle's own
`paddle.distributed.passes.pass_utils.PipelineMemoryEstimator` on the same sub-programs,
and a measurement: the sub-programs run in sequence as jobs of one Paddle executor plan on
the CPU, reading the host allocator's statistics between jobs (pipemem/validation/paddle_runs/measure.py).

The paddlenlp-* cases are PaddleNLP's own auto-parallel Llama programs, built for every card
of a plan by Paddle's own passes (1F1B, FThenB, VPP; pp, mp, sharding), measured job
by job on Paddle's executor and estimated by `pipemem.estimate(mode="paddle")`
(pipemem/validation/paddle_runs/paddlenlp_cases.py); they need the paddlenlp interpreter
($PIPEMEM_PADDLENLP_PYTHON).

The paddlenlp-legacy-* cases are the same PaddleNLP runs as Paddle's pipeline-memory-estimator
pull request ran them: legacy IR, built by paddlepaddle 2.6's pipeline passes
($PIPEMEM_PADDLE26_PYTHON), compared on this Paddle's legacy executor with Paddle's estimator
beside pipemem (pipemem/validation/paddle_runs/paddlenlp_legacy.py).

The -pir cases are the same models built as PIR programs (Paddle 3's default IR). PIR
programs cannot be measured per sub-program (no py_func op in PIR), so each is compared
over the whole step: its peak, its net change, and the bytes it allocates with garbage
collection off (pipemem/validation/paddle_runs/pir_measure.py); Paddle's estimator cannot read PIR
programs (n/a).

Paddle runs in a subprocess (`python -m pipemem.validation.paddle_runs.worker`), one per IR: it must be
configured before import (legacy IR or PIR) and must not share a process with PyTorch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..errors import UserError
from .compare import CaseRow, add_json_option, exit_code
from .paddle_runs.models import CASES  # builders only: paddle is imported when one runs, in the worker
from .paddle_runs.paddlenlp_cases import CASE_NAMES as PADDLENLP_CASE_NAMES
from .paddle_runs.paddlenlp_legacy import CASE_NAMES as LEGACY_NLP_CASE_NAMES
from .paddle_runs.pir_models import CASES as PIR_CASES

TRUTH = "measured"  # a real run, bytes from the allocator or profiler (compare.TRUTHS)
# Paddle's executor measured (host memory statistics) against pipemem over the same captured
# programs: every line within 1 % (docs/ACCURACY.md).
TOLERANCE = 0.01

EXAMPLE = """\
examples:
  pipemem validate paddle
  pipemem validate paddle --json
  pipemem validate paddle --cases mlp,gpt2-recompute
  pipemem validate paddle --ir pir
  PIPEMEM_PADDLENLP_PYTHON=~/venvs/paddlenlp/bin/python pipemem validate paddle --ir paddlenlp --cases paddlenlp-pp4
  PIPEMEM_PADDLE26_PYTHON=~/venvs/paddle26/bin/python pipemem validate paddle --ir paddlenlp-legacy
"""  # noqa: E501 (example command lines, printed as they stand)

CASE_NAMES = tuple(CASES)
PIR_CASE_NAMES = tuple(PIR_CASES)


def run_cases(
    names=CASE_NAMES,
    timeout: float | None = None,
    ir: str = "legacy",
    trials: int | None = None,
    progress=None,
) -> list[CaseRow]:
    """Run the comparison for `names` (all of one IR: "legacy" or "pir") in a fresh Python
    process; its `cases[]` rows. `progress` (a progress.CaseProgress) advances per case, on
    the worker's progress lines. `timeout`: seconds for the whole run (default 300 per case:
    a PIR case's trials take minutes on a loaded 2-core machine)."""
    import tempfile
    import threading
    import time
    from importlib.util import find_spec

    from .paddle_runs.worker import PROGRESS_PREFIX

    if find_spec("paddle") is None:
        raise UserError("pipemem validate paddle needs paddlepaddle: pip install 'pipemem[paddle]'")
    cmd = [sys.executable, "-m", "pipemem.validation.paddle_runs.worker", "--ir", ir]
    if timeout is None:
        timeout = 300.0 * max(1, len(list(names)))
    if trials is not None:
        cmd += ["--trials", str(trials)]
    left = list(names)
    err_lines: list[str] = []
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [*cmd, "--", *names], stdout=out, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
        )
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        started = time.monotonic()
        try:
            if progress is not None and left:
                progress.start(left[0])
            for line in proc.stderr:
                if not line.startswith(PROGRESS_PREFIX):
                    err_lines.append(line)
                    continue
                name = line[len(PROGRESS_PREFIX) :].strip()
                if name in left:
                    left.remove(name)
                if progress is not None:
                    progress.done(name)
                    if left:
                        progress.start(left[0])
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode < 0 and time.monotonic() - started >= timeout:
            raise subprocess.TimeoutExpired(cmd, timeout)
        out.seek(0)
        stdout = out.read()
    stderr = "".join(err_lines)
    if proc.returncode == 2:
        raise UserError(stderr.strip().splitlines()[-1] if stderr.strip() else "paddle worker refused")
    if proc.returncode != 0:
        raise RuntimeError(f"paddle worker failed (exit {proc.returncode}):\n{stderr[-4000:]}")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"paddle worker printed no result:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return [CaseRow.from_dict(r) for r in json.loads(lines[-1])["cases"]]


HELP = "Paddle static programs: pipemem vs Paddle's PipelineMemoryEstimator"
DESCRIPTION = __doc__.split("\n\n")[1]


def add_arguments(p) -> None:
    add_json_option(p)
    p.add_argument(
        "--cases",
        default="",
        help="comma-separated case names (default: all of --ir); "
        f"known: {', '.join(CASE_NAMES + PIR_CASE_NAMES + PADDLENLP_CASE_NAMES + LEGACY_NLP_CASE_NAMES)}",
    )
    p.add_argument(
        "--ir",
        choices=("legacy", "pir", "both", "paddlenlp", "paddlenlp-legacy", "all"),
        default="all",
        help="legacy Program cases, PIR cases (*-pir), both, PaddleNLP's own programs (paddlenlp-*: PIR, "
        "paddle 3; paddlenlp-legacy-*: legacy IR, built by paddle 2.6), or all (default; the "
        "paddlenlp cases are skipped with a note when their interpreter is missing)",
    )
    p.add_argument(
        "--trials", type=int, default=3, help="paddlenlp cases: measured runs per job (smallest peak)"
    )


def _with_interpreter(cases: list[str], interpreter, label: str, asked: bool, notes: list[str]) -> list[str]:
    """`cases` when their interpreter is there; else a UserError if they were asked for by
    name or --ir, or none and a note (the default --ir all)."""
    if not cases:
        return []
    try:
        interpreter()
    except UserError as e:
        if asked:
            raise
        notes.append(f"{label} cases skipped: {e}")
        return []
    return cases


def run(args) -> int:
    ir = getattr(args, "ir", "all")
    allowed = {
        "legacy": CASE_NAMES,
        "pir": PIR_CASE_NAMES,
        "both": CASE_NAMES + PIR_CASE_NAMES,
        "paddlenlp": PADDLENLP_CASE_NAMES,
        "paddlenlp-legacy": LEGACY_NLP_CASE_NAMES,
        "all": CASE_NAMES + PIR_CASE_NAMES + PADDLENLP_CASE_NAMES + LEGACY_NLP_CASE_NAMES,
    }[ir]
    names = [n.strip() for n in args.cases.split(",") if n.strip()] or list(allowed)
    bad = [n for n in names if n not in allowed]
    if bad:
        raise UserError(
            f"--cases: unknown case(s) {', '.join(bad)} for --ir {ir}; known: {', '.join(allowed)}"
        )
    from .progress import CaseProgress, print_result

    rows = []
    legacy = [n for n in names if n in CASE_NAMES]
    pir = [n for n in names if n in PIR_CASE_NAMES]
    with CaseProgress(legacy + pir, "validate paddle") as bar:
        if legacy:
            rows += run_cases(legacy, progress=bar)
        if pir:
            rows += run_cases(pir, ir="pir", progress=bar)
    notes: list[str] = []
    from ..paddle.paddlenlp_programs import paddlenlp_python
    from .paddle_runs import paddlenlp_cases, paddlenlp_legacy

    explicit = bool(args.cases)
    nlp = _with_interpreter(
        [n for n in names if n in PADDLENLP_CASE_NAMES],
        paddlenlp_python,
        "paddlenlp",
        explicit or ir == "paddlenlp",
        notes,
    )
    for n in nlp:
        rows += paddlenlp_cases.compare_case(n, trials=getattr(args, "trials", 3))
    legacy_nlp = _with_interpreter(
        [n for n in names if n in LEGACY_NLP_CASE_NAMES],
        paddlenlp_legacy.paddle26_python,
        "paddlenlp-legacy",
        explicit or ir == "paddlenlp-legacy",
        notes,
    )
    for n in legacy_nlp:
        rows += [CaseRow.from_dict(r) for r in paddlenlp_legacy.compare_case(n)]
    perrs = [abs(r.get("paddle_rel_error")) for r in rows if r.get("paddle_rel_error") is not None]
    status = print_result(
        rows,
        args.json,
        "paddle",
        TRUTH,
        TOLERANCE,
        dict(paddle_max_abs_rel_error=max(perrs, default=0.0), notes=notes),
        columns=(("paddle_estimated_bytes", "Paddle estimator"), ("paddle_rel_error", "its error")),
        signed=lambda name: name.endswith("net"),
        what="lines",
    )
    if args.json:
        return status
    undefined = sum(
        1 for r in rows if r.get("paddle_rel_error") is None and r.get("paddle_estimated_bytes") is not None
    )
    theirs = (f"max |error| {max(perrs) * 100:.2f}%" if perrs else "n/a") + (
        f" ({undefined} lines with measured 0 and a non-zero estimate have no relative error)"
        if undefined
        else ""
    )
    if any(r.get("paddle_estimated_bytes") is None and not r.get("paddle_error") for r in rows):
        theirs += "; it cannot read PIR programs (- on the -pir and paddlenlp lines)"
    failed = sorted({r.get("paddle_error") for r in rows if r.get("paddle_error")})
    if failed:
        theirs += f"; it fails on {sum(1 for r in rows if r.get('paddle_error'))} line(s) (-): " + " | ".join(
            failed
        )
    print(f"Paddle's own estimator: {theirs}")
    for note in notes:
        print(f"note: {note}")
    return exit_code(rows, TOLERANCE)
