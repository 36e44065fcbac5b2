"""DistributedDataParallel's memory, modelled from torch's own DDP code (torch 2.13:
torch/nn/parallel/distributed.py, torch/csrc/distributed/c10d/reducer.cpp) and checked
against real gloo runs (`pipemem validate dist`, the ddp cases): what a DDP rank holds and
allocates beyond the plain model's step, installed on a traced model.

What DDP does with memory in the FIRST training step (dense parameters, defaults: no comm
hook, find_unused_parameters=False, static_graph=False, batched_grad_copy=False):
- Buckets. `DistributedDataParallel.__init__` assigns the parameters that require grad to
  buckets (`dist._compute_bucket_assignment_by_size`: definition order, one open bucket per
  dtype and device, closed when it reaches its limit; the buckets sorted by their first
  parameter; DDP reverses the list, the order gradients are expected in) and the Reducer
  allocates, per bucket, one flat tensor of its parameters' total numel (no padding),
  resident from construction on; each parameter's slot is a view into it. With
  find_unused_parameters and static_graph off the first iteration's limit is `sys.maxsize`
  (`_BucketCapacityConfig.compute_bucket_size_limits`): ONE bucket per dtype, whatever
  `bucket_cap_mb` says.
- Buffers. At the start of every forward (`_pre_forward`, forward_sync_buffers on by default)
  the module's buffers are broadcast from rank 0 (`_broadcast_coalesced`): per bucket of at
  most 250 MiB (`broadcast_bucket_size`, per dtype) a flat copy (`torch.cat`; none for a
  bucket of one tensor, which is flattened as a view), at most two buckets in flight.
- Backward. After AccumulateGrad has written a parameter's .grad, the Reducer's post hook
  (`mark_variable_ready_dense`) writes it, divided by the world size, into its bucket view
  (`at::mul_out`: no new tensor). With gradient_as_bucket_view=True the .grad is then
  replaced by the bucket view, so the tensor autograd created is freed at once and the
  gradients live only in the buckets; with False (the default) .grad keeps its own storage,
  a second copy of every gradient.
- All-reduce. A full bucket is all-reduced in place (gloo / NCCL reduce the tensor they are
  given; gloo's own scratch is not torch memory). At the end of backward a
  gradient_as_bucket_view=False .grad gets the reduced values copied back in place.

From the SECOND step on (not traced yet; `--step first` only): the first forward of step 2
rebuilds the buckets in the order gradients became ready, with the limits
[`dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB, only when bucket_cap_mb is left at its default),
bucket_cap_mb (25 MiB)], allocating the new buckets before it frees the old ones (torch's
own comment in `_pre_forward`; seen in a profile: two copies of the buckets for a moment at
that forward's start). Resident bytes stay the gradient bytes; the optimizer states are
resident too.
"""

from __future__ import annotations

import sys
from collections import deque

import torch

DEFAULT_BUCKET_CAP_MB = 25  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DistributedDataParallel.broadcast_bucket_size
MB = 1024 * 1024


def bucket_limits(bucket_cap_mb: float | None = None, first_iteration: bool = True) -> list[int]:
    """The byte limits DDP assigns gradient buckets with: one unlimited bucket (per dtype) for
    the first iteration (find_unused_parameters and static_graph off, the defaults); the
    rebuilt buckets' limits after it, the first one small only when the cap is the default."""
    if first_iteration:
        return [sys.maxsize]
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MB)
    first = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    return [first, cap] if first < cap else [cap]


def assign_by_size(tensors: list, limits: list[int]) -> list[list[int]]:
    """Indices of `tensors` per bucket, as `dist._compute_bucket_assignment_by_size` makes
    them (dense tensors, no given order): in order, one open bucket per (dtype, device),
    closed once its bytes reach its limit (a dtype's i-th bucket takes the i-th limit, the
    last one after that); the buckets sorted by their smallest index."""
    open_: dict = {}  # (dtype, device) -> (indices, bytes, buckets closed so far)
    out = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        idx, size, done = open_.get(key, ([], 0, 0))
        idx = idx + [i]
        size += t.numel() * t.element_size()
        if size >= limits[min(done, len(limits) - 1)]:
            out.append(idx)
            idx, size, done = [], 0, done + 1
        open_[key] = (idx, size, done)
    out += [idx for idx, _, _ in open_.values() if idx]
    return sorted(out, key=min)


def bucket_layout(params: list, limits: list[int] | None = None) -> list[list[int]]:
    """The Reducer's buckets (indices of `params`): `assign_by_size` reversed, as DDP hands
    them over. `limits` default: the first iteration's."""
    return assign_by_size(params, bucket_limits() if limits is None else limits)[::-1]


class DDPBuckets:
    """DDP's memory behaviour in the first step (the module docstring) on `module`: the flat
    bucket tensors, allocated now (create it where the trace's tensors are made, e.g. under
    FakeTensorMode, before the step); a forward pre-hook making the buffer broadcast's flat
    copies; a post-accumulate-grad hook per parameter doing the Reducer's copy into its bucket
    (and, as a bucket view, the swap of .grad). The all-reduce itself is in place and
    allocates nothing, so the model runs none."""

    def __init__(self, module: torch.nn.Module, world: int, gradient_as_bucket_view: bool = False):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = list(module.buffers())
        self.world, self.as_view = world, gradient_as_bucket_view
        self.layout = bucket_layout(self.params)
        self.buckets, self.views = [], {}
        for idx in self.layout:
            flat = torch.empty(
                sum(self.params[i].numel() for i in idx),
                dtype=self.params[idx[0]].dtype,
                device=self.params[idx[0]].device,
            )
            off = 0
            for i in idx:
                p = self.params[i]
                self.views[p] = flat[off : off + p.numel()].view(p.shape)
                off += p.numel()
            self.buckets.append(flat)
        self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        if self.buffers:
            self.hooks.append(module.register_forward_pre_hook(self._sync_buffers))

    @property
    def bucket_bytes(self) -> list[int]:
        return [b.numel() * b.element_size() for b in self.buckets]

    def _sync_buffers(self, module, args) -> None:
        in_flight: deque = deque()
        for idx in assign_by_size(self.buffers, [BROADCAST_BUCKET_BYTES]):
            if len(in_flight) >= 2:
                in_flight.popleft()  # the oldest broadcast finishes, its flat copy dies
            group = [self.buffers[i].contiguous().view(-1) for i in idx]
            in_flight.append(group[0] if len(group) == 1 else torch.cat(group))
        in_flight.clear()

    def _ready(self, p) -> None:
        view = self.views[p]
        torch.mul(p.grad, 1.0 / self.world, out=view)
        if self.as_view:
            p.grad = view

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
