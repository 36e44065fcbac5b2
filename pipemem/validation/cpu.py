"""`pipemem validate cpu`: traced estimates against real CPU training steps.

Each case builds a tiny HF causal LM, runs the default training step for real on the CPU
twice, the second under `torch.profiler.profile(profile_memory=True)` (the steady state
users measure: optimizer states exist, gradients were set to None), and sums the allocation
events in time order (read from `prof.profiler.kineto_results.experimental_event_tree()`,
an allocation event per block the CPU allocator hands out or takes back). Measured peak =
bytes of parameters, buffers, inputs and optimizer states + the highest running sum;
net after forward = the running sum when the backward starts. The estimate is the traced step
with `--kernel-policy cpu` (the kernels the real run uses). Seconds per case on 2 cores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .compare import CaseRow, add_listed_case_options, pick_cases

TRUTH = "measured"  # a real run, bytes from the allocator or profiler (compare.TRUTHS)
# A real step measured by the profiler against a trace with the kernels it runs: the same
# tensors, so a row may differ only by a few scalars (0.1 %).
TOLERANCE = 1e-3

EXAMPLE = """\
examples:
  pipemem validate cpu
  pipemem validate cpu --json
  pipemem validate cpu --cases llama-fp32-sdpa,mixtral-bf16-pure
"""


@dataclass(frozen=True)
class Case:
    name: str
    arch: str
    dtype: str = "fp32"
    attn: str = "sdpa"
    recompute: str = "none"
    batch: int = 2
    seq: int = 64
    optimizer: str = "adamw"


CASES = (
    Case("llama-fp32-sdpa", "llama", batch=4, seq=256),
    Case("llama-fp32-eager", "llama", attn="eager", batch=4, seq=128),
    Case("llama-bf16-autocast-full", "llama", dtype="bf16-autocast", recompute="full"),
    Case("llama-fp32-selective", "llama", recompute="selective", seq=256),
    Case("mistral-bf16-autocast", "mistral", dtype="bf16-autocast", batch=4, seq=128),
    Case("qwen2-bf16-pure-full", "qwen2", dtype="bf16-pure", recompute="full"),
    Case("gpt2-fp32-eager", "gpt2", attn="eager"),
    Case("gpt2-fp32-sdpa-full", "gpt2", recompute="full"),
    Case("mixtral-bf16-pure", "mixtral", dtype="bf16-pure"),
    Case("mixtral-bf16-pure-full", "mixtral", dtype="bf16-pure", recompute="full"),
    Case("llama-fp16-autocast", "llama", dtype="fp16-autocast"),
    Case("llama-fp16-pure", "llama", dtype="fp16-pure"),
    Case("gpt2-bf16-autocast-selective", "gpt2", dtype="bf16-autocast", recompute="selective"),
)


@dataclass
class Measured:
    peak_bytes: int
    net_after_forward: int
    static_bytes: int


def _storages_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr(), st.nbytes()] = st.nbytes()
    return sum(seen.values())


def measure_step(
    model, args, kwargs, loss_fn, optimizer=None, autocast_dtype=None, inputs=(), step: str = "steady"
) -> Measured:
    """Run `step.run_step` for real on the CPU under the profiler; peak and net after forward
    from the allocation events, plus the bytes alive when the step starts: parameters,
    buffers, `inputs`, and (step="steady": one unmeasured step runs first) the optimizer
    states and any gradients the first step left."""
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..traced.step import run_step, zero_grads

    if step == "steady":
        run_step(model, args, kwargs, loss_fn, optimizer, autocast_dtype)
        if optimizer is None:
            zero_grads(model.parameters())
    states = [
        v
        for st in (optimizer.state.values() if optimizer is not None else ())
        for v in st.values()
        if isinstance(v, torch.Tensor)
    ]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    static = _storages_bytes([*model.parameters(), *model.buffers(), *inputs, *states, *grads])

    def on_phase(phase):
        with record_function(f"pipemem::{phase}"):
            pass

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(model, args, kwargs, loss_fn, optimizer, autocast_dtype, on_phase)
    allocs, marks = [], {}

    def walk(node):
        if node.typed[0] == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.typed[1].alloc_size))
        elif node.name.startswith("pipemem::"):
            marks[node.name[len("pipemem::") :]] = node.start_time_ns
        for c in node.children:
            walk(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    allocs.sort()
    cur = peak = 0
    net_fwd = None
    t_backward = marks.get("backward")
    for t, size in allocs:
        if net_fwd is None and t_backward is not None and t >= t_backward:
            net_fwd = cur
        cur += size
        peak = max(peak, cur)
    return Measured(
        peak_bytes=static + peak,
        net_after_forward=net_fwd if net_fwd is not None else cur,
        static_bytes=static,
    )


def measure_real(case: Case, seed: int = 0) -> Measured:
    """Run the case's training step for real on the CPU and measure it with the profiler."""
    import torch

    from ..traced.hf import (
        TINY,
        Precision,
        build_model,
        enable_recompute,
        hf_loss,
        make_config,
        optimizer_factory,
        step_inputs,
    )

    torch.manual_seed(seed)
    cfg = make_config(TINY[case.arch], case.attn)
    prec = Precision.parse(case.dtype)
    model = build_model(cfg, prec.param_dtype, device="cpu")
    enable_recompute(model, case.recompute)
    kwargs = step_inputs(cfg, case.batch, case.seq)()
    opt_factory = optimizer_factory(case.optimizer)
    optimizer = opt_factory(model.parameters()) if opt_factory else None
    return measure_step(
        model, (), kwargs, hf_loss, optimizer, prec.autocast_dtype, inputs=[kwargs["input_ids"]]
    )


