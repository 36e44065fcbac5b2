"""`pipemem validate features`: the modern-trainer features (pipemem.features) in templates
against traces made by each feature's own library, on fake tensors (no GPU):

* compile: AOTAutograd's `min_cut_rematerialization_partition` with inductor's decompositions,
  on every layer of a 2-layer Hugging Face model (pipemem.traced.compiled) -- what compiling
  removes from the bytes the forward leaves for backward, whole model vs 2 x one template layer;
* chunked CE: torchtune's `CEWithChunkedOutputLoss` behind torchtune's chunked output
  projection, eager and with its `compute_cross_entropy` compiled -- the head's kept bytes;
* fused linear CE: Liger-Kernel's own `LigerFusedLinearCrossEntropyLoss` behind the final
  norm, on real CPU tensors (its triton kernels run by triton's interpreter) with its CUDA code
  path -- the head's kept bytes, forward peak and backward peak;
* fp8: torchao's `convert_to_float8_training` (tensorwise) on an HF Llama -- layer 1's forward
  peak (where torchao's casts dominate) and its kept bytes;
* optimizer in backward: torchtune's `register_optim_in_bwd_hooks` (one fused AdamW per
  parameter), steady state -- layer 1's backward peak;
* torchtune's own modules (`--convention torchtune`): torchtune's Llama 3.2 decoder built by its
  `llama3_2` builder -- a layer's kept bytes, forward and backward peaks, bf16 and fp32 -- and its
  Qwen2 decoder (`qwen2`: q/k/v biases) in bf16, and
  AOTAutograd's partitioner on its layers (`compile/torchtune-bf16`);
* LoRA: PEFT's `get_peft_model` (LoraLayer on every linear, its fp32 adapters) on an HF Llama and
  torchtune's `lora_llama3_2` (LoRALinear) -- a layer's kept bytes, forward and backward peaks,
  bf16 and fp32, with and without the adapters' dropout;
* activation offloading: torchtune's `OffloadActivations` (its copy stream and stashes) around
  the decoder, as torchtune's recipe wraps the model with the output layer left out --
  the kept bytes it removes and a layer's forward and backward peaks. Its CUDA streams and
  events are stand-ins that do nothing, and its host copies are recorded as host memory
  (`traced.capture.host_memory`); every reference it holds is its own code's.

torchtune 0.6's package imports a torchao module newer torchao releases moved, so the three
source files used are loaded by path (`_torchtune_file`; stubs stand for the torchtune helpers
they import) and its model code is imported under bare package modules (`torchtune_packages`).
Reference = the traced library run, estimate = the template. Seconds on 2 cores: about 28.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import time
import types
from pathlib import Path
from typing import Callable

from .case_model import torchtune_decoder_kwargs, torchtune_lora_llama
from .compare import CaseRow, add_json_option
from .cuda_stand_ins import Stream as _Stream

TRUTH = "traced"  # the framework's code on fake tensors, bytes counted by pipemem (compare.TRUTHS)
# A library's code traced on fake tensors against the template of the same layer: the same
# tensors, so a row may differ by a few scalars and rounding of kept views (1 %).
TOLERANCE = 0.01
# Disagreements found and not modelled: shown with their reason, outside the verdict
# (docs/ACCURACY.md, "Modern-trainer features"); estimates that meet them carry a warning.
_GPT2_OFFLOAD = (
    "template low, not modelled: offloaded GPT-2 (non-gated MLP) layers hold tensors the "
    "template frees; estimates of such layers warn"
)
KNOWN_GAPS = {
    "offload-torchtune/gpt2: layer forward peak": _GPT2_OFFLOAD,
    "offload-torchtune/gpt2: layer backward peak": _GPT2_OFFLOAD,
}

S, B = 256, 2
LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 768,
    "vocab_size": 512,
}
HEAD = dict(LLAMA, vocab_size=4096, num_hidden_layers=1)
CHUNKS = 8


def _llama_head_layers():
    """The last stage's final norm and output layer at HEAD's shape (HF Llama's RMSNorm, an
    output projection without bias): what every loss head traced here puts before its loss."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(HEAD["hidden_size"]), torch.nn.Linear(
        HEAD["hidden_size"], HEAD["vocab_size"], bias=False
    )


# ---------------------------------------------------------------- shared helpers


def template_layer(config: dict, layer: int = 0, convention: str = "hf", **plan):
    from ..model import arch_from_hf_config
    from ..plan import ParallelPlan, validate_plan
    from ..templates.conventions import convention_for
    from ..templates.layers import layer_options, make_shard
    from ..templates.programs import layer_memory

    arch = arch_from_hf_config(config, "t")
    p = validate_plan(
        arch,
        ParallelPlan(
            seq_len=plan.pop("seq_len", S),
            micro_batch=plan.pop("micro_batch", B),
            convention=convention,
            **plan,
        ),
    )
    conv = convention_for(p)
    return layer_memory(arch, make_shard(arch, p, conv), conv, layer_options(arch, p, layer, False))


def trace_hf(
    config: dict,
    dtype: str = "bf16",
    master: bool = False,
    prepare=None,
    step: str = "first",
    layers: int = 2,
):
    import torch

    from ..traced.hf import Precision, build_model, fake_tensor_quirks, hf_loss, make_config, step_inputs
    from ..traced.step import trace_step

    cfg = make_config(config, "sdpa", layers)
    prec = Precision.parse(dtype, master)
    del torch
    return trace_step(
        lambda: build_model(cfg, prec.param_dtype),
        step_inputs(cfg, B, S),
        hf_loss,
        None,
        "cuda",
        autocast_dtype=prec.autocast_dtype,
        prepare=prepare,
        patches=fake_tensor_quirks(),
        step=step,
    )


