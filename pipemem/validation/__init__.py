"""Validation: pipemem's estimates against measurements of real runs and traces of the
frameworks' own code. Apart from the flow of DESIGN.md (nothing in the core imports it).

* `pipemem validate <target>`: each target is a module here (cpu.py, dist.py, paddle.py,
  cuda.py...) holding `HELP`, `DESCRIPTION`, `EXAMPLE`, `add_arguments(parser)` and
  `run(args) -> int` (cli/command.py); `cmd_validate` finds them through TARGETS. A target of
  named cases (NAMED_CASE_TARGETS) holds no `add_arguments` or `run`: `compare.NamedCaseCommand`
  makes them, and `compare.run_named_cases` reads its cases, tolerance and library check off it.
  Every target estimates through `pipemem.estimate`, reports
  `compare.CaseRow`s (one `rel_error`), states its `TRUTH` (measured: a real run; traced: the
  framework's code on fake tensors) and `TOLERANCE`, and exits 1 beyond it (`compare.report`,
  `compare.exit_code`). A target checks the libraries it runs first (`compare.require`: one
  error line naming what to install, not an import traceback).
* `distributed/`: the models and launch helpers of the gloo runs (`validate dist`).
* `paddle_runs/`: the Paddle cases, executor measurements and the comparison worker.
* `published.py`: the published measured runs (bench/validate_published.py).
* `features.py`: compile, chunked CE, fp8 and optimizer-in-backward against their libraries' traces.
* `allocations.py`: the CPU allocator's events from PyTorch's profiler as bytes over time (what the
  targets that run a framework's own step on the CPU measure: deepspeed, hf_trainer);
  `rank_processes.py`: one measuring process per rank, as a launcher starts them.
* `allocator.py`: the caching-allocator model against recorded GPU memory snapshots.
"""

TARGETS = (
    "cpu",
    "dist",
    "paddle",
    "cuda",
    "megatron",
    "torchtitan",
    "torchtune",
    "deepspeed",
    "hf_trainer",
    "features",
    "allocator",
)
# targets of named cases: their command is compare.NamedCaseCommand, made from the module
NAMED_CASE_TARGETS = ("torchtitan", "torchtune", "deepspeed", "hf_trainer")
