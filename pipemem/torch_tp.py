"""Tensor-parallel styles for PyTorch DTensor that trade activation memory for communication.

`RegatherColwiseParallel` is a drop-in for `torch.distributed.tensor.parallel.ColwiseParallel`
on the linears that read a sequence-parallel input (q/k/v or a fused qkv, gate/up or a fused
w13, the LM head). Under sequence parallelism (a `SequenceParallel` norm, then
`PrepareModuleInput` or `input_layouts=Shard(1)` all-gathering its output), PyTorch's
column-parallel linear saves the *gathered* input ``[b, s, h]`` for its weight gradient. With
this style it saves only this rank's sequence shard ``[b, s/tp, h]`` and all-gathers it again
in backward: per block input and microbatch, ``(tp-1)/tp * b*s*h`` elements fewer are kept
from the forward to the backward, for one more all-gather per block in backward. This is
Paddle's `recompute_allgather` (``MpConfig.recompute_allgather``) and what Megatron-LM's
sequence-parallel linears always do; `pipemem estimate --recompute-allgather` models it.

The one-line change to a torchtitan-style plan::

    from pipemem.torch_tp import RegatherColwiseParallel as ColwiseParallel

How it works, and why the numerics are unchanged: the autograd graph is exactly the plain
style's. Only the tensor the linear's matmul *saves* is replaced, with
`torch.autograd.graph.saved_tensors_hooks` active during the linear's forward: a saved view of
the gathered input is packed as (this rank's shard, the view's geometry) and unpacked in
backward by all-gathering the shard again, which reproduces the gathered tensor bit for bit.
The input gradient still reaches the shared gathered input and is reduce-scattered once per
block, so outputs and gradients are bitwise those of `ColwiseParallel`.

* Several linears reading one gathered input (q, k and v after one `PrepareModuleInput`)
  share one shard and one re-gather per backward pass: the re-gathered tensor lives from the
  first of their backward nodes to the last, then is freed. (A pass that runs only some of
  them keeps it until the graph is freed.)
* Where the style gathers the input itself (``input_layouts=Shard(d)``) it keeps the input
  shard it was given; where the input arrives gathered (`PrepareModuleInput`), it keeps a
  copy of this rank's chunk of it (the sharded norm output it came from is freed as usual).
* Activation checkpointing (`torch.utils.checkpoint`, non-reentrant, full or selective):
  the hooks hand the shard to the checkpoint's own hooks, so a checkpointed block still
  keeps nothing; after recomputation the linears keep the shard, not the gathered input.
* FSDP2 over a data-parallel mesh dimension composes (the hooks touch activations only).
* Eager only: torch.compile is not supported.
* Without sequence parallelism the input is replicated, and the style still keeps only 1/tp
  of it and gathers it in backward; `pipemem estimate --recompute-allgather` models the
  sequence-parallel case only (without the flag its estimate is the larger, safe one).

Only this module imports torch; ``import pipemem`` does not.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["RegatherColwiseParallel"]


class RegatherColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` whose linear keeps only this rank's sequence shard of its input for
    backward and all-gathers it again there (see the module docstring).

    Keyword Args:
        input_layouts, output_layouts, use_local_output: as `ColwiseParallel`.
        sequence_dim (int): the sequence dimension of the linear's input, along which it
            is sharded under sequence parallelism (1 for ``[batch, seq, hidden]``, the
            default, as `SequenceParallel`'s; 0 for ``[seq, batch, hidden]``). When
            ``input_layouts`` is ``Shard(d)``, ``d`` is used.

    Example::

        >>> from torch.distributed.tensor import Replicate, Shard
        >>> from torch.distributed.tensor.parallel import (PrepareModuleInput, RowwiseParallel,
        ...                                                SequenceParallel, parallelize_module)
        >>> from pipemem.torch_tp import RegatherColwiseParallel
        >>> plan = {
        ...     "attention_norm": SequenceParallel(),
        ...     "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
        ...                                     desired_input_layouts=(Replicate(), None)),
        ...     "attention.wq": RegatherColwiseParallel(),
        ...     "attention.wk": RegatherColwiseParallel(),
        ...     "attention.wv": RegatherColwiseParallel(),
        ...     "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        ... }
        >>> parallelize_module(block, tp_mesh, plan)   # doctest: +SKIP

    nn.Embedding modules are sharded as `ColwiseParallel` does and keep what it keeps (their
    input is token ids, nothing is gathered).
    """

    def __init__(
        self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True, sequence_dim: int = 1
    ):
        super().__init__(
            input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output
        )
        layout = self.input_layouts[0]
        self.sequence_dim = layout.dim if isinstance(layout, Shard) else sequence_dim

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        out = ColwiseParallel._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, inputs, device_mesh
        )
        layout, x = input_layouts[0], inputs[0]
        given = x.placements[0] if isinstance(x, DTensor) else layout
        if isinstance(layout, Shard) and given == layout and out is not x:
            # gathered here from the shard we were given: keep that shard, no copy
            _KNOWN_SHARDS[_local(out).untyped_storage()] = (_local(x), layout.dim)
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if isinstance(module, nn.Linear):
            if device_mesh.ndim != 1:
                raise ValueError(
                    f"RegatherColwiseParallel needs a 1-D tensor-parallel mesh, got {device_mesh.ndim}-D"
                )
            # after ColwiseParallel's input hook (it sees the gathered input), before its output hook
            module.register_forward_pre_hook(partial(_enter, self.sequence_dim, device_mesh))
            module.register_forward_hook(_exit, prepend=True, always_call=True)
        return module


# ---- per-call hooks ------------------------------------------------------------------------