def layer_kept(step, layer: int = 1) -> int:
    """Bytes a traced layer's forward allocates that are still alive when the forward ends."""
    from ..liveness import analyze_sequence, compile_program

    prog = step.programs[0]
    alive = set(analyze_sequence(step.programs, live_on_entry=step.entry_storages)[0].live_after)
    c = compile_program(prog)
    ops = [i for i, x in enumerate(step.op_layers["forward"]) if x == layer]
    return sum(
        int(c.sizes[sid])
        for sid, name in enumerate(c.storage_names)
        if ops[0] <= c.first_op[sid] <= ops[-1] and c.first_is_write[sid] and name in alive
    )


def layer_segment_peak(step, phase: str, layer: int = 1) -> int:
    """Peak of one layer's ops in a traced phase, above the bytes in use when they start."""
    from ..liveness import analyze_sequence

    res = analyze_sequence(step.programs, live_on_entry=step.entry_storages)
    k = [p.name for p in step.programs].index(phase)
    idx = [i for i, x in enumerate(step.op_layers[phase]) if x == layer]
    r = res[k]
    base = int(r.after[idx[0] - 1]) if idx[0] else 0
    return max(int(r.during[i]) for i in idx) - base


def layer_rows(tag: str, step, template) -> list[CaseRow]:
    """Layer 1 of a traced step against the template's layer: its kept bytes, its forward and its
    backward peak (three rows named `<tag>: layer ...`)."""
    return [
        CaseRow(f"{tag}: layer kept", layer_kept(step), template.F.net_bytes),
        CaseRow(f"{tag}: layer forward peak", layer_segment_peak(step, "forward"), template.F.peak_bytes),
        CaseRow(f"{tag}: layer backward peak", layer_segment_peak(step, "backward"), template.B.peak_bytes),
    ]


def _torchtune_file(relative: str, stubs: dict | None = None):
    """A torchtune source file as a module (None when torchtune is not installed). `stubs`:
    module name -> attributes, for the helpers the file imports from torchtune itself."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    saved = {}
    for name, attrs in (stubs or {}).items():
        saved[name] = sys.modules.get(name)
        mod = types.ModuleType(name)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
    try:
        mod_spec = importlib.util.spec_from_file_location("_torchtune_" + path.stem, path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        return mod
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


@contextlib.contextmanager
def torchtune_packages():
    """Import torchtune's model code without its package `__init__`s (which import datasets,
    tokenizers and a torchao module newer torchao releases moved): the packages on the way
    are bare modules over torchtune's own directories; sys.modules is restored on exit."""
    import torch

    spec = importlib.util.find_spec("torchtune")
    root = Path(list(spec.submodule_search_locations)[0])
    before = {
        k: v for k, v in sys.modules.items() if k.startswith("torchtune") or k == "torchao.dtypes.nf4tensor"
    }
    nf4 = types.ModuleType("torchao.dtypes.nf4tensor")

    class NF4Tensor(torch.Tensor):  # only isinstance checks and decorators read these
        pass

    nf4.__dict__.update(
        NF4Tensor=NF4Tensor, to_nf4=None, linear_nf4=None, implements=lambda *a, **k: lambda f: f
    )
    sys.modules["torchao.dtypes.nf4tensor"] = nf4
    for rel in ("", "models", "models/llama3", "models/llama3_1", "models/llama3_2", "models/qwen2"):
        name = ".".join(["torchtune", *rel.split("/")]) if rel else "torchtune"
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / rel)]
        pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        pkg.__spec__.submodule_search_locations = pkg.__path__
        sys.modules[name] = pkg
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k.startswith("torchtune") or k == "torchao.dtypes.nf4tensor"]:
            del sys.modules[k]
        sys.modules.update(before)


def torchtune_decoder(config: dict, dtype: str):
    """torchtune's own decoder at `config`'s shape -- its `llama3_2` component builder, or `qwen2`
    (q/k/v biases) for a qwen2 config -- real tensors in `dtype` (small: the rope cache is built
    eagerly); None without torchtune."""
    import torch

    if importlib.util.find_spec("torchtune") is None:
        return None
    with torchtune_packages():
        if config.get("model_type") == "qwen2":
            from torchtune.models.qwen2._component_builders import qwen2 as build

            extra = {}
        else:
            from torchtune.models.llama3_2._component_builders import llama3_2 as build

            extra = {"rope_base": 500000}
        model = build(**torchtune_decoder_kwargs(config, S), tie_word_embeddings=False, **extra)
    return model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])


def torchtune_chunked_loss():
    mod = _torchtune_file("modules/loss/ce_chunked_output_loss.py")
    return None if mod is None else mod.CEWithChunkedOutputLoss


def torchtune_optim_in_bwd_hooks():
    import logging

    import torch

    mod = _torchtune_file(
        "training/memory.py",
        {
            "torchtune": {},
            "torchtune.utils": {
                "get_device_support": lambda: "cpu",
                "get_logger": lambda *a, **k: logging.getLogger("torchtune"),
                "get_torch_device_namespace": lambda: torch.cpu,
            },
        },
    )
    return None if mod is None else mod.register_optim_in_bwd_hooks


