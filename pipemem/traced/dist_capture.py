"""Tracing distributed PyTorch code on fake tensors: `pipemem.traced.capture.StorageRecorder`
taught two things that the single-device recorder never meets, and the fake process group
under which DTensor and FSDP2 run rank r's real Python without peers.

1. DTensor. A dispatch mode sees an op on DTensors *before* DTensor's own dispatch, and the
   local ops DTensor runs underneath happen with the mode popped. The memory is the local
   tensors', so every DTensor argument and result is read as its `_local_tensor`; a storage
   first met as an input that nobody declared was made inside DTensor's dispatch and is
   allocated where it is first met (not on entry). Functional collectives' `wait_tensor`
   returns its input in a real run (a new tensor under fake tensors): same storage here.
2. Storage resizing. FSDP2 frees and re-allocates unsharded parameters and all-gather
   buffers with ``untyped_storage().resize_()`` (`_fsdp_param.alloc_storage/free_storage`),
   which no dispatch mode sees. While recording, those two functions are wrapped: a resize to
   full size is a new storage, allocated right there; a resize to 0 frees it there.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch

from ..errors import UserError
from .capture import StorageRecorder


def _keep(_obj) -> None:
    """Finalizer that only holds its argument alive until it runs."""


_RETURNS_INPUT = {torch.ops._c10d_functional.wait_tensor.default}


def _local(t):
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class DistStorageRecorder(StorageRecorder):
    """StorageRecorder for DTensor / FSDP2 code (see the module docstring)."""

    def __init__(self, scope=None, **options):
        # DTensor arguments are not plain fake tensors: no valueless shortcuts
        options.setdefault("shortcuts", False)
        super().__init__(scope, **options)
        self._manually_freed: set[str] = set()

    # Storage resizing ---------------------------------------------------------------------
    def _freed(self, name: str) -> None:
        if name in self._manually_freed:  # freed by resize_(0) already; the object dies later
            return
        super()._freed(name)

    def resized_alloc(self, tensor: torch.Tensor) -> None:
        st = tensor.untyped_storage()
        name = self._ids.get(st)
        if (
            name is not None
            and name not in self._manually_freed
            and self.storages[name].nbytes == st.nbytes()
        ):
            return
        new = self._new(tensor, st, self.phase)
        self.storages[new].nbytes = st.nbytes()
        frees, self._pending_frees = self._pending_frees, []
        module = self.scope.current if self.scope is not None else ""
        self.ops.append(["resize_storage", self.phase, module, [], [new], frees])

    def resized_free(self, tensor: torch.Tensor) -> None:
        name = self._ids.get(tensor.untyped_storage())
        if name is None or name in self._manually_freed:
            return
        self._manually_freed.add(name)
        self.storages[name].alive = False
        self._free_here(name)

    @contextlib.contextmanager
    def fsdp_resizes(self):
        """Wrap FSDP2's storage alloc/free (both modules that call them) while active."""
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        orig_alloc, orig_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

        def alloc(tensor):
            before = tensor.untyped_storage().size()
            orig_alloc(tensor)
            if tensor.untyped_storage().size() != before:
                self.resized_alloc(tensor)

        def free(tensor):
            if tensor.untyped_storage().size() != 0:
                self.resized_free(tensor)
            orig_free(tensor)

        patched = [
            (_fsdp_param, "alloc_storage", alloc),
            (_fsdp_param, "free_storage", free),
            (_fsdp_param_group, "alloc_storage", alloc),
        ]
        saved = [(m, n, getattr(m, n)) for m, n, _ in patched if hasattr(m, n)]
        for m, n, f in patched:
            if hasattr(m, n):
                setattr(m, n, f)
        try:
            yield self
        finally:
            for m, n, f in saved:
                setattr(m, n, f)

    # Dispatch hooks ---------------------------------------------------------------------------
    def _unwrap(self, t):
        return _local(t)

    def _skip(self, storage) -> bool:
        return storage.nbytes() == 0  # a freed (resized-to-0) storage read for metadata

    def _after_call(self, func, args, out) -> None:
        if func in _RETURNS_INPUT and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            # Real: returns its (waited-on) input. Fake: a fresh tensor. Make it the same storage.
            in_st, out_st = _local(args[0]).untyped_storage(), _local(out).untyped_storage()
            name = self._ids.get(in_st)
            if name is not None and out_st is not in_st:
                self._ids[out_st] = name
                weakref.finalize(out_st, _keep, in_st)  # the storage dies with the last of the two

    def _undeclared_input(self, a, st, constants: list) -> str:
        # Not declared (params, buffers, inputs, grads are): made inside DTensor's dispatch,
        # where the mode is popped (sharded-embedding masks, scalar operands). It exists from
        # here, not from before the step.
        name = self._new(a, st, self.phase)
        self.ops.append(
            ["dtensor_internal", self.phase, self.scope.current if self.scope else "", [], [name], []]
        )
        return name


@contextlib.contextmanager
def fake_process_group(rank: int, world: int):
    """Rank `rank` of a `world`-rank fake process group (``init_process_group("fake",
    store=FakeStore())``, what torch.distributed._tools' FSDPMemTracker tests use), torn down on
    exit: collectives return at once, outputs are allocated as in a real run."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError(
            "a torch.distributed process group is already initialised in this process; "
            "trace fake ranks in a fresh process"
        )
    hook = sys.excepthook  # init_process_group prefixes tracebacks with "[rankN]:"
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
