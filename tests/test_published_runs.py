"""bench/validate_published.py: published-run records -> pipemem plans, checked field by field.

The records below are copies of seven lines of shared/validation/published_public.jsonl (their
`quote`, `source` and `arch_source` text dropped), so the test runs without the shared folder.
Every expectation is read off the record's own fields (parallelism, batch, precision text,
framework), never from pipemem's output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
import pipemem.validation.published as V  # noqa: E402

RECORDS_JSONL = r"""{"id": "torchtitan-T1-FSDP", "model": {"name": "Llama 3.1 8B (torchtitan flavor 8B)", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "tied_embeddings": false, "norm": "RMSNorm", "act": "SwiGLU"}, "seq_len": 8192, "micro_batch": 2, "global_batch": 16, "grad_accum": 1, "dtype": "bf16", "framework": "torchtitan (FSDP2 / DTensor)", "mixed_precision": "bf16 compute; FSDP2 MixedPrecisionPolicy param=bf16, reduce=fp32 (config defaults mixed_precision_param=bfloat16, mixed_precision_reduce=float32); sharded fp32 master params", "optimizer": "AdamW (fp32 states, sharded by FSDP)", "flash_attention": "yes (F.scaled_dot_product_attention, is_causal=True)", "parallelism": {"world": 8, "dp_shard_fsdp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_equiv": "FSDP2 full shard (ZeRO-3-like)"}, "recompute": "selective AC (benchmark text: 'Selective activation checkpointing'; default config selective_ac_option='op')", "torch_compile": false, "schedule": "n/a", "hardware": "H100 SXM-class, 96GB HBM2e, 500W limit (Grand Teton), 8 GPUs/host", "measured": {"value": 82.4, "unit": "GiB", "metric": "torch.cuda.memory_stats()['reserved_bytes.all.peak'] (torchtitan logs max_reserved GiB); footnote: 'Different PP ranks can have different peak memory usages. We take the maximum across all GPUs.'", "rank": "max over all GPUs"}, "source_estimate": null, "completeness": "high", "missing": ["seq_len not restated in benchmark file (taken from train_configs/llama3_8b.toml @9dec370: seq_len = 8192)"]}
{"id": "megatron-vuiseng9-gpt2xl-1gpu", "model": {"name": "GPT2-XL (Megatron GPT)", "layers": 48, "hidden": 1600, "heads": 25, "ffn": 6400, "vocab": "GPT-2 BPE (padded by Megatron)", "params_B": 1.56}, "seq_len": 1024, "micro_batch": 1, "global_batch": 1, "grad_accum": 1, "dtype": "bf16 likely (theoretical uses 18 B/param: 26699.47 MB / 1.5554B params)", "framework": "Megatron-LM main f4fa7d6b era, NGC pytorch:25.06", "optimizer": "Adam (non-distributed)", "flash_attention": "not stated", "parallelism": {"world": 1}, "recompute": "not stated", "schedule": "n/a", "hardware": "H100 80GB HBM3", "measured": {"value": 33321, "unit": "MiB", "metric": "nvidia-smi used memory (gpustat line '33321 / 81559 MB')", "rank": "GPU 0"}, "source_estimate": {"value": 29485.06, "unit": "MB", "what": "Megatron 'Theoretical memory footprints: weight and optimizer=26699.47 MB, activation=2785.59 MB, total=29485.06 MB' (activation 'without SP')"}, "completeness": "low", "missing": ["nvidia-smi includes CUDA context + allocator cache", "exact launch args (Makefile target gpt2-xl-1gpu-bs1)"]}
{"id": "megatron-fgo-qwen3-30b-a3b-pp1vpp1-seq8192-full", "model": {"name": "Qwen3-30B-A3B ('Same as Qwen-30B model structure')", "layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "ffn_dense": 6144, "moe_ffn": 768, "experts": 128, "topk": 8, "vocab": "151936 (standard Qwen3; not restated)"}, "seq_len": 8192, "micro_batch": 1, "global_batch": 256, "grad_accum": "not derivable (world size not stated)", "dtype": "bf16 presumably (not restated for this table)", "framework": "Megatron-LM mcore (2025-10)", "optimizer": "Adam (distributed optimizer presumably)", "flash_attention": "TE fused attention presumably", "parallelism": {"tp": 1, "pp": 1, "vpp": 1, "ep": 8, "cp": 1, "world": "not stated"}, "recompute": "full", "offload": "none", "schedule": "1F1B", "hardware": "H100 (80GB)", "measured": {"value": 59566, "unit": "MB", "metric": "'Memory (MB)' column (presumably Megatron report_memory max allocated; not stated)", "rank": "not stated"}, "source_estimate": null, "completeness": "medium", "missing": ["world size / DP", "metric definition", "dtype"]}
{"id": "paddle-pr62865-1F1B-rank0", "model": {"name": "PaddleNLP Llama2 (facebook/llama-7b dims, hidden_layer=4)", "layers": 4, "hidden": 4096, "heads": 32, "kv_heads": 32, "ffn": 11008, "vocab": 32000}, "seq_len": "not stated (sibling PR #63402 script uses --max_seq_length 2048)", "micro_batch": 1, "global_batch": "not stated", "grad_accum": "not stated (#63402 script: 8)", "dtype": "not stated (#63402 script: --fp16 0 ... i.e. possibly fp32)", "framework": "Paddle static-graph auto-parallel (PaddleNLP run_pretrain_auto_static.py)", "optimizer": "AdamW (PaddleNLP default)", "flash_attention": "not stated (#63402 script: --use_flash_attention 0)", "parallelism": {"world": 4, "pp": 4, "dp": 1, "tp": 1}, "recompute": "not stated", "schedule": "1F1B", "hardware": "4x RTX 3090 24GB", "measured": {"value": 12605.69, "unit": "MB", "metric": "max_memory_allocated (Paddle)", "rank": "card 0 = PP stage 0", "also": {"max_memory_reserved": 13405.76}}, "source_estimate": null, "completeness": "low", "missing": ["seq_len", "precision", "global batch / #microbatches", "exact model dims"]}
{"id": "llmc-pr309-gpt2-124M-b32-z0", "model": {"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072, "vocab": "50257 (llm.c pads to 50304)", "name": "gpt2-124M"}, "seq_len": "1024 (llm.c default T)", "micro_batch": 32, "global_batch": 128, "grad_accum": 1, "dtype": "bf16 activations/params + fp32 master copy of params (log: 'allocated 118 MiB for master copy of params')", "framework": "llm.c train_gpt2cu (CUDA/C, static buffers, no autograd)", "optimizer": "AdamW (fp32 m, v)", "flash_attention": "cuDNN attention (USE_CUDNN=1)", "parallelism": {"world": 4, "dp": 4, "zero": 0}, "recompute": "llm.c default at the time (not stated)", "schedule": "n/a", "hardware": "4 GPUs (karpathy's box; type not stated, A100/H100 class)", "measured": {"value": 16661, "unit": "MiB", "metric": "'MiB/GPU' printed by llm.c (device memory in use)", "rank": "per GPU"}, "source_estimate": null, "completeness": "medium", "missing": ["GPU type", "llm.c memory layout differs from PyTorch (static activation buffers)"], "breakdown_printed": null}
{"id": "torchtitan-T1-FSDP_torch.compile_Float8", "model": {"name": "Llama 3.1 8B (torchtitan flavor 8B)", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "tied_embeddings": false, "norm": "RMSNorm", "act": "SwiGLU"}, "seq_len": 8192, "micro_batch": 2, "global_batch": 16, "grad_accum": 1, "dtype": "bf16 + Float8 linears (torchao, dynamic scaling)", "framework": "torchtitan (FSDP2 / DTensor)", "mixed_precision": "bf16 compute; FSDP2 MixedPrecisionPolicy param=bf16, reduce=fp32 (config defaults mixed_precision_param=bfloat16, mixed_precision_reduce=float32); sharded fp32 master params", "optimizer": "AdamW (fp32 states, sharded by FSDP)", "flash_attention": "yes (F.scaled_dot_product_attention, is_causal=True)", "parallelism": {"world": 8, "dp_shard_fsdp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_equiv": "FSDP2 full shard (ZeRO-3-like)"}, "recompute": "selective AC (benchmark text: 'Selective activation checkpointing'; default config selective_ac_option='op')", "torch_compile": true, "schedule": "n/a", "hardware": "H100 SXM-class, 96GB HBM2e, 500W limit (Grand Teton), 8 GPUs/host", "measured": {"value": 76.8, "unit": "GiB", "metric": "torch.cuda.memory_stats()['reserved_bytes.all.peak'] (torchtitan logs max_reserved GiB); footnote: 'Different PP ranks can have different peak memory usages. We take the maximum across all GPUs.'", "rank": "max over all GPUs"}, "source_estimate": null, "completeness": "high", "missing": ["seq_len not restated in benchmark file (taken from train_configs/llama3_8b.toml @9dec370: seq_len = 8192)"]}
{"id": "colossal-lightning-gpt2xl-ddp-amp", "model": {"name": "GPT2-XL (HF GPT2LMHeadModel)", "layers": 48, "hidden": 1600, "heads": 25, "kv_heads": 25, "ffn": 6400, "vocab": 50257, "tied_embeddings": true}, "seq_len": 1024, "micro_batch": 6, "global_batch": 24, "grad_accum": 1, "dtype": "fp16 AMP (PyTorch Lightning precision=16; fp32 weights + fp32 Adam)", "framework": "PyTorch Lightning DDP (static_graph=True)", "optimizer": "torch.optim.Adam", "flash_attention": "no (HF GPT2 eager attention, 2022)", "parallelism": {"world": 4, "dp": 4, "zero": 0}, "recompute": "HF gradient_checkpointing_enable() (default checkpoint=True unless --no_activation_ckpt)", "schedule": "n/a", "hardware": "4x A100 40GB", "measured": {"value": 37905.422, "unit": "MB (MiB: /1024**2)", "metric": "torch.cuda.max_memory_allocated() at on_fit_end", "rank": "rank 0"}, "source_estimate": null, "completeness": "high", "missing": ["exact library versions"]}
"""
RECORDS = {r["id"]: r for r in map(json.loads, RECORDS_JSONL.strip().splitlines())}


def test_torchtitan_fsdp_record_gives_fsdp_plan():
    rec = RECORDS["torchtitan-T1-FSDP"]
    t = V.translate(rec)
    plan, cfg, par, m = t["plan"], t["config"], rec["parallelism"], rec["model"]
    # parallelism: dp_shard_fsdp=8 over world 8, no tp/pp/cp
    assert plan["dp"] == par["dp_shard_fsdp"] == par["world"] == 8
    assert plan["fsdp"] is True and "zero" not in plan
    degrees = (plan["tp"], plan["pp"], plan["cp"], plan["ep"])
    assert degrees == (par["tp"], par["pp"], par["cp"], par["ep"]) == (1, 1, 1, 1)
    assert plan["seq_len"] == rec["seq_len"] == 8192 and plan["micro_batch"] == rec["micro_batch"] == 2
    # "bf16 compute ... sharded fp32 master params"; "Selective activation checkpointing"; SDPA
    assert plan["dtype"] == "bf16" and plan["master_weights"] is True
    assert plan["recompute"] == "selective" and plan["flash_attn"] is True
    assert plan["convention"] == "torchtitan" and plan["optimizer"] == "adamw"
    # model shape straight from the record (Llama: RMSNorm/SwiGLU, GQA 32/8)
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (m["layers"], m["hidden"], m["heads"], m["kv_heads"],
                                                             m["ffn"], m["vocab"])
    # measured: reserved, GiB, max over GPUs
    assert t["metric"] == "reserved" and t["measured_bytes"] == 82.4 * 2**30 and t["rank"] is None


def test_megatron_single_gpu_record():
    rec = RECORDS["megatron-vuiseng9-gpt2xl-1gpu"]
    t = V.translate(rec)
    plan, cfg = t["plan"], t["config"]
    assert plan["convention"] == "megatron"
    assert (plan["dp"], plan["tp"], plan["pp"]) == (1, 1, 1)             # world 1
    assert plan["seq_len"] == 1024 and plan["micro_batch"] == 1
    assert plan["dtype"] == "bf16" and plan["optimizer"] == "adam"      # "Adam (non-distributed)"
    assert not plan.get("dist_opt")
    assert plan["recompute"] == "none"                                  # not stated: Megatron default
    assert cfg["model_type"] == "gpt2" and (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["n_inner"]) == (
        48, 1600, 25, 6400)
    assert cfg["vocab_size"] == 50257                                   # "GPT-2 BPE"
    assert t["metric"] == "nvidia-smi" and t["measured_bytes"] == 33321 * 2**20


def test_megatron_moe_record_without_world_size_is_skipped_with_its_plan():
    rec = RECORDS["megatron-fgo-qwen3-30b-a3b-pp1vpp1-seq8192-full"]
    with pytest.raises(V.Skip, match="world size") as exc:
        V.translate(rec)
    cfg, plan = exc.value.partial
    assert plan["ep"] == 8 and plan["seq_len"] == 8192 and plan["recompute"] == "full"
    assert plan["dist_opt"] is True                                     # "distributed optimizer presumably"
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 128 and cfg["num_experts_per_tok"] == 8
    assert cfg["moe_intermediate_size"] == 768 and cfg["head_dim"] == 128


def test_paddle_pipeline_record_compares_its_own_stage():
    rec = RECORDS["paddle-pr62865-1F1B-rank0"]
    t = V.translate(rec)
    plan = t["plan"]
    assert plan["convention"] == "paddle"
    assert (plan["pp"], plan["dp"], plan["tp"]) == (4, 1, 1) and plan["micro_batch"] == 1
    # unstated in the record, taken from the sibling PR #63402 script it cites
    assert (plan["seq_len"], plan["dtype"], plan["microbatches"], plan["flash_attn"]) == (2048, "fp32", 8, False)
    assert t["rank"] == 0                                               # "card 0 = PP stage 0"
    assert t["metric"] == "allocated" and t["measured_bytes"] == 12605.69 * 2**20


def test_inexpressible_records_are_skipped_with_reason():
    with pytest.raises(V.Skip, match="llm.c"):
        V.translate(RECORDS["llmc-pr309-gpt2-124M-b32-z0"])


def test_modern_features_are_read_from_the_record():
    # torchtitan's 2024 benchmark: per-block compile (no loss compile then) + torchao Float8
    plan = V.translate(RECORDS["torchtitan-T1-FSDP_torch.compile_Float8"])["plan"]
    assert plan["compile"] == "layers" and plan["fp8"] == "tensorwise"
    assert plan["recompute"] == "selective" and plan["convention"] == "torchtitan"
    tt = {"id": "x", "framework": "torchtune full_finetune_single_device", "torch_compile": True,
          "options": {"compile": True, "chunked_ce": True, "ac": True, "opt_in_bwd": True, "offload": True}}
    feats, notes = V.modern_features(tt, "hf")
    assert feats == {"compile": "all", "loss": "chunked", "optimizer_in_backward": True, "activation_offload": "all"}
    assert notes


def test_units_and_metrics():
    assert V.unit_bytes({"unit": "GB (1e9 bytes)"}, "litgpt")[0] == 1e9
    assert V.unit_bytes({"unit": "MB (MiB: /1024**2)"}, "Lightning")[0] == 2**20
    assert V.unit_bytes({"unit": "GiB"}, "torchtitan")[0] == 2**30
    assert V.metric_of({"metric": "Peak Memory Active (torch.cuda memory_stats active_bytes peak)"}) == "active"
    assert V.metric_of({"metric": "torch.cuda.max_memory_allocated() at on_fit_end"}) == "allocated"
    hedged = "'Memory (MB)' column (presumably Megatron report_memory max allocated)"
    assert V.metric_of({"metric": hedged}) == "unknown"


def test_bench_script_runs_on_a_subset(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(RECORDS_JSONL.strip() + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "validate_published.py"), "--json",
                          "--records", str(path)], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert elapsed < 20
    result = json.loads(out.stdout)
    rows = {r["id"]: r for r in result["rows"]}
    assert set(rows) == set(RECORDS)                                    # nothing dropped silently
    assert rows["paddle-pr62865-1F1B-rank0"]["status"] == "compared"
    assert rows["paddle-pr62865-1F1B-rank0"]["where"] == "pp rank 0"
    # measured as reserved: compared on the reserved estimate, which holds at least the allocated bytes
    t1 = rows["torchtitan-T1-FSDP"]
    assert t1["status"] == "compared" and t1["estimate_metric"] == "reserved"
    assert t1["estimated_bytes"] >= t1["allocated_bytes"]
    assert t1["rel_error"] == pytest.approx((t1["estimated_bytes"] - t1["measured_bytes"]) / t1["measured_bytes"])
    # Paddle's max reserved beside its max allocated: recorded, and reserved said to be not modelled
    p0 = rows["paddle-pr62865-1F1B-rank0"]
    assert p0["reserved_measured_bytes"] > p0["measured_bytes"] and "reserved is not modelled" in p0["note"]
    assert rows["megatron-vuiseng9-gpt2xl-1gpu"]["status"] == "gap"     # nvidia-smi
    assert rows["llmc-pr309-gpt2-124M-b32-z0"]["status"] == "skipped" and rows["llmc-pr309-gpt2-124M-b32-z0"]["note"]
    r = rows["colossal-lightning-gpt2xl-ddp-amp"]
    assert r["status"] == "compared"
    assert r["rel_error"] == pytest.approx((r["estimated_bytes"] - r["measured_bytes"]) / r["measured_bytes"])
    # two allocated (Paddle, ColossalAI) and two reserved (the torchtitan rows); the medians apart
    assert result["summary"]["by_status"]["compared"] == 4
    assert result["summary"]["reserved_compared"] == 2


def test_paddlenlp_records_take_paddlenlps_kernel_defaults():
    # the record's framework names PaddleNLP's auto-parallel script and states none of the kernel
    # switches: they are PaddleNLP's defaults, read by the same code as --from-paddlenlp
    from pipemem.configs.paddlenlp import default_switches

    t = V.translate(RECORDS["paddle-pr62865-1F1B-rank0"])
    assert t["plan"]["convention"] == "paddle"
    assert t["plan"]["extra"] == default_switches(auto_parallel=True)
    assert t["plan"]["extra"]["fused_norm"] is False and t["plan"]["extra"]["full_vocab_loss"] is True
    assert any("PaddleNLP's defaults" in n for n in t["notes"])


TORCHTUNE = {"id": "torchtune-x", "model": {"name": "Llama 3.2 3B", "layers": 28, "hidden": 3072, "heads": 24,
                                             "kv_heads": 8, "ffn": 8192, "vocab": 128256, "tied_embeddings": True},
             "seq_len": 4096, "micro_batch": 2, "dtype": "pure bf16 (no fp32 master)",
             "framework": "torchtune full_finetune_single_device", "optimizer": "AdamW",
             "flash_attention": "yes (SDPA)", "parallelism": {"world": 1}, "recompute": "none",
             "measured": {"value": 60.0, "unit": "GiB", "metric": "Peak Memory Active"}, "completeness": "medium"}


@pytest.mark.parametrize("source, legacy", [
    ("torchtune README (added in commit 1814feb17, PR #2003, 2024-11-18)", True),
    ("torchtune README (2025-02-01)", False), ("torchtune README", False)])
def test_torchtune_records_use_torchtunes_modules_of_their_date(source, legacy):
    t = V.translate(dict(TORCHTUNE, source=source))
    assert t["plan"]["convention"] == "torchtune"
    assert ((t["plan"].get("extra") or {}).get("norm_weight_first") is False) == legacy
    # the legacy RMSNorm (cast, then scale) keeps the bf16 normalised tensor, the built-in one the fp32
    est = V.evaluate(dict(TORCHTUNE, source=source))
    other = V.evaluate(dict(TORCHTUNE, source="x (2025-02-01)" if legacy else "x (2024-01-01)"))
    assert (est["estimated_bytes"] < other["estimated_bytes"]) == legacy