def torchtune_offload_activations():
    """torchtune's `OffloadActivations` class, run against fake CUDA streams, with its CPU
    buffers recorded as host memory; None when torchtune is not installed."""
    import logging

    import torch

    from ..traced.capture import host_memory

    class NF4Tensor(torch.Tensor):  # torchao moved it; only an isinstance check reads it
        pass

    class TiedLinear:
        pass

    mod = _torchtune_file(
        "training/_activation_offloading.py",
        {
            "psutil": {},
            "torchao.dtypes.nf4tensor": {"NF4Tensor": NF4Tensor},
            "torchtune": {},
            "torchtune.modules": {"TiedLinear": TiedLinear},
            "torchtune.utils": {"get_logger": lambda *a, **k: logging.getLogger("torchtune")},
        },
    )
    if mod is None:
        return None
    compute = _Stream()

    class _Cuda:
        Stream = _Stream
        default_stream = staticmethod(lambda *a: compute)
        current_stream = staticmethod(lambda *a: compute)
        stream = staticmethod(lambda s: contextlib.nullcontext())

    class _Torch:
        """torch as the module sees it: fake streams; `empty_like(..., device="cpu")` (its
        host buffer) is host memory."""

        cuda = _Cuda

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty_like(t, **kw):
            if str(kw.get("device")) != "cpu":
                return torch.empty_like(t, **kw)
            kw.pop("pin_memory", None)
            with host_memory():
                return torch.empty_like(t, **kw)

    mod.torch = _Torch()
    return mod.OffloadActivations


@contextlib.contextmanager
def _device_copies():
    """`t.to("cuda")` on a fake CPU tensor: a new device storage (the reload); record_stream
    orders nothing here."""
    import torch

    from ..traced.hf import fake_tensor_quirks

    to, record_stream = torch.Tensor.to, torch.Tensor.record_stream

    def to_device(self, *args, **kwargs):
        dev = args[0] if args else kwargs.get("device")
        if isinstance(dev, (str, torch.device)) and str(dev).startswith("cuda"):
            return torch.empty_like(self).copy_(self)
        return to(self, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.record_stream = to_device, lambda self, stream: None
    try:
        with fake_tensor_quirks():
            yield
    finally:
        torch.Tensor.to, torch.Tensor.record_stream = to, record_stream


# ---------------------------------------------------------------- the comparisons

COMPILE_CASES = {
    "llama-bf16-pure": (dict(LLAMA, intermediate_size=512, num_hidden_layers=2), "bf16", False),
    "llama-autocast": (dict(LLAMA, intermediate_size=512), "bf16", True),
    "qwen2-bf16-pure": (dict(LLAMA, model_type="qwen2", intermediate_size=512), "bf16", False),
}


def compile_case(name: str) -> CaseRow:
    """Bytes compiling every layer removes from what the forward keeps (2-layer model)."""
    from ..traced.compiled import compile_layers

    config, dtype, master = COMPILE_CASES[name]
    traced = (
        trace_hf(config, dtype, master).phase("forward").net_bytes
        - trace_hf(config, dtype, master, prepare=compile_layers).phase("forward").net_bytes
    )
    est = 2 * (
        template_layer(config, dtype=dtype, master_weights=master).F.net_bytes
        - template_layer(config, dtype=dtype, master_weights=master, compile=True).F.net_bytes
    )
    return CaseRow(f"compile/{name}: saved bytes removed", traced, est)


def _chunked_head_trace(compiled: bool):
    import torch

    from ..traced.compiled import compile_function
    from ..traced.step import trace_step

    cls = torchtune_chunked_loss()
    loss = cls(num_output_chunks=CHUNKS)
    if compiled:
        loss.compute_cross_entropy = compile_function(loss.compute_cross_entropy)
    H, V = HEAD["hidden_size"], HEAD["vocab_size"]

    class Head(torch.nn.Module):
        """torchtune's TransformerDecoder tail: final norm, chunked_output, the loss."""

        def __init__(self):
            super().__init__()
            self.norm, self.output = _llama_head_layers()
            self.loss = loss

        def forward(self, h, labels):
            h = self.norm(h)
            return self.loss([self.output(c) for c in h.chunk(CHUNKS, dim=1)], labels)

    def inputs(_m=None):
        return (
            (torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, V, (B, S))),
            {},
        )

    st = trace_step(Head().to(torch.bfloat16), inputs, None, None, "cuda", step="first")
    f, b = st.phase("forward"), st.phase("backward")
    return f.net_bytes, b.peak_bytes + f.net_bytes


def _head_memory(**plan):
    """The template's head part (final norm, output layer, loss) of HEAD in pure bf16, hf convention."""
    from ..model import arch_from_hf_config
    from ..plan import ParallelPlan, validate_plan
    from ..templates.conventions import convention_for
    from ..templates.layers import make_shard
    from ..templates.programs import head_memory

    arch = arch_from_hf_config(HEAD, "t")
    p = validate_plan(
        arch,
        ParallelPlan(seq_len=S, micro_batch=B, dtype="bf16", master_weights=False, convention="hf", **plan),
    )
    conv = convention_for(p)
    return head_memory(arch, make_shard(arch, p, conv), conv)


def _chunked_head_template(compiled: bool):
    hm = _head_memory(loss="chunked", loss_chunks=CHUNKS, compile=compiled)
    # the traced step keeps its input as a static input; the template part frees it after its
    # last use (the next part owns it): count it on both sides
    return hm.F.net_bytes + hm.input_bytes, hm.B.peak_bytes + hm.F.net_bytes + hm.input_bytes


