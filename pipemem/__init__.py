"""pipemem: per-rank GPU memory of distributed training, at every moment of the pipeline schedule.

Layers (DESIGN.md "The flow"), each importing only from those before it:
ir -> liveness -> sources (traced, templates, paddle) -> stages -> schedules / replay -> report -> cli.
"""

from .configs.resolve import read_config  # noqa: E402
from .errors import UserError  # noqa: E402

# Eager on purpose: importing the submodule `pipemem.estimate` (the CLI does) would otherwise
# bind the package attribute to the module. It imports no torch.
from .estimate import Estimate, estimate  # noqa: E402
from .ir import Op, Program, Tensor, TensorKind, load_programs, save_programs  # noqa: E402
from .liveness import analyze_program, analyze_sequence  # noqa: E402
from .pipeline_estimator import PipelineMemoryEstimator  # noqa: E402
from .version import __version__  # noqa: E402,F401

__all__ = [
    "UserError",
    "Op",
    "Program",
    "Tensor",
    "TensorKind",
    "load_programs",
    "save_programs",
    "analyze_program",
    "analyze_sequence",
    "PipelineMemoryEstimator",
    "Estimate",
    "estimate",
    "read_config",
]
