"""Stage jobs of a torch.distributed.pipelining run, traced on fake tensors.

For one pipeline stage (a `DecoderStack` slice) the actions F, B, I and W are traced with the
very functions the pipelining runtime calls (`stage_backward`, `stage_backward_input`,
`stage_backward_weight` from torch.distributed.pipelining._backward, called as
`PipelineStage.backward_one_chunk` calls them), each a program walked by liveness.

Convention (what `pipeline_runtime` expects): the job nets *include* the stage output `y`
(made by F) and the input gradient `dx` (made by B or I): the trace keeps both alive to its
end, and the runtime model frees them when the runtime's last holder lets go (fwd_cache,
backward_state, P2P ops and Works of sends, a neighbouring stage's receive slot). The stage
input (a receive buffer, or a view of the batch on the first stage), the output-gradient
receive buffer and the targets exist before the job (static bytes of the rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...ir import TensorKind
from ...jobs import JobMemory
from ...liveness import analyze_sequence


@dataclass
class TracedStageJobs:
    stage: int
    F: JobMemory
    B_first: JobMemory          # the first full backward of the step (creates param grads)
    B: JobMemory                # later full backwards (accumulate into them)
    I: JobMemory | None = None  # input-grad backward (split backward)
    W_first: JobMemory | None = None
    W: JobMemory | None = None
    param_bytes: int = 0
    y_bytes: int = 0            # stage output (sent to the next stage; logits on the last)
    dx_bytes: int = 0           # gradient of the stage input (0 on the first stage)
    input_bytes: int = 0        # one receive buffer for the stage input
    output_grad_bytes: int = 0  # one receive buffer for the output gradient
    first: bool = False
    last: bool = False
    notes: dict = field(default_factory=dict)

    def job(self, kind: str, first_grad: bool) -> JobMemory:
        if kind == "B":
            return self.B_first if first_grad else self.B
        if kind == "W":
            return self.W_first if first_grad else self.W
        return getattr(self, kind)


def trace_stage_jobs(spec: dict, stage: int, num_stages: int, layer_ids, micro_batch: int, seq_len: int,
                     split_backward: bool = False) -> TracedStageJobs:
    """Trace F/B (and I/W) of one stage for one microbatch; see the module docstring."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .models import build_stack, model_config
    cfg = model_config(spec)
    first, last = stage == 0, stage == num_stages - 1
    with FakeTensorMode():
        full = _trace_sequence(build_stack(cfg, layer_ids, first, last, seq_len, init=False),
                               cfg, first, last, micro_batch, seq_len, "FB")
        split = (_trace_sequence(build_stack(cfg, layer_ids, first, last, seq_len, init=False),
                                 cfg, first, last, micro_batch, seq_len, "FIW") if split_backward else None)
    out = TracedStageJobs(stage=stage, F=full["F0"], B_first=full["B0"], B=full["B1"],
                          param_bytes=full["param_bytes"], y_bytes=full["y_bytes"], dx_bytes=full["dx_bytes"],
                          input_bytes=full["input_bytes"], output_grad_bytes=full["output_grad_bytes"],
                          first=first, last=last)
    if split is not None:
        out.I, out.W_first, out.W = split["I0"], split["W0"], split["W1"]
    return out