def chunked_ce_cases(compiled: bool) -> list[CaseRow]:
    tag = "compiled" if compiled else "eager"
    (t_kept, t_bwd), (m_kept, m_bwd) = _chunked_head_trace(compiled), _chunked_head_template(compiled)
    rows = [CaseRow(f"chunked-ce/{tag}: head kept", t_kept, m_kept)]
    if not compiled:
        # the traced compiled backward runs inductor's decomposed ops unfused: its transients are
        # not what inductor runs, so only the eager backward peak is a reference
        rows.append(CaseRow(f"chunked-ce/{tag}: head backward peak", t_bwd, m_bwd))
    return rows


def _shifted_head_trace():
    """A training step's own loss on the model's bf16 logits (the ColossalAI Lightning GPT
    benchmark's, transformers < 4.46's GPT-2): final norm, output layer, then a shifted
    contiguous copy and torch's cross-entropy without `.float()`, traced eagerly."""
    import torch

    from ..traced.step import trace_step

    H, V = HEAD["hidden_size"], HEAD["vocab_size"]

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.output = _llama_head_layers()

        def forward(self, h, labels):
            logits = self.output(self.norm(h))
            shifted = logits[..., :-1, :].contiguous()
            return torch.nn.functional.cross_entropy(shifted.view(-1, V), labels[..., 1:].reshape(-1))

    def inputs(_m=None):
        return (
            (torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, V, (B, S))),
            {},
        )

    st = trace_step(Head().to(torch.bfloat16), inputs, None, None, "cuda", step="first")
    f, b = st.phase("forward"), st.phase("backward")
    return f.peak_bytes, f.net_bytes, b.peak_bytes + f.net_bytes


def _shifted_head_template():
    hm = _head_memory(loss="shifted")
    # the traced input is a static input of the step; the template part frees it (see above)
    return (
        hm.F.peak_bytes + hm.input_bytes,
        hm.F.net_bytes + hm.input_bytes,
        hm.B.peak_bytes + hm.F.net_bytes + hm.input_bytes,
    )


def shifted_ce_cases() -> list[CaseRow]:
    t, m = _shifted_head_trace(), _shifted_head_template()
    return [
        CaseRow(f"shifted-ce/eager: head {what}", a, b)
        for what, a, b in zip(("forward peak", "kept", "backward peak"), t, m)
    ]


# ---------------------------------------------------------------- Liger's fused linear CE


def liger_flce_module():
    """Liger-Kernel's ops.fused_linear_cross_entropy, its triton kernels run by triton's
    interpreter on CPU tensors (TRITON_INTERPRET=1 must be set before triton decorates them),
    or None when liger-kernel / triton are not installed or were imported without it."""
    import os

    if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
        return None
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return None  # triton.language was decorated for a GPU (tests/conftest.py sets it)
    try:
        import liger_kernel.ops.fused_linear_cross_entropy as mod
        from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    except Exception:  # an incompatible triton / torch pair
        return None
    if type(liger_cross_entropy_kernel).__name__ != "InterpretedFunction":
        return None  # imported earlier without the interpreter: its kernels need a GPU
    return mod


def _liger_gpu_forward(mod):
    """`fused_linear_cross_entropy_forward` with its device queries answered as on an sm90 GPU
    (on CPU tensors Liger takes its fallback: fresh logits per chunk, a [V, h] bf16 + fp32
    temporary per chunk for the weight grad), nothing else changed: the persistent logits
    buffer and the mm / addmm(out=) accumulation a CUDA run does."""
    import inspect

    src = inspect.getsource(mod)
    for a, b in (
        ('_input.device.type != "cuda"', '_input.device.type not in ("cuda", "cpu")'),
        ('grad_weight.device.type == "cuda"', 'grad_weight.device.type in ("cuda", "cpu")'),
        ("torch.cuda.get_device_capability(grad_weight.device)", "(9, 0)"),
    ):
        if a not in src:
            return None  # another Liger release: its CUDA tests are not these
        src = src.replace(a, b)
    ns = {"__name__": mod.__name__ + "_gpu_path", "__file__": mod.__file__}
    exec(compile(src, mod.__file__, "exec"), ns)
    return ns["fused_linear_cross_entropy_forward"]


