"""Kernel stand-ins for the traced validate workers (megatron_trace, torchtitan_trace): each plays
a GPU kernel on fake CPU tensors with that kernel's allocations and saved tensors, and nothing
else -- what a CPU fallback would allocate is not what the GPU run allocates.

  * `fake_item`: `.item()` of a fake tensor (a grad norm, a token count) is a constant;
  * Transformer Engine's and apex's kernels as megatron-core calls them (megatron_trace's
    docstring lists the policy): fused norms, fused rope, flash attention, grouped GEMMs,
    TE's `general_gemm` for the router, fused weight-gradient accumulation, `masked_select`
    with the number of entries a dropless routing selects;
  * `flex_as_flash`: torchtitan's FlexAttention run as causal SDPA, which the CUDA kernel
    policy routes to the flash kernel.

The flash backward's workspace is the one the templates assume (traced/kernel_workspace.py).
"""

from __future__ import annotations

import contextlib

import torch

from ..traced.kernel_workspace import flash_attention_backward_workspace

# .item() ---------------------------------------------------------------------------------------

ITEM_OPS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


def fake_item(int_value: int):
    """The fake-tensor implementation of `.item()` (`ITEM_OPS`): a constant instead of an error,
    1.0 for a float, False for a bool, `int_value` for an integer."""
    from torch._prims_common import is_float_dtype

    def constant(fake_mode, func, arg, *args, **kwargs):
        if is_float_dtype(arg.dtype):
            return 1.0
        return False if arg.dtype == torch.bool else int_value

    return constant


def install_fake_item(int_value: int):
    """`fake_item(int_value)` for every op of `ITEM_OPS` in the fake-tensor op table; returns
    the function that puts the table back as it was."""
    from torch._subclasses import fake_impls

    table = fake_impls.op_implementations_dict
    saved = {op: (op in table, table.get(op)) for op in ITEM_OPS}
    for op in ITEM_OPS:
        table[op] = fake_item(int_value)

    def undo() -> None:
        for op, (had, old) in saved.items():
            if had:
                table[op] = old
            else:
                table.pop(op, None)

    return undo


# Transformer Engine / apex kernels, as megatron-core calls them -----------------------------------


def wgrad_accumulate(total_input, grad_output, main_grad):
    """apex's wgrad_gemm_accum_*: main_grad += grad_output^T @ input, in place (no allocation)."""


DUMMY_WGRADS: dict = {}


def dummy_wgrad(shape, dtype, zero=False, *args, **kwargs):
    """Transformer Engine's get_dummy_wgrad: one cached tensor per (shape, dtype)."""
    key = (*shape, dtype)
    if key not in DUMMY_WGRADS:
        DUMMY_WGRADS[key] = torch.empty(shape, dtype=dtype)
    return DUMMY_WGRADS[key].detach()


class _FusedNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rms: bool):
        x = x.contiguous()  # TE's norms work on (and save) a contiguous copy of a strided input
        tokens = x.shape[:-1]
        y = torch.empty_like(x)
        rstd = torch.empty(tokens, dtype=torch.float32)
        saved = [x, weight, rstd]
        if not rms:
            saved.append(torch.empty(tokens, dtype=torch.float32))  # mean
        ctx.save_for_backward(*saved)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors[:2]
        dbias = torch.empty_like(weight) if ctx.has_bias else None
        return torch.empty_like(x), torch.empty_like(weight), dbias, None


class FusedNorm(torch.nn.Module):
    """TE's LayerNorm / RMSNorm memory contract: output + fp32 rstd (and mean) per token; saves
    the (contiguous) input, the weight and the statistics."""

    def __init__(self, hidden: int, rms: bool, dtype, sequence_parallel: bool):
        super().__init__()
        self.rms = rms
        self.weight = torch.nn.Parameter(torch.empty(hidden, dtype=dtype))
        self.bias = None if rms else torch.nn.Parameter(torch.empty(hidden, dtype=dtype))
        for prm in self.parameters():
            prm.sequence_parallel = sequence_parallel

    def forward(self, x):
        return _FusedNormFn.apply(x, self.weight, self.bias, self.rms)


def te_gemm(a, b, out_dtype, layout="TN", bias=None, grad=False, **kwargs):
    """transformer_engine general_gemm's result for megatron's router: one output tensor in
    `out_dtype` (no casted copies of the operands). Layouts as megatron calls it."""
    rows, cols = {
        "TN": (b.shape[0], a.shape[0]),
        "NN": (b.shape[0], a.shape[1]),
        "NT": (b.shape[1], a.shape[1]),
    }[layout]
    return (torch.empty((rows, cols), dtype=out_dtype),)


class MaskedSelect(torch.autograd.Function):
    """x.masked_select(mask) with `n` selected entries (its backward keeps the mask)."""

    @staticmethod
    def forward(ctx, x, mask, n):
        ctx.save_for_backward(mask)
        ctx.shape = x.shape
        return torch.empty(n, dtype=x.dtype)

    @staticmethod
    def backward(ctx, g):
        return torch.empty(ctx.shape, dtype=g.dtype), None, None


