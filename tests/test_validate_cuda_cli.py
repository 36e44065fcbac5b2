"""`pipemem validate cuda` without a GPU: the one-line refusal, the case list, the driver on
CPU with tiny HF models, the estimate adapter, the JSON file and the table."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipemem.cli.main import main
from pipemem.validation import cuda
from pipemem.validation.cuda_cases import Case

torch = pytest.importorskip("torch")

TINY = Case(hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128, layers=2, seq_len=16, microbatches=2)


# Without a GPU ------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_gpu_one_line_and_exit_2(capsys):
    assert main(["validate", "cuda", "--configs", "small"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "no CUDA GPU" in err


def test_list_needs_no_gpu(capsys):
    assert main(["validate", "cuda", "--list", "--case", "pp2"]) == 0
    names = capsys.readouterr().out.split()
    assert names and all("pp2" in n for n in names)


def test_bad_flag_is_one_line(capsys):
    assert main(["validate", "cuda", "--configs", "huge"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# The driver on CPU --------------------------------------------------------------------------


def test_single_stage_case_runs_every_microbatch_and_the_optimizer():
    r = cuda.measure_case(replace(TINY, precision="bf16_autocast", optimizer="adamw_fused"), "cpu")
    assert r["error"] is None and len(r["ranks"]) == 1
    rank = r["ranks"][0]
    assert [a for a, _ in rank["timeline"]] == ["F0@s0", "B0@s0", "F1@s0", "B1@s0"]
    assert rank["max_held_forwards"] == 1 and rank["received_activations"] == 0
    assert rank["allocated_peak_bytes"] is None  # no device counters on CPU
    assert r["measured_bytes"] is None


def test_pipeline_ranks_receive_what_the_schedule_sends():
    case = replace(TINY, pp=2, vpp=1, schedule="1F1B", microbatches=4)
    r = cuda.measure_case(case, "cpu", isolate=False)
    assert r["error"] is None
    first, last = r["ranks"]
    assert (first["stages"], last["stages"]) == ([0], [1])
    # 1F1B on rank r of p holds min(m, p - r) microbatches; the last rank receives every activation.
    assert (first["max_held_forwards"], last["max_held_forwards"]) == (2, 1)
    assert (first["received_activations"], last["received_activations"]) == (0, 4)
    assert (first["received_grads"], last["received_grads"]) == (4, 0)


def test_received_activation_dtype_is_what_a_stage_really_sends():
    """Stage 0's real output under each precision has the dtype the receiving rank allocates."""
    from pipemem.validation.stage_emulation import hf_stage_modules

    for precision in ("bf16", "bf16_autocast", "fp32"):
        case = replace(TINY, precision=precision, pp=2, schedule="1F1B")
        cfg = cuda.build_hf_config(case)
        stage = hf_stage_modules(cfg, {0: case.stage_layers(0)}, 2, None, "cpu", cuda.param_dtype(case))[0]
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16_autocast" else torch.no_grad()
        with ctx:
            out = stage(torch.randint(0, case.vocab, (1, case.seq_len)))
        assert out.dtype == cuda.recv_dtype(case), precision
        assert tuple(out.shape) == (case.micro_batch, case.seq_len, case.hidden)


def _saved_bytes(case: Case) -> int:
    """Bytes of the distinct storages autograd saves during one forward of the whole model."""
    from pipemem.validation.stage_emulation import (
        checkpoint_layers,
        core_attention_recompute_impl,
        hf_stage_modules,
    )

    cfg = cuda.build_hf_config(case)
    if case.recompute == "selective":
        cfg._attn_implementation = core_attention_recompute_impl(case.attn)
    labels = torch.randint(0, case.vocab, (1, case.seq_len))
    stage = hf_stage_modules(cfg, {0: range(case.layers)}, 1, labels, "cpu", torch.float32)[0]
    if case.recompute == "full":
        checkpoint_layers(stage)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(torch.randint(0, case.vocab, (1, case.seq_len)))
    return sum(seen.values())


def test_recompute_policies_save_what_they_promise():
    base = replace(TINY, precision="fp32", attn="eager", seq_len=64)
    none, sel, full = (_saved_bytes(replace(base, recompute=r)) for r in ("none", "selective", "full"))
    heads, s, layers = base.heads, base.seq_len, base.layers
    # Eager attention saves its fp32 softmax probabilities [b, heads, s, s] per layer; recomputing
    # the core attention drops at least those.
    assert none - sel >= layers * heads * s * s * 4
    # Full recompute keeps only each layer's input among the layers' tensors: far less again.
    assert full < sel


