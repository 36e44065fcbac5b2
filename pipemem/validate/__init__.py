"""`pipemem validate <target>`: run real steps, measure, compare with the estimate.

Each target lives in its own module here (cpu.py, dist.py, paddle.py, cuda.py) and defines
`register(subparsers)` and `run(args) -> int`; `cmd_validate` discovers them.
"""

TARGETS = ("cpu", "dist", "paddle", "cuda")
