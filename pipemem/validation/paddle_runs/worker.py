"""`python -m pipemem.validation.paddle_runs.worker [--ir pir] [--trials N] [CASE ...]`: run the Paddle
comparison in this process and print one JSON object ``{"cases": [...]}``.

Paddle is configured before it is imported (legacy IR by default, PIR with ``--ir pir``;
garbage collection on), so this runs as its own process: `pipemem validate paddle` and
the tests start it (once per IR), and Paddle never shares a process with PyTorch.
"""

from __future__ import annotations

import json
import os
import sys

# Legacy `Program` IR (the captured and measured programs are legacy ones); GC on (eager
# deletion threshold 0 frees a var right after its last use). These are not negotiable.
PADDLE_ENV = {"FLAGS_enable_pir_api": "0", "FLAGS_eager_delete_tensor_gb": "0"}
# The same for PIR programs (Paddle 3's default IR).
PIR_ENV = {"FLAGS_enable_pir_api": "1", "FLAGS_eager_delete_tensor_gb": "0"}
# Quiet logs unless the caller asked for them.
LOG_ENV = {"GLOG_v": "0", "GLOG_minloglevel": "2"}
# A line on stderr after each case: `pipemem validate paddle` advances its progress bar on it.
PROGRESS_PREFIX = "pipemem-case-done: "


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipemem.validation.paddle_runs.worker")
    parser.add_argument(
        "--ir",
        choices=("legacy", "pir", "paddlenlp-legacy"),
        default="legacy",
        help="paddlenlp-legacy: the cases are LABEL=CARD_DIR of built job programs",
    )
    parser.add_argument(
        "--estimate-only",
        action="store_true",
        help="paddlenlp-legacy: pipemem's and Paddle's estimates without running the programs",
    )
    parser.add_argument("--trials", type=int, default=5, help="PIR: measured steps per case (smallest peak)")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    os.environ.update(PIR_ENV if args.ir == "pir" else PADDLE_ENV)
    for k, v in LOG_ENV.items():
        os.environ.setdefault(k, v)
    import warnings

    warnings.filterwarnings("ignore")
    from ...errors import UserError
    from .compare import compare, compare_pir

    if args.ir == "paddlenlp-legacy":
        from .paddlenlp_legacy import compare_card

        rows = []
        for item in args.cases:
            label, folder = item.split("=", 1)
            rows += compare_card(folder, label, measure=not args.estimate_only)
            print(f"{PROGRESS_PREFIX}{label}", file=sys.stderr, flush=True)
        json.dump({"cases": [r.to_dict() for r in rows]}, sys.stdout)
        print()
        return 0
    if args.ir == "pir":
        from .pir_models import CASES
    else:
        from .models import CASES

    names = args.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    try:
        rows = []
        for name in names:  # one at a time, so the caller can show progress per case
            rows += compare_pir([name], trials=args.trials) if args.ir == "pir" else compare([name])
            print(f"{PROGRESS_PREFIX}{name}", file=sys.stderr, flush=True)
    except UserError as e:
        print(str(e), file=sys.stderr)
        return 2
    json.dump({"cases": [r.to_dict() for r in rows]}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
