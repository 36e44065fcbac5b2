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
     (`aten._scaled_dot_product_efficient_attention`: output + logsumexp padded to 32 rows) for
     fp32 or masked inputs with head_dim divisible by 4 (fp32) / 8 (`check_head_dim_size_mem_efficient`);
     otherwise the math path (`aten._scaled_dot_product_attention_math`). Grouped-query k/v go
     to efficient attention as they are (recent CUDA kernels take them natively); its meta
     kernel needs equal head counts, so without a mask and with the sequence a multiple of 32
     the trace runs the flash meta kernel (same saved tensors), else it expands k/v (slightly high). On sm90+
     with a recent cuDNN, PyTorch may prefer cuDNN attention (`check_prefer_cudnn_attention`),
     which saves the same output + fp32 logsumexp as flash.
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
  4. ``F.softmax`` / ``F.log_softmax`` of an fp16 input with ``dtype=float32`` -> the CUDA branch
     of `at::native::softmax` / `log_softmax` (aten/src/ATen/native/SoftMax.cpp) calls
     `_softmax(input, dim, half_to_float=true)`: no fp32 copy of the input (the CPU branch makes
     one with `input_.toType(dtype)`). bf16 inputs take the copying branch on both devices.
  5. Autocast: the trace runs under CPU autocast, whose op lists differ from CUDA's. CUDA's
     float32 list (aten/src/ATen/autocast_mode.h `AT_FORALL_FP32`, and the "CUDA Ops that can
     autocast to float32" table of the torch.amp docs: pow, exp, log*, rsqrt, reciprocal,
     layer_norm, group_norm, softplus, the losses, ...) casts fp16/bf16 inputs to fp32; its
     `AT_FORALL_FP32_SET_OPT_DTYPE` ops (softmax, log_softmax, sum, cumsum, cumprod, prod) run
     with ``dtype=float32`` unless a dtype is given. We wrap those entry points (torch.*,
     Tensor methods and operators, torch.nn.functional) while autocast is on; CPU autocast
     upcasts none of them (pow, softmax, layer_norm stay bf16 on the CPU).
  6. ``F.rms_norm`` (``nn.RMSNorm``) -> `rms_norm_symint` (aten/src/ATen/native/layer_norm.cpp)
     calls `at::_fused_rms_norm` when the weight has the input's dtype: on CUDA one kernel
     whose autograd node saves the input, the fp32 rstd [rows, 1] and the weight (the CPU
     build decomposes it into fp32 ops that save an fp32 copy and the normalised fp32
     tensor). Traced as that kernel: output and rstd allocated, input/rstd/weight saved.

