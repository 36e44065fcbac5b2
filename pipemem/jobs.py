"""What the stage-job layer hands to schedules and replay (layer 4 of DESIGN.md's flow).

A *job* is one action of one pipeline stage for one microbatch (F, B, I, W) or the optimizer
step; its memory is `{net, peak}` from liveness, relative to the bytes in use when it starts.
Templates, traced programs and Paddle programs all produce these, so replay never needs to
know where the numbers came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

JOB_KINDS = ("F", "B", "I", "W", "optimizer")


@dataclass(frozen=True, slots=True)
class JobMemory:
    net_bytes: int
    peak_bytes: int
    seconds: float = 0.0   # modelled duration, for the schedule time model (0 = unknown)

    def to_dict(self) -> dict:
        return {"net_bytes": self.net_bytes, "peak_bytes": self.peak_bytes}


@dataclass(frozen=True, slots=True)
class StaticBytes:
    """Bytes a rank holds when the reported step starts, before any microbatch (`total`), and
    what the step itself creates and frees again (not in `total`):

    grads_in_step: gradients set to None by the previous step's zero_grad, created by the
        first backward of this step and freed after its optimizer step (--grads set-to-none,
        ddp-bucket);
    optimizer_in_step: optimizer states the first step creates in its optimizer step
        (--step first)."""

    params: int = 0
    grads: int = 0        # resident gradient storage: fp32 main-grad buffers, DDP buckets
    optimizer: int = 0    # optimizer states incl. fp32 master weights
    other: int = 0        # buffers, CUDA context, comm buffers that persist...
    grads_in_step: int = 0
    optimizer_in_step: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.other

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "other": self.other, "total": self.total, "grads_in_step": self.grads_in_step,
                "optimizer_in_step": self.optimizer_in_step}


@dataclass(slots=True)
class StageJobs:
    """The jobs of one (virtual) pipeline stage. `I`/`W` are the split backward (input grad,
    weight grad); `B` is the fused backward (= I then W)."""

    stage: int
    F: JobMemory
    B: JobMemory
    I: JobMemory | None = None
    W: JobMemory | None = None
    layers: tuple[int, ...] = ()          # decoder layer indices on this stage
    notes: dict = field(default_factory=dict)

    def job(self, kind: str) -> JobMemory:
        j = getattr(self, kind, None)
        if j is None:
            raise KeyError(f"stage {self.stage} has no {kind} job (split backward not built)")
        return j
