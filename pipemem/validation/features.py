"""`pipemem validate features`: the modern-trainer features (pipemem.features) in templates
against traces made by each feature's own library, on fake tensors (no GPU):

* compile: AOTAutograd's `min_cut_rematerialization_partition` with inductor's decompositions,
  on every layer of a 2-layer Hugging Face model (pipemem.traced.compiled) -- what compiling
  removes from the bytes the forward leaves for backward, whole model vs 2 x one template layer;
* chunked CE: torchtune's `CEWithChunkedOutputLoss` behind torchtune's chunked output
  projection, eager and with its `compute_cross_entropy` compiled -- the head's kept bytes;
* fp8: torchao's `convert_to_float8_training` (tensorwise) on an HF Llama -- layer 1's forward
  peak (where torchao's casts dominate) and its kept bytes;
* optimizer in backward: torchtune's `register_optim_in_bwd_hooks` (one fused AdamW per
  parameter), steady state -- layer 1's backward peak.

torchtune 0.6's package imports a torchao module newer torchao releases moved, so its two
source files are loaded by path (`_torchtune_file`). Reference = the traced library run,
estimate = the template. Seconds on 2 cores: about 60.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
from pathlib import Path
from typing import Callable

from .compare import CaseRow, max_abs_rel_error

S, B = 256, 2
LLAMA = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 768, "vocab_size": 512}
HEAD = dict(LLAMA, vocab_size=4096, num_hidden_layers=1)
CHUNKS = 8


# ---------------------------------------------------------------- shared helpers

def template_layer(config: dict, layer: int = 0, **plan):
    from ..model import arch_from_hf_config
    from ..plan import ParallelPlan, validate_plan
    from ..templates.conventions import convention_for
    from ..templates.layers import layer_options, make_shard
    from ..templates.programs import layer_memory

    arch = arch_from_hf_config(config, "t")
    p = validate_plan(arch, ParallelPlan(seq_len=plan.pop("seq_len", S), micro_batch=plan.pop("micro_batch", B),
                                         convention="hf", **plan))
    conv = convention_for(p)
    return layer_memory(arch, make_shard(arch, p, conv), conv, layer_options(arch, p, layer, False))


def trace_hf(config: dict, dtype: str = "bf16", master: bool = False, prepare=None, step: str = "first",
             layers: int = 2):
    import torch

    from ..traced.hf import Precision, build_model, fake_tensor_quirks, hf_loss, make_config, step_inputs
    from ..traced.step import trace_step

    cfg = make_config(config, "sdpa", layers)
    prec = Precision.parse(dtype, master)
    del torch
    return trace_step(lambda: build_model(cfg, prec.param_dtype), step_inputs(cfg, B, S), hf_loss, None, "cuda",
                      autocast_dtype=prec.autocast_dtype, prepare=prepare, patches=fake_tensor_quirks(), step=step)


def layer_segment_peak(step, phase: str, layer: int = 1) -> int:
    """Peak of one layer's ops in a traced phase, above the bytes in use when they start."""
    from ..liveness import analyze_sequence

    res = analyze_sequence(step.programs, live_on_entry=step.entry_storages)
    k = [p.name for p in step.programs].index(phase)
    idx = [i for i, x in enumerate(step.op_layers[phase]) if x == layer]
    r = res[k]
    base = int(r.after[idx[0] - 1]) if idx[0] else 0
    return max(int(r.during[i]) for i in idx) - base


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


def torchtune_chunked_loss():
    mod = _torchtune_file("modules/loss/ce_chunked_output_loss.py")
    return None if mod is None else mod.CEWithChunkedOutputLoss


def torchtune_optim_in_bwd_hooks():
    import logging

    import torch
    mod = _torchtune_file("training/memory.py", {
        "torchtune": {}, "torchtune.utils": {"get_device_support": lambda: "cpu",
                                             "get_logger": lambda *a, **k: logging.getLogger("torchtune"),
                                             "get_torch_device_namespace": lambda: torch.cpu}})
    return None if mod is None else mod.register_optim_in_bwd_hooks


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
    traced = (trace_hf(config, dtype, master).phase("forward").net_bytes
              - trace_hf(config, dtype, master, prepare=compile_layers).phase("forward").net_bytes)
    est = 2 * (template_layer(config, dtype=dtype, master_weights=master).F.net_bytes
               - template_layer(config, dtype=dtype, master_weights=master, compile=True).F.net_bytes)
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
            from transformers.models.llama.modeling_llama import LlamaRMSNorm
            self.norm = LlamaRMSNorm(H)
            self.output = torch.nn.Linear(H, V, bias=False)
            self.loss = loss

        def forward(self, h, labels):
            h = self.norm(h)
            return self.loss([self.output(c) for c in h.chunk(CHUNKS, dim=1)], labels)

    def inputs(_m=None):
        return ((torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, V, (B, S))), {})
    st = trace_step(Head().to(torch.bfloat16), inputs, None, None, "cuda", step="first")
    f, b = st.phase("forward"), st.phase("backward")
    return f.net_bytes, b.peak_bytes + f.net_bytes