def _trace_sequence(module, cfg, first: bool, last: bool, mb: int, seq: int, kinds: str) -> dict:
    """Two microbatches through `kinds` ("FB": F B F B, "FIW": F I W F I W), one phase each."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    from .capture import DistStorageRecorder
    from .models import loss_fn

    from .models import param_dtype
    hidden, dtype = cfg.hidden_size, param_dtype(cfg)
    if first:
        x = torch.empty((mb, seq), dtype=torch.long)
    else:
        x = torch.empty((mb, seq, hidden), dtype=dtype).requires_grad_()
    target = torch.empty((mb, seq), dtype=torch.long) if last else None
    out_shape = (mb, seq, cfg.vocab_size if last else hidden)
    gy = None if last else torch.empty(out_shape, dtype=dtype)
    params = list(module.parameters())
    rec = DistStorageRecorder()
    rec.register(params, TensorKind.PARAM)
    rec.register(module.buffers(), TensorKind.BUFFER)
    rec.register([t for t in (x, target, gy) if t is not None], TensorKind.ACTIVATION)
    held = []       # what the runtime model owns: y, dx, losses (freed after the trace)
    phases = []
    with rec:
        for m in range(2):
            rec.begin(f"F{m}")
            phases.append(f"F{m}")
            y = module(x)
            loss = loss_fn(y, target) if last else None
            held += [y, loss]
            stage_output = loss if last else (y,)
            output_grads = None if last else (gy,)
            inputs = [x]
            if kinds == "FB":
                rec.begin(f"B{m}")
                phases.append(f"B{m}")
                dx = stage_backward(stage_output, output_grads, inputs)
                held.append(dx)
            else:
                rec.begin(f"I{m}")
                phases.append(f"I{m}")
                if not first:
                    so = (stage_output,) if isinstance(stage_output, torch.Tensor) else stage_output
                    dx, groups = stage_backward_input(so, output_grads, inputs, iter(params))
                    held.append(dx)
                rec.begin(f"W{m}")
                phases.append(f"W{m}")
                if not first:
                    stage_backward_weight(iter(params), groups)
                    del groups, so
                else:     # the runtime defers the first stage's whole backward to W
                    stage_backward(stage_output, output_grads, inputs)
            if last and not first:
                y.detach_()
            del y, loss, stage_output, output_grads
    programs = {p.name: p for p in rec.programs()}
    ordered = [programs[p] if p in programs else None for p in phases]
    mem = analyze_sequence([p for p in ordered if p is not None], live_on_entry=rec.entry_storages())
    it = iter(mem)
    out = {}
    for name, prog in zip(phases, ordered):
        r = next(it) if prog is not None else None
        out[name] = JobMemory(r.net_bytes, r.peak_bytes) if r is not None else JobMemory(0, 0)
    elem = torch.finfo(dtype).bits // 8
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    out["y_bytes"] = mb * seq * out_shape[-1] * elem
    out["dx_bytes"] = 0 if first else mb * seq * hidden * elem
    out["input_bytes"] = 0 if first else mb * seq * hidden * elem
    out["output_grad_bytes"] = 0 if last else mb * seq * hidden * elem
    return out


def trace_optimizer(spec: dict, stage_layers: dict[int, list[int]], num_stages: int,
                    seq_len: int) -> tuple[JobMemory, int]:
    """`optimizer.step(); zero_grad(set_to_none=True)` over the params of a rank's stages, every
    param holding a gradient on entry. Returns (job, buffer bytes of the stage modules)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .capture import DistStorageRecorder
    from .models import build_stack, make_optimizer, model_config
    cfg = model_config(spec)
    with FakeTensorMode():
        mods = [build_stack(cfg, layers, s == 0, s == num_stages - 1, seq_len, init=False)
                for s, layers in stage_layers.items()]
        params = [p for m in mods for p in m.parameters()]
        buffers = [b for m in mods for b in m.buffers()]
        buffer_bytes = sum(b.untyped_storage().nbytes() for b in {id(b): b for b in buffers}.values())
        for p in params:
            p.grad = torch.empty_like(p)
        opt = make_optimizer(params)
        rec = DistStorageRecorder()
        rec.register(params, TensorKind.PARAM)
        rec.register([p.grad for p in params], TensorKind.GRAD)
        with rec:
            rec.begin("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
        progs = rec.programs()
        (r,) = analyze_sequence(progs, live_on_entry=rec.entry_storages())
        del opt
    return JobMemory(r.net_bytes, r.peak_bytes), buffer_bytes
