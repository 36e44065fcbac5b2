"""Record eager PyTorch execution on fake tensors as pipemem IR (the *traced* source).

`StorageRecorder` is a `TorchDispatchMode`: every aten op that runs while it is active is
recorded with the storages it reads and the storages it creates or aliases. Each new storage
gets a `weakref.finalize`, so the moment eager drops its last reference (refcount, not last
use: autograd's saved tensors, Python locals, the autocast cache...) is known exactly and
becomes `Op.frees` of the op that ran last. Liveness then frees every storage where eager
freed it, which is why the traced peak equals a real CPU run's to the byte (FINDINGS.md §4).

`ModuleScope` labels ops with the innermost module running them, forward and backward,
without changing any tensor lifetime (unlike `ModTracker`, whose default multi-grad hook
buffers input gradients until all of them are ready).

Nothing here knows about training steps or HF models: see `step.py` and `hf.py`.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..ir import DTYPE_BYTES, Op, Program, Tensor, TensorKind

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_PRIM_DEVICE = torch.ops.prim.device.default
_NOT_DONE = object()
_ZEROS_LIKE = torch.ops.aten.zeros_like.default
_EMPTY_LIKE = torch.ops.aten.empty_like.default
# Foreach ops whose results have the shape and dtype of their first list's tensors.
_FOREACH_ELEMENTWISE = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "sqrt",
        "reciprocal",
        "lerp",
        "addcmul",
        "addcdiv",
        "abs",
        "exp",
        "sign",
        "clamp_min",
        "clamp_max",
        "maximum",
        "minimum",
        "copy",
        "zero",
        "sigmoid",
        "rsqrt",
    }
)

# Raw op record fields (lists are cheaper than objects on the hot path).
_TYPE, _PHASE, _MODULE, _INPUTS, _OUTPUTS, _FREES = range(6)


# Depth of `host_memory()` contexts: storages created inside one live in host memory.
_HOST_DEPTH = [0]


@contextlib.contextmanager
def host_memory():
    """Storages created inside are host (CPU) memory: recorded with 0 device bytes. Fake
    tensors here are all CPU tensors, so code that copies activations to the host (activation
    offloading) marks its host buffers with this; the copy back is a new device storage."""
    _HOST_DEPTH[0] += 1
    try:
        yield
    finally:
        _HOST_DEPTH[0] -= 1


def _valueless(t) -> bool:
    return isinstance(t, FakeTensor) or t.is_meta


def _flat(args, kwargs) -> list:
    """The tensors among aten op arguments (tensors and lists of tensors; faster than pytree)."""
    out = []
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


class ModuleScope:
    """Which module an op runs for, forward and backward, as a fully qualified name.

    Forward: global module pre/post hooks keep the stack of running modules. Each forward
    module call also records the range of autograd sequence numbers its ops were given
    (`torch._C._autograd._get_sequence_nr`). Backward: the op belongs to the module whose
    range holds the sequence number of the autograd node running it
    (`torch._C._current_autograd_node`); gradient accumulation belongs to the parameter's
    module. No tensor hooks: nothing changes any lifetime, and it costs a fraction of
    ModTracker's multi-grad hooks (which also buffer gradients)."""

    def __init__(self, root: torch.nn.Module | None = None):
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._depth: dict[str, int] = {}
        self._param_module: dict[int, str] = {}
        if root is not None:
            for name, mod in root.named_modules():
                key = name or type(mod).__name__
                self._names[mod] = key
                self._depth[key] = name.count(".") + 1 if name else 0
                for p in mod.parameters(recurse=False):
                    self._param_module.setdefault(id(p), key)
        self._stack: list[tuple[str, int]] = []  # (name, first sequence number)
        self._ranges: list[tuple[int, int, int, str]] = []  # (depth, start, end, name)
        self._owner: list[str] | None = None
        self._base = 0
        self._handles = []

    def _name(self, mod) -> str:
        name = self._names.get(mod)
        if name is None:  # a module outside the root (built in forward): innermost when running
            name = self._names[mod] = type(mod).__name__
            self._depth.setdefault(name, 1000)
        return name

    def _pre(self, mod, args):
        self._stack.append((self._name(mod), _seq_nr()))

    def _post(self, mod, args, out):
        if not self._stack:
            return
        name, start = self._stack.pop()
        if torch._C._current_graph_task_id() == -1:  # a forward, not a recompute in backward
            self._ranges.append((self._depth.get(name, 1000), start, _seq_nr(), name))
            self._owner = None

    @property
    def current(self) -> str:
        if self._stack:  # forward, or a layer recomputed inside the backward
            return self._stack[-1][0]
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        seq = node._sequence_nr()
        owner = self._owner if self._owner is not None else self._build_owner()
        i = seq - self._base
        if 0 <= i < len(owner):
            return owner[i]
        variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter's module
        return self._param_module.get(id(variable), "") if variable is not None else ""

    def _build_owner(self) -> list[str]:
        """Sequence number -> innermost module, painting outer ranges first."""
        if not self._ranges:
            self._owner = []
            return self._owner
        self._base = min(r[1] for r in self._ranges)
        owner = [""] * (max(r[2] for r in self._ranges) - self._base)
        for _depth, start, end, name in sorted(self._ranges, key=lambda r: r[0]):
            owner[start - self._base : end - self._base] = [name] * (end - start)
        self._owner = owner
        return owner

    def reset(self) -> None:
        self._stack.clear()

    def restart(self) -> None:
        """Forget the module calls recorded so far (a new step starts)."""
        self._stack.clear()
        self._ranges.clear()
        self._owner = None

    def __enter__(self):
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []


