"""The seed's three runs at their full size, on the seed-era programs: pipemem and Paddle's
own PipelineMemoryEstimator side by side, per card and job (no measurement: a 7B-wide layer's
programs are not run on the CPU; the tiny copies of the same cases are measured by
`pipemem validate paddle --ir paddlenlp-legacy`).

    PIPEMEM_PADDLE26_PYTHON=~/venvs/paddle26/bin/python \\
        python bench/paddlenlp_legacy_seed_shapes.py [--out docs/paddlenlp_legacy_seed_shapes.txt]

The seed's launch line (Paddle PR #63402): run_pretrain_auto_static.py, facebook/llama-7b's
shape with num_hidden_layers 4, max_seq_length 2048, fp32, no flash attention, no fused RMSNorm,
1F1B, gradient accumulation 8; pp 4 batch 1 with and without full recompute, pp 2 x mp 2
batch 2. Programs are built by paddlepaddle 2.6.2 + paddlenlp 2.8.1 (`build_case`) and read by
this interpreter's Paddle (legacy IR). MB = 2^20 bytes, as Paddle's memory logs print them.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipemem.validation.paddle_runs.paddlenlp_legacy import SEED_RUNS, build_case, compare_built  # noqa: E402

MB = 2**20


def _mb(v) -> str:
    return "-" if v is None else f"{v / MB:,.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()
    lines = [
        "# PIPEMEM_PADDLE26_PYTHON=~/venvs/paddle26/bin/python python bench/paddlenlp_legacy_seed_shapes.py",
        "# (programs built by paddlepaddle 2.6.2 + paddlenlp 2.8.1 at the seed's full size; "
        "estimates only; MB = 2^20 B)",
        f"{'case':44} {'pipemem MB':>12} {'Paddle MB':>12} {'difference':>12}  Paddle's error",
    ]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in SEED_RUNS.items():
            cards = build_case(name, Path(tmp) / name, spec=spec)
            for row in compare_built(name, cards, measure=False):
                ours, theirs = row["estimated_bytes"], row["paddle_estimated_bytes"]
                diff = "-" if theirs is None else f"{(ours - theirs) / MB:+,.2f}"
                lines.append(
                    f"{row['name']:44} {_mb(ours):>12} {_mb(theirs):>12} {diff:>12}  "
                    f"{row['paddle_error'][:60]}"
                )
            print(f"{name} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