class _LaunchWithoutModes:
    """A Liger kernel launched with the dispatch modes off (the interpreter's staging copies
    are not device allocations). The interpreter leaves its arguments in reference cycles, which
    would keep every logits chunk alive until Python's cyclic gc: collected after each launch,
    as a compiled launch keeps no reference."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        import gc

        from torch.utils._python_dispatch import _disable_current_modes

        launch = self.kernel[grid]

        def run(*args, **kwargs):
            with _disable_current_modes():
                out = launch(*args, **kwargs)
                gc.collect()
            return out

        return run


def _real_step_memory(model, args):
    """trace_step(step="first", no optimizer, "cuda" policy) on real CPU tensors (the triton
    interpreter needs values): forward kept, forward peak, backward peak above the step's start
    (the parameter grads the backward creates included)."""
    import torch

    from ..ir import TensorKind
    from ..traced import kernel_policy as policies
    from ..traced.capture import ModuleScope, StorageRecorder
    from ..traced.step import analyze_programs, run_step

    params = list(model.parameters())
    scope = ModuleScope(model)
    rec = StorageRecorder(scope)
    rec.register(params, TensorKind.PARAM)
    rec.register([a for a in args if isinstance(a, torch.Tensor)], TensorKind.ACTIVATION)

    def on_phase(phase):
        if phase in ("forward", "backward"):
            scope.reset()
            rec.begin(phase)
        if phase == "end":
            rec.set_kind([p.grad for p in params if p.grad is not None], TensorKind.GRAD)

    with scope, rec, policies.context("cuda"):
        run_step(model, args, {}, lambda out: out, None, None, on_phase)
    phases = {p.name: p for p in analyze_programs(rec.programs(), rec.entry_storages())}
    f, b = phases["forward"], phases["backward"]
    return f.net_bytes, f.peak_bytes, b.peak_bytes + f.net_bytes


def _liger_head_trace():
    mod = liger_flce_module()  # before transformers, which imports triton
    import torch

    gpu_forward = _liger_gpu_forward(mod)
    H, V = HEAD["hidden_size"], HEAD["vocab_size"]

    class Head(torch.nn.Module):
        """What Liger's HF patch runs for the last stage: final norm, then
        LigerFusedLinearCrossEntropyLoss on the output weight (no lm_head call)."""

        def __init__(self):
            super().__init__()
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.norm, self.output = _llama_head_layers()
            self.loss = LigerFusedLinearCrossEntropyLoss()

        def forward(self, h, labels):
            return self.loss(self.output.weight, self.norm(h).view(-1, H), labels.view(-1))

    torch.manual_seed(0)
    model = Head().to(torch.bfloat16)
    h = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (B, S))
    saved = {"fused_linear_cross_entropy_forward": mod.fused_linear_cross_entropy_forward}
    for ns in (mod.__dict__, gpu_forward.__globals__):
        for name in ("liger_cross_entropy_kernel", "element_mul_kernel"):
            saved[(id(ns), name)] = (ns, name, ns[name])
            ns[name] = _LaunchWithoutModes(ns[name])
    mod.fused_linear_cross_entropy_forward = gpu_forward
    try:
        kept, fwd_peak, bwd_peak = _real_step_memory(model, (h, labels))
    finally:
        mod.fused_linear_cross_entropy_forward = saved.pop("fused_linear_cross_entropy_forward")
        for ns, name, kernel in saved.values():
            ns[name] = kernel
    # the traced step has the labels as an input; the template's head loads them
    return kept, fwd_peak + labels.numel() * 8, bwd_peak


def _liger_head_template():
    from ..model import arch_from_hf_config
    from ..plan import ParallelPlan, validate_plan
    from ..templates.conventions import convention_for
    from ..templates.layers import make_shard
    from ..templates.programs import head_memory

    arch = arch_from_hf_config(HEAD, "t")
    p = validate_plan(
        arch,
        ParallelPlan(
            seq_len=S, micro_batch=B, dtype="bf16", master_weights=False, convention="hf", loss="fused_linear"
        ),
    )
    conv = convention_for(p)
    sh = make_shard(arch, p, conv)
    hm = head_memory(arch, sh, conv)
    # a part leaves the parameter grads to the gradient component; the traced first step has
    # each from its accumulate_grad on (the weight's is Liger's grad_weight, which the template
    # frees there): add them to the backward's curve
    import numpy as np

    from ..liveness import compile_program
    from ..templates.programs import head_programs

    pp = head_programs(arch, sh, conv)
    c = compile_program(pp.B)
    grads = np.zeros(len(pp.B.ops), dtype=np.int64)
    for i, name in enumerate(c.storage_names):
        if name.startswith("g.") and c.first_op[i] >= 0:
            grads[c.first_op[i]] += int(c.sizes[i])
    # from the op after accumulate_grad: there the grad takes the place of the (stolen) buffer
    b_peak = max(0, int((pp.results["B"].during + np.concatenate([[0], np.cumsum(grads)[:-1]])).max()))
    n = hm.input_bytes  # the input on both sides, as _chunked_head_template
    return hm.F.net_bytes + n, hm.F.peak_bytes + n, b_peak + hm.F.net_bytes + n


def fused_linear_ce_cases() -> list[CaseRow]:
    """Liger's LigerFusedLinearCrossEntropyLoss behind an HF final norm, its kernels run by
    triton's interpreter, traced on real CPU tensors with Liger's CUDA code path."""
    (t_kept, t_fwd, t_bwd), (m_kept, m_fwd, m_bwd) = _liger_head_trace(), _liger_head_template()
    return [
        CaseRow("fused-linear-ce/liger: head kept", t_kept, m_kept),
        CaseRow("fused-linear-ce/liger: head forward peak", t_fwd, m_fwd),
        CaseRow("fused-linear-ce/liger: head backward peak", t_bwd, m_bwd),
    ]


def fp8_cases() -> list[CaseRow]:
    """torchao Float8 (tensorwise) on every linear but lm_head, as torchtitan converts."""
    from torchao.float8 import convert_to_float8_training

    def convert(model):
        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")

    f8, bf = trace_hf(LLAMA, prepare=convert), trace_hf(LLAMA)
    t8, tb = (
        template_layer(
            LLAMA, 1, dtype="bf16", master_weights=False, fp8="tensorwise", extra={"first_step": True}
        ),
        template_layer(LLAMA, 1, dtype="bf16", master_weights=False, extra={"first_step": True}),
    )
    return [
        CaseRow(
            "fp8-torchao: forward kept (whole model), fp8 minus bf16",
            f8.phase("forward").net_bytes - bf.phase("forward").net_bytes,
            t8.F.net_bytes - tb.F.net_bytes,
            extra={"note": "torchao keeps the high-precision tensors: 0 expected"},
        ),
        CaseRow("fp8-torchao: layer forward peak", layer_segment_peak(f8, "forward"), t8.F.peak_bytes),
    ]


def optimizer_in_backward_cases() -> list[CaseRow]:
    import torch

    from ..ir import TensorKind
    from ..liveness import analyze_sequence

    register = torchtune_optim_in_bwd_hooks()

    def prepare(model):
        register(model, {p: torch.optim.AdamW([p], lr=1e-4, fused=True) for p in model.parameters()})

    st = trace_hf(LLAMA, prepare=prepare, step="steady")
    res = analyze_sequence(st.programs, live_on_entry=st.entry_storages)
    bwd = st.programs[[p.name for p in st.programs].index("backward")]
    grads = {t.storage for t in bwd.tensors.values() if t.kind is TensorKind.GRAD}
    left = sum(
        bwd.tensors[n].nbytes
        for n in bwd.tensors
        if bwd.tensors[n].storage in grads & set(res[1].live_after) and bwd.tensors[n].storage == n
    )
    est = template_layer(LLAMA, 1, dtype="bf16", master_weights=False, optimizer_in_backward=True)
    return [
        CaseRow("optimizer-in-backward: grads alive after backward", left, 0),
        CaseRow(
            "optimizer-in-backward: layer backward peak", layer_segment_peak(st, "backward"), est.B.peak_bytes
        ),
    ]


def _offload_trace(offload: bool, config: dict | None = None):
    """A 2-layer HF model's steady step (LLAMA unless `config`), grads zeroed in place (resident,
    as the layer templates count them), the decoder under torchtune's offloading context when
    `offload`."""
    from ..traced.hf import Precision, build_model, hf_loss, make_config, step_inputs
    from ..traced.step import trace_step

    cls = torchtune_offload_activations() if offload else None

    def prepare(model):
        ctx, decoder = cls(use_pin_memory=False), model.base_model  # the decoder, not the LM head
        forward = decoder.forward

        def offloaded(*args, **kwargs):
            with ctx:
                return forward(*args, **kwargs)

        decoder.forward = offloaded

    cfg = make_config(config or LLAMA, "sdpa", 2)
    return trace_step(
        lambda: build_model(cfg, Precision.parse("bf16", False).param_dtype),
        step_inputs(cfg, B, S),
        hf_loss,
        None,
        "cuda",
        prepare=prepare if offload else None,
        patches=_device_copies(),
        step="steady",
        set_to_none=False,
    )


# a non-gated (GPT-2) layer: Conv1D weights saved as parameters, GELU's chain, Python locals
# holding the attention output and the MLP's input -- the template is known to be low here
# (docs/ACCURACY.md; estimates with --activation-offload all on such layers carry a warning)
GPT2 = {
    "model_type": "gpt2",
    "n_embd": 256,
    "n_layer": 2,
    "n_head": 8,
    "vocab_size": 512,
    "n_positions": 1024,
}


def offload_cases(config: dict | None = None, tag: str = "llama") -> list[CaseRow]:
    """torchtune's OffloadActivations. The layer template's programs start from the bytes the
    previous (identical) layer leaves in the stash; the traced layer starts with them alive, so
    the template's peaks are read above them."""
    config = config or LLAMA
    from ..model import arch_from_hf_config
    from ..plan import ParallelPlan, validate_plan
    from ..templates.conventions import convention_for
    from ..templates.layers import decoder_layer_tape, layer_options, make_shard

    off, base = _offload_trace(True, config), _offload_trace(False, config)
    kw = dict(dtype="bf16", master_weights=False)
    t_off = template_layer(config, 1, activation_offload=("*",), **kw)
    t_base = template_layer(config, 1, **kw)
    arch = arch_from_hf_config(config, "t")
    p = validate_plan(
        arch, ParallelPlan(seq_len=S, micro_batch=B, convention="hf", activation_offload=("*",), **kw)
    )
    conv = convention_for(p)
    tape, _, _ = decoder_layer_tape(arch, make_shard(arch, p, conv), conv, layer_options(arch, p, 1, False))
    fwd_carry, bwd_carry = sum(tape.offload_carry[0].values()), tape.offload_carry[1]
    return [
        CaseRow(
            f"offload-torchtune/{tag}: forward kept removed (2 layers)",
            base.phase("forward").net_bytes - off.phase("forward").net_bytes,
            2 * (t_base.F.net_bytes - t_off.F.net_bytes),
        ),
        CaseRow(
            f"offload-torchtune/{tag}: layer forward peak",
            layer_segment_peak(off, "forward"),
            t_off.F.peak_bytes - fwd_carry,
        ),
        CaseRow(
            f"offload-torchtune/{tag}: layer backward peak",
            layer_segment_peak(off, "backward"),
            t_off.B.peak_bytes - bwd_carry,
        ),
    ]