def _seq_nr() -> int:
    return torch._C._autograd._get_sequence_nr()


@dataclass
class _StorageInfo:
    nbytes: int
    shape: tuple
    dtype: str
    phase: str  # phase that created it ("" = existed before the trace)
    kind: TensorKind | None = None
    alive: bool = True


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    return name if name in DTYPE_BYTES else "uint8"  # exotic dtypes: size comes from `bytes`


class StorageRecorder(TorchDispatchMode):
    """Records aten ops and storage lifetimes; `programs()` turns them into IR programs."""

    def __init__(self, scope: ModuleScope | None = None, cpu_scalars: bool = False, shortcuts: bool = True):
        super().__init__()
        self.shortcuts = shortcuts  # skip value computations that cannot change memory
        self.scope = scope
        self.cpu_scalars = cpu_scalars
        self.phase = "forward"
        self.phases: list[str] = ["forward"]
        self.ops: list[list] = []
        self.storages: dict[str, _StorageInfo] = {}
        self.aliases: dict[str, tuple[str, tuple, str, int]] = {}  # name -> (storage, shape, dtype, bytes)
        self._ids = WeakIdKeyDictionary()
        self._pending_frees: list[str] = []
        self._next = 0
        self.closed = False  # after the traced code ends, frees are the tracer's own cleanup

    def __exit__(self, *exc):
        self.closed = True
        return super().__exit__(*exc)

    # Storages -------------------------------------------------------------------------------
    def _new(self, t: torch.Tensor, st, phase: str, kind: TensorKind | None = None) -> str:
        name = f"s{self._next}"
        self._next += 1
        self._ids[st] = name
        nbytes = 0 if _HOST_DEPTH[0] else st.nbytes()
        self.storages[name] = _StorageInfo(nbytes, tuple(t.shape), _dtype_name(t.dtype), phase, kind)
        weakref.finalize(st, self._freed, name)
        return name

    def _freed(self, name: str) -> None:
        info = self.storages.get(name)
        if self.closed or info is None:  # None: dropped by restart()
            return
        info.alive = False
        self._free_here(name)

    def _free_here(self, name: str) -> None:
        """Record `name` as freed after the last op recorded so far."""
        if self.ops:
            self.ops[-1][_FREES].append(name)
        else:
            self._pending_frees.append(name)

    def register(self, tensors, kind: TensorKind | str) -> list[str]:
        """Declare tensors that exist before the trace (params, buffers, inputs)."""
        kind = TensorKind(kind)
        names = []
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            name = self._ids.get(st)
            if name is None:
                name = self._new(t, st, "", kind)
            names.append(name)
        return names

    def storage_names(self, tensors) -> set[str]:
        out = set()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                name = self._ids.get(t.untyped_storage())
                if name is not None:
                    out.add(name)
        return out

    def note_external(self, t: torch.Tensor, op_type: str) -> None:
        """A tensor the traced code allocated outside the dispatcher (e.g. RNG state): an op
        `op_type` creating it, now; its lifetime is tracked like any other storage."""
        st = t.untyped_storage()
        if self._ids.get(st) is not None:
            return
        frees, self._pending_frees = self._pending_frees, []
        name = self._new(t, st, self.phase)
        module = self.scope.current if self.scope is not None else ""
        self.ops.append([op_type, self.phase, module, [], [name], frees])

    def set_kind(self, tensors, kind: TensorKind) -> None:
        for name in self.storage_names(tensors):
            info = self.storages[name]
            if info.phase:  # only storages created during the trace change kind
                info.kind = kind

    def restart(self) -> list[str]:
        """Start recording afresh, as if the trace began now: every storage alive at this
        moment (what an earlier step left: optimizer states, kept gradients, runtime buffers)
        becomes one that existed before the trace, with the kind it was given; the ops
        recorded so far are dropped. Returns the names of the storages carried over that the
        earlier recording created. Used to trace a steady-state step after a warm-up step."""
        carried = []
        for name, info in self.storages.items():
            if info.alive and info.phase:
                if info.kind is None:  # not labelled by the step: a runtime's buffer
                    info.kind = TensorKind.COMM
                info.phase = ""
                carried.append(name)
        self.storages = {n: i for n, i in self.storages.items() if i.alive}
        live = set(self.storages)
        self.aliases = {a: v for a, v in self.aliases.items() if v[0] in live}
        self.ops = []
        self._pending_frees = []
        self.phase = "forward"
        self.phases = ["forward"]
        if self.scope is not None:
            self.scope.restart()
        return carried

    def begin(self, phase: str) -> None:
        self.phase = phase
        if phase not in self.phases:
            self.phases.append(phase)

    # Dispatch ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._valueless_shortcut(func, args) if (self.shortcuts and not kwargs) else _NOT_DONE
        if out is _NOT_DONE:
            out = func(*args, **kwargs)
        if func is _PRIM_DEVICE:  # metadata query, touches no memory
            return out
        self._after_call(func, args, out)
        inputs = []
        constants = []
        # lift_fresh wraps the real constant behind a fake tensor built from Python data
        # (torch.tensor(0.0) for Adam's `step`): the real run has one storage, the output's.
        flat_args = () if func is _LIFT_FRESH else _flat(args, kwargs)
        for a, st, name in self._recorded(flat_args):
            if name is None:
                name = self._undeclared_input(a, st, constants)
            if name not in inputs:
                inputs.append(name)
        outputs = []
        for t, st, name in self._recorded(out if isinstance(out, (tuple, list)) else (out,)):
            if name is None:
                outputs.append(self._new(t, st, self.phase))
            else:
                alias = f"{name}.{len(self.aliases)}"
                nbytes = min(t.numel() * t.element_size(), self.storages[name].nbytes)
                self.aliases[alias] = (name, tuple(t.shape), _dtype_name(t.dtype), nbytes)
                outputs.append(alias)
        if not inputs and not outputs:
            return out
        frees, self._pending_frees = self._pending_frees, []
        module = self.scope.current if self.scope is not None else ""
        freed_by_op = self._wrapped_scalars(func, args, kwargs) if self.cpu_scalars else []
        constants.extend(freed_by_op)
        if constants:
            self.ops.append(["constant", self.phase, module, [], constants, frees])
            frees = []
        self.ops.append(
            [
                func.__name__ if hasattr(func, "__name__") else str(func),
                self.phase,
                module,
                inputs,
                outputs,
                frees + freed_by_op,
            ]
        )
        return out

    def _recorded(self, values):
        """(tensor, storage, its recorded name or None) for each tensor among `values` whose storage
        is recorded, the tensor unwrapped. The name is looked up when the item is reached: what the
        caller records for one tensor is known for the next (two views of a new storage)."""
        ids = self._ids
        for t in values:
            if isinstance(t, torch.Tensor):
                t = self._unwrap(t)
                st = t.untyped_storage()
                if not self._skip(st):
                    yield t, st, ids.get(st)

    # Hooks for recorders of tensor subclasses (pipemem.validation.distributed.capture) ----------------
    def _unwrap(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor whose storage holds the memory (a subclass's local tensor)."""
        return t

    def _skip(self, storage) -> bool:
        """Storages not to record (none here)."""
        return False

    def _after_call(self, func, args, out) -> None:
        """Called after an op ran, before its tensors are recorded."""

    def _undeclared_input(self, a: torch.Tensor, st, constants: list) -> str:
        """An input neither declared nor made by a recorded op: a tensor built from Python data
        during the step (a Python scalar wrapped as a 0-dim tensor for `mul_.Tensor`). The
        real run allocates it just before this op; a synthetic "constant" op does that here."""
        name = self._new(a, st, self.phase)
        constants.append(name)
        return name

    @staticmethod
    def _valueless_shortcut(func, args):
        """Shortcuts for tensors without values (fake or meta), which dominate optimizer traces
        of deep models: foreach meta kernels run one Python decomposition per tensor (and fake
        tensors hash every list for their cache), yet nothing about memory needs them. In-place
        elementwise foreach ops change no storage; out-of-place ones return one new tensor
        like each input; zeros_like allocates what empty_like does."""
        if func is _ZEROS_LIKE and args and _valueless(args[0]):  # same schema, same allocation
            return _EMPTY_LIKE(*args)
        name = getattr(func, "__name__", "")
        if not name.startswith("_foreach_") or not args or not isinstance(args[0], (list, tuple)):
            return _NOT_DONE
        first = args[0]
        if not first or not all(isinstance(t, torch.Tensor) and _valueless(t) for t in first):
            return _NOT_DONE
        base = name.split(".", 1)[0]
        if base.endswith("_"):
            return None if base[:-1][len("_foreach_") :] in _FOREACH_ELEMENTWISE else _NOT_DONE
        if base[len("_foreach_") :] in _FOREACH_ELEMENTWISE:
            return [torch.empty_like(t) for t in first]
        return _NOT_DONE

    def _wrapped_scalars(self, func, args, kwargs) -> list[str]:
        """CPU only: a Python number passed where the schema takes a Tensor becomes a 0-dim
        "wrapped number" tensor (8 bytes: double or int64; Python's arg parser), which the
        dispatcher hands back to Python modes as the number, so it is invisible here. On the
        CPU, TensorIterator (aten/src/ATen/TensorIterator.cpp, `compute_types` with
        promote_inputs_to_common_dtype) also casts it to the op's dtype. Both live during the
        op. (On CUDA, CPU scalars are kernel arguments: no device memory.)"""
        schema = getattr(func, "_schema", None)
        if schema is None:
            return []
        dtype = None
        for a in args:
            if isinstance(a, torch.Tensor):
                dtype = a.dtype
                break
        names = []
        for i, arg in enumerate(schema.arguments):
            v = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(v, (bool, int, float, complex)) and isinstance(arg.type, torch.TensorType):
                wrapped = {
                    bool: torch.bool,
                    int: torch.int64,
                    float: torch.float64,
                    complex: torch.complex128,
                }[type(v)]
                sizes = [(wrapped.itemsize, wrapped)]
                if dtype is not None and dtype != wrapped:
                    sizes.append((dtype.itemsize, dtype))
                for nbytes, dt in sizes:
                    name = f"s{self._next}"
                    self._next += 1
                    self.storages[name] = _StorageInfo(
                        nbytes, (), _dtype_name(dt), self.phase, TensorKind.TEMP, False
                    )
                    names.append(name)
        return names

    # IR -----------------------------------------------------------------------------------------
    def finalize_kinds(self) -> None:
        """Kinds for storages created in the trace that no caller labelled: forward storages
        that outlive the forward are activations, everything else is a temporary."""
        alive_after_forward = self._alive_after_phase("forward")
        for name, info in self.storages.items():
            if info.kind is None:
                if info.phase == "forward" and name in alive_after_forward:
                    info.kind = TensorKind.ACTIVATION
                else:
                    info.kind = TensorKind.TEMP

    def _alive_after_phase(self, phase: str) -> set[str]:
        freed_by_end: set[str] = set()
        created: set[str] = set()
        for rec in self.ops:
            if rec[_PHASE] != phase:
                if created:
                    break
                continue
            for n in rec[_OUTPUTS]:
                if n in self.storages:
                    created.add(n)
            freed_by_end.update(rec[_FREES])
        return created - freed_by_end

    def entry_storages(self) -> list[str]:
        return [n for n, s in self.storages.items() if not s.phase]

    def programs(self) -> list[Program]:
        """One program per phase, in phase order. Storages still alive when the trace ends are
        persistent (nothing in the step frees them); pre-existing ones are persistent too."""
        self.finalize_kinds()
        tensors: dict[str, Tensor] = {}
        for name, s in self.storages.items():
            tensors[name] = Tensor(
                name=name,
                shape=s.shape,
                dtype=s.dtype,
                kind=s.kind,
                persistent=(not s.phase) or s.alive,
                bytes=s.nbytes,
            )
        for name, (base, shape, dtype, nbytes) in self.aliases.items():
            b = tensors[base]
            tensors[name] = Tensor(
                name=name,
                shape=shape,
                dtype=dtype,
                kind=b.kind,
                storage=base,
                persistent=b.persistent,
                bytes=nbytes,
            )
        progs = {p: Program(name=p, type=p) for p in self.phases}
        for rec in self.ops:
            prog = progs[rec[_PHASE]]
            pt = prog.tensors
            for group in (rec[_INPUTS], rec[_OUTPUTS], rec[_FREES]):
                for n in group:
                    if n not in pt:
                        pt[n] = tensors[n]
                        if n in self.aliases:
                            base = self.aliases[n][0]
                            if base not in pt:
                                pt[base] = tensors[base]
            prog.ops.append(
                Op(
                    type=rec[_TYPE],
                    inputs=tuple(rec[_INPUTS]),
                    outputs=tuple(rec[_OUTPUTS]),
                    frees=tuple(rec[_FREES]),
                    phase=rec[_PHASE],
                    module=rec[_MODULE],
                )
            )
        return [progs[p] for p in self.phases if progs[p].ops]


# Layer labels --------------------------------------------------------------------------------


def find_layer_prefix(model: torch.nn.Module) -> str | None:
    """The qualified name of the longest `nn.ModuleList` of identical blocks (the decoder
    layers: ``model.layers`` in Llama, ``transformer.h`` in GPT-2), or None."""
    best, best_len = None, 1
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > best_len:
            if len({type(m) for m in mod}) == 1:
                best, best_len = name, len(mod)
    return best


def layer_index_fn(prefix: str | None):
    """Maps a module name to its decoder-layer index (None outside the layers)."""
    if not prefix:
        return lambda module: None
    pattern = re.compile(rf"(?:^|\.){re.escape(prefix)}\.(\d+)(?:\.|$)")
    cache: dict[str, int | None] = {}

    def index(module: str):
        v = cache.get(module, -1)
        if v == -1:
            m = pattern.search(module)
            v = cache[module] = int(m.group(1)) if m else None
        return v

    return index
