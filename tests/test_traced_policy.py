"""The cuda kernel policy: what the CUDA kernels save, on fake CPU tensors."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipemem.traced.hf import TINY, trace_hf_step  # noqa: E402


def _ops(step, phase):
    return [op for p in step.programs if p.name == phase for op in p.ops]


def test_cuda_policy_flash_attention_and_foreach():
    B, S = 2, 64
    cfg = TINY["llama"]
    step = trace_hf_step(cfg, B, S, dtype="bf16-autocast", kernel_policy="cuda")
    fwd = step.programs[0]
    flash = [op for op in fwd.ops if op.type == "_scaled_dot_product_flash_attention.default"]
    assert len(flash) == cfg["num_hidden_layers"]
    heads, hd = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    out, lse = (fwd.tensors[n] for n in flash[0].outputs[:2])
    assert out.dtype == "bfloat16" and out.nbytes == B * heads * S * hd * 2  # autocast cast first
    assert lse.dtype == "float32" and lse.nbytes == B * heads * S * 4  # logsumexp [B,H,S]
    assert any(op.type.startswith("_foreach_") for op in _ops(step, "optimizer"))
    cpu = trace_hf_step(cfg, B, S, dtype="bf16-autocast", kernel_policy="cpu")
    assert not any(op.type.startswith("_foreach_") for op in _ops(cpu, "optimizer"))


def test_cuda_policy_dropout_bool_mask():
    step = trace_hf_step(TINY["gpt2"], 2, 64, attn="eager", optimizer="none", kernel_policy="cuda")
    fwd = step.programs[0]
    drops = [op for op in fwd.ops if op.type == "native_dropout.default"]
    assert drops and all(fwd.tensors[op.outputs[1]].dtype == "bool" for op in drops)
    cpu = trace_hf_step(TINY["gpt2"], 2, 64, attn="eager", optimizer="none", kernel_policy="cpu")
    assert not any(op.type == "native_dropout.default" for op in cpu.programs[0].ops)
    # the CPU mask is fp32 (4 B/elem), the CUDA one bool: CUDA keeps less after the forward
    assert step.net_after_forward < cpu.net_after_forward


def test_cuda_policy_autocast_fp32_ops():
    # GPT-2 under bf16 autocast: CUDA autocast runs pow (in gelu_new) in fp32 (its fp32 list);
    # CPU autocast keeps it in bf16.
    def dtypes(policy, op_prefix):
        step = trace_hf_step(
            TINY["gpt2"], 2, 64, attn="eager", dtype="bf16-autocast", optimizer="none", kernel_policy=policy
        )
        fwd = step.programs[0]
        return {
            fwd.tensors[op.outputs[0]].dtype for op in fwd.ops if op.type.startswith(op_prefix) and op.outputs
        }

    assert dtypes("cuda", "pow.") == {"float32"}
    assert dtypes("cpu", "pow.") == {"bfloat16"}


def test_cuda_policy_restores_torch():
    import torch.nn.functional as F

    from pipemem.traced import kernel_policy

    before = (F.softmax, F.dropout, F.scaled_dot_product_attention, torch.pow, "pow" in vars(torch.Tensor))
    with kernel_policy.context("cuda"):
        assert F.dropout is not before[1]
    assert (
        F.softmax,
        F.dropout,
        F.scaled_dot_product_attention,
        torch.pow,
        "pow" in vars(torch.Tensor),
    ) == before