# storage of a gathered input -> (the shard it was gathered from, sequence dim), while the
# gathered tensor lives: what the linears reading it save instead of it
_KNOWN_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# saved shard -> _Regather: how many linears saved it, and per backward pass the re-gathered
# tensor they share
_PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()
_STACK_ATTR = "_pipemem_regather_hooks"


@dataclass
class _Regather:
    """The saves of one shard, and per backward pass (autograd graph task) how many of them
    are still to be unpacked and the re-gathered tensor they share. Autograd unpacks every
    saved tensor of a node it runs, so a split backward (input grads, then weight grads, as
    zero-bubble pipeline schedules run it) gathers once in each pass."""

    saves: int = 0
    passes: dict = field(default_factory=dict)  # graph task id -> [unpacks left, gathered]


@dataclass(frozen=True)
class _SavedShard:
    """What a saved view of the gathered input is packed as: the shard (or what the outer
    saved-tensor hooks made of it) and how to rebuild the view from the re-gathered tensor."""

    packed: object
    seq_dim: int
    mesh: DeviceMesh
    full_shape: torch.Size
    full_stride: tuple
    view: tuple  # (size, stride, storage offset relative to the gathered tensor)
    spec: object  # the saved DTensor's spec (None for a plain tensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding t's data on this rank (through DTensor and a pending
    collective's wrapper). Views made inside DTensor's dispatch have no `_base`: tensors are
    matched by storage."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, AsyncCollectiveTensor):
        t = t.elem
    return t


def _enter(seq_dim: int, mesh: DeviceMesh, module: nn.Module, args) -> None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        hooks = None
    else:
        local = x._local_tensor if isinstance(x, DTensor) else x
        if isinstance(local, AsyncCollectiveTensor):
            local.trigger_wait()  # a copy of our chunk may be taken before the matmul waits
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack = partial(_pack, weakref.ref(_local(x)), seq_dim, mesh, outer)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, partial(_unpack, outer))
        hooks.__enter__()
    module.__dict__.setdefault(_STACK_ATTR, []).append(hooks)


def _exit(module: nn.Module, args, output):
    hooks = module.__dict__[_STACK_ATTR].pop()
    if hooks is not None:
        hooks.__exit__(None, None, None)
    return None


def _pack(root_ref, seq_dim: int, mesh: DeviceMesh, outer, t: torch.Tensor):
    """Pack hook of the linear's forward. Holds the gathered input only weakly: saved
    variables keep their hooks until the backward."""
    root = root_ref()
    local = _local(t)
    if root is None or not t.is_floating_point() or local.untyped_storage() is not root.untyped_storage():
        return (False, outer[0](t) if outer else t.detach())
    shard, dim = _shard_of(root, seq_dim, mesh)
    _PENDING.setdefault(shard, _Regather()).saves += 1
    view = (tuple(local.size()), tuple(local.stride()), local.storage_offset() - root.storage_offset())
    spec = t._spec if isinstance(t, DTensor) else None
    return (
        True,
        _SavedShard(
            outer[0](shard) if outer else shard, dim, mesh, root.shape, tuple(root.stride()), view, spec
        ),
    )


def _shard_of(root: torch.Tensor, seq_dim: int, mesh: DeviceMesh) -> tuple[torch.Tensor, int]:
    """The shard to keep for gathered tensor `root`: the one it was gathered from if this
    style gathered it, else a copy of this rank's chunk (made once, shared by the linears
    reading the same gathered input)."""
    key = root.untyped_storage()
    known = _KNOWN_SHARDS.get(key)
    if known is None:
        with torch.no_grad():
            chunk = torch.chunk(root, mesh.size(), dim=seq_dim)[mesh.get_local_rank()]
            known = (chunk.clone(memory_format=torch.contiguous_format), seq_dim)
        _KNOWN_SHARDS[key] = known
    return known


def _unpack(outer, packed):
    is_shard, payload = packed
    if not is_shard:
        return outer[1](payload) if outer else payload
    s: _SavedShard = payload
    shard = outer[1](s.packed) if outer else s.packed
    pending = _PENDING.get(shard)
    task = torch._C._current_graph_task_id()
    if pending is None or task == -1:  # unpacked outside a backward pass
        full = _all_gather(shard, s)
    else:
        # in each backward pass the first of the linears sharing this shard gathers; the last lets go
        state = pending.passes.get(task)
        if state is None:
            state = pending.passes[task] = [pending.saves, _all_gather(shard, s)]
        full = state[1]
        state[0] -= 1
        if state[0] <= 0:
            del pending.passes[task]
    size, stride, offset = s.view
    local = full.as_strided(size, stride, full.storage_offset() + offset)
    if s.spec is None:
        return local
    return DTensor(local, s.spec, requires_grad=False)


def _all_gather(shard: torch.Tensor, s: _SavedShard) -> torch.Tensor:
    """All-gather the sequence shards into the tensor the forward gathered (same layout)."""
    with torch.no_grad():
        d = DTensor.from_local(
            shard, s.mesh, [Shard(s.seq_dim)], run_check=False, shape=s.full_shape, stride=s.full_stride
        )
        full = d.redistribute(s.mesh, [Replicate()]).to_local()
        if isinstance(full, AsyncCollectiveTensor):
            full = full.trigger_wait()
    if full.shape != s.full_shape or tuple(full.stride()) != s.full_stride:
        raise RuntimeError(
            f"RegatherColwiseParallel: the re-gathered input has shape {tuple(full.shape)}, stride "
            f"{tuple(full.stride())}; the forward's had {tuple(s.full_shape)}, {s.full_stride}"
        )
    return full
