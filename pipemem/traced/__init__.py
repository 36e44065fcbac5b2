"""Traced mode: run a real eager training step of any PyTorch module on fake CPU tensors and
record its ops and storage lifetimes as pipemem IR (DESIGN.md, "Sources of programs").

Importing this package does not import torch; the names below load their modules on first
use:

* `trace_step(model_or_factory, example_inputs, loss_fn, optimizer_factory, kernel_policy="cuda")`
  -> `TracedStep` (step.py), `run_step` (the step itself, shared with real runs);
* `trace_hf_step(config, batch, seq, dtype=..., attn=..., recompute=...)` (hf.py);
* `trace_replicated(...)` (replicate.py): a few layers traced, the rest replicated exactly;
* `traced_estimate(model_config, plan, kernel_policy="cuda")` -> `TracedEstimate` (estimate.py);
* parallel plans (parallel.py): `traced_stage_plan` (pipeline stage jobs, first-backward
  variants, per-rank static and optimizer) and `trace_sharded_rank` (one TP or FSDP2 rank under
  PyTorch's fake process group), on the model split and sharded as torchtitan does
  (stack.py: `DecoderStack`, `tp_plan`); `dist_capture.py` records DTensor / FSDP2 code.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "trace_step": "step",
    "run_step": "step",
    "TracedStep": "step",
    "PhaseMemory": "step",
    "trace_stage": "step",
    "trace_hf_step": "hf",
    "trace_replicated": "replicate",
    "replicate_step": "replicate",
    "traced_estimate": "estimate",
    "TracedEstimate": "estimate",
    "traced_stage_plan": "parallel",
    "trace_sharded_rank": "parallel",
    "TracedStagePlan": "parallel",
    "DecoderStack": "stack",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
