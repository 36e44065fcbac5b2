"""Kernel policies: which kernels a traced step stands for.

A trace runs on fake *CPU* tensors (fake CUDA devices crash the CPU wheel, FINDINGS.md §4),
so by default it saves what CPU kernels save. Two policies:

* ``cpu``: exactly what the same step does on the CPU with PyTorch defaults (ground truth for
  `pipemem validate cpu`); nothing is changed.
* ``cuda`` (default): the kernels a CUDA run picks where they save different tensors. Each rule
  names the PyTorch source it follows:

  1. ``F.scaled_dot_product_attention`` -> the backend `sdp::select_sdp_backend`
     (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) picks: flash
     (`aten._scaled_dot_product_flash_attention`: saves output + logsumexp [B,H,S] fp32 + philox
     seed/offset) for fp16/bf16 without an explicit mask and head_dim <= 256 (`check_dtypes_low_precision`,
     `check_head_dim_size_flash`, `check_for_attn_mask`); otherwise memory-efficient attention
     (`aten._scaled_dot_product_efficient_attention`: output + logsumexp padded to 32 rows), which
     takes fp32 and masks but not grouped-query heads (`check_grouped_query_attention` lists flash
     and math only); otherwise the math path (`aten._scaled_dot_product_attention_math`).
     Under autocast the inputs are cast first, as the CUDA autocast list
     (aten/src/ATen/autocast_mode.cpp, `KERNEL_CUDA(scaled_dot_product_attention, lower_precision_fp)`)
     does.
  2. ``F.dropout`` -> `at::native::dropout` (aten/src/ATen/native/Dropout.cpp) takes the fused
     `native_dropout` kernel when `is_fused_kernel_acceptable` (CUDA input, 0 < p < 1), whose mask is
     bool (Dropout.cu `dropout_cuda`: `at::empty_like(self, kBool)`); the CPU path saves a mask in
     the input dtype.
  3. Optimizers with ``foreach=None`` -> `_default_to_fused_or_foreach` (torch/optim/optimizer.py)
     picks the foreach implementation for CUDA tensors (the CPU default is the for-loop, which
     peaks lower: FINDINGS.md §4).

Known gap: autocast runs with the CPU autocast op lists; the CUDA lists also upcast e.g. `pow`,
`softmax`, `layer_norm` to fp32. Llama-family models upcast explicitly, so they are not affected.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import UserError

POLICIES = ("cuda", "cpu")


def check(policy: str) -> str:
    if policy not in POLICIES:
        raise UserError(f"--kernel-policy {policy!r}: use one of {', '.join(POLICIES)}")
    return policy


def _arg(args, kwargs, i, name, default):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _autocast_cast(*ts):
    """Cast floating inputs to the active CPU autocast dtype, as CUDA autocast does for SDPA."""
    if not torch.is_autocast_enabled("cpu"):
        return ts
    dt = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dt) if t is not None and t.is_floating_point() and t.dtype != dt else t for t in ts)


class CudaKernels(TorchFunctionMode):
    """Rules 1 and 2 of the module docstring, applied above autograd so saved tensors follow."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(args, kwargs)
        if func is F.dropout:
            x = args[0]
            p = _arg(args, kwargs, 1, "p", 0.5)
            training = _arg(args, kwargs, 2, "training", True)
            inplace = _arg(args, kwargs, 3, "inplace", False)
            if training and 0 < p < 1 and x.numel() > 0 and not inplace:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)

    @staticmethod
    def _sdpa(args, kwargs):
        q, k, v = args[:3]
        mask = _arg(args, kwargs, 3, "attn_mask", None)
        p = _arg(args, kwargs, 4, "dropout_p", 0.0)
        causal = _arg(args, kwargs, 5, "is_causal", False)
        scale = kwargs.get("scale")
        gqa = kwargs.get("enable_gqa", False) and q.shape[-3] != k.shape[-3]
        q, k, v = _autocast_cast(q, k, v)
        if mask is not None and mask.is_floating_point():
            (mask,) = _autocast_cast(mask)
        aten = torch.ops.aten
        low_precision = q.dtype in (torch.float16, torch.bfloat16)
        if mask is None and low_precision and q.shape[-1] <= 256 and q.dim() == 4:
            return aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
        if not gqa and q.dim() == 4:
            need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            return aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, need_grad, p, causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math(
            q, k, v, mask, p, causal, None, scale=scale, enable_gqa=bool(gqa))[0]


def context(policy: str):
    """The context manager a traced step runs under for `policy`."""
    check(policy)
    return CudaKernels() if policy == "cuda" else contextlib.nullcontext()


def configure_optimizer(policy: str, optimizer) -> None:
    """Rule 3: foreach where the optimizer left the choice to PyTorch."""
    if policy != "cuda" or optimizer is None:
        return
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


# Ops that selective checkpointing saves (the matmuls and attention kernels of both policies).
def saved_ops_for_selective():
    aten = torch.ops.aten
    ops = [aten.mm.default, aten.bmm.default, aten.addmm.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default]
    for name in ("_grouped_mm",):
        op = getattr(aten, name, None)
        if op is not None:
            ops.append(op.default)
    return frozenset(ops)
