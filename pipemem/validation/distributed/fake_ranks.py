"""The local program of one rank of a tensor-parallel or FSDP run, traced in one process.

PyTorch's fake process group (``init_process_group("fake", store=FakeStore())``, what
torch.distributed._tools' FSDPMemTracker tests use) lets DTensor and FSDP2 run their real
Python for rank r of a world of w without peers: collectives return at once, outputs are
allocated as in a real run. Under FakeTensorMode nothing is computed either, so the traced
storages and their lifetimes are those of rank r's real step (`pipemem.traced.capture`).
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial

import torch

from ...errors import UserError
from ...ir import TensorKind
from ...liveness import analyze_sequence


@contextlib.contextmanager
def fake_process_group(rank: int, world: int):
    """Rank `rank` of a `world`-rank fake process group, torn down on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise UserError("a torch.distributed process group is already initialised in this process; "
                        "trace fake ranks in a fresh process")
    hook = sys.excepthook       # init_process_group prefixes tracebacks with "[rankN]:"
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def trace_parallel_rank(kind: str, spec: dict, micro_batch: int, seq_len: int, rank: int, world: int,
                        regather: bool = False) -> dict:
    """Trace one training step (forward, backward, AdamW, zero_grad) of rank `rank` of a
    tensor-parallel (`kind="tp"`; `regather`: with pipemem.torch_tp.RegatherColwiseParallel)
    or FSDP2 (`kind="fsdp"`) run of the `DecoderStack` model.
    Returns {peak_bytes, static_bytes, param_bytes, peak_at, phases: [ProgramMemory dicts]}."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .models import build_fsdp_model, build_tp_model, make_mesh, model_config

    build = {"tp": partial(build_tp_model, regather=regather), "fsdp": build_fsdp_model}.get(kind)
    if build is None:
        raise UserError(f"unknown parallel kind {kind!r}: use tp or fsdp")
    cfg = model_config(spec)
    with fake_process_group(rank, world):
        mesh = make_mesh(world)          # device meshes cannot be built under FakeTensorMode
        with FakeTensorMode():
            return trace_model_step(build(cfg, seq_len, mesh, init=False), micro_batch, seq_len)


def trace_model_step(model, micro_batch: int, seq_len: int) -> dict:
    """Trace `run_step` (the step the real ranks run) of a fake `DecoderStack` and walk the
    forward / backward / optimizer programs with liveness, params and inputs live on entry."""
    from ...traced.step import run_step
    from .capture import DistStorageRecorder
    from .models import local_tensor, loss_fn, make_optimizer

    opt = make_optimizer(model.parameters())
    ids = torch.empty((micro_batch, seq_len), dtype=torch.long)
    target = torch.empty((micro_batch, seq_len), dtype=torch.long)
    rec = DistStorageRecorder()
    params = rec.register([local_tensor(p) for p in model.parameters()], TensorKind.PARAM)
    rec.register([local_tensor(b) for b in model.buffers()], TensorKind.BUFFER)
    rec.register([ids, target], TensorKind.ACTIVATION)

    def on_phase(phase: str) -> None:
        if phase != "end":
            rec.begin(phase)

    with rec.fsdp_resizes(), rec:
        run_step(model, (ids,), {}, lambda out: loss_fn(out, target), opt, on_phase=on_phase)
    del opt
    programs = rec.programs()
    entry = rec.entry_storages()
    static = sum(rec.storages[n].nbytes for n in entry)
    param_bytes = sum(rec.storages[n].nbytes for n in set(params))
    results = analyze_sequence(programs, live_on_entry=entry)
    cur = peak = 0
    at = ""
    for r in results:
        if cur + r.peak_bytes > peak:
            peak, at = cur + r.peak_bytes, f"{r.name}: {r.peak_op_label}"
        cur += r.net_bytes
    return {"peak_bytes": static + peak, "static_bytes": static, "param_bytes": param_bytes, "peak_at": at,
            "phases": [r.to_dict() for r in results]}