def estimate(case: Case):
    """`pipemem.estimate` of the case in traced mode (cpu kernel policy): the call users make."""
    import pipemem

    from ..traced.hf import TINY

    base, _, how = case.dtype.partition("-")
    # HF modules and PyTorch's zero_grad(set_to_none=True), as the real step runs them
    return pipemem.estimate(
        TINY[case.arch],
        mode="traced",
        kernel_policy="cpu",
        convention="hf",
        grads="set-to-none",
        micro_batch=case.batch,
        seq_len=case.seq,
        dtype=base,
        master_weights=how != "pure",
        flash_attn=case.attn == "sdpa",
        recompute=case.recompute,
        optimizer=case.optimizer,
    )


def run_cases(cases=CASES, progress=None) -> list[CaseRow]:
    """Trace and measure each case; `progress` (a progress.CaseProgress) follows along."""
    rows = []
    for case in cases:
        if progress is not None:
            progress.start(case.name)
        t0 = time.perf_counter()
        est = estimate(case).ranks[0]
        t1 = time.perf_counter()
        real = measure_real(case)
        t2 = time.perf_counter()
        for what, m, e in (
            ("peak", real.peak_bytes, est.peak_allocated_bytes),
            ("net_after_forward", real.net_after_forward, est.jobs["F"].net_bytes),
        ):
            rows.append(
                CaseRow(
                    f"{case.name}/{what}",
                    int(m),
                    int(e),
                    {"trace_seconds": round(t1 - t0, 3), "real_seconds": round(t2 - t1, 3)},
                )
            )
        if progress is not None:
            progress.done(case.name)
    return rows


HELP = "traced estimates vs real CPU training steps of tiny HF models"
DESCRIPTION = (
    "Run the default training step of tiny HF models (Llama, Mistral, Qwen2, "
    "GPT-2, Mixtral) for real on the CPU, measure peak and net-after-forward "
    "bytes with the profiler, and compare with traced mode "
    "(--kernel-policy cpu). Exit 1 if any case is off by more than "
    f"{TOLERANCE:.1%}."
)


def add_arguments(p) -> None:
    add_listed_case_options(p, CASES)


def run(args) -> int:
    from .compare import require
    from .progress import CaseProgress, print_result, quiet_profiler_chatter

    cases = pick_cases(getattr(args, "cases", ""), CASES)
    require("cpu", ("torch", "transformers"))
    with quiet_profiler_chatter(), CaseProgress([c.name for c in cases], "validate cpu") as bar:
        rows = run_cases(cases, bar)
    return print_result(
        rows,
        args.json,
        "cpu",
        TRUTH,
        TOLERANCE,
        {"kernel_policy": "cpu"},
        columns=(("trace_seconds", "trace s"), ("real_seconds", "real s")),
        signed=lambda name: name.endswith("net_after_forward"),
    )
