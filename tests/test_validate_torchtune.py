"""`pipemem validate torchtune` in CI: torchtune's own distributed full fine-tune step (its model,
`shard_model` and FSDP2, traced on fake tensors) against `pipemem.estimate` for the CI cases; the
full set runs as `pipemem validate torchtune --full`."""

import json
import subprocess
import sys

import pytest

from pipemem.validation import TARGETS
from pipemem.validation.torchtune import CI_CASES, TOLERANCE, all_cases, available, hf_config, plan_kwargs

needs_torchtune = pytest.mark.skipif(available() is not None, reason="torchtune 0.6.1 not importable")


def test_target_registered_and_cases_are_valid_plans():
    import pipemem

    assert "torchtune" in TARGETS
    names = [c["name"] for c in all_cases()]
    assert len(names) == len(set(names)) and set(CI_CASES) <= set(names)
    for case in all_cases():  # every case is a plan pipemem accepts, through the one path
        est = pipemem.estimate(hf_config(case), **plan_kwargs(case))
        assert est.ranks[0].peak_allocated_bytes > 0


def test_every_case_key_the_trace_reads_reaches_the_plan_through_the_reader():
    """The estimate's plan is the case's recipe config read by `pipemem.read_config`: each key
    `torchtune_trace` acts on (world, chunks, checkpointing, custom units, resharding) shows."""
    for case in all_cases():
        plan = plan_kwargs(case)
        extra = plan.get("extra", {})
        assert (plan["convention"], plan["fsdp"], plan["dp"]) == ("torchtune", True, case["world"])
        assert (plan["seq_len"], plan["micro_batch"], plan["dtype"]) == (
            case["seq_len"],
            case["micro_batch"],
            "bf16",
        )
        assert plan.get("loss_chunks", 1) == case.get("loss_chunks", 1)
        assert (plan.get("recompute") == "full") == bool(case.get("activation_checkpointing"))
        assert extra.get("custom_sharded_layers", []) == sorted(case.get("custom_sharded_layers", []))
        assert extra.get("fsdp_reshard_after_forward", True) == case.get("reshard_after_forward", True)
        assert plan["optimizer_impl"] == "fused"  # the trace's torch.optim.AdamW(fused=True)


@needs_torchtune
@pytest.mark.slow
def test_validate_torchtune_ci_cases_agree():
    out = subprocess.run(
        [sys.executable, "-m", "pipemem", "validate", "torchtune", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    assert {r["case"] for r in d["cases"]} == set(CI_CASES)
    assert (d["truth"], d["tolerance"], d["passed"]) == ("traced", TOLERANCE, True)
    for r in d["cases"]:
        assert r["measured_bytes"] > 0 and abs(r["rel_error"]) <= TOLERANCE, r


@needs_torchtune
@pytest.mark.slow
def test_root_unit_is_what_torchtune_holds():
    """Without custom_sharded_layers, torchtune leaves the embedding, final norm and output layer to
    FSDP2's root unit. Measured on torchtune's own step: the root case holds more than the
    custom_sharded_layers case while the backward runs (the unit gathered again, its grads unreduced
    until the end), and the estimate follows each within the tolerance."""
    from pipemem.validation.torchtune import compare_case, trace_case

    by = {c["name"]: c for c in all_cases()}
    rows = {}
    for name in ("fsdp2-root-chunked", "fsdp2-custom-chunked"):
        trace = trace_case(by[name], 600)
        rows[name] = (trace, compare_case(by[name], trace))
    (root_trace, root_row), (custom_trace, custom_row) = (
        rows["fsdp2-root-chunked"],
        rows["fsdp2-custom-chunked"],
    )
    backward = lambda t: next(p["peak_bytes"] for p in t["phases"] if p["name"] == "backward")  # noqa: E731
    assert backward(root_trace) > backward(custom_trace)
    assert root_row.estimated_bytes > custom_row.estimated_bytes
    for row in (root_row, custom_row):
        assert abs(row.rel_error) <= TOLERANCE, row


def test_lora_cases_are_the_8b_lora_recipe_as_the_reader_puts_it():
    """The LoRA cases trace lora_finetune_distributed with recipes/configs/llama3_1/8B_lora.yaml's
    adapters (tests/data/torchtune/8B_lora.yaml): the estimate they are held to has the LoRA
    switches --from-torchtune reads from that file."""
    from pathlib import Path

    from pipemem.configs.torchtune import read

    tool = read(str(Path(__file__).parent / "data" / "torchtune" / "8B_lora.yaml"))
    lora = [c for c in all_cases() if c.get("lora")]
    assert lora
    for case in lora:
        kw = plan_kwargs(case)
        for key in ("lora_rank", "lora_targets", "fsdp"):
            assert kw[key] == tool.plan[key], key