def _chunked_head_template(compiled: bool):
    from ..model import arch_from_hf_config
    from ..plan import ParallelPlan, validate_plan
    from ..templates.conventions import convention_for
    from ..templates.layers import make_shard
    from ..templates.programs import head_memory

    arch = arch_from_hf_config(HEAD, "t")
    p = validate_plan(arch, ParallelPlan(seq_len=S, micro_batch=B, dtype="bf16", master_weights=False,
                                         convention="hf", loss="chunked", loss_chunks=CHUNKS, compile=compiled))
    conv = convention_for(p)
    hm = head_memory(arch, make_shard(arch, p, conv), conv)
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


def fp8_cases() -> list[CaseRow]:
    """torchao Float8 (tensorwise) on every linear but lm_head, as torchtitan converts."""
    from torchao.float8 import convert_to_float8_training

    def convert(model):
        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    f8, bf = trace_hf(LLAMA, prepare=convert), trace_hf(LLAMA)
    t8, tb = template_layer(LLAMA, 1, dtype="bf16", master_weights=False, fp8="tensorwise",
                            extra={"first_step": True}), \
        template_layer(LLAMA, 1, dtype="bf16", master_weights=False, extra={"first_step": True})
    return [CaseRow("fp8-torchao: forward kept (whole model), fp8 minus bf16",
                    f8.phase("forward").net_bytes - bf.phase("forward").net_bytes, t8.F.net_bytes - tb.F.net_bytes,
                    extra={"note": "torchao keeps the high-precision tensors: 0 expected"}),
            CaseRow("fp8-torchao: layer forward peak", layer_segment_peak(f8, "forward"), t8.F.peak_bytes)]


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
    left = sum(bwd.tensors[n].nbytes for n in bwd.tensors if bwd.tensors[n].storage in grads & set(res[1].live_after)
               and bwd.tensors[n].storage == n)
    est = template_layer(LLAMA, 1, dtype="bf16", master_weights=False, optimizer_in_backward=True)
    return [CaseRow("optimizer-in-backward: grads alive after backward", left, 0),
            CaseRow("optimizer-in-backward: layer backward peak", layer_segment_peak(st, "backward"),
                    est.B.peak_bytes)]


def case_list() -> list[tuple[str, Callable[[], list[CaseRow]]]]:
    """(name, run) of each case whose library is installed, in the order they run."""
    cases: list[tuple[str, Callable[[], list[CaseRow]]]] = [
        (f"compile/{n}", lambda n=n: [compile_case(n)]) for n in sorted(COMPILE_CASES)]
    if torchtune_chunked_loss() is not None:
        cases += [("chunked-ce/eager", lambda: chunked_ce_cases(False)),
                  ("chunked-ce/compiled", lambda: chunked_ce_cases(True))]
    if importlib.util.find_spec("torchao") is not None:
        cases.append(("fp8/tensorwise", fp8_cases))
    if torchtune_optim_in_bwd_hooks() is not None:
        cases.append(("optimizer-in-backward", optimizer_in_backward_cases))
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
    return rows


# ---------------------------------------------------------------- command

EXAMPLE = """\
examples:
  pipemem validate features
  pipemem validate features --json
"""


def register(sub) -> None:
    p = sub.add_parser("features", help="compile, chunked CE, fp8, optimizer-in-backward vs their libraries' traces",
                       description=__doc__.split("\n\n")[0], epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object with cases[]")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import UserError

    for mod in ("torch", "transformers", "networkx"):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"pipemem validate features needs {mod}: pip install 'pipemem[torch,modern]'")
    from .progress import CaseProgress, print_summary, quiet_profiler_chatter

    t0 = time.perf_counter()
    cases = case_list()
    with quiet_profiler_chatter(), CaseProgress([n for n, _ in cases], "validate features") as bar:
        rows = run_all(bar, cases)
    out = {"cases": [r.to_dict() for r in rows], "max_abs_rel_error": max_abs_rel_error(rows),
           "seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    # measured = the library's own trace, estimated = the template
    print_summary(rows, title="validate features: reference (library trace) vs template")
    print(f"({out['seconds']} s)")
    return 0