# grouped-query attention at 4 query heads per K/V head, where torchtune's expansion shows
TT_LLAMA = dict(LLAMA, num_key_value_heads=2)


TT_QWEN2 = dict(TT_LLAMA, model_type="qwen2")


def _torchtune_trace(dtype: str, compiled: bool = False, config: dict | None = None):
    """torchtune's own 2-layer decoder, steady step (grads zeroed in place, resident as the
    layer templates count them), its fp32 logits into cross entropy as its recipe does."""
    import torch
    import torch.nn.functional as F

    from ..traced.compiled import compile_layers
    from ..traced.step import trace_step

    config = config or TT_LLAMA
    model = torchtune_decoder(config, dtype)
    V = config["vocab_size"]

    def inputs(_model):
        return (torch.randint(0, V, (B, S)),), {}

    def loss(logits):
        return F.cross_entropy(logits.reshape(-1, V), torch.zeros(B * S, dtype=torch.long))

    return trace_step(
        model,
        inputs,
        loss,
        None,
        "cuda",
        step="steady",
        set_to_none=False,
        prepare=(lambda m: compile_layers(m, "layers")) if compiled else None,
    )


def torchtune_module_cases(dtype: str, config: dict | None = None) -> list[CaseRow]:
    """torchtune's own modules (RMSNorm on an fp32 copy, K/V expanded before SDPA, the
    attention output held to the layer's end) against the torchtune convention's layer."""
    config = config or TT_LLAMA
    st = _torchtune_trace(dtype, config=config)
    t = template_layer(config, 1, convention="torchtune", dtype=dtype)
    tag = f"{'qwen2-' if config.get('model_type') == 'qwen2' else ''}{dtype}"
    return layer_rows(f"torchtune-modules/{tag}", st, t)


