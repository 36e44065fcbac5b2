"""Liveness over a generated 1,000,000-op program (issue: Foundation; target <= 2 s).

The program is a chain of transformer-like ops: each op reads the previous activation and a
weight, writes a new activation; every 4th op is a view, every 8th in place, one in 16 has a
workspace, and every 32nd activation is kept alive to the end (a saved tensor). Timed:
`analyze_program` on a fresh program (flattening + walk), median of 5 runs.

    python bench/bench_liveness.py [--ops N] [--repeat R]
"""

import argparse
import statistics
import time

from pipemem.ir import Op, Program, Tensor
from pipemem.liveness import analyze_program


def build(n_ops: int) -> Program:
    p = Program("bench")
    tensors = p.tensors
    tensors["w"] = Tensor("w", (1024, 1024), "bf16", "param")
    tensors["a0"] = Tensor("a0", (4, 1024), "bf16")
    ops = p.ops
    prev = "a0"
    saved = []
    for i in range(1, n_ops + 1):
        name = f"a{i}"
        if i % 4 == 0:
            tensors[name] = Tensor(name, (1024, 4), "bf16", storage=tensors[prev].storage)
            ops.append(Op("view", (prev,), (name,)))
        elif i % 8 == 1 and i > 1:
            tensors[name] = Tensor(name, (4, 1024), "bf16", storage=tensors[prev].storage)
            ops.append(Op("relu_", (prev,), (name,)))
        else:
            tensors[name] = Tensor(name, (4, 1024 + i % 7), "bf16")
            ops.append(Op("matmul", (prev, "w"), (name,), workspace_bytes=(1 << 20) if i % 16 == 0 else 0))
        if i % 32 == 0:
            saved.append(name)
        prev = name
    ops.append(Op("loss", tuple(saved) + (prev,), ()))
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    times = []
    for _ in range(args.repeat):
        prog = build(args.ops)
        t0 = time.perf_counter()
        r = analyze_program(prog)
        times.append(time.perf_counter() - t0)
    print(
        f"liveness over {len(prog.ops):,} ops, {len(prog.tensors):,} tensors: "
        f"median {statistics.median(times):.3f} s over {args.repeat} runs "
        f"(min {min(times):.3f}, max {max(times):.3f}); peak {r.peak_bytes:,} B"
    )


if __name__ == "__main__":
    main()
