"""GPU memory a training process uses beside what PyTorch's tensors are counted in.

A job dies when the driver cannot give it memory, and the driver has given out more than the
caching allocator's reserved bytes: the CUDA context, NCCL's buffers, and the cuBLAS workspaces,
which come from the caching allocator but never appear in a trace of the model's tensors (so
pipemem's allocated and reserved peaks do not hold them). This module prices each, per pipeline
rank, from the plan; every default names its source and every one can be overridden.

* CUDA context (driver state, the kernels loaded so far): about 300 MB for a bare context with
  lazy module loading, >1000 MB before CUDA 11.7 loaded modules lazily (PyTorch maintainers,
  pytorch/pytorch#107667); the kernels a training step loads on top (cuBLAS, flash attention,
  NCCL, the optimizer's) bring it to the 0.5 GiB pipemem assumes by default
  (`--cuda-context-mib`).
* NCCL: each communicator a rank uses allocates its own channel buffers (more communicators,
  more memory; linear in channels; NVIDIA/nccl#986). Measured with one 4 MB all-reduce per
  group on 4 x A100 with NVLink: 544 MB for a 2-rank group, 688 MB for a larger one
  (NVIDIA/nccl#964). On sm 9.0+ NVSwitch systems NCCL adds NVLink SHARP (NVLS) buffers to
  intra-node groups of more than 2 ranks: nvlsPerRankSize 301989888 B in NCCL's own log on
  8 x H200 (vllm-project/vllm#9699). `--nccl-mib` sets the per-communicator size instead.
  PyTorch's ProcessGroupNCCL creates a communicator at a group's first collective, so only the
  groups the plan communicates over count (listed by `communicators`).
* cuBLAS workspace: one per (handle, stream) that runs matmuls, allocated through the caching
  allocator: 4096 KiB x 8 = 32 MiB on sm 9.0, else 4096 KiB x 2 + 16 KiB x 8 (PyTorch
  aten/src/ATen/cuda/CublasHandlePool.cpp, `parseChosenWorkspaceSize`, CUBLAS_WORKSPACE_CONFIG
  unset). It is a segment of its own (larger than 10 MiB on sm 9.0), so it adds to reserved
  bytes one for one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError

MIB = 1 << 20
CUDA_CONTEXT_BYTES = 512 * MIB
NCCL_PAIR_BYTES = 544 * 10**6  # NVIDIA/nccl#964: a 2-rank group
NCCL_GROUP_BYTES = 688 * 10**6  # NVIDIA/nccl#964: a group of more than 2 ranks
NVLS_BYTES = 301_989_888  # vllm-project/vllm#9699: nvlsPerRankSize on H200
GPUS_PER_NODE = 8
MAX_OVERRIDE_MIB = 1 << 20  # 1 TiB: anything larger is a typo


@dataclass(frozen=True, slots=True)
class Communicator:
    name: str  # the plan's group: tp, cp, dp, pp, ep, world, embedding...
    ranks: int
    nvls: bool  # NVLS buffers counted (intra-node, > 2 ranks, sm 9.0+)
    bytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "ranks": self.ranks, "nvls": self.nvls, "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class OutsideAllocator:
    """What one rank holds beside the caching allocator's reserved bytes (and the cuBLAS
    workspace, which the allocator holds but no trace of the model's tensors shows)."""

    cuda_context_bytes: int
    communicators: tuple[Communicator, ...]
    cublas_workspace_bytes: int

    @property
    def nccl_bytes(self) -> int:
        return sum(c.bytes for c in self.communicators)

    @property
    def total_bytes(self) -> int:
        return self.cuda_context_bytes + self.nccl_bytes + self.cublas_workspace_bytes

    def to_dict(self) -> dict:
        sums = ("cuda_context_bytes", "nccl_bytes", "cublas_workspace_bytes", "total_bytes")
        return {
            **{k: getattr(self, k) for k in sums},
            "communicators": [c.to_dict() for c in self.communicators],
        }


