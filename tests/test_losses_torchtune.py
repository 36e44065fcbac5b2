"""Chunked cross-entropy in templates (pipemem.templates.losses) against torchtune's own
`CEWithChunkedOutputLoss`, traced on fake tensors: the final RMSNorm, the output projection per
chunk (torchtune's `chunked_output`) and the loss, eager and with `compute_cross_entropy`
compiled by AOTAutograd's partitioner (what torchtune's compile_loss does). The bytes the
forward leaves for the backward and the backward's peak agree with the template head.
"""

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipemem.model import arch_from_hf_config  # noqa: E402
from pipemem.plan import ParallelPlan, validate_plan  # noqa: E402
from pipemem.templates.conventions import convention_for  # noqa: E402
from pipemem.templates.layers import make_shard  # noqa: E402
from pipemem.templates.programs import head_memory  # noqa: E402

S, B, H, V, CHUNKS = 256, 2, 256, 4096, 8
CONFIG = {"model_type": "llama", "hidden_size": H, "num_attention_heads": 8, "num_key_value_heads": 4,
          "num_hidden_layers": 1, "intermediate_size": 512, "vocab_size": V, "tie_word_embeddings": False}


def torchtune_chunked_loss():
    """torchtune's loss module, loaded from its file (torchtune's package __init__ imports
    torchao APIs that newer torchao releases moved)."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "modules" / "loss" / "ce_chunked_output_loss.py"
    mod_spec = importlib.util.spec_from_file_location("_tt_ce_chunked", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.CEWithChunkedOutputLoss


class Head(torch.nn.Module):
    """torchtune's TransformerDecoder tail: norm, then chunked_output (a list of bf16 logits)."""

    def __init__(self, loss):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        self.norm = LlamaRMSNorm(H)
        self.output = torch.nn.Linear(H, V, bias=False)
        self.loss = loss

    def forward(self, h, labels):
        h = self.norm(h)
        logits = [self.output(c) for c in h.chunk(CHUNKS, dim=1)]
        return self.loss(logits, labels)


def traced(compiled: bool):
    from pipemem.traced.compiled import compile_function
    from pipemem.traced.step import trace_step

    loss = torchtune_chunked_loss()(num_output_chunks=CHUNKS)
    if compiled:
        loss.compute_cross_entropy = compile_function(loss.compute_cross_entropy)
    model = Head(loss).to(torch.bfloat16)

    def inputs(_m=None):
        return ((torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True),
                 torch.randint(0, V, (B, S))), {})
    st = trace_step(model, inputs, None, None, "cuda")
    f, b = st.phase("forward"), st.phase("backward")
    return f.net_bytes, b.peak_bytes + f.net_bytes


def template(compiled: bool):
    arch = arch_from_hf_config(CONFIG, "t")
    plan = validate_plan(arch, ParallelPlan(seq_len=S, micro_batch=B, dtype="bf16", master_weights=False,
                                            convention="hf", loss="chunked", loss_chunks=CHUNKS, compile=compiled))
    conv = convention_for(plan)
    hm = head_memory(arch, make_shard(arch, plan, conv), conv)
    # the traced step keeps its input tensor as a static input; the template part frees it
    # after its last use (the next part owns it): count it on both sides
    return hm.F.net_bytes + hm.input_bytes, hm.B.peak_bytes + hm.F.net_bytes + hm.input_bytes


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_cross_entropy_matches_torchtune(compiled):
    t_kept, t_bwd = traced(compiled)
    m_kept, m_bwd = template(compiled)
    logits_bf16 = S * B * V * 2
    # what is at stake: eager keeps fp32 log-softmax chunks (2x the bf16 logits), compiled the bf16 logits
    assert t_kept > (1.9 if not compiled else 0.9) * logits_bf16
    assert abs(m_kept - t_kept) <= 0.01 * t_kept, (m_kept, t_kept)
    if not compiled:
        # (the traced compiled backward runs inductor's decomposed ops unfused: its transients
        # are not what inductor runs, so only the eager backward peak is compared)
        assert abs(m_bwd - t_bwd) <= 0.02 * t_bwd, (m_bwd, t_bwd)
