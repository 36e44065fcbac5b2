"""One training step, run for real or traced on fake tensors.

`run_step` is THE step both ways (the trace and the real CPU run of `pipemem validate cpu`
execute the same Python, so every reference is dropped at the same moment):

    with autocast:  loss = loss_fn(model(*args, **kwargs))
    loss.backward()
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

For HF causal LMs `loss_fn` reads `.loss` and the inputs are
``input_ids=ids, labels=ids, use_cache=False`` (`hf.py`).

`trace_step` runs it under `FakeTensorMode` with a `StorageRecorder` and returns a
`TracedStep`: IR programs ``forward``, ``backward``, ``optimizer`` and their memory.
Which step: ``step="steady"`` (default) runs one warm-up step first and records the second,
as users measure it after a few steps: the optimizer states exist (PyTorch optimizers create
them lazily in the first `step()`) and gradients are where the trainer left them (gone after
``zero_grad(set_to_none=True)``, zeroed in place with ``set_to_none=False``); whatever else
the first step left alive (a runtime's buffers) is carried over too. ``step="first"`` records
the first step: no optimizer state before its optimizer phase, gradients created in backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..errors import UserError
from ..ir import Program, TensorKind
from ..jobs import compose_at
from ..liveness import analyze_sequence
from . import kernel_policy as policies
from .capture import ModuleScope, StorageRecorder, find_layer_prefix, layer_index_fn

PHASES = ("forward", "backward", "optimizer")
STEPS = ("steady", "first")


def default_loss(output):
    """The loss of a model output: the tensor itself, `.loss` (HF), or its first element."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise UserError("trace_step: the model output has no loss; pass loss_fn=")


def adamw(params):
    """The default optimizer (PyTorch defaults; the kernel policy picks foreach)."""
    return torch.optim.AdamW(params, lr=1e-4)