def check_override(flag: str, mib) -> float | None:
    """A `--cuda-context-mib` / `--nccl-mib` value: None, or a number of MiB in [0, 1 TiB]."""
    if mib is None:
        return None
    try:
        v = float(mib)
    except (TypeError, ValueError):
        raise UserError(f"{flag} {mib!r}: give a number of MiB (e.g. {flag} 600)") from None
    if not 0 <= v <= MAX_OVERRIDE_MIB:
        raise UserError(f"{flag} {mib}: must be between 0 and {MAX_OVERRIDE_MIB} MiB")
    return v


def _sm90_or_newer(compute_capability) -> bool:
    """Unknown hardware (--gpu-memory alone) is priced as the larger case: no FITS rests on
    a smaller workspace than the GPU may use."""
    try:
        return float(str(compute_capability)) >= 9.0
    except (TypeError, ValueError):
        return compute_capability is None


def cublas_workspace_bytes(compute_capability) -> int:
    return 4096 * 1024 * 8 if _sm90_or_newer(compute_capability) else 4096 * 1024 * 2 + 16 * 1024 * 8


def _groups(plan, tied_embeddings: bool, pp_rank: int) -> list[tuple[str, int, int]]:
    """(name, ranks, stride) of each group a rank of the plan communicates over, with the
    stride between its members in Megatron's rank order (tp fastest, then cp, dp, pp): a
    group whose members span at most one node is intra-node."""
    tp, cp, dp, pp, ep = plan.tp, plan.cp, plan.dp, plan.pp, plan.ep
    out = []
    if tp > 1:
        out.append(("tp", tp, 1))
    if cp > 1:
        out.append(("cp", cp, tp))
    if dp * cp > 1:  # gradient reduction / sharding over the data-parallel ranks (and cp's)
        out.append(("dp" if cp == 1 else "dp-cp", dp * cp, tp))
    if ep > 1:
        out.append(("ep", ep, tp))
        edp = max(1, plan.edp)
        if edp > 1:
            out.append(("expert-dp", edp, tp * ep))
    if pp > 1:
        out.append(("pp", pp, tp * cp * dp))
        if tied_embeddings and pp_rank in (0, pp - 1):
            # the first and last stage all-reduce the tied embedding's gradient
            out.append(("embedding", 2, tp * cp * dp * (pp - 1)))
    if plan.world > 1:  # the default group: init barriers, loss and norm all-reduces
        out.append(("world", plan.world, 1))
    return out


def communicators(
    plan, tied_embeddings: bool, pp_rank: int, compute_capability, nccl_mib: float | None = None
) -> tuple[Communicator, ...]:
    sm90 = _sm90_or_newer(compute_capability)
    out = []
    for name, ranks, stride in _groups(plan, tied_embeddings, pp_rank):
        if nccl_mib is not None:
            out.append(Communicator(name, ranks, False, int(nccl_mib * MIB)))
            continue
        intra = stride * ranks <= GPUS_PER_NODE if ranks <= GPUS_PER_NODE else False
        nvls = sm90 and intra and ranks > 2
        size = (NCCL_PAIR_BYTES if ranks == 2 else NCCL_GROUP_BYTES) + (NVLS_BYTES if nvls else 0)
        out.append(Communicator(name, ranks, nvls, size))
    return tuple(out)


def outside_allocator(
    plan,
    tied_embeddings: bool,
    pp_rank: int,
    compute_capability,
    cuda_context_mib: float | None = None,
    nccl_mib: float | None = None,
) -> OutsideAllocator:
    """The memory rank `pp_rank` of the plan holds beside the caching allocator's reserved
    bytes (module docstring). `compute_capability` is the GPU's ("9.0"), None when unknown."""
    context = CUDA_CONTEXT_BYTES if cuda_context_mib is None else int(cuda_context_mib * MIB)
    return OutsideAllocator(
        context,
        communicators(plan, tied_embeddings, pp_rank, compute_capability, nccl_mib),
        cublas_workspace_bytes(compute_capability),
    )