What a kernel allocates *inside* itself (flash attention's backward workspace...) no trace can
see; those bytes are assumed from the kernels' sources in one place, `kernel_workspace.py`,
shared by the templates and the traced stand-ins of validation/megatron_trace.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

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


class CudaKernels:
    """Rules 1 and 2 of the module docstring. They replace the `torch.nn.functional` entry
    points while a step is traced (callers look them up at call time), so they also apply
    when checkpointing recomputes a layer inside the backward, where a TorchFunctionMode is
    not active. They run above autograd, so saved tensors follow the CUDA kernels."""

    def __enter__(self):
        self._saved = (F.scaled_dot_product_attention, F.dropout, F.rms_norm)
        F.scaled_dot_product_attention = self._sdpa_entry
        F.dropout = self._dropout_entry
        F.rms_norm = self._rms_norm_entry
        self._patched = []
        for owner, names, wrap in (
            (torch, _FP32_TORCH, _fp32_inputs),
            (torch.Tensor, _FP32_TENSOR, _fp32_inputs),
            (F, _FP32_FUNCTIONAL, _fp32_inputs),
            (torch, _SET_DTYPE, _fp32_dtype),
            (torch.Tensor, _SET_DTYPE, _fp32_dtype),
            (F, _SET_DTYPE_FUNCTIONAL, _fp32_dtype),
        ):
            for name in names:
                original = getattr(owner, name, None)
                if original is not None:
                    self._patched.append((owner, name, original, name in vars(owner)))
                    setattr(owner, name, wrap(original, name))
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention, F.dropout, F.rms_norm = self._saved
        for owner, name, original, own in reversed(self._patched):
            if own:
                setattr(owner, name, original)
            else:  # inherited (torch.Tensor from TensorBase): drop our shadowing attribute
                delattr(owner, name)
        self._patched = []
        return False

    def _sdpa_entry(self, *args, **kwargs):
        return self._sdpa(args, kwargs)

    def _dropout_entry(self, *args, **kwargs):
        x = args[0] if args else kwargs["input"]
        p = _arg(args, kwargs, 1, "p", 0.5)
        training = _arg(args, kwargs, 2, "training", True)
        inplace = _arg(args, kwargs, 3, "inplace", False)
        if training and 0 < p < 1 and x.numel() > 0 and not inplace:
            return torch.native_dropout(x, p, True)[0]
        return self._saved[1](*args, **kwargs)

    def _rms_norm_entry(self, input, normalized_shape, weight=None, eps=None):
        if weight is not None and weight.dtype != input.dtype:  # CUDA falls back to the composite too
            return self._saved[2](input, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(input, weight, tuple(normalized_shape))

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
        elif mask is not None and mask.dtype == torch.bool:
            # scaled_dot_product_attention turns a boolean mask into an additive one of the query's
            # dtype before any kernel runs (attention.cpp, convert_boolean_attn_mask): a new
            # [B, 1, S, S] tensor, which the efficient kernel saves as its bias (sliding-window
            # layers, Gemma 3 / Mistral: HF passes such a mask once seq_len > window)
            zero, neg_inf = torch.zeros((), dtype=q.dtype), torch.full((), float("-inf"), dtype=q.dtype)
            mask = torch.where(mask, zero, neg_inf)
        aten = torch.ops.aten
        low_precision = q.dtype in (torch.float16, torch.bfloat16)
        head = q.shape[-1]
        if mask is None and low_precision and head <= 256 and q.dim() == 4 and head == v.shape[-1]:
            return aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
        align = 8 if low_precision else 4
        # the efficient kernel takes a value head dim other than the query's (MLA: 192 vs 128) when
        # both are aligned (sdp_utils.cpp, check_head_dim_size_mem_efficient, torch 2.x)
        if q.dim() == 4 and head % align == 0 and v.shape[-1] % align == 0:
            if gqa and mask is None and q.shape[-2] % 32 == 0 and head == v.shape[-1]:
                # CUDA's efficient kernel takes grouped heads natively (sdp_utils.cpp:
                # backend_supports_grouped_query_attention) and saves the output, the fp32
                # logsumexp (rows padded to 32) and k/v as given. Its meta kernel wants equal
                # head counts; the flash meta kernel takes grouped heads and saves the same
                # tensors when the sequence is a multiple of 32.
                return aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
            if gqa:
                # The meta kernels want equal head counts; expanding k/v keeps this trace
                # conservative where newer CUDA kernels take grouped heads natively.
                rep = q.shape[-3] // k.shape[-3]
                k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
            need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            return aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, need_grad, p, causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            q, k, v, mask, p, causal, None, scale=scale, enable_gqa=bool(gqa)
        )[0]


class _FusedRMSNorm(torch.autograd.Function):
    """Rule 6: the memory of CUDA's `_fused_rms_norm` kernel and its backward."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape):
        stat_shape = x.shape[: x.dim() - len(normalized_shape)] + (1,) * len(normalized_shape)
        rstd = x.new_empty(stat_shape, dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        dw = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
        return torch.empty_like(x), dw, None


_LOW = (torch.float16, torch.bfloat16)
# CUDA autocast's fp32 list: the pointwise functions both torch and torch.Tensor name, then each
# namespace's own
_FP32_POINTWISE = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
)
_FP32_TORCH = _FP32_POINTWISE + ("cdist", "dist", "renorm", "cosine_similarity", "layer_norm", "group_norm")
_FP32_TENSOR = _FP32_POINTWISE + ("__pow__", "__rpow__", "__rtruediv__", "__rdiv__", "dist", "renorm")
_FP32_FUNCTIONAL = (
    "layer_norm",
    "group_norm",
    "softplus",
    "normalize",
    "cosine_similarity",
    "pdist",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "nll_loss",
    "binary_cross_entropy_with_logits",
    "cross_entropy",
    "poisson_nll_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "cosine_embedding_loss",
)
_SET_DTYPE = ("softmax", "log_softmax", "sum", "cumsum", "cumprod", "prod")
_SET_DTYPE_FUNCTIONAL = ("softmax", "log_softmax", "softmin")


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu")


def _fp32_inputs(original, name):
    """CUDA autocast's float32 policy: fp16/bf16 tensor arguments are cast to fp32 first."""

    def wrapper(*args, **kwargs):
        if _autocast_on():
            args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in _LOW else a for a in args)
            kwargs = {
                k: (v.float() if isinstance(v, torch.Tensor) and v.dtype in _LOW else v)
                for k, v in kwargs.items()
            }
        return original(*args, **kwargs)

    wrapper.__name__ = name
    return wrapper


