"""`python -m pipemem.paddle.paddlenlp_worker SPEC.json RANK OUT.json`: build one rank's
PaddleNLP auto-parallel job programs (`pipemem.paddle.paddlenlp_build`) and write them as
pipemem IR (`pipemem.paddle.pir_capture.capture_jobs`) with the job list, as one JSON file.

Run by `pipemem.paddle.paddlenlp_programs` with the interpreter that has paddlenlp, one
process per rank: Paddle must be configured (rank, PIR) before it is imported and keeps
its auto-parallel state per process. Exit status 2 with one line on stderr when the
plan cannot be built.
"""

from __future__ import annotations

import json
import sys
import time

CAPTURE_VERSION = 5  # bump when the captured programs would change for the same spec


def capture_rank(plan) -> dict:
    """The JSON document of one rank: its job list and its job programs as pipemem IR."""
    from ..ir import programs_to_json
    from .pir_capture import capture_jobs

    programs, fed = capture_jobs(plan.programs)
    counts = {t: len(list(p.global_block().ops)) for t, p in plan.programs.items()}
    return {
        "format": "pipemem.paddlenlp-rank/1",
        "capture_version": CAPTURE_VERSION,
        "rank": plan.rank,
        "job_list": [list(j) for j in plan.job_list],
        "job_types": list(programs),
        "paddle_op_counts": counts,
        "fed_bytes": fed,
        "ir": programs_to_json(list(programs.values())),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3:
        print("usage: python -m pipemem.paddle.paddlenlp_worker SPEC.json RANK OUT.json", file=sys.stderr)
        return 2
    spec_path, rank, out = argv[0], int(argv[1]), argv[2]
    from .paddlenlp_build import BuildSpec, build_rank, set_rank_env

    with open(spec_path, encoding="utf-8") as f:
        spec = BuildSpec(**json.load(f))
    set_rank_env(rank, spec.world)
    import warnings

    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    try:
        plan = build_rank(spec, rank)
    except (ValueError, AssertionError, NotImplementedError) as e:
        print(
            f"Paddle could not build rank {rank}: {type(e).__name__}: {str(e).strip().splitlines()[0]}",
            file=sys.stderr,
        )
        return 2
    built = time.perf_counter() - t0
    from ..errors import UserError

    try:
        doc = capture_rank(plan)
    except UserError as e:
        print(f"rank {rank}: {e}", file=sys.stderr)
        return 2
    doc["seconds"] = {"build": round(built, 2), "capture": round(time.perf_counter() - t0 - built, 2)}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