# Estimates ----------------------------------------------------------------------------------


class _FakeEstimate:
    def __init__(self, peaks):
        self.peaks = peaks

    def to_dict(self):
        return {"ranks": [{"pp_rank": r, "peak_allocated_bytes": b} for r, b in enumerate(self.peaks)]}


def test_estimates_attach_per_rank_and_rel_error():
    calls = []

    def estimator(model, **kw):
        calls.append((model["model_type"], kw["mode"], kw["kernel_policy"], kw["pp"]))
        if kw["mode"] == "traced":
            raise cuda.UserError("--mode traced runs one whole model on one rank")
        return _FakeEstimate([1200, 900])

    result = {"ranks": [{"rank": 0}, {"rank": 1}], "measured_bytes": 1000}
    cuda.add_estimates(result, replace(TINY, pp=2, schedule="1F1B"), estimator)
    assert calls == [("llama", "traced", "cuda", 2), ("llama", "templates", "cuda", 2)]
    assert (
        result["estimates"]["traced"]["ranks"] is None
        and "one rank" in result["estimates"]["traced"]["error"]
    )
    assert result["estimate_mode"] == "templates" and result["estimated_bytes"] == 1200
    assert result["rel_error"] == pytest.approx(0.2)
    assert [r["estimated_bytes"]["templates"] for r in result["ranks"]] == [1200, 900]


def test_estimator_crash_is_recorded_not_raised():
    def broken(model, **kw):
        raise KeyError("boom")

    e = cuda.estimate_case(TINY, "templates", broken)
    assert e["peak_bytes"] is None and "KeyError" in e["error"]


def test_rel_error_definition():
    assert cuda.rel_error(110, 100) == pytest.approx(0.10)
    assert cuda.rel_error(None, 100) is None and cuda.rel_error(5, 0) is None


# Report -------------------------------------------------------------------------------------