def _fp32_dtype(original, name):
    """CUDA autocast's fp32_set_opt_dtype policy (dtype=float32 for fp16/bf16 inputs unless a
    dtype is given), then rule 4 for fp16 softmax / log_softmax."""
    half_to_float = {"softmax": torch._softmax, "log_softmax": torch._log_softmax}.get(name)

    def wrapper(*args, **kwargs):
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            return original(*args, **kwargs)
        dtype_given = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args[1:])
        if _autocast_on() and x.dtype in _LOW and not dtype_given:
            kwargs = dict(kwargs, dtype=torch.float32)
        if half_to_float is not None and x.dtype == torch.float16 and kwargs.get("dtype") == torch.float32:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int):
                return half_to_float(x, dim, True)
        return original(*args, **kwargs)

    wrapper.__name__ = name
    return wrapper


def context(policy: str):
    """The context manager a traced step runs under for `policy` (both policies: fp32 / fp16
    grouped GEMMs, see `GroupedMmAnyFloat`)."""
    check(policy)
    stack = contextlib.ExitStack()
    stack.enter_context(GroupedMmAnyFloat())
    if policy == "cuda":
        stack.enter_context(CudaKernels())
    return stack


class GroupedMmAnyFloat:
    """`aten._grouped_mm` of fp32 or fp16 operands on fake tensors.

    The kernels take them: the CPU kernel (aten/src/ATen/native/GroupedMMUtils.h,
    `_grouped_mm_fallback`: an mm per group into one output) and, since PyTorch 2.9, the CUDA
    one, which takes its CUTLASS path for bf16 on sm80+ only and that same per-group fallback
    otherwise (`_grouped_mm_cuda`, GroupedBlas.cpp). The meta function in
    torch/_meta_registrations.py (`_meta_grouped_mm_common`) still checks the bf16 fast path's
    dtypes only, so without this a trace of HF's grouped_mm experts (its default for MoE) with
    fp32 weights stops there. While a step is traced, equal fp32 / fp16 operands get an output
    of their dtype (the fallback's `at::empty(..., mat_a.options())`); every other call, and
    every call outside a trace, goes to torch's own meta function. Autograd is untouched
    (GroupedMmBackward0 saves both operands and the offsets in every dtype).

    The Meta kernel is registered once per process and delegates to torch's outside a trace
    (a registration dropped on exit is still reached by later FakeTensorMode dispatches of
    this PyTorch, so it is not dropped)."""

    _OTHER = (torch.float32, torch.float16)
    _active = 0
    _lib = None

    @classmethod
    def _register(cls) -> bool:
        if cls._lib is not None:
            return True
        try:
            from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm
        except ImportError:  # a PyTorch without grouped GEMMs
            return False

        def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
            if (
                cls._active
                and mat_a.dtype == mat_b.dtype
                and mat_a.dtype in cls._OTHER
                and out_dtype in (None, mat_a.dtype)
                and bias is None
            ):
                return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
            return meta_grouped_mm(mat_a, mat_b, offs, bias, out_dtype)

        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_grouped_mm", meta, "Meta")
        cls._lib = lib
        return True

    def __enter__(self):
        self._on = self._register()
        if self._on:
            GroupedMmAnyFloat._active += 1
        return self

    def __exit__(self, *exc):
        if self._on:
            GroupedMmAnyFloat._active -= 1
            self._on = False
        return False


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
    ops = [
        aten.mm.default,
        aten.bmm.default,
        aten.addmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    ]
    for name in ("_grouped_mm",):
        op = getattr(aten, name, None)
        if op is not None:
            ops.append(op.default)
    return frozenset(ops)
