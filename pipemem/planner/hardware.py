"""Nominal speeds of the GPU presets, for the planner's cost model only (memory never uses them).

Per GPU: dense bf16 tensor-core TFLOP/s, the intra-node link (NVLink / Infinity Fabric, GB/s
per direction per GPU) and the usual inter-node network per GPU (GB/s per direction). Values
are the vendors' datasheet figures; they only have to rank plans against each other, and
`pipemem plan --tflops / --intra-node-gbps / --inter-node-gbps` overrides them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class Speeds:
    tflops: float  # dense bf16 (fp16 / fp32 where the GPU has no bf16 tensor cores)
    intra_gbps: float  # GB/s per GPU per direction inside a node
    inter_gbps: float  # GB/s per GPU per direction across nodes
    source: str = ""


SPEEDS = {
    "a100-40g": Speeds(
        312, 300, 25, "A100 datasheet: 312 TF bf16 dense, NVLink3 600 GB/s bidirectional; HDR 200 Gb/s"
    ),
    "a100-80g": Speeds(
        312, 300, 25, "A100 datasheet: 312 TF bf16 dense, NVLink3 600 GB/s bidirectional; HDR 200 Gb/s"
    ),
    "h100-80g": Speeds(989, 450, 50, "H100 SXM datasheet: 989 TF bf16 dense, NVLink4 900 GB/s; NDR 400 Gb/s"),
    "h100-94g": Speeds(
        835, 300, 50, "H100 NVL datasheet: 835 TF bf16 dense, NVLink bridge 600 GB/s; NDR 400 Gb/s"
    ),
    "h200": Speeds(989, 450, 50, "H200 SXM datasheet: 989 TF bf16 dense, NVLink4 900 GB/s; NDR 400 Gb/s"),
    "b200": Speeds(2250, 900, 100, "B200 datasheet: 2.25 PF bf16 dense, NVLink5 1.8 TB/s; XDR 800 Gb/s"),
    "mi300x": Speeds(
        1307, 448, 50, "MI300X datasheet: 1307 TF bf16 dense, Infinity Fabric 896 GB/s; 400 Gb/s"
    ),
    "rtx3090": Speeds(71, 25, 12.5, "RTX 3090: 71 TF bf16 (fp32 accumulate), PCIe 4.0 x16; 100 Gb/s"),
    "gtx1080ti": Speeds(
        11.3, 12, 12.5, "GTX 1080 Ti: 11.3 TF fp32 (no bf16 tensor cores), PCIe 3.0 x16; 100 Gb/s"
    ),
}

# used with --gpu-memory and no --gpu: an H100 SXM node
DEFAULT_SPEEDS = SPEEDS["h100-80g"]


def speeds_for(
    gpu_key: str | None, tflops: float | None = None, intra: float | None = None, inter: float | None = None
) -> Speeds:
    base = SPEEDS.get(gpu_key or "", DEFAULT_SPEEDS)
    for flag, v in (("--tflops", tflops), ("--intra-node-gbps", intra), ("--inter-node-gbps", inter)):
        if v is not None and not v > 0:
            raise UserError(f"{flag} {v}: must be a positive number")
    return Speeds(
        tflops or base.tflops,
        intra or base.intra_gbps,
        inter or base.inter_gbps,
        base.source if (tflops, intra, inter) == (None, None, None) else "given on the command line",
    )