def _report():
    env = {
        "gpu": {"name": "NVIDIA H200", "total_memory_bytes": 150_000_000_000},
        "driver": "570.1",
        "cuda": "12.8",
        "torch": "2.13.0",
        "transformers": "5.24.0",
        "pipemem": "0.1.0",
    }
    rep = cuda.new_report(env, "small")
    rep["cases"].append(
        {
            "name": "a/case",
            "config": {},
            "error": None,
            "measured_bytes": 2 << 30,
            "ranks": [
                {
                    "rank": 0,
                    "allocated_peak_bytes": 2 << 30,
                    "reserved_peak_bytes": 3 << 30,
                    "estimated_bytes": {"traced": (2 << 30) + (2 << 30) // 10, "templates": None},
                }
            ],
        }
    )
    rep["cases"].append(
        {
            "name": "b/oom",
            "config": {},
            "error": "rank 1: OutOfMemoryError: CUDA out of memory",
            "ranks": [],
            "measured_bytes": None,
        }
    )
    return rep


def test_report_file_round_trips_and_default_name(tmp_path):
    rep = _report()
    path = cuda.write_report(rep, tmp_path / "sub" / "h200.json")
    back = json.loads(path.read_text())
    assert back == rep and back["format"] == cuda.FORMAT
    assert path.read_text().endswith("}\n")
    default = cuda.default_out(rep)
    assert default.parts[:2] == ("validation", "cuda") and default.name.startswith("nvidia-h200-small-")


def test_table_has_a_row_per_rank_and_the_errors():
    text = cuda.format_table(_report())
    lines = text.splitlines()
    assert "NVIDIA H200" in lines[0] and "driver 570.1" in lines[0]
    row = next(line for line in lines if line.startswith("a/case"))
    assert "2.00 GiB" in row and "3.00 GiB" in row and "+10.0%" in row
    assert any(line.startswith("b/oom") and "OutOfMemoryError" in line for line in lines)


@pytest.mark.slow
def test_pipeline_rank_runs_in_its_own_process():
    """The production path for pipeline cases: each rank in a fresh (spawned) process."""
    import os

    case = replace(TINY, pp=2, schedule="1F1B", microbatches=2)
    r = cuda.run_rank_isolated(case, 1, "cpu")
    assert r["stages"] == [1] and r["received_activations"] == 2 and r["pid"] != os.getpid()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_recompute_changes_memory_not_math(attn):
    """Same weights and tokens: none, selective and full recompute give the same loss and grads,
    and the selective implementation builds the same attention mask as its base."""
    import transformers.masking_utils as mu

    from pipemem.validation.stage_emulation import (
        checkpoint_layers,
        core_attention_recompute_impl,
        hf_stage_modules,
    )

    ids = torch.randint(0, TINY.vocab, (1, TINY.seq_len), generator=torch.Generator().manual_seed(1))
    results = {}
    for recompute in ("none", "selective", "full"):
        case = replace(TINY, precision="fp32", attn=attn, recompute=recompute)
        cfg = cuda.build_hf_config(case)
        if recompute == "selective":
            h, pos = torch.zeros(1, case.seq_len, case.hidden), torch.arange(case.seq_len)[None]
            base = mu.create_causal_mask(
                config=cfg, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
            )
            cfg._attn_implementation = core_attention_recompute_impl(attn)
            mine = mu.create_causal_mask(
                config=cfg, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
            )
            assert (base is None and mine is None) or torch.equal(base, mine)
        torch.manual_seed(0)
        stage = hf_stage_modules(cfg, {0: range(case.layers)}, 1, ids, "cpu", torch.float32)[0]
        if recompute == "full":
            checkpoint_layers(stage)
        loss = stage(ids)
        loss.backward()
        results[recompute] = (loss.detach(), [p.grad for p in stage.parameters()])
    ref_loss, ref_grads = results["none"]
    for recompute in ("selective", "full"):
        loss, grads_ = results[recompute]
        assert torch.allclose(loss, ref_loss, atol=1e-6)
        assert all(torch.allclose(g, r, atol=1e-6) for g, r in zip(grads_, ref_grads))


def test_run_writes_one_file_and_prints_the_table(monkeypatch, tmp_path, capsys):
    """The command's wiring with the device parts replaced: cases -> measure -> estimates ->
    file -> table (the device parts themselves are run_rank, tested above on CPU)."""
    env = {"gpu": {"name": "Test GPU"}, "driver": "1.0", "cuda": "12.8", "torch": torch.__version__}
    measured = []

    def fake_measure(case, device):
        measured.append((case.name, device))
        return {
            "name": case.name,
            "config": case.to_dict(),
            "error": None,
            "measured_bytes": 1 << 30,
            "measured_reserved_bytes": 2 << 30,
            "ranks": [
                {"rank": r, "allocated_peak_bytes": 1 << 30, "reserved_peak_bytes": 2 << 30}
                for r in range(case.pp)
            ],
        }

    monkeypatch.setattr(cuda, "require_cuda", lambda: None)
    monkeypatch.setattr(cuda, "environment", lambda: env)
    monkeypatch.setattr(cuda, "measure_case", fake_measure)
    out = tmp_path / "run.json"
    # the fake measurements (1 GiB on every rank) are not the estimates: the verdict fails, exit 1
    assert main(["validate", "cuda", "--case", "mixtral", "--case", "pp2-1F1B", "--out", str(out)]) == 1
    assert [d for _, d in measured] == ["cuda", "cuda"]
    doc = json.loads(out.read_text())
    assert doc["truth"] == "measured" and doc["tolerance"] == cuda.TOLERANCE and doc["passed"] is False
    headline = [r for c in doc["cases"] for r in c["rows"] if r["mode"] == c["estimate_mode"]]
    assert sorted(doc["beyond_tolerance"]) == sorted(
        r["name"] for r in headline if abs(r["rel_error"]) > cuda.TOLERANCE
    )
    assert doc["beyond_tolerance"]
    assert doc["gpu"]["name"] == "Test GPU" and [c["name"] for c in doc["cases"]] == [n for n, _ in measured]
    for c in doc["cases"]:
        assert set(c["estimates"]) == {"traced", "templates"}
        assert all(set(r["estimated_bytes"]) == {"traced", "templates"} for r in c["ranks"])
    text = capsys.readouterr().out
    assert "Test GPU" in text and f"wrote {out}" in text
    assert "truth measured" in text and "FAIL" in text
    assert sum(line.startswith("llama-h2048") for line in text.splitlines()) == 2  # one row per pp rank
