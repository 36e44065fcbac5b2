"""What GPU kernels allocate inside themselves that no trace on fake tensors can see: assumed
from each kernel's source, not measured. One place, read by the templates (the `workspace_*`
of their ops) and by the traced stand-ins that play those kernels in a trace
(validation/megatron_trace.py), so the two sides assume the same bytes -- which is why a row
that depends on them checks nothing about them: such rows say `ASSUMED` (only a GPU run,
`pipemem validate cuda`, measures them). Imports nothing (template mode needs no torch).
"""

from __future__ import annotations

from math import prod

ASSUMED = "kernel workspace assumed, not checked"


def flash_attention_backward_workspace(
    s: int, b: int, heads: int, kv_heads: int, head_dim: int, elem_bytes: int
) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, bytes per element) of the buffers flash attention's backward allocates
    beyond dq, dk, dv. Source: Dao-AILab/flash-attention v2, csrc/flash_attn/flash_api.cpp
    `mha_bwd`: `dq_accum` (fp32, [b, s, heads, head_dim] rounded up to the kernel's tiles) and
    `softmax_d` (fp32, [b, heads, s]); with fewer K/V heads than query heads, `dk_expanded` and
    `dv_expanded` (the input dtype, every query head) summed per group afterwards. The tile
    rounding (sequence to 128, head_dim to 32 / 64) is left out. TE's flash / cuDNN backends and
    PyTorch's `_scaled_dot_product_flash_attention_backward` (which vendors the same kernels)
    are taken to allocate the same."""
    out = [("dq_accum", (s, b, heads, head_dim), 4), ("softmax_d", (b, heads, s), 4)]
    if kv_heads < heads:
        out += [
            ("dk_expanded", (s, b, heads, head_dim), elem_bytes),
            ("dv_expanded", (s, b, heads, head_dim), elem_bytes),
        ]
    return out


def flash_attention_backward_workspace_bytes(
    s: int, b: int, heads: int, kv_heads: int, head_dim: int, elem_bytes: int
) -> int:
    """The bytes of `flash_attention_backward_workspace`, all alive at once inside the kernel."""
    return sum(
        prod(shape) * eb
        for _, shape, eb in flash_attention_backward_workspace(s, b, heads, kv_heads, head_dim, elem_bytes)
    )
