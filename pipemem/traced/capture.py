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

import re
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..ir import DTYPE_BYTES, Op, Program, Tensor, TensorKind

# Raw op record fields (lists are cheaper than objects on the hot path).
_TYPE, _PHASE, _MODULE, _INPUTS, _OUTPUTS, _FREES = range(6)


class ModuleScope:
    """Which modules are running, forward and backward, as fully qualified names.

    Forward: module pre/post hooks. Backward: a module is entered when the gradient of any of
    its outputs is ready and left when the gradient of any of its inputs is ready (``mode="any"``
    hooks pass gradients through untouched, so no lifetime changes)."""

    def __init__(self, root: torch.nn.Module | None = None):
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._depth: dict[str, int] = {}
        if root is not None:
            for name, mod in root.named_modules():
                if name:
                    self._names[mod] = name
                    self._depth[name] = name.count(".") + 1
                else:
                    self._names[mod] = type(mod).__name__
                    self._depth[type(mod).__name__] = 0
        self._count: dict[str, int] = {}
        self.current = ""          # innermost active module ("" = none)
        self._handles = []

    def _name(self, mod) -> str:
        name = self._names.get(mod)
        if name is None:   # a module outside the root (built in forward): innermost when running
            name = self._names[mod] = type(mod).__name__
            self._depth.setdefault(name, 1000)
        return name

    def _enter(self, name: str) -> None:
        self._count[name] = self._count.get(name, 0) + 1
        self._refresh()

    def _leave(self, name: str) -> None:
        n = self._count.get(name, 0) - 1
        if n > 0:
            self._count[name] = n
        else:
            self._count.pop(name, None)
        self._refresh()

    def _refresh(self) -> None:
        self.current = max(self._count, key=self._depth.__getitem__) if self._count else ""

    def _pre(self, mod, args):
        name = self._name(mod)
        self._enter(name)
        if torch._C._current_graph_task_id() == -1:   # not recomputing inside backward
            ts = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
            if ts:
                register_multi_grad_hook(ts, lambda _g, n=name: self._leave(n), mode="any")

    def _post(self, mod, args, out):
        name = self._name(mod)
        self._leave(name)
        if torch._C._current_graph_task_id() == -1:
            ts = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
            if ts:
                register_multi_grad_hook(ts, lambda _g, n=name: self._enter(n), mode="any")

    def reset(self) -> None:
        self._count.clear()
        self.current = ""

    def __enter__(self):
        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class _StorageInfo:
    nbytes: int
    shape: tuple
    dtype: str
    phase: str                  # phase that created it ("" = existed before the trace)
    kind: TensorKind | None = None
    alive: bool = True


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    return name if name in DTYPE_BYTES else "uint8"   # exotic dtypes: size comes from `bytes`


class StorageRecorder(TorchDispatchMode):
    """Records aten ops and storage lifetimes; `programs()` turns them into IR programs."""

    def __init__(self, scope: ModuleScope | None = None):
        super().__init__()
        self.scope = scope
        self.phase = "forward"
        self.phases: list[str] = ["forward"]
        self.ops: list[list] = []
        self.storages: dict[str, _StorageInfo] = {}
        self.aliases: dict[str, tuple[str, tuple, str, int]] = {}   # name -> (storage, shape, dtype, bytes)
        self._ids = WeakIdKeyDictionary()
        self._pending_frees: list[str] = []
        self._next = 0
        self.closed = False    # after the traced code ends, frees are the tracer's own cleanup

    def __exit__(self, *exc):
        self.closed = True
        return super().__exit__(*exc)

    # Storages -------------------------------------------------------------------------------
    def _new(self, t: torch.Tensor, st, phase: str, kind: TensorKind | None = None) -> str:
        name = f"s{self._next}"
        self._next += 1
        self._ids[st] = name
        self.storages[name] = _StorageInfo(st.nbytes(), tuple(t.shape), _dtype_name(t.dtype), phase, kind)
        weakref.finalize(st, self._freed, name)
        return name

    def _freed(self, name: str) -> None:
        if self.closed:
            return
        self.storages[name].alive = False
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

    def set_kind(self, tensors, kind: TensorKind) -> None:
        for name in self.storage_names(tensors):
            info = self.storages[name]
            if info.phase:            # only storages created during the trace change kind
                info.kind = kind

    def begin(self, phase: str) -> None:
        self.phase = phase
        if phase not in self.phases:
            self.phases.append(phase)

    # Dispatch ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ids = self._ids
        inputs = []
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                st = a.untyped_storage()
                name = ids.get(st)
                if name is None:
                    # Not declared and not made by an op: a tensor built from Python data during
                    # the step (torch.tensor(0.0) for Adam's `step` reaches dispatch only as the
                    # input of lift_fresh). It was allocated just now, as in the real run.
                    name = self._new(a, st, self.phase)
                if name not in inputs:
                    inputs.append(name)
        outputs = []
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            name = ids.get(st)
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
        self.ops.append([func.__name__ if hasattr(func, "__name__") else str(func),
                         self.phase, module, inputs, outputs, frees])
        return out

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
            tensors[name] = Tensor(name=name, shape=s.shape, dtype=s.dtype, kind=s.kind,
                                   persistent=(not s.phase) or s.alive, bytes=s.nbytes)
        for name, (base, shape, dtype, nbytes) in self.aliases.items():
            b = tensors[base]
            tensors[name] = Tensor(name=name, shape=shape, dtype=dtype, kind=b.kind, storage=base,
                                   persistent=b.persistent, bytes=nbytes)
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
            prog.ops.append(Op(type=rec[_TYPE], inputs=tuple(rec[_INPUTS]), outputs=tuple(rec[_OUTPUTS]),
                               frees=tuple(rec[_FREES]), phase=rec[_PHASE], module=rec[_MODULE]))
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


@dataclass
class RecordedRun:
    """What a recorder saw, turned into programs, with the static (pre-existing) bytes."""

    programs: list[Program]
    entry_storages: list[str]
    static: dict = field(default_factory=dict)   # params / buffers / inputs / other -> bytes