def torchtune_compile_case() -> list[CaseRow]:
    """The real partitioner on torchtune's own layers: what compiling removes from the forward's
    kept bytes (2 layers), against the min-cut over the torchtune convention's tape."""
    traced = (
        _torchtune_trace("bf16").phase("forward").net_bytes
        - _torchtune_trace("bf16", compiled=True).phase("forward").net_bytes
    )
    est = 2 * (
        template_layer(TT_LLAMA, convention="torchtune", dtype="bf16").F.net_bytes
        - template_layer(TT_LLAMA, convention="torchtune", dtype="bf16", compile=True).F.net_bytes
    )
    return [CaseRow("compile/torchtune-bf16: saved bytes removed", traced, est)]


# ---------------------------------------------------------------- LoRA

# the adapters of the comparisons: every decoder linear (PEFT's "all-linear"), rank 8
LORA_RANK = 8
HF_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_prepare(dropout: float, targets=None):
    """PEFT's `get_peft_model` on the fake HF model, as a LoRA training script calls it (its
    defaults: the adapters upcast to fp32, `autocast_adapter_dtype=True`); None without peft."""
    if importlib.util.find_spec("peft") is None:
        return None

    def prepare(model):
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(
            r=LORA_RANK, lora_alpha=16, lora_dropout=dropout, target_modules=targets or HF_LINEARS
        )
        get_peft_model(model, cfg)  # replaces the targeted modules of `model` in place

    return prepare


def _lora_trace(prepare, dtype: str, layers: int = 2, autocast: bool = False):
    """A 2-layer HF Llama (LLAMA) in `dtype`, no autocast, `prepare` applied; steady step,
    the adapters' grads zeroed in place (resident, as the layer templates count them)."""
    from ..traced.hf import Precision, build_model, fake_tensor_quirks, hf_loss, make_config, step_inputs
    from ..traced.step import trace_step

    cfg = make_config(LLAMA, "sdpa", layers)

    def build():  # on the meta device: the adapters are made there too
        model = build_model(cfg, Precision.parse(dtype, False).param_dtype)
        prepare(model)
        return model

    import torch

    return trace_step(
        build,
        step_inputs(cfg, B, S),
        hf_loss,
        None,
        "cuda",
        autocast_dtype=torch.bfloat16 if autocast else None,
        patches=fake_tensor_quirks(),
        step="steady",
        set_to_none=False,
    )


def lora_template_layer(config: dict, convention: str, dropout: float, **plan):
    """The template's layer 1 under --lora-rank LORA_RANK on every linear, with `dropout` on the
    adapters' input."""
    return template_layer(
        config,
        1,
        convention=convention,
        lora_rank=LORA_RANK,
        lora_targets="all-linear",
        lora_dropout=dropout,
        **plan,
    )


def lora_peft_cases(dtype: str, dropout: float, autocast: bool = False) -> list[CaseRow]:
    """PEFT's LoraLayer on every linear of an HF Llama decoder layer (the model in `dtype`;
    PEFT's fp32 adapters on an input cast to fp32; `autocast`: the bf16 model under the Trainer's
    bf16 autocast, as --bf16 runs it) against --lora-rank under the hf convention: a layer's kept
    bytes, forward and backward peaks."""
    st = _lora_trace(peft_prepare(dropout), dtype, autocast=autocast)
    t = lora_template_layer(LLAMA, "hf", dropout, dtype=dtype, master_weights=autocast)
    tag = f"lora-peft/{dtype}{'-autocast' if autocast else ''}{'-dropout' if dropout else ''}"
    return layer_rows(tag, st, t)


def torchtune_lora_decoder(dtype: str, dropout: float):
    """torchtune's own `lora_llama3_2` decoder at TT_LLAMA's shape, adapters on every layer
    linear (q, k, v, output_proj and the MLP's w1 / w2 / w3), the base frozen as its recipe's
    `set_trainable_params(model, get_adapter_params(model))` leaves it; None without torchtune."""
    import torch

    if importlib.util.find_spec("torchtune") is None:
        return None
    with torchtune_packages():
        model = torchtune_lora_llama(
            TT_LLAMA,
            S,
            ["q_proj", "k_proj", "v_proj", "output_proj"],
            mlp=True,
            rank=LORA_RANK,
            alpha=16,
            dropout=dropout,
            tie_word_embeddings=False,
        )
    return model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])


