"""bench/validate_published.py: published-run records -> pipemem plans, checked field by field.

The records are seven of bench/data/published_runs.jsonl, the file the bench script reads.
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

IDS = (
    "torchtitan-T1-FSDP",
    "megatron-vuiseng9-gpt2xl-1gpu",
    "megatron-fgo-qwen3-30b-a3b-pp1vpp1-seq8192-full",
    "paddle-pr62865-1F1B-rank0",
    "llmc-pr309-gpt2-124M-b32-z0",
    "torchtitan-T1-FSDP_torch.compile_Float8",
    "colossal-lightning-gpt2xl-ddp-amp",
)
ALL = {r["id"]: r for r in V.load_records()}
RECORDS = {i: ALL[i] for i in IDS}


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
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    ) == (m["layers"], m["hidden"], m["heads"], m["kv_heads"], m["ffn"], m["vocab"])
    # measured: reserved, GiB, max over GPUs
    assert t["metric"] == "reserved" and t["measured_bytes"] == 82.4 * 2**30 and t["rank"] is None


def test_megatron_single_gpu_record():
    rec = RECORDS["megatron-vuiseng9-gpt2xl-1gpu"]
    t = V.translate(rec)
    plan, cfg = t["plan"], t["config"]
    assert plan["convention"] == "megatron"
    assert (plan["dp"], plan["tp"], plan["pp"]) == (1, 1, 1)  # world 1
    assert plan["seq_len"] == 1024 and plan["micro_batch"] == 1
    assert plan["dtype"] == "bf16" and plan["optimizer"] == "adam"  # "Adam (non-distributed)"
    assert not plan.get("dist_opt")
    assert plan["recompute"] == "none"  # not stated: Megatron default
    assert cfg["model_type"] == "gpt2" and (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["n_inner"]) == (
        48,
        1600,
        25,
        6400,
    )
    assert cfg["vocab_size"] == 50257  # "GPT-2 BPE"
    assert t["metric"] == "nvidia-smi" and t["measured_bytes"] == 33321 * 2**20


def test_megatron_moe_record_without_world_size_is_skipped_with_its_plan():
    rec = RECORDS["megatron-fgo-qwen3-30b-a3b-pp1vpp1-seq8192-full"]
    with pytest.raises(V.Skip, match="world size") as exc:
        V.translate(rec)
    cfg, plan = exc.value.partial
    assert plan["ep"] == 8 and plan["seq_len"] == 8192 and plan["recompute"] == "full"
    assert plan["dist_opt"] is True  # "distributed optimizer presumably"
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 128 and cfg["num_experts_per_tok"] == 8
    assert cfg["moe_intermediate_size"] == 768 and cfg["head_dim"] == 128


def test_paddle_pipeline_record_compares_its_own_stage():
    rec = RECORDS["paddle-pr62865-1F1B-rank0"]
    t = V.translate(rec)
    plan = t["plan"]
    assert plan["convention"] == "paddle"
    assert (plan["pp"], plan["dp"], plan["tp"]) == (4, 1, 1) and plan["micro_batch"] == 1
    # unstated in the record, taken from the sibling PR #63402 script it cites
    assert (plan["seq_len"], plan["dtype"], plan["microbatches"], plan["flash_attn"]) == (
        2048,
        "fp32",
        8,
        False,
    )
    assert t["rank"] == 0  # "card 0 = PP stage 0"
    assert t["metric"] == "allocated" and t["measured_bytes"] == 12605.69 * 2**20


def test_inexpressible_records_are_skipped_with_reason():
    with pytest.raises(V.Skip, match="llm.c"):
        V.translate(RECORDS["llmc-pr309-gpt2-124M-b32-z0"])


def test_modern_features_are_read_from_the_record():
    # torchtitan's 2024 benchmark: per-block compile (no loss compile then) + torchao Float8
    plan = V.translate(RECORDS["torchtitan-T1-FSDP_torch.compile_Float8"])["plan"]
    assert plan["compile"] == "layers" and plan["fp8"] == "tensorwise"
    assert plan["recompute"] == "selective" and plan["convention"] == "torchtitan"
    tt = {
        "id": "x",
        "framework": "torchtune full_finetune_single_device",
        "torch_compile": True,
        "options": {"compile": True, "chunked_ce": True, "ac": True, "opt_in_bwd": True, "offload": True},
    }
    feats, notes = V.modern_features(tt, "hf")
    assert feats == {
        "compile": "all",
        "loss": "chunked",
        "optimizer_in_backward": True,
        "activation_offload": "all",
    }
    assert notes


def test_units_and_metrics():
    assert V.unit_bytes({"unit": "GB (1e9 bytes)"}, "litgpt")[0] == 1e9
    assert V.unit_bytes({"unit": "MB (MiB: /1024**2)"}, "Lightning")[0] == 2**20
    assert V.unit_bytes({"unit": "GiB"}, "torchtitan")[0] == 2**30
    assert (
        V.metric_of({"metric": "Peak Memory Active (torch.cuda memory_stats active_bytes peak)"}) == "active"
    )
    assert V.metric_of({"metric": "torch.cuda.max_memory_allocated() at on_fit_end"}) == "allocated"
    hedged = "'Memory (MB)' column (presumably Megatron report_memory max allocated)"
    assert V.metric_of({"metric": hedged}) == "unknown"


def test_records_file_is_well_formed():
    # one object a line, unique ids, each naming its source, the quote, and a value with its unit and metric
    lines = (ROOT / "bench" / "data" / "published_runs.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    assert len(records) == len(ALL) == len(lines)
    for r in records:
        assert r["source"] and r["quote"] and isinstance(r["missing"], list), r["id"]
        m = r["measured"]
        assert m["value"] > 0 and m["unit"] and m["metric"], r["id"]


def test_bench_script_runs_on_a_subset():
    # the script's default records are the project's own file (nothing outside the checkout)
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "validate_published.py"), "--json", "--ids", ",".join(IDS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert elapsed < 20
    result = json.loads(out.stdout)
    rows = {r["id"]: r for r in result["rows"]}
    assert set(rows) == set(RECORDS)  # nothing dropped silently
    assert rows["paddle-pr62865-1F1B-rank0"]["status"] == "compared"
    assert rows["paddle-pr62865-1F1B-rank0"]["where"] == "pp rank 0"
    # measured as reserved: compared on the reserved estimate, which holds at least the allocated bytes
    t1 = rows["torchtitan-T1-FSDP"]
    assert t1["status"] == "compared" and t1["estimate_metric"] == "reserved"
    assert t1["estimated_bytes"] >= t1["allocated_bytes"]
    assert t1["rel_error"] == pytest.approx(
        (t1["estimated_bytes"] - t1["measured_bytes"]) / t1["measured_bytes"]
    )
    # Paddle's max reserved beside its max allocated: recorded, and reserved said to be not modelled
    p0 = rows["paddle-pr62865-1F1B-rank0"]
    assert p0["reserved_measured_bytes"] > p0["measured_bytes"] and "reserved is not modelled" in p0["note"]
    # nvidia-smi: compared with the device peak (reserved + outside the allocator), two-sided
    smi = rows["megatron-vuiseng9-gpt2xl-1gpu"]
    assert smi["status"] == "compared" and smi["estimate_metric"] == "device"
    assert smi["estimated_bytes"] == smi["device_estimated_bytes"] > smi["allocated_bytes"]
    assert smi["tolerance"] == V.TWO_SIDED_TOLERANCE["device"]
    assert smi["within_tolerance"] == (abs(smi["rel_error"]) <= smi["tolerance"])
    assert t1["tolerance"] == V.TWO_SIDED_TOLERANCE["reserved"]
    assert (
        rows["llmc-pr309-gpt2-124M-b32-z0"]["status"] == "skipped"
        and rows["llmc-pr309-gpt2-124M-b32-z0"]["note"]
    )
    r = rows["colossal-lightning-gpt2xl-ddp-amp"]
    assert r["status"] == "compared"
    assert r["rel_error"] == pytest.approx((r["estimated_bytes"] - r["measured_bytes"]) / r["measured_bytes"])
    # two allocated (Paddle, ColossalAI), two reserved (the torchtitan rows) and one device peak
    # (nvidia-smi); the medians apart
    assert result["summary"]["by_status"]["compared"] == 5
    assert result["summary"]["reserved_compared"] == 2
    assert result["summary"]["device_compared"] == 1
    assert result["summary"]["two_sided_rows"] == 3


def test_paddlenlp_records_take_paddlenlps_kernel_defaults():
    # the record's framework names PaddleNLP's auto-parallel script and states none of the kernel
    # switches: they are PaddleNLP's defaults, read by the same code as --from-paddlenlp
    from pipemem.configs.paddlenlp import default_switches

    t = V.translate(RECORDS["paddle-pr62865-1F1B-rank0"])
    assert t["plan"]["convention"] == "paddle"
    assert t["plan"]["extra"] == default_switches(auto_parallel=True)
    assert t["plan"]["extra"]["fused_norm"] is False and t["plan"]["extra"]["full_vocab_loss"] is True
    assert any("PaddleNLP's defaults" in n for n in t["notes"])


TORCHTUNE = {
    "id": "torchtune-x",
    "model": {
        "name": "Llama 3.2 3B",
        "layers": 28,
        "hidden": 3072,
        "heads": 24,
        "kv_heads": 8,
        "ffn": 8192,
        "vocab": 128256,
        "tied_embeddings": True,
    },
    "seq_len": 4096,
    "micro_batch": 2,
    "dtype": "pure bf16 (no fp32 master)",
    "framework": "torchtune full_finetune_single_device",
    "optimizer": "AdamW",
    "flash_attention": "yes (SDPA)",
    "parallelism": {"world": 1},
    "recompute": "none",
    "measured": {"value": 60.0, "unit": "GiB", "metric": "Peak Memory Active"},
    "completeness": "medium",
}


@pytest.mark.parametrize(
    "source, legacy",
    [
        ("torchtune README (added in commit 1814feb17, PR #2003, 2024-11-18)", True),
        ("torchtune README (2025-02-01)", False),
        ("torchtune README", False),
    ],
)
def test_torchtune_records_use_torchtunes_modules_of_their_date(source, legacy):
    t = V.translate(dict(TORCHTUNE, source=source))
    assert t["plan"]["convention"] == "torchtune"
    assert ((t["plan"].get("extra") or {}).get("norm_weight_first") is False) == legacy
    # the legacy RMSNorm (cast, then scale) keeps the bf16 normalised tensor, the built-in one the fp32
    est = V.evaluate(dict(TORCHTUNE, source=source))
    other = V.evaluate(dict(TORCHTUNE, source="x (2025-02-01)" if legacy else "x (2024-01-01)"))
    assert (est["estimated_bytes"] < other["estimated_bytes"]) == legacy


def test_committed_table_is_what_the_records_give_now():
    # docs/published_runs.md is generated (its first lines name the command); the estimate column
    # and the status are template mode's, which this re-runs (~15 s): a change to the estimator
    # that moves a published row shows here until the table is regenerated
    import re

    table = (ROOT / "docs" / "published_runs.md").read_text(encoding="utf-8")
    committed = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 10 and cells[0] in ALL:
            committed[cells[0]] = (cells[5], cells[8])
    assert set(committed) == set(ALL)
    result = V.run(list(ALL.values()), None, False, False)
    gib = lambda b: "" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731 -- the table's format
    now = {r["id"]: (gib(r["estimated_bytes"]), r["status"]) for r in result["rows"]}
    drift = {i: (committed[i], now[i]) for i in ALL if committed[i] != now[i]}
    assert not drift, f"regenerate docs/published_runs.md ({re.sub(' +', ' ', V.COMMAND)}): {drift}"


def test_rows_on_a_per_record_choice_show_the_framework_default():
    # torchtune's RMSNorm by date: the legacy record's estimate under the framework's default is
    # the estimate of the same record dated after the change (no choice made there)
    legacy = V.evaluate(dict(TORCHTUNE, source="x (2024-01-01)"))
    current = V.evaluate(dict(TORCHTUNE, source="x (2025-02-01)"))
    assert legacy["choices"] == ["torchtune RMSNorm by the record's date"]
    assert not current.get("choices")
    assert legacy["default_bytes"] == current["estimated_bytes"] != legacy["estimated_bytes"]
    assert legacy["default_rel_error"] == pytest.approx(
        (legacy["default_bytes"] - legacy["measured_bytes"]) / legacy["measured_bytes"]
    )
    # Lightning + DeepSpeed: the benchmark's loss, FusedAdam and Lightning's bucket are choices;
    # the default plan drops exactly those fields
    t = V.translate(ALL["colossal-lightning-gpt2xl-deepspeed-zero3"])
    d = V.default_plan(t["plan"], t["choices"])
    assert t["plan"]["loss"] == "shifted" and "loss" not in d
    assert t["plan"]["optimizer_impl"] == "fused" and "optimizer_impl" not in d
    assert "reduce_bucket_size" in t["plan"]["extra"] and "reduce_bucket_size" not in (d.get("extra") or {})
    assert {k: v for k, v in d.items() if k not in ("loss", "optimizer_impl", "extra")} == {
        k: v for k, v in t["plan"].items() if k not in ("loss", "optimizer_impl", "extra")
    }
    # a record whose plan rests on no choice has none and no default column
    assert not V.evaluate(ALL["megatron-vuiseng9-gpt2xl-1gpu"]).get("choices")


def test_two_sided_rows_state_what_is_compared_and_their_tolerance():
    # measured as reserved or by nvidia-smi, with reserved modelled: both sides checked; as reserved
    # where reserved is not modelled: a gap, one side only (the note says so)
    result = V.run(
        [ALL[i] for i in ("torchtitan-T1-FSDP", "megatron-vuiseng9-gpt2xl-1gpu")]
        + [r for r in ALL.values() if r["id"].startswith("torchtitan-nvfp4doc")]
    )
    rows = {r["id"]: r for r in result["rows"]}
    for r in rows.values():
        if r["estimate_metric"] in ("reserved", "device"):
            assert r["tolerance"] == V.TWO_SIDED_TOLERANCE[r["estimate_metric"]]
            assert r["within_tolerance"] == (abs(r["rel_error"]) <= r["tolerance"])
            assert ("BEYOND" in r["note"]) != r["within_tolerance"]
    b200 = next(r for i, r in rows.items() if i.startswith("torchtitan-nvfp4doc"))
    assert b200["status"] == "gap" and "only one side" in b200["note"] and "tolerance" not in b200
    text = V.markdown(result)
    assert "device peak (reserved + outside the allocator) against nvidia-smi" in text
    assert "two-sided rows" in text


MSSWIFT_MOONLIGHT = "msswift-moonlight-16b-a3b-pp2ep4-8gpu"


def test_megatron_swift_deepseek_v3_record_gives_its_own_config_and_uneven_pipeline():
    # Moonlight (DeepseekV3ForCausalLM) under ms-swift's Megatron-SWIFT: the model is the record's own
    # config.json (latent attention, shared experts, a dense first layer), the plan its script's flags
    rec = ALL[MSSWIFT_MOONLIGHT]
    t = V.translate(rec)
    cfg, plan = t["config"], t["plan"]
    assert cfg == rec["model"]["hf_config"] and cfg is not rec["model"]["hf_config"]
    assert (
        cfg["model_type"] == "deepseek_v3"
        and cfg["q_lora_rank"] is None
        and cfg["first_k_dense_replace"] == 1
    )
    par = rec["parallelism"]
    assert (plan["dp"], plan["pp"], plan["ep"]) == (par["dp"], par["pp"], par["ep"])
    assert plan["pp_layout"] == tuple(par["pp_layout"]) and sum(plan["pp_layout"]) == cfg["num_hidden_layers"]
    assert plan["convention"] == "megatron" and plan["dist_opt"] is True
    assert plan["loss"] == "fused" and plan["global_batch"] == rec["global_batch"]
    assert plan["recompute"] == "full" and plan["seq_len"] == rec["seq_len"]
    # the script's comment says neither the metric nor the rank: a one-sided (gap) row
    assert t["metric"] == "unknown" and t["rank"] is None
    assert t["measured_bytes"] == rec["measured"]["value"] * 2**30
    row = V.evaluate(rec)
    assert row["status"] == "gap" and row["estimated_bytes"] < row["measured_bytes"]


def test_record_config_and_layout_errors_are_skips():
    rec = ALL[MSSWIFT_MOONLIGHT]
    bad_cfg = dict(rec, model=dict(rec["model"], hf_config={"hidden_size": 2048}))
    with pytest.raises(V.Skip, match="model_type"):
        V.translate(bad_cfg)
    bad_layout = dict(rec, parallelism=dict(rec["parallelism"], pp_layout=[27]))
    with pytest.raises(V.Skip, match="pp_layout"):
        V.translate(bad_layout)
    # without its layout the 27 layers do not split over 2 stages: the layout is what makes the plan
    from pipemem.errors import UserError
    from pipemem.estimate import estimate

    even = dict(rec, parallelism={k: v for k, v in rec["parallelism"].items() if k != "pp_layout"})
    t = V.translate(even)
    assert "pp_layout" not in t["plan"]
    with pytest.raises(UserError):
        estimate(t["config"], **t["plan"])


def test_megatron_swift_folded_expert_parallel_record_reads_etp_and_capacity():
    # Qwen3-30B-A3B with ep 4 carved from tp 4 (dp 1): the record's expert-tensor-parallel size and
    # capacity factor reach the plan, which pipemem accepts as Megatron's MoE parallel folding
    rec = ALL["msswift-qwen3-30b-a3b-instruct-pp2tp4ep4-8gpu"]
    t = V.translate(rec)
    plan, par = t["plan"], rec["parallelism"]
    assert (plan["tp"], plan["ep"], plan["etp"], plan["dp"]) == (par["tp"], par["ep"], par["etp"], par["dp"])
    assert plan["extra"]["moe_capacity_factor"] == rec["options"]["moe_expert_capacity_factor"]
    assert "etp1" in V.plan_summary(plan) and "layout 25/23" in V.plan_summary(plan)
    row = V.evaluate(rec)
    assert row["status"] == "gap" and row["estimated_bytes"] < row["measured_bytes"]
    # without its etp the plan is the default (etp = tp = 4), which ep 4 cannot fold into dp 1
    default = dict(rec, parallelism={k: v for k, v in par.items() if k != "etp"})
    assert "etp" not in V.translate(default)["plan"]
    assert V.evaluate(default)["status"] == "skipped"


def test_summary_counts_the_gap_rows_whose_metric_is_not_stated():
    ids = {"msswift-moonlight-16b-a3b-pp2ep4-8gpu", "msswift-qwen3-30b-a3b-instruct-pp2tp4ep4-8gpu"}
    result = V.run(list(ALL.values()), ids, False, False)
    rows = result["rows"]
    assert {r["metric"] for r in rows} == {"unknown"} and {r["status"] for r in rows} == {"gap"}
    below = sum(r["estimated_bytes"] <= r["measured_bytes"] for r in rows)
    line = next(x for x in V.markdown(result).splitlines() if "metric not stated" in x and x.startswith("*"))
    assert f"in {below} of {len(rows)}" in line
