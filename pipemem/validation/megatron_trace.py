"""Trace megatron-core's own training step for one rank, on fake tensors, in one CPU process.

megatron-core (``pip install -e '.[megatron]'``, megatron-core 0.16.1) builds its `GPTModel`
with the local (non-Transformer-Engine) layer spec, wraps it in its `DistributedDataParallel`
(contiguous param and grad buffers) and its optimizer (`DistributedOptimizer` or the
fp16/bf16 optimizer with fp32 master weights), and runs two full training steps through its
own pipeline schedule (`get_forward_backward_func`) under `FakeTensorMode` with PyTorch's
"fake" process group as rank 0 of a world of tp x pp x dp ranks. `pipemem.traced.capture.
StorageRecorder` records every storage and when eager frees it; the second step is the
steady state (optimizer states resident).

Two kinds of patches, each needed to run at all or to run what a GPU run runs:

CPU / fake-tensor patches (no memory effect): `torch.cuda.current_device` and megatron's CUDA
RNG helpers point at the CPU; `device="cuda"` arguments become "cpu" (a TorchFunctionMode);
object collectives are local; `_coalescing_manager` issues ops one by one (the coalesced c10d
ops have no fake kernel); `.item()` on fake tensors returns a constant (grad norm, found-inf);
megatron's local multi-tensor L2 norm stacks norms instead of reading values; its RNG tracker
`fork` is a no-op (it compares RNG states by value); `Float16Module` skips `.bfloat16()` (the
model is built in bf16: fake parameters cannot be swapped).

Kernel policy: Megatron-LM on GPUs runs Transformer Engine and apex kernels whose memory
contract differs from the CPU fallbacks of the local spec. Each is replaced by a function
with the GPU kernel's allocations and saved tensors, and nothing else:
  * norms (TE's fused LayerNorm/RMSNorm): output + fp32 rstd (and mean) per token; saves the
    input and the statistics;
  * core attention (TE's flash / cuDNN attention, `--attention-backend fused|flash|auto`):
    output [s, b, heads*d] + fp32 logsumexp [b, heads, s]; saves q, k, v, output, logsumexp;
    backward allocates dq, dk, dv and the kernel's workspace (fp32 dq accumulator, softmax
    row sums, with GQA full-head dk/dv before the group sum) -- the same workspace the
    templates assume, from one place (traced/kernel_workspace.py), so not checked here: the
    rows that depend on it say "kernel workspace assumed, not checked";
  * rotary embedding (`--apply-rope-fusion`, TE's fused rope): a new output; saves nothing
    but the frequencies;
  * weight-gradient accumulation fusion (apex `fused_weight_gradient_mlp_cuda`, Megatron-LM's
    default): the wgrad GEMM accumulates into `main_grad` in place, and the dummy weight
    gradient handed to autograd is TE's `get_dummy_wgrad` (one cached tensor per weight
    shape and dtype, kept for the run);
  * sequence-parallel all-gathers allocate a new tensor per gather (TE's
    `gather_along_first_dim`) instead of megatron's global memory buffer;
  * megatron's @jit_fuser activations (bias-GeLU, SwiGLU) are one kernel each (torch.compile
    on a GPU): only their results are allocated;
  * the native fused cross-entropy's @jit_fuser helpers (`--cross-entropy-loss-fusion`) run
    as megatron's plain functions (its logits-sized tensors are the kernels'; see
    `_plain_fused_cross_entropy`);
  * dropout is CUDA's fused `native_dropout` (a bool mask; `pipemem.traced.kernel_policy`);
  * apex's multi_tensor_scale (grad clipping, main -> model param copies) is in place;
  * MoE: TE's GroupedLinear (one output for all local experts, fused wgrad) for the experts;
    TE's GEMM for the fp32 router logits; balanced dropless routing (see
    `_moe_on_fake_tensors`);
  * Adam is the fused kernel (apex/TE FusedAdam: in place, no temporaries), as torch's
    `AdamW(fused=True)`.

Fine-grained activation offloading (`--fine-grained-activation-offloading --offload-modules`,
pipeline_parallel/fine_grained_activation_offload.py) runs megatron's own code: its
saved-tensor hooks, groups, warm-up step and the rules that keep the stage's last layer on the
GPU. Its CUDA machinery is inert here (streams, events, `record_stream`, nvtx; TE's
`cpu_offload.CPUOffloadEnabled` flag, read only by TE modules, is a stub); `tensor_push`'s
guard against fake tensors (torch.compile tracing) is dropped. Memory: the pinned host copy is
made inside `capture.host_memory()` (0 device bytes; a non-contiguous source's `.contiguous()`
stays a device temporary), the reload is megatron's own `torch.empty(device=dev)` + copy (a new
device storage), and `forced_released_tensors` -- megatron's `untyped_storage().resize_(0)`,
which frees device memory while Python still references the tensor -- is recorded as that
storage's free at that point.

Optimizer CPU offloading (`--optimizer-cpu-offload --optimizer-offload-fraction F`, with the
`--use-precision-aware-optimizer` Megatron-LM asserts beside it) runs megatron's own
HybridDeviceOptimizer (optimizer/cpu_offloading/hybrid_optimizer.py): its split of the rank's
shards, the fp32 masters it makes, the CPU and GPU torch AdamW (`fused=True`, megatron's own
defaults), the grad and param copies and its hooks. Host vs device is tracked inside its methods
(`_HostTensors`: `.cpu()` / `.pin_memory()` / `pin_memory=` buffers and whatever is computed
from them are host storages, `Tensor.is_cuda` tells them apart); a non-blocking copy between
host and device that changes dtype makes the device temporary torch's CUDA copy kernel makes.
The throwaway hybrid optimizer get_megatron_optimizer builds over the unsharded params is
collected (`gc.collect()`) before the steps.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import types
import warnings

import torch

from ..errors import UserError
from ..traced.capture import StorageRecorder, host_memory
from . import kernel_stand_ins as ksi
from .cuda_stand_ins import Event as _Event
from .cuda_stand_ins import Stream as _Stream
from .megatron import MegatronCase
from .recorded_step import default_dtype

# Patches --------------------------------------------------------------------------------------


class _Patches:
    """setattr with undo."""

    def __init__(self):
        self._undo = []

    def set(self, obj, name, value):
        if hasattr(obj, name):
            old = getattr(obj, name)
            self._undo.append(lambda: setattr(obj, name, old))
        else:
            self._undo.append(lambda: delattr(obj, name))
        setattr(obj, name, value)

    def on_undo(self, undo) -> None:
        """`undo()` runs with the undoing of the patches, in reverse order of patching."""
        self._undo.append(undo)

    def undo(self):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """device='cuda' -> cpu; Tensor.cuda() is the identity; Tensor.type() names the CUDA type
    (the trace's fake CPU tensors stand for device memory)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        d = kwargs.get("device")
        if d is not None and _is_cuda(d):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # megatron checks for torch.cuda.*Tensor types
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _is_cuda(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


@contextlib.contextmanager
def megatron_on_cpu():
    """The CPU / fake-tensor patches and the kernel policy of the module docstring."""
    p = _Patches()
    fused_wgrad = types.ModuleType("fused_weight_gradient_mlp_cuda")
    fused_wgrad.wgrad_gemm_accum_fp32 = ksi.wgrad_accumulate
    fused_wgrad.wgrad_gemm_accum_fp16 = ksi.wgrad_accumulate
    had_module = "fused_weight_gradient_mlp_cuda" in sys.modules
    sys.modules["fused_weight_gradient_mlp_cuda"] = fused_wgrad
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _apply(p, fused_wgrad)
        yield
    finally:
        p.undo()
        if not had_module:
            sys.modules.pop("fused_weight_gradient_mlp_cuda", None)


def _apply(p: _Patches, fused_wgrad) -> None:
    import torch.distributed as dist
    from megatron.core import utils as mutils
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptim
    from megatron.core.tensor_parallel import layers as tpl
    from megatron.core.tensor_parallel import random as rnd
    from megatron.core.transformer import attention as attn
    from megatron.core.transformer import module as mmod
    from megatron.core.transformer import torch_norm

    cpu = lambda *a, **k: "cpu"  # noqa: E731
    p.set(torch.cuda, "current_device", cpu)
    p.set(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    p.set(torch.cuda, "get_rng_state", lambda device=None: torch.get_rng_state())
    p.set(torch.cuda, "synchronize", lambda *a, **k: None)
    p.set(rnd, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    p.set(rnd, "_set_cuda_rng_state", lambda state, *a, **k: None)
    p.set(rnd.CudaRNGStatesTracker, "fork", _no_fork)
    p.set(dist, "all_gather_object", _local_all_gather_object)
    p.set(dist, "broadcast_object_list", lambda *a, **k: None)
    p.set(pgb, "_coalescing_manager", _one_by_one)
    p.set(clip_grads, "l2_norm_impl", _stacked_l2_norm)
    p.set(clip_grads, "multi_tensor_scale_impl", _fused_scale)
    p.set(moptim, "multi_tensor_scale_impl", _fused_scale)
    p.set(mmod.Float16Module, "__init__", _float16_init(mmod.Float16Module.__init__))
    # kernel policy
    p.set(torch_norm.WrappedTorchNorm, "__new__", _fused_norm_new)
    p.set(tpl, "_grad_accum_fusion_available", True)
    p.set(tpl, "fused_weight_gradient_mlp_cuda", fused_wgrad)
    p.set(tpl, "HAVE_TE", True)
    p.set(tpl, "get_dummy_wgrad", ksi.dummy_wgrad)
    p.set(mutils.GlobalMemoryBuffer, "get_tensor", _fresh_tensor)
    p.set(attn, "apply_rotary_pos_emb", ksi.fused_rope)
    from megatron.core.transformer import multi_latent_attention as mla

    p.set(mla, "apply_rotary_pos_emb", ksi.fused_rope)
    from importlib.util import find_spec

    if find_spec("transformer_engine") is None:  # its TE names are stand-in mocks without TE
        p.set(mla, "HAVE_TE", False)
        p.set(mla, "TELinear", ksi.DuplicatedLinear)  # MLASelfAttention's "duplicated" down projections
    _fused_activations(p)
    _plain_fused_cross_entropy(p)
    _moe_on_fake_tensors(p)
    _fine_grained_offload(p)
    _hybrid_device_optimizer(p)
    p.on_undo(ksi.install_fake_item(0))  # `.item()`: 0 for an integer


@contextlib.contextmanager
def _no_fork(self, name="model-parallel-rng"):
    yield


def _local_all_gather_object(object_list, obj, group=None):
    for i in range(len(object_list)):
        object_list[i] = obj


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    class _Work:
        def wait(self):
            pass

    yield _Work()


def _stacked_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    norms = [torch.linalg.vector_norm(t).float() for tl in tensor_lists for t in tl]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _fused_scale(chunk_size, noop_flag, tensor_lists, scale):
    """apex's multi_tensor_scale: dst = src * scale in one kernel, no temporaries (megatron's
    CPU fallback materialises src * scale per tensor)."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        if dst is not src:
            dst.copy_(src)
        if scale != 1.0:
            dst.mul_(scale)


def _float16_init(orig):
    def init(self, config, module):
        module.bfloat16 = lambda: module
        module.half = lambda: module
        try:
            orig(self, config, module)
        finally:
            del module.__dict__["bfloat16"]
            del module.__dict__["half"]

    return init


# Kernel policy ---------------------------------------------------------------------------------


def _fresh_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    return torch.empty(tuple(tensor_shape), dtype=dtype)


def _fused_norm_new(
    cls,
    config,
    hidden_size,
    eps=1e-5,
    persist_layer_norm=False,
    zero_centered_gamma=False,
    normalization="LayerNorm",
):
    return ksi.FusedNorm(
        hidden_size, config.normalization == "RMSNorm", config.params_dtype, config.sequence_parallel
    )


def _fused_activations(p: _Patches) -> None:
    """megatron's @jit_fuser activation kernels (bias-GeLU, (bias-)SwiGLU, weighted SwiGLU):
    on a GPU one fused kernel each, writing only its result; eagerly on the CPU they allocate a
    temporary per elementwise op. Their autograd functions (what is saved) stay megatron's."""
    from megatron.core.fusions import fused_bias_gelu as gelu
    from megatron.core.fusions import fused_bias_swiglu as swiglu

    def half(y):
        return torch.empty((*y.shape[:-1], y.shape[-1] // 2), dtype=y.dtype)

    p.set(gelu, "bias_gelu", lambda bias, y: torch.empty_like(y))
    p.set(gelu, "bias_gelu_back", lambda g, bias, y: torch.empty_like(y))
    p.set(swiglu, "swiglu", half)
    p.set(swiglu, "bias_swiglu", lambda y, bias: half(y))
    p.set(swiglu, "weighted_swiglu", lambda y, weights: half(y))
    p.set(swiglu, "swiglu_back", lambda g, y: torch.empty_like(y))
    p.set(swiglu, "bias_swiglu_back", lambda g, y, bias: torch.empty_like(y))
    p.set(
        swiglu, "weighted_swiglu_back", lambda g, y, weights: (torch.empty_like(y), torch.empty_like(weights))
    )


def _plain_fused_cross_entropy(p: _Patches) -> None:
    """`--cross-entropy-loss-fusion` (native impl): megatron's fusions/fused_cross_entropy.py
    runs its own four @jit_fuser (torch.compile) helpers as plain functions, what megatron runs
    after `disable_jit_fuser()` (torch.compile cannot run on fake tensors). Their large tensors
    are the compiled kernels': the fp32 copy of the logits (max-subtract, exp and divide in
    place: the saved softmax) and, in the backward, the softmax edited in place into the grad
    and cast to a new bf16 logits grad; eagerly they also make a few per-token temporaries."""
    from megatron.core.fusions import fused_cross_entropy as fce

    for name in (
        "calculate_logits_max",
        "calculate_predicted_logits",
        "calculate_cross_entropy_loss",
        "calculate_gradients",
    ):
        fn = getattr(fce, name)
        p.set(fce, name, getattr(fn, "_torchdynamo_orig_callable", getattr(fn, "__wrapped__", fn)))


def _moe_on_fake_tensors(p: _Patches) -> None:
    """megatron's MoE runs on fake tensors with balanced dropless routing.

    Routing decides how many tokens each expert gets: data that fake tensors do not have. The
    alltoall dispatcher's token counts (`preprocess`, then copied to the host) are replaced by
    balanced ones -- each of the T x top_k routed copies of this rank's tokens spread evenly
    over the experts -- after megatron's own code has made its (device) count tensors; the
    two `masked_select`s of `permute` return the `num_out_tokens` (= T x top_k) entries a
    dropless routing selects (same allocations; masked_select's backward keeps the mask)."""
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher as td

    p.set(torch.cuda, "Stream", _Stream)
    p.set(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    p.set(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
    orig_pre = td.MoEAlltoAllTokenDispatcher.preprocess

    def preprocess(self, routing_map):
        orig_pre(self, routing_map)
        tokens, k, experts = routing_map.size(0), self.config.moe_router_topk, self.num_experts
        ep, tp, local = self.ep_size, self.tp_size, self.num_local_experts
        per_expert = tokens * k // experts
        self.num_out_tokens = tokens * k
        self.input_splits = np.full(ep, tokens * k // ep)
        self.output_splits = np.full(ep, per_expert * local)
        self.output_splits_tp = np.full(tp, per_expert * local * ep)
        self.num_global_tokens_per_local_expert = np.full((tp * ep, local), per_expert)
        return np.full(local, per_expert * tp * ep)

    p.set(td.MoEAlltoAllTokenDispatcher, "preprocess", preprocess)
    p.set(
        td.MoEAlltoAllTokenDispatcher,
        "_maybe_dtoh_and_synchronize",
        lambda self, point, tokens_per_expert=None: tokens_per_expert,
    )
    p.set(td, "permute", _dropless_permute)
    from megatron.core.transformer.moe import moe_utils

    p.set(moe_utils, "te_general_gemm", ksi.te_gemm)  # the router GEMM, straight to fp32


class _Recorder:
    """The trace's StorageRecorder, for megatron's forced releases (set by `_trace`)."""

    current = None


def _fine_grained_offload(p: _Patches) -> None:
    """megatron's fine-grained activation offloading on fake tensors (module docstring)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    p.set(torch.cuda, "Event", _Event)
    p.set(torch.cuda.nvtx, "range_push", lambda *a, **k: None)
    p.set(torch.cuda.nvtx, "range_pop", lambda *a, **k: None)
    p.set(torch.Tensor, "record_stream", lambda self, stream: None)
    p.set(te_ext, "cpu_offload", types.SimpleNamespace(CPUOffloadEnabled=False))
    p.set(fgo.PipelineOffloadManager, "OFFLOAD_MGR", None)  # a fresh singleton per trace
    handler = fgo.ChunkOffloadHandler
    orig_offload, orig_reload = handler.offload, handler.reload

    def offload(self, src_tensor, pin_memory=True, use_cpu_pool=True):
        if not src_tensor.is_contiguous():
            src_tensor = src_tensor.contiguous()  # a device temporary, as on the GPU
        with host_memory():  # the pinned host copy
            return orig_offload(self, src_tensor, pin_memory=pin_memory, use_cpu_pool=use_cpu_pool)

    def reload(self, state, non_blocking=None):
        return orig_reload(self, state, non_blocking=False)  # is_pinned() would ask for a device

    def tensor_push(self, tensor):  # megatron's, less the FakeTensor assert
        tag = (self._offloaded_group_index, self._tensor_count_current_group)
        self._tensor_count_current_group += 1
        self.offload_groups[self._offloaded_group_index - 1].push_tensor(tag, tensor)
        return tag

    def bulk_offload(self, forced_released_tensors):  # megatron's, resize_(0) recorded
        if self.should_bulk_offload():
            self._groups_to_reload.append(self._groups_to_offload[-1])
            self.bulk_offload_group()
            for t in forced_released_tensors:
                if self.tensor_need_offloading_checker(t) and _Recorder.current is not None:
                    _Recorder.current.release(t)

    p.set(handler, "offload", offload)
    p.set(handler, "reload", reload)
    p.set(handler, "tensor_push", tensor_push)
    p.set(handler, "bulk_offload", bulk_offload)


class _HostTensors(torch.overrides.TorchFunctionMode):
    """Host vs device tensors inside megatron's HybridDeviceOptimizer (all fake tensors are CPU
    tensors): `.cpu()` and `.pin_memory()` make a new host storage, so does a factory call with
    `pin_memory=` (its `device="cpu"` buffers); anything computed from a host tensor is host
    (the CPU optimizer's states, the fp32 master made from the host copy); `Tensor.is_cuda` is
    False for host storages only. A non-blocking copy between host and device with a dtype
    change converts on the GPU (torch's copy_kernel_cuda): a device temporary of the source
    dtype (host -> device) or of the destination dtype (device -> host)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cpu:
            return args[0] if _is_host(args[0]) else _host_copy(args[0])
        if func is torch.Tensor.pin_memory:
            return _host_copy(args[0])
        if func is torch.Tensor.copy_:
            return _copy(func, args, kwargs)
        if "pin_memory" in kwargs:
            kwargs.pop("pin_memory")
            with host_memory():
                return func(*args, **kwargs)
        if any(_is_host(a) for a in _tensor_args(args, kwargs)):
            with host_memory():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _tensor_args(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _is_host(t) -> bool:
    rec = _Recorder.current
    if rec is None or not isinstance(t, torch.Tensor):
        return False
    st = t.untyped_storage()
    name = rec._ids.get(st)
    return name is not None and rec.storages[name].nbytes == 0 and st.nbytes() > 0


def _host_copy(t):
    with host_memory():
        return t.clone()


def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    if non_blocking and dst.dtype != src.dtype and _is_host(dst) != _is_host(src):
        if _is_host(src):  # H2D: the host data lands in a device buffer of its dtype, converted there
            tmp = torch.empty_like(dst, dtype=src.dtype)
            tmp.copy_(src)
            src = tmp
        else:  # D2H: converted on the device first
            src = src.to(dst.dtype)
        out = dst.copy_(src)
        del src
        return out
    if _is_host(dst) or _is_host(src):
        with host_memory():
            return func(*args, **kwargs)
    return func(*args, **kwargs)


@contextlib.contextmanager
def _host_tensors():
    """`_HostTensors` plus `Tensor.is_cuda` (a getter no TorchFunctionMode sees)."""
    torch.Tensor.is_cuda = property(lambda self: not _is_host(self))
    try:
        with _HostTensors():
            yield
    finally:
        del torch.Tensor.is_cuda


def _hybrid_device_optimizer(p: _Patches) -> None:
    """`--optimizer-cpu-offload` (optimizer/cpu_offloading/hybrid_optimizer.py): megatron's
    HybridDeviceOptimizer builds, steps and zeroes under `_host_tensors` (its pinned host copies
    of the offloaded shards, their fp32 masters, states and pinned grad buffers are host memory;
    the fp32 masters and states of the rest are device memory); its streams and events are the
    inert stand-ins; the Transformer Engine version check of the precision-aware config passes."""
    from megatron.core.optimizer import optimizer_config
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as hdo

    # --use-precision-aware-optimizer asks for Transformer Engine >= 2.1 (store_param_remainders,
    # which the hybrid optimizer does not read)
    p.set(optimizer_config, "is_te_min_version", lambda *a, **k: True)
    cls = hdo.HybridDeviceOptimizer
    for name in ("__init__", "step", "zero_grad"):
        orig = getattr(cls, name)

        def wrapped(self, *a, _orig=orig, **k):
            with _host_tensors():
                return _orig(self, *a, **k)

        p.set(cls, name, wrapped)


def _dropless_permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
    """megatron.core.transformer.moe.moe_utils.permute, dropless branch, with masked_select's
    result sized by `num_out_tokens`."""
    num_tokens, _ = tokens.shape
    num_experts = routing_map.shape[1]
    routing_map = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = ksi.MaskedSelect.apply(token_indices, routing_map, num_out_tokens)
    permuted_probs = None
    if probs is not None:
        permuted_probs = ksi.MaskedSelect.apply(probs.T.contiguous(), routing_map, num_out_tokens)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


# The trace ---------------------------------------------------------------------------------------


def _layer_spec(case: MegatronCase):
    """The local layer spec with the kernel policy's modules; a DeepSeek-style case with dense
    first layers gets one spec per layer of the rank (what get_gpt_decoder_block_spec builds from
    --moe-layer-freq)."""
    if case.kind == "deepseek" and case.experts and case.dense_layers:
        from megatron.core.models.gpt.gpt_layer_specs import LNImpl
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        per_stage = case.layers // case.pp
        first = case.pp_rank * per_stage
        specs = [_one_layer_spec(case, moe=i >= case.dense_layers) for i in range(first, first + per_stage)]
        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=LNImpl)
    return _one_layer_spec(case, moe=bool(case.experts))


def _one_layer_spec(case: MegatronCase, moe: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=case.experts if moe else None,
        moe_grouped_gemm=case.grouped_gemm,
        normalization="RMSNorm" if case.kind != "gpt" else "LayerNorm",
        multi_latent_attention=case.kind == "deepseek",
        qk_layernorm=case.kind == "deepseek",
    )
    spec.submodules.self_attention.submodules.core_attention = ksi.FlashAttention
    if case.kind == "deepseek":
        # the TE spec's down projections (TELinear, duplicated over tp), not the local spec's
        sub = spec.submodules.self_attention.submodules
        sub.linear_q_down_proj = sub.linear_kv_down_proj = ksi.DuplicatedLinear
    if moe:
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import TEGroupedMLP
        from megatron.core.transformer.spec_utils import ModuleSpec

        spec.submodules.mlp.submodules.experts = ModuleSpec(
            module=TEGroupedMLP,
            submodules=MLPSubmodules(linear_fc1=ksi.GroupedLinear, linear_fc2=ksi.GroupedLinear),
        )
    return spec


def _config(case: MegatronCase):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    gpt = case.kind == "gpt"
    kw = dict(
        num_layers=case.layers,
        hidden_size=case.hidden,
        num_attention_heads=case.heads,
        num_query_groups=case.kv_heads,
        ffn_hidden_size=case.ffn,
        use_cpu_initialization=True,
        sequence_parallel=case.sp and case.tp > 1,
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        expert_model_parallel_size=case.ep,
        params_dtype=torch.bfloat16,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        normalization="LayerNorm" if gpt else "RMSNorm",
        gated_linear_unit=not gpt,
        activation_func=F.gelu if gpt else F.silu,
        add_bias_linear=gpt,
        bias_activation_fusion=True,
        hidden_dropout=case.dropout,
        attention_dropout=case.dropout,
        gradient_accumulation_fusion=True,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=True,
        deallocate_pipeline_outputs=True,
        batch_p2p_comm=True,  # as Megatron-LM sets them
        cross_entropy_loss_fusion=case.ce_fusion,
        cross_entropy_fusion_impl="native",
    )
    if case.offload:
        kw.update(fine_grained_activation_offloading=True, offload_modules=case.offload.split(","))
    if case.recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif case.recompute == "full":
        kw.update(
            recompute_granularity="full",
            recompute_method=case.recompute_method,
            recompute_num_layers=case.recompute_layers or 1,
        )
    if case.kind == "deepseek":
        # megatron-core's MLA; rope_type "rope" with the fused rope (kernel policy) on its parts
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kw.update(
            multi_latent_attention=True,
            q_lora_rank=case.q_lora_rank or None,
            kv_lora_rank=case.kv_lora_rank,
            qk_head_dim=case.qk_head_dim,
            qk_pos_emb_head_dim=case.qk_pos_emb_head_dim,
            v_head_dim=case.v_head_dim,
            rope_type="rope",
            qk_layernorm=True,
            num_query_groups=case.heads,
        )
        if case.experts:
            kw.update(
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_num_groups=case.router_groups or None,
                moe_router_group_topk=case.router_group_topk or None,
                moe_router_topk_scaling_factor=case.topk_scaling or None,
                moe_layer_freq=[0] * case.dense_layers + [1] * (case.layers - case.dense_layers),
            )
        if case.mtp_layers:
            kw.update(mtp_num_layers=case.mtp_layers, mtp_loss_scaling_factor=0.1)
        config_cls = MLATransformerConfig
    else:
        config_cls = TransformerConfig
    if case.experts:
        kw.update(
            num_moe_experts=case.experts,
            moe_router_topk=case.top_k,
            moe_ffn_hidden_size=case.expert_ffn,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=case.grouped_gemm,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_shared_expert_intermediate_size=case.shared_ffn or None,
            moe_router_dtype="fp32",
        )
    return config_cls(**kw)


def trace_case(case: MegatronCase) -> dict:
    """Trace two training steps of rank `case.pp_rank`'s first tp/dp rank; returns
    {peak_bytes, static_bytes, layer_kept_bytes: {layer: bytes}, phases: [...]}."""
    try:
        import megatron.core  # noqa: F401
    except ModuleNotFoundError:
        raise UserError(
            "pipemem validate megatron needs megatron-core: pip install -e '.[megatron]'"
        ) from None
    from ..traced.dist_capture import fake_process_group

    ksi.DUMMY_WGRADS.clear()
    # rank order of megatron's default "tp-cp-ep-dp-pp": pipeline rank r is global rank r * tp * dp
    rank = case.pp_rank * case.tp * case.dp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake_process_group(rank, case.world), megatron_on_cpu():
            from megatron.core import parallel_state as ps

            ps.initialize_model_parallel(
                tensor_model_parallel_size=case.tp,
                pipeline_model_parallel_size=case.pp,
                expert_model_parallel_size=case.ep,
                create_gloo_process_groups=False,
            )
            try:
                return _trace(case)
            finally:
                ps.destroy_model_parallel()
                ksi.DUMMY_WGRADS.clear()


class _ReleasingRecorder(StorageRecorder):
    """StorageRecorder + megatron's forced release (`untyped_storage().resize_(0)`): the
    storage is recorded freed there; its Python references going later frees nothing more."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.released: set[str] = set()

    def release(self, t: torch.Tensor) -> None:
        name = self._ids.get(t.untyped_storage())
        info = self.storages.get(name) if name is not None else None
        if info is None or not info.alive or name in self.released:
            return
        self.released.add(name)
        info.alive = False
        self._free_here(name)

    def _freed(self, name: str) -> None:
        if name not in self.released:
            super()._freed(name)


def _trace(case: MegatronCase) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..liveness import analyze_sequence, sequence_peak, sequence_starts
    from ..traced import kernel_policy
    from ..traced.capture import ModuleScope, find_layer_prefix, layer_index_fn

    model_parallel_cuda_manual_seed(1234)
    cfg = _config(case)
    rec = _ReleasingRecorder()
    _Recorder.current = rec
    rec.begin("build")
    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    with FakeTensorMode(), _CudaToCpu(), rec:
        # Megatron-LM pads the tokenizer's vocabulary to a multiple of 128 x tp before building
        # the model (megatron/training/tokenizer: _vocab_size_with_padding)
        multiple = 128 * case.tp
        vocab = -(-case.vocab // multiple) * multiple
        layer_spec = _layer_spec(case)
        mtp_spec = None
        if case.mtp_layers:  # --mtp-num-layers: what Megatron-LM's pretrain_gpt.py builds
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp_spec = get_gpt_mtp_block_spec(cfg, layer_spec, use_transformer_engine=False)
        with default_dtype(torch.bfloat16):
            gpt = GPTModel(
                config=cfg,
                transformer_layer_spec=layer_spec,
                mtp_block_spec=mtp_spec,
                vocab_size=vocab,
                max_sequence_length=case.seq_len,
                pre_process=pre,
                post_process=post,
                position_embedding_type="learned_absolute" if case.kind == "gpt" else "rope",
                share_embeddings_and_output_weights=case.kind == "gpt",
            )
            model = Float16Module(cfg, gpt)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=case.main_grad_dtype == "fp32",
            overlap_grad_reduce=False,
            use_distributed_optimizer=case.dist_opt,
        )
        model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
        offload = {}
        if case.optimizer_offload is not None:
            # --optimizer-cpu-offload --optimizer-offload-fraction F; Megatron-LM asserts
            # --use-precision-aware-optimizer with it (training/arguments.py), whose path the
            # hybrid optimizer reuses (fp32 masters made by it, grads as `decoupled_grad`)
            offload = dict(
                optimizer_cpu_offload=True,
                optimizer_offload_fraction=case.optimizer_offload,
                use_precision_aware_optimizer=True,
            )
        te_adam = _te_fused_adam() if case.precision_aware else contextlib.nullcontext()
        with te_adam:
            if case.precision_aware:
                offload = _precision_aware_config(case.precision_aware)
            opt_cfg = OptimizerConfig(
                optimizer="adam",
                lr=1e-4,
                bf16=True,
                use_distributed_optimizer=case.dist_opt,
                clip_grad=1.0,
                **offload,
            )
            opt = _with_fused_adam(
                lambda: get_megatron_optimizer(opt_cfg, [model], use_gloo_process_groups=False)
            )
        if offload:
            # get_megatron_optimizer's first HybridDeviceOptimizer, over the unsharded params
            # (optimizer/__init__.py), is replaced by the DistributedOptimizer's over its shards;
            # its step hooks close over it (a reference cycle), so its device copies go at
            # Python's next full collection -- here, not at a step that depends on gc timing
            gc.collect()
        scope = ModuleScope(model)
        rec.scope = scope
        layer_of = layer_index_fn(find_layer_prefix(model))
        counter = {"F": 0, "B": 0}
        step_no = [0]
        orig_fwd, orig_bwd = schedules.forward_step, schedules.backward_step

        def forward_step(*a, **k):
            rec.begin(f"s{step_no[0]}.F{counter['F']}")
            counter["F"] += 1
            return orig_fwd(*a, **k)

        def backward_step(*a, **k):
            rec.begin(f"s{step_no[0]}.B{counter['B']}")
            counter["B"] += 1
            return orig_bwd(*a, **k)

        def data():
            b, s = case.micro_batch, case.seq_len
            while True:
                yield (
                    torch.randint(0, case.vocab, (b, s)),
                    torch.arange(s).unsqueeze(0).expand(b, s),
                    torch.randint(0, case.vocab, (b, s)),
                    torch.ones(b, s),
                )

        it = data()

        def step_func(data_iterator, m):
            ids, pos, labels, mask = next(data_iterator)
            out = m(ids, pos, None, labels=labels)

            def loss_func(output):
                return torch.sum(output.float().view(-1) * mask.view(-1)) / mask.sum(), {}

            return out, loss_func

        fb = get_forward_backward_func()
        schedules.forward_step, schedules.backward_step = forward_step, backward_step
        try:
            with scope, kernel_policy.context("cuda"):
                for step in (1, 2):
                    step_no[0] = step
                    counter.update(F=0, B=0)
                    rec.begin(f"s{step}.zero_grad")
                    model.zero_grad_buffer()
                    opt.zero_grad()
                    fb(
                        forward_step_func=step_func,
                        data_iterator=it,
                        model=[model],
                        num_microbatches=case.microbatches,
                        seq_length=case.seq_len,
                        micro_batch_size=case.micro_batch,
                        forward_only=False,
                    )
                    rec.begin(f"s{step}.optimizer")
                    opt.step()
        finally:
            schedules.forward_step, schedules.backward_step = orig_fwd, orig_bwd
            _Recorder.current = None
    programs = rec.programs()
    results = analyze_sequence(programs, live_on_entry=[])
    starts = sequence_starts(results)
    peak, peak_at = sequence_peak(results, lambda name: name.startswith("s2."))
    # resident during step 2: after its zero_grad, before its forward
    step2_start = {r.name: start for r, start in zip(results, starts)}.get("s2.F0")
    phases = [
        {"name": r.name, "start_bytes": start, "peak_bytes": start + r.peak_bytes, "net_bytes": r.net_bytes}
        for r, start in zip(results, starts)
    ]
    kept = _layer_kept(programs, "s2.F0", layer_of)
    return {
        "case": case.name,
        "peak_bytes": peak,
        "peak_at": peak_at,
        "static_bytes": step2_start,
        "layer_kept_bytes": kept,
        "layer0_kept": _layer_kept_detail(programs, "s2.F0", layer_of, 0),
        "phases": phases,
        "resident": _resident(programs, results, "s2.zero_grad"),
    }


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}


def _precision_aware_config(spec: str) -> dict:
    """OptimizerConfig fields of `--use-precision-aware-optimizer --main-params-dtype M
    --exp-avg-dtype A --exp-avg-sq-dtype S` ("M/A/S"; Megatron-LM maps fp8 to torch.uint8)."""
    main, avg, avg_sq = (_TORCH_DTYPES[d] for d in spec.split("/"))
    return dict(
        use_precision_aware_optimizer=True, main_params_dtype=main, exp_avg_dtype=avg, exp_avg_sq_dtype=avg_sq
    )


class _TEFusedAdam(torch.optim.Optimizer):
    """Transformer Engine's FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py) as
    megatron's precision-aware optimizer builds it, for what it allocates (TE does not run on
    this CPU). Read from TE's code, not copied:

    * states are made at the first step, per parameter: `exp_avg` and `exp_avg_sq` in their
      dtypes; an fp8 (uint8) moment is a Float8Tensor from a Float8Quantizer with both
      usages, i.e. uint8 data and, on Hopper (TN-only fp8 GEMMs), a uint8 transpose, plus an
      fp32 scale-inverse (csrc/quantizer.cpp `Float8Quantizer::create_tensor`); every non-fp32
      state also has an fp32 scale (`_scales`);
    * with `master_weights` a `master_param` state: for bf16 parameters with
      `store_param_remainders` (fp32 masters only) an int16 tensor of the low 16 bits,
      otherwise a tensor in `master_weight_dtype`, filled from an fp32 copy of the parameter;
    * the step is one multi-tensor kernel per group, in place: no temporaries; gradients are
      read from `decoupled_grad` when `use_decoupled_grad`."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=None,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        use_decoupled_grad=False,
        store_param_remainders=False,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = master_weights
        self.dtypes = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )
        self.scales = {}

    def _new_state(self, p, name: str, remainders: bool = False):
        dtype = self.dtypes[name]
        if remainders:
            return torch.zeros_like(p, dtype=torch.int16)
        if dtype != torch.float32:
            self.scales.setdefault(p, {})[name] = torch.ones(1, dtype=torch.float32)
        if dtype == torch.uint8:
            return (
                torch.empty_like(p, dtype=torch.uint8),
                torch.empty(p.shape[::-1], dtype=torch.uint8),
                torch.ones(1, dtype=torch.float32),
            )
        return torch.zeros_like(p, dtype=dtype)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = self._new_state(p, "exp_avg")
                    state["exp_avg_sq"] = self._new_state(p, "exp_avg_sq")
                    if self.master_weights:
                        remainders = self.store_param_remainders and p.dtype == torch.bfloat16
                        master = self._new_state(p, "master_param", remainders)
                        if not remainders:
                            master.copy_(p.detach().float())  # TE fills it from an fp32 copy
                        state["master_param"] = master
        return None


@contextlib.contextmanager
def _te_fused_adam():
    """megatron-core with Transformer Engine's FusedAdam: its config's import check finds the
    stand-in module, get_megatron_optimizer takes `_TEFusedAdam` (USING_PYTORCH_OPTIMIZER off)
    and the DistributedOptimizer accepts it, and the TE version checks pass (TE >= 2.1:
    store_param_remainders is passed)."""
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer import distrib_optimizer, optimizer_config

    name = "transformer_engine.pytorch.optimizers"
    stand_in = types.ModuleType(name)
    stand_in.FusedAdam = _TEFusedAdam
    had = sys.modules.get(name)
    sys.modules[name] = stand_in
    p = _Patches()
    p.set(mopt, "Adam", _TEFusedAdam)
    p.set(distrib_optimizer, "Adam", _TEFusedAdam)  # its isinstance check of the inner optimizer
    p.set(mopt, "USING_PYTORCH_OPTIMIZER", False)
    p.set(mopt, "is_te_min_version", lambda *a, **k: True)
    p.set(optimizer_config, "is_te_min_version", lambda *a, **k: True)
    try:
        yield
    finally:
        p.undo()
        if had is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = had


def _with_fused_adam(build):
    """Build the optimizer with apex/TE FusedAdam's memory behaviour: megatron-core without
    apex or TE takes torch.optim.AdamW / Adam; here they default to fused=True."""
    saved = torch.optim.AdamW, torch.optim.Adam

    def fused(cls):
        class Fused(cls):
            def __init__(self, *a, **k):
                k.setdefault("fused", True)
                super().__init__(*a, **k)

        Fused.__name__ = cls.__name__
        return Fused

    torch.optim.AdamW, torch.optim.Adam = fused(saved[0]), fused(saved[1])
    try:
        return build()
    finally:
        torch.optim.AdamW, torch.optim.Adam = saved


def _resident(programs, results, phase: str) -> list[dict]:
    """What is alive when `phase` starts, grouped by the phase, op and module that made it."""
    at = next((i for i, p in enumerate(programs) if p.name == phase), len(programs))
    made: dict[str, tuple] = {}
    freed: set[str] = set()
    for prog in programs[:at]:
        for op in prog.ops:
            for n in op.outputs:
                t = prog.tensors[n]
                if t.storage == n:
                    made[n] = (prog.name, op.type, op.module, t.nbytes, tuple(t.shape), t.dtype)
            freed.update(prog.tensors[n].storage for n in op.frees)
    groups: dict[tuple, list] = {}
    for n, (ph, ty, mod, nb, _shape, dt) in made.items():
        if n not in freed:
            g = groups.setdefault((ph, ty, mod, dt), [0, 0])
            g[0] += nb
            g[1] += 1
    return [
        {"phase": k[0], "op": k[1], "module": k[2], "dtype": k[3], "bytes": v[0], "count": v[1]}
        for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])
    ]


def _layer_kept(programs, phase: str, layer_of) -> dict[int, int]:
    """Bytes of the storages each decoder layer's forward created that are still alive when
    the forward `phase` ends (what that layer keeps for its backward, incl. its output)."""
    prog = next((p for p in programs if p.name == phase), None)
    if prog is None:
        return {}
    created: dict[str, int] = {}
    freed: set[str] = set()
    for op in prog.ops:
        layer = layer_of(op.module)
        for name in op.outputs:
            t = prog.tensors[name]
            if t.storage == name and layer is not None:
                created[name] = layer
        freed.update(prog.tensors[n].storage for n in op.frees)
    out: dict[int, int] = {}
    for name, layer in created.items():
        if name not in freed:
            out[layer] = out.get(layer, 0) + prog.tensors[name].nbytes
    return dict(sorted(out.items()))


def _layer_kept_detail(programs, phase: str, layer_of, layer: int) -> list[dict]:
    """The storages behind `_layer_kept` for one layer: op, module, shape, dtype, bytes."""
    prog = next((p for p in programs if p.name == phase), None)
    if prog is None:
        return []
    made, freed = [], set()
    for op in prog.ops:
        if layer_of(op.module) == layer:
            made.extend((n, op) for n in op.outputs if prog.tensors[n].storage == n)
        freed.update(prog.tensors[n].storage for n in op.frees)
    return [
        {
            "op": op.type,
            "module": op.module,
            "shape": list(prog.tensors[n].shape),
            "dtype": prog.tensors[n].dtype,
            "bytes": prog.tensors[n].nbytes,
        }
        for n, op in made
        if n not in freed
    ]


def main(argv=None) -> int:
    """Worker: `python -m pipemem.validation.megatron_trace '<case json>'` prints the trace JSON."""
    import json

    args = sys.argv[1:] if argv is None else argv
    case = MegatronCase(**json.loads(args[0]))
    print(json.dumps(trace_case(case)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