class _GroupedGemm(torch.autograd.Function):
    """Transformer Engine's GroupedLinear with fused weight-gradient accumulation: one output
    for all local experts; saves its input; backward writes dgrad, accumulates each expert's
    wgrad into its main_grad and hands autograd TE's cached dummy wgrads."""

    @staticmethod
    def forward(ctx, x, out_features, *weights):
        ctx.save_for_backward(x, *weights)
        return torch.empty((x.shape[0], out_features), dtype=x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, *weights = ctx.saved_tensors
        dummies = []
        for w in weights:
            if hasattr(w, "grad_added_to_main_grad"):
                w.grad_added_to_main_grad = True
            dummies.append(dummy_wgrad(list(w.shape), x.dtype))
        return (torch.empty_like(x), None, *dummies)


class GroupedLinear(torch.nn.Module):
    """Stands for TEColumnParallelGroupedLinear / TERowParallelGroupedLinear (expert tensor
    parallel size 1 in the cases traced): one weight [out, in] per local expert."""

    def __init__(self, num_gemms, input_size, output_size, *, config, is_expert=True, **kwargs):
        super().__init__()
        self.out_features = output_size
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            for _ in range(num_gemms)
        )
        for w in self.weights:
            w.allreduce = not is_expert  # expert params: the expert-data-parallel grad buffer

    def forward(self, x, m_splits):
        return _GroupedGemm.apply(x, self.out_features, *self.weights), None


class DuplicatedLinear(torch.nn.Module):
    """Stands for Transformer Engine's TELinear with `parallel_mode="duplicated"`: MLA's down
    projections in the TE layer spec Megatron-LM runs (the local spec's are column-parallel and
    gathered), one full weight on every tp rank reading the rank's (sequence-shard) input; saves
    its input, fused wgrad accumulation as the other stand-ins."""

    def __init__(self, input_size, output_size, *, config, init_method=None, bias=False, **kwargs):
        super().__init__()
        self.out_features = output_size
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel  # grads all-reduced over tp

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        out = _GroupedGemm.apply(flat, self.out_features, self.weight)
        return out.view(*x.shape[:-1], self.out_features), None


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        return torch.empty_like(t)

    @staticmethod
    def backward(ctx, dy):
        return torch.empty_like(dy), None


def fused_rope(t, freqs, config=None, cu_seqlens=None, mscale=1.0, cp_group=None, **kwargs):
    return _Rope.apply(t, freqs)


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        s, b, a, d = q.shape
        out = torch.empty((s, b, a * v.shape[-1]), dtype=q.dtype)  # MLA: v's head dim
        lse = torch.empty((b, a, s), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        s, b, a, d = q.shape
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # the kernel's own buffers: the same assumption the templates make, from one place
        # (traced/kernel_workspace.py) -- rows that depend on it say so (kernel_workspace.ASSUMED)
        buffers = flash_attention_backward_workspace(s, b, a, k.shape[2], d, q.element_size())
        workspace = [
            torch.empty(shape, dtype=q.dtype if eb == q.element_size() else torch.float32)
            for _, shape, eb in buffers
        ]
        del workspace
        return dq, dk, dv


class FlashAttention(torch.nn.Module):
    """Stands for TE's DotProductAttention with a flash / cuDNN fused backend. megatron builds it
    with the layer's config and the attention's settings (mask type, softmax scale, head dims),
    and calls it with q, k, v and the mask arguments; what the kernel allocates and saves
    follows from q, k and v alone."""

    def __init__(self, config, **kwargs):
        super().__init__()
        self.config = config

    def forward(self, query, key, value, *masks, **mask_kwargs):
        return _Flash.apply(query, key, value)


# torchtitan's attention -------------------------------------------------------------------------


@contextlib.contextmanager
def flex_as_flash():
    """FlexAttention (torchtitan's language-model attention: a compiled Triton kernel, no CPU
    backward) run as causal SDPA, which pipemem's CUDA kernel policy routes to the flash
    kernel: the same saved tensors (q, k, v, output, fp32 logsumexp). The per-document
    BlockMask a real run builds from the batch's positions (int32, (S/128)^2 per sequence)
    is not made (`Decoder.get_attention_masks` returns None while tracing)."""
    import torch.nn.functional as F
    from torchtitan.models.common.attention import FlexAttention

    # the argument names are FlexAttention.forward's: TP's local_map reads them
    def forward(
        self,
        q_BLNH,
        k_BLNH,
        v_BLNH,
        *,
        attention_masks=None,
        score_mod=None,
        scale=None,
        enable_gqa=False,
        out_transform=None,
        **kwargs,
    ):
        if out_transform is not None:
            raise NotImplementedError(
                "flex attention with an output transform (attention sinks) is not traced"
            )
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)

    def no_masks(self, *args, **kwargs):
        return None

    from torchtitan.models.common.decoder import Decoder

    saved = (FlexAttention.forward, Decoder.get_attention_masks)
    FlexAttention.forward, Decoder.get_attention_masks = forward, no_masks
    try:
        yield
    finally:
        FlexAttention.forward, Decoder.get_attention_masks = saved