def lora_torchtune_cases(dtype: str, dropout: float) -> list[CaseRow]:
    """torchtune's LoRALinear in its own decoder against --lora-rank under the torchtune
    convention: a layer's kept bytes, forward and backward peaks."""
    import torch
    import torch.nn.functional as F

    from ..traced.step import trace_step

    model = torchtune_lora_decoder(dtype, dropout)
    V = TT_LLAMA["vocab_size"]
    st = trace_step(
        model,
        lambda _m: ((torch.randint(0, V, (B, S)),), {}),
        lambda logits: F.cross_entropy(logits.reshape(-1, V), torch.zeros(B * S, dtype=torch.long)),
        None,
        "cuda",
        step="steady",
        set_to_none=False,
    )
    t = lora_template_layer(TT_LLAMA, "torchtune", dropout, dtype=dtype)
    tag = f"lora-torchtune/{dtype}{'-dropout' if dropout else ''}"
    return layer_rows(tag, st, t)


def case_list() -> list[tuple[str, Callable[[], list[CaseRow]]]]:
    """(name, run) of each case whose library is installed, in the order they run."""
    cases: list[tuple[str, Callable[[], list[CaseRow]]]] = [
        (f"compile/{n}", lambda n=n: [compile_case(n)]) for n in sorted(COMPILE_CASES)
    ]
    if torchtune_chunked_loss() is not None:
        cases += [
            ("chunked-ce/eager", lambda: chunked_ce_cases(False)),
            ("chunked-ce/compiled", lambda: chunked_ce_cases(True)),
        ]
    cases.append(("shifted-ce/eager", shifted_ce_cases))
    if liger_flce_module() is not None and _liger_gpu_forward(liger_flce_module()) is not None:
        cases.append(("fused-linear-ce/liger", fused_linear_ce_cases))
    if importlib.util.find_spec("torchao") is not None:
        cases.append(("fp8/tensorwise", fp8_cases))
    if torchtune_optim_in_bwd_hooks() is not None:
        cases.append(("optimizer-in-backward", optimizer_in_backward_cases))
    if importlib.util.find_spec("torchtune") is not None:
        cases += [
            ("torchtune-modules/bf16", lambda: torchtune_module_cases("bf16")),
            ("torchtune-modules/fp32", lambda: torchtune_module_cases("fp32")),
            ("torchtune-modules/qwen2-bf16", lambda: torchtune_module_cases("bf16", TT_QWEN2)),
            ("compile/torchtune-bf16", torchtune_compile_case),
            ("offload/torchtune-llama", offload_cases),
            ("offload/torchtune-gpt2", lambda: offload_cases(GPT2, "gpt2")),
        ]
        cases += [
            (f"lora-torchtune/{dt}{'-dropout' if d else ''}", lambda dt=dt, d=d: lora_torchtune_cases(dt, d))
            for dt in ("bf16", "fp32")
            for d in (0.0, 0.1)
        ]
    if importlib.util.find_spec("peft") is not None:
        cases += [
            (f"lora-peft/{dt}{'-dropout' if d else ''}", lambda dt=dt, d=d: lora_peft_cases(dt, d))
            for dt in ("bf16", "fp32")
            for d in (0.0, 0.1)
        ]
        cases += [
            (
                f"lora-peft/bf16-autocast{'-dropout' if d else ''}",
                lambda d=d: lora_peft_cases("bf16", d, True),
            )
            for d in (0.0, 0.1)
        ]
    return cases


def run_all(progress=None, cases=None) -> list[CaseRow]:
    """Every case's rows; `progress` (a progress.CaseProgress) follows along."""
    rows: list[CaseRow] = []
    for name, fn in case_list() if cases is None else cases:
        if progress is not None:
            progress.start(name)
        rows += fn()
        if progress is not None:
            progress.done(name)
    for r in rows:
        if r.name in KNOWN_GAPS:
            r.extra["known_gap"] = KNOWN_GAPS[r.name]
    return rows


# ---------------------------------------------------------------- command

EXAMPLE = """\
examples:
  pipemem validate features
  pipemem validate features --json
"""


HELP = "compile, chunked CE, fp8, optimizer-in-backward, offloading vs their libraries' traces"
DESCRIPTION = __doc__.split("\n\n")[0]


def add_arguments(p) -> None:
    add_json_option(p)


def run(args) -> int:
    import os

    from ..errors import UserError

    os.environ.setdefault("TRITON_INTERPRET", "1")  # Liger's kernels, if triton is not imported yet
    for mod in ("torch", "transformers", "networkx"):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"pipemem validate features needs {mod}: pip install 'pipemem[torch,modern]'")
    from .progress import CaseProgress, print_result, quiet_profiler_chatter

    t0 = time.perf_counter()
    cases = case_list()
    with quiet_profiler_chatter(), CaseProgress([n for n, _ in cases], "validate features") as bar:
        rows = run_all(bar, cases)
    seconds = round(time.perf_counter() - t0, 1)
    # measured = the library's own code traced, estimated = the template
    status = print_result(
        rows,
        args.json,
        "features",
        TRUTH,
        TOLERANCE,
        {"seconds": seconds},
        title="reference (library trace) vs template",
    )
    if not args.json:
        print(f"({seconds} s)")
    return status
