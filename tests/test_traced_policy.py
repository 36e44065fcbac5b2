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


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_grouped_mm_of_fp32_operands_traces_under_both_policies(policy):
    """torch's meta function for _grouped_mm wants bf16 (its CUDA fast path); the CPU kernel and
    CUDA's per-group fallback take fp32. Inside a traced step fp32 operands pass with an fp32
    output, and autograd saves both operands and the offsets; outside it torch's own check is
    back (the meta function still refuses fp32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipemem.traced import kernel_policy

    def grouped(rows):
        a = torch.empty(rows, 16, requires_grad=True)
        w = torch.empty(4, 16, 8, requires_grad=True)
        return torch._grouped_mm(a, w, offs=torch.tensor([2, 5, 8, rows], dtype=torch.int32))

    with FakeTensorMode(), kernel_policy.context(policy):
        y = grouped(10)
        assert y.dtype == torch.float32 and tuple(y.shape) == (10, 8)
        assert y.grad_fn.name() == "GroupedMmBackward0"
        assert y.grad_fn._saved_self.dtype == y.grad_fn._saved_mat2.dtype == torch.float32
    with FakeTensorMode(), pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        grouped(13)


def test_traced_moe_runs_its_grouped_mm_experts_in_fp32():
    """HF's MoE experts (grouped_mm) with fp32 weights: the trace runs them in fp32 (it used to
    refuse), their parameters are fp32 and the GEMMs' saved inputs are fp32 [tokens x top-k, h]."""
    from pipemem import estimate

    cfg = dict(TINY["mixtral"])
    est = estimate(cfg, mode="traced", seq_len=64, micro_batch=1, dtype="fp32", step="first")
    pure = estimate(
        cfg, mode="traced", seq_len=64, micro_batch=1, dtype="bf16", master_weights=False, step="first"
    )
    assert est.ranks[0].static.params == 2 * pure.ranks[0].static.params
    step = trace_hf_step(cfg, 1, 64, dtype="fp32", kernel_policy="cuda", optimizer="none")
    gmm = [op for op in step.programs[0].ops if op.type == "_grouped_mm.default"]
    assert len(gmm) == 2 * cfg["num_hidden_layers"]
    assert {step.programs[0].tensors[op.outputs[0]].dtype for op in gmm} == {"float32"}
