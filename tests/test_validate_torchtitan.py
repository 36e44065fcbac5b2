"""torchtitan 0.3's own training step, traced per rank on fake tensors with the fake process
group (`pipemem validate torchtitan`), against the torchtitan-convention estimate through
`pipemem.estimate`; and `--from-torchtitan` reading torchtitan's own launch arguments."""

import pytest

pytest.importorskip("torch")
from pipemem.validation.torchtitan_trace import available  # noqa: E402

pytestmark = pytest.mark.skipif(available() is not None, reason="torchtitan==0.3.0 not installed")


def test_fsdp2_rank_within_one_percent():
    from pipemem.validation.torchtitan import all_cases, compare_case, trace_case

    case = {c["name"]: c for c in all_cases()}["fsdp2"]
    traces = trace_case(case)
    t = traces[0]
    # the trace read torchtitan's own model (llama3 debugmodel) and recorded the second step:
    # optimizer states (AdamW: 2 x fp32 shards) and resident gradients are what it starts with
    assert t["model"] == {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "vocab_size": 2048,
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
        "hidden_act": "silu",
        "intermediate_size": 768,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 16,
    }
    # the estimate's plan is what --from-torchtitan reads from the Trainer.Config the rank ran
    plan = t["plan"]
    assert (plan["convention"], plan["fsdp"], plan["dp"], plan["tp"]) == ("torchtitan", True, 2, 1)
    assert (plan["seq_len"], plan["micro_batch"], plan["recompute"]) == (256, 2, "none")
    kinds = t["static_by_kind"]
    assert kinds["optimizer_state"] >= 2 * kinds["param"] and kinds["grad"] == kinds["param"]
    (row,) = compare_case(case, traces)
    assert abs(row.rel_error) <= 0.01, row.to_dict()


def test_deepseek_v3_mla_moe_rank_within_one_percent():
    """deepseek_v3's debugmodel cut to its first three layers (one dense, two MLA + MoE): its
    multi-head latent attention, torchtitan's MoE module (fp32 gate, grouped experts, fp32 combine)
    and the per-layer RoPE / expert buffers, against torchtitan's own step."""
    from pipemem.validation.torchtitan import all_cases, compare_case, trace_case

    case = {c["name"]: c for c in all_cases()}["dsv3-3layers-fsdp2"]
    traces = trace_case(case)
    t = traces[0]
    m = t["model"]
    # read off torchtitan's own config tree: a softmax router is HF's deepseek_v2 form
    assert m["model_type"] == "deepseek_v2" and m["num_hidden_layers"] == 3
    assert m["first_k_dense_replace"] == 1 and m["kv_lora_rank"] > 0 and m["q_lora_rank"] is None
    # the RoPE caches and the MoE's expert-bias / token-count buffers are what the estimate's
    # `other` static bytes hold
    (row,) = compare_case(case, traces)
    assert t["static_by_kind"]["buffer"] > 0
    assert abs(row.rel_error) <= 0.01, row.to_dict()


def test_from_torchtitan_launch_arguments():
    from pipemem.configs.torchtitan import read_args

    tc = read_args(
        [
            "--module",
            "llama3",
            "--config",
            "llama3_debugmodel",
            "--parallelism.data_parallel_shard_degree",
            "4",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.disable_cuda_graphs",
        ]
    )
    p = tc.plan
    assert (
        tc.model["hidden_size"] == 256
        and tc.model["num_hidden_layers"] == 6
        and tc.model["vocab_size"] == 2048
    )
    assert p["dp"] == 4 and p["tp"] == 2 and p["sp"] is True and p["fsdp"] is True
    assert p["recompute"] == "selective" and p["grads"] == "set-to-none" and p["extra"]["loss_chunks"] == 8
    # torch.compile is modelled (pipemem.features): read from torchtitan's own flag
    tc = read_args(["--module", "llama3", "--config", "llama3_debugmodel", "--compile.enable"])
    assert tc.plan["compile"] in ("layers", "all")


def test_llama4_rank_within_one_percent():
    """torchtitan 0.3 ships no llama4: 0.2.2's own step (its llama4 debugmodel: dense layers
    interleaved with MoE layers of 8 grouped-GEMM experts and a shared expert, set-to-none grads,
    one model-level RoPE buffer) from $PIPEMEM_TORCHTITAN_LLAMA4, against the estimate."""
    from pipemem.traced.torchtitan_llama4 import ENV
    from pipemem.traced.torchtitan_llama4 import available as llama4_available

    if llama4_available() is not None:
        pytest.skip(f"torchtitan 0.2.2 not found (${ENV})")
    from pipemem.validation.torchtitan import all_cases, compare_case, trace_case

    case = {c["name"]: c for c in all_cases()}["llama4-fsdp2"]
    traces = trace_case(case)
    t = traces[0]
    m = t["model"]
    assert m["model_type"] == "llama4_text" and m["torchtitan_release"] == "0.2.2"
    assert m["moe_layers"] == [1, 3, 5] and m["intermediate_size_mlp"] != m["intermediate_size"]
    # the step starts with zero_grad(set_to_none): no gradients among what it starts with
    assert "grad" not in t["static_by_kind"] and t["static_by_kind"]["buffer"] > 0
    (row,) = compare_case(case, traces)
    assert abs(row.rel_error) <= 0.01, row.to_dict()