def run_step(
    model,
    args,
    kwargs,
    loss_fn=default_loss,
    optimizer=None,
    autocast_dtype=None,
    on_phase: Callable[[str], None] | None = None,
    zero_grad: bool = True,
    backward: bool = True,
    set_to_none: bool = True,
) -> None:
    """Run one training step. `on_phase(name)` is called when forward / backward / optimizer
    start and at "end". After the optimizer step, `optimizer.zero_grad(set_to_none=...)`
    (`zero_grad=False` skips it)."""
    mark = on_phase or (lambda phase: None)
    amp = (
        torch.autocast("cpu", dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    mark("forward")
    with amp:
        loss = loss_fn(model(*args, **kwargs))
    if backward:
        mark("backward")
        if isinstance(loss, tuple):  # a pipeline stage: (output, f(output) -> output grad)
            out, grad_fn = loss
            torch.autograd.backward(out, grad_fn(out))
            del out
        else:
            loss.backward()
        if optimizer is not None:
            mark("optimizer")
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad(set_to_none=set_to_none)
    del loss
    mark("end")


def zero_grads(params, set_to_none: bool = True) -> None:
    """What `optimizer.zero_grad` does to `params` (for steps traced without an optimizer)."""
    for p in params:
        if p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()


@dataclass
class PhaseMemory:
    name: str
    net_bytes: int
    peak_bytes: int  # above the bytes in use when the phase starts
    peak_op: str = ""

    def to_dict(self) -> dict:
        return asdict(self)  # the fields, in order: the `phases` rows of ProgramMemory.phase_row


@dataclass
class TracedStep:
    """A traced training step: IR programs, the static bytes that exist before it, and the
    memory of each phase (from `pipemem.liveness`, the same code every source goes through)."""

    programs: list[Program]
    entry_storages: list[str]
    static: dict  # params, buffers, inputs, other, total (bytes)
    phases: list[PhaseMemory]
    layer_prefix: str | None = None
    layers: int = 0
    op_layers: dict = field(default_factory=dict, repr=False)  # phase -> [layer index or None per op]
    kinds_bytes: dict = field(default_factory=dict)  # created-in-step bytes per kind
    entry_sizes: list = field(default_factory=list, repr=False)  # bytes of each entry storage
    # storage of each parameter's .grad when the step ends (None: no grad) and of the loss
    grad_storages: list = field(default_factory=list, repr=False)
    loss_storage: str | None = None

    @property
    def peak_bytes(self) -> int:
        """Highest total bytes in use during the step, params, buffers and inputs included."""
        return self.static["total"] + _peak_of(self.phases)[0]

    @property
    def peak_at(self) -> str:
        i = _peak_of(self.phases)[1]
        return f"{self.phases[i].name}: {self.phases[i].peak_op}" if i >= 0 else ""

    @property
    def net_after_forward(self) -> int:
        """Bytes the forward leaves allocated for the backward (above the static bytes)."""
        return next((p.net_bytes for p in self.phases if p.name == "forward"), 0)

    def phase(self, name: str) -> PhaseMemory:
        for p in self.phases:
            if p.name == name:
                return p
        return PhaseMemory(name, 0, 0)

    def summary(self) -> dict:
        return {**step_summary(self), "created_bytes_by_kind": dict(self.kinds_bytes)}


def step_summary(step) -> dict:
    """What a traced step's summary says, for TracedStep and the steps made from one
    (traced.replicate): its peak and where, the static bytes, the phases, its layers."""
    return {
        "peak_bytes": step.peak_bytes,
        "peak_at": step.peak_at,
        "net_after_forward": step.net_after_forward,
        "static": dict(step.static),
        "phases": [p.to_dict() for p in step.phases],
        "layers": step.layers,
    }


def _peak_of(phases) -> tuple[int, int]:
    step, at = compose_at(phases)
    return step.peak_bytes, at


def analyze_programs(programs: list[Program], entry: list[str]) -> list[PhaseMemory]:
    results = analyze_sequence(programs, live_on_entry=entry)
    return [PhaseMemory(r.name, r.net_bytes, r.peak_bytes, r.peak_op_label) for r in results]


# Fake model and inputs ---------------------------------------------------------------------


def meta_to_fake(module: torch.nn.Module) -> list:
    """Inside an active FakeTensorMode: replace meta (or real) parameters and buffers by fake
    CPU tensors of the same shape and dtype, keeping tied weights tied. Much cheaper than
    running initialisation ops on fake tensors. Returns what `restore_tensors` needs to put
    the originals back (a real module passed to `trace_step` is left as it was)."""
    memo: dict[int, torch.Tensor] = {}
    originals = []
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                )
            originals.append((mod._parameters, name, p))
            mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = torch.empty(b.shape, dtype=b.dtype)
            originals.append((mod._buffers, name, b))
            mod._buffers[name] = memo[id(b)]
    return originals


def restore_tensors(originals) -> None:
    for table, name, t in originals:
        table[name] = t


def _fake_inputs(example_inputs, model):
    """(args, kwargs) of fake tensors; real or meta tensors are replaced by fake ones of the
    same shape, keeping tensors passed twice (input_ids and labels) one tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    memo: dict[int, torch.Tensor] = {}

    def fake(x):
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
            return x
        if id(x) not in memo:
            t = torch.empty(x.shape, dtype=x.dtype)
            memo[id(x)] = t.requires_grad_() if (x.requires_grad and x.is_leaf) else t
        return memo[id(x)]

    if callable(example_inputs) and not isinstance(example_inputs, torch.Tensor):
        example_inputs = example_inputs(model)
    if isinstance(example_inputs, dict):
        return (), {k: fake(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, torch.Tensor):
        return (fake(example_inputs),), {}
    if isinstance(example_inputs, (tuple, list)):
        if (
            len(example_inputs) == 2
            and isinstance(example_inputs[1], dict)
            and isinstance(example_inputs[0], (tuple, list))
        ):
            a, k = example_inputs
            return tuple(fake(x) for x in a), {n: fake(v) for n, v in k.items()}
        return tuple(fake(x) for x in example_inputs), {}
    raise UserError(
        "trace_step: example_inputs must be a tensor, a tuple, a dict, (args, kwargs) or a callable"
    )


@contextlib.contextmanager
def _host_rng_states(rec):
    """CPU policy only: non-reentrant checkpointing keeps `torch.get_rng_state()` (a 5056-byte
    CPU tensor, built outside the dispatcher) per checkpointed region until its recompute.
    Record it so the CPU ground truth matches; on a GPU it is host memory, not device memory."""
    original = torch.get_rng_state

    def get_rng_state():
        state = original()
        rec.note_external(state, "get_rng_state")
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _meta_model(model_or_factory) -> torch.nn.Module:
    """The module to trace, built on the meta device when a factory is given (no init cost)."""
    if isinstance(model_or_factory, torch.nn.Module):
        return model_or_factory
    if callable(model_or_factory):
        with torch.device("meta"):
            model = model_or_factory()
        if isinstance(model, torch.nn.Module):
            return model
    raise UserError("trace_step: pass an nn.Module or a zero-argument function that builds one")


def _bytes_of(storages, names) -> int:
    return sum(storages[n].nbytes for n in set(names) if n in storages)


def _static_bytes(storages, entry: list[str], declared: dict) -> dict:
    """Bytes alive when the recorded step starts: the declared params, buffers and inputs,
    then what an earlier step left, by kind (gradients, optimizer states, other)."""
    params, buffers = set(declared["params"]), set(declared["buffers"]) - set(declared["params"])
    inputs = set(declared["inputs"]) - params - buffers
    rest = [n for n in entry if n not in params | buffers | inputs]
    out = {
        "params": _bytes_of(storages, params),
        "buffers": _bytes_of(storages, buffers),
        "inputs": _bytes_of(storages, inputs),
        "grads": _bytes_of(storages, [n for n in rest if storages[n].kind is TensorKind.GRAD]),
        "optimizer": _bytes_of(storages, [n for n in rest if storages[n].kind is TensorKind.OPTIMIZER_STATE]),
    }
    out["other"] = _bytes_of(storages, rest) - out["grads"] - out["optimizer"]
    out["total"] = _bytes_of(storages, entry)
    return out


def trace_step(
    model_or_factory,
    example_inputs,
    loss_fn: Callable | None = None,
    optimizer_factory: Callable | None = adamw,
    kernel_policy: str = "cuda",
    *,
    autocast_dtype=None,
    zero_grad: bool = True,
    backward: bool = True,
    layer_prefix: str | None = None,
    prepare: Callable | None = None,
    patches=None,
    step: str = "steady",
    set_to_none: bool = True,
) -> TracedStep:
    """Trace one training step of any module on fake CPU tensors.

    model_or_factory: an nn.Module (its parameters become fake tensors of the same shapes;
        build it on the meta device to skip initialisation) or a function building one (run on
        meta). example_inputs: a tensor, a tuple of args, a dict of kwargs, ``(args, kwargs)``,
        or ``f(model)`` returning one of those. loss_fn: output -> scalar (default: the output,
        its ``.loss`` or its first element). optimizer_factory: params -> optimizer, or None for
        forward+backward only. prepare: ``f(model)`` run on the fake model before tracing
        (checkpointing, hooks). patches: a context manager active while tracing (framework
        quirks, see `hf.fake_tensor_quirks`). step: "steady" (record the second step) or
        "first" (see the module docstring). set_to_none: how zero_grad leaves the gradients
        (also applied between the steps when there is no optimizer).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    policies.check(kernel_policy)
    if step not in STEPS:
        raise UserError(f"trace_step: step={step!r}; use one of {', '.join(STEPS)}")
    loss_fn = loss_fn or default_loss
    model = _meta_model(model_or_factory)
    with FakeTensorMode(), patches or contextlib.nullcontext():
        originals = meta_to_fake(model)
        try:
            if prepare is not None:
                prepare(model)
            args, kwargs = _fake_inputs(example_inputs, model)
            optimizer = optimizer_factory(model.parameters()) if optimizer_factory is not None else None
            policies.configure_optimizer(kernel_policy, optimizer)
            params = list(model.parameters())
            scope = ModuleScope(model)
            rec = StorageRecorder(scope, cpu_scalars=(kernel_policy == "cpu"))
            names = {
                "params": rec.register(params, TensorKind.PARAM),
                "buffers": rec.register(model.buffers(), TensorKind.BUFFER),
            }
            input_tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
            names["inputs"] = rec.register(input_tensors, TensorKind.ACTIVATION)

            seen: dict = {}  # storage names the allocation stream needs (pipemem.traced.replicate)

            def on_phase(phase: str) -> None:
                if phase in ("optimizer", "end"):
                    rec.set_kind([p.grad for p in params if p.grad is not None], TensorKind.GRAD)
                if phase == "end":
                    seen["grads"] = [next(iter(rec.storage_names([p.grad])), None) for p in params]
                if phase == "end" and optimizer is not None:
                    states = [
                        v
                        for st in optimizer.state.values()
                        for v in st.values()
                        if isinstance(v, torch.Tensor)
                    ]
                    rec.set_kind(states, TensorKind.OPTIMIZER_STATE)
                if phase in PHASES:
                    scope.reset()
                    rec.begin(phase)

            host = _host_rng_states(rec) if kernel_policy == "cpu" else contextlib.nullcontext()
            with scope, rec, policies.context(kernel_policy), host:
                # "steady": a warm-up step first, then the recorder starts afresh for the one recorded
                for warm_up in (True, False) if step == "steady" else (False,):
                    run_step(
                        model,
                        args,
                        kwargs,
                        _named_loss(loss_fn, rec, seen),
                        optimizer,
                        autocast_dtype,
                        on_phase,
                        zero_grad=zero_grad,
                        backward=backward,
                        set_to_none=set_to_none,
                    )
                    if warm_up:
                        if optimizer is None and zero_grad:
                            zero_grads(params, set_to_none)
                        rec.restart()
            # on_phase reads `optimizer` from its cell: rebinding it drops the reference as `del` would
            optimizer = None
            del args, kwargs, input_tensors
            programs = rec.programs()
            entry = rec.entry_storages()
            static = _static_bytes(rec.storages, entry, names)
            entry_sizes = [rec.storages[n].nbytes for n in entry]
            kinds: dict[str, int] = {}
            for info in rec.storages.values():
                if info.phase:
                    kinds[info.kind.value] = kinds.get(info.kind.value, 0) + info.nbytes
            prefix = layer_prefix if layer_prefix is not None else find_layer_prefix(model)
            n_layers = len(model.get_submodule(prefix)) if prefix else 0
        finally:
            restore_tensors(originals)  # a real module passed in is left as it was
    index = layer_index_fn(prefix)
    op_layers = {p.name: [index(op.module) for op in p.ops] for p in programs}
    return TracedStep(
        programs=programs,
        entry_storages=entry,
        static=static,
        phases=analyze_programs(programs, entry),
        layer_prefix=prefix,
        layers=n_layers,
        op_layers=op_layers,
        kinds_bytes=kinds,
        entry_sizes=entry_sizes,
        grad_storages=seen.get("grads", []),
        loss_storage=seen.get("loss"),
    )


def _named_loss(loss_fn, rec, seen: dict):
    """loss_fn, noting the recorded storage name of the loss it returns (a plain tensor)."""

    def named(out):
        loss = loss_fn(out)
        if isinstance(loss, torch.Tensor):
            seen["loss"] = next(iter(rec.storage_names([loss])), None)
        return loss

    return named


def trace_stage(module, inputs, output_grad_fn: Callable | None = None, **kwargs) -> TracedStep:
    """Forward and backward of one pipeline stage: `module(*inputs)` (inputs that require grad
    are the activations received from the previous stage), then the backward from an output
    gradient `output_grad_fn(output)` (default: ones like the output, as received from the
    next stage; created when the backward starts). Other arguments as `trace_step`'s, but no
    optimizer unless `optimizer_factory` names one."""
    grad_fn = output_grad_fn or torch.ones_like
    kwargs.setdefault("optimizer_factory", None)
    return trace_step(module, inputs, lambda out: (out, grad_fn), **kwargs)
