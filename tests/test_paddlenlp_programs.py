"""PaddleNLP job programs -> per-card jobs and schedule (pipemem.paddle.paddlenlp_programs).

The liveness rules here are the executor's (a job keeps what a later job of the same
micro-batch reads); the documents are written by hand in the worker's format, so these run
without Paddle. The end-to-end build with Paddle's own passes runs when a paddlenlp
interpreter is available ($PIPEMEM_PADDLENLP_PYTHON)."""

import json
import os
import shutil

import pytest

from pipemem.errors import UserError
from pipemem.paddle.paddlenlp_programs import build_spec, job_memory, stage_plan

MB = 1 << 20


def _doc(rank, job_list, first=False):
    """recv_forward (unless first) -> forward (keeps 'h' for backward) -> backward -> send_backward
    -> optimizer."""
    t = {
        "recv": {"shape": [MB // 4], "dtype": "float32"},
        "h": {"shape": [2 * MB // 4], "dtype": "float32"},
        "tmp": {"shape": [3 * MB // 4], "dtype": "float32"},
        "dx": {"shape": [MB // 4], "dtype": "float32"},
        "g": {"shape": [MB // 4], "dtype": "float32", "kind": "grad", "persistent": True},
        "w": {"shape": [MB // 4], "dtype": "float32", "kind": "param"},
        "m": {"shape": [2 * MB // 4], "dtype": "float32", "kind": "optimizer_state"},
        "ids": {"shape": [4], "dtype": "int64", "persistent": True},
    }
    x = "ids" if first else "recv"
    progs = [
        {
            "name": "forward",
            "type": "forward",
            "ops": [
                {"type": "matmul", "inputs": [x, "w"], "outputs": ["tmp"]},
                {"type": "relu", "inputs": ["tmp"], "outputs": ["h"]},
            ],
        },
        {
            "name": "backward",
            "type": "backward",
            "ops": [
                {"type": "relu_grad", "inputs": ["h", x], "outputs": ["dx"]},
                {"type": "add_", "inputs": ["g", "dx"], "outputs": ["g"]},
            ],
        },
        {"name": "send_backward", "type": "send_backward", "ops": [{"type": "send_v2", "inputs": ["dx"]}]},
        {
            "name": "optimizer",
            "type": "optimizer",
            "ops": [{"type": "adamw_", "inputs": ["w", "g", "m"], "outputs": ["w", "m"]}],
        },
    ]
    if not first:
        progs.insert(
            0,
            {
                "name": "recv_forward",
                "type": "recv_forward",
                "ops": [{"type": "recv_v2", "inputs": [], "outputs": ["recv"]}],
            },
        )
    return {
        "rank": rank,
        "job_list": job_list,
        "fed_bytes": 32,
        "ir": {"format": "pipemem.programs/1", "tensors": t, "programs": progs},
    }


def test_jobs_keep_what_later_jobs_of_their_microbatch_read():
    jl = [
        ["recv_forward", 0],
        ["forward", 0],
        ["recv_forward", 1],
        ["forward", 1],
        ["backward", 0],
        ["send_backward", 0],
        ["backward", 1],
        ["send_backward", 1],
        ["optimizer", 0],
    ]
    cj = job_memory(_doc(1, jl))
    # forward keeps h (2 MiB) and the received input (read by backward); tmp (3 MiB) dies inside
    assert cj.jobs[("forward", 0)][:2] == (2 * MB, 5 * MB)
    # backward frees h and recv, keeps dx for send_backward
    assert cj.jobs[("backward", 0)][:2] == (-3 * MB + MB, MB)
    assert cj.jobs[("send_backward", 0)][:2] == (-MB, 0)
    assert cj.static.params == MB and cj.static.grads == MB and cj.static.optimizer == 2 * MB


def test_schedule_is_each_cards_job_list_with_comm_jobs_folded():
    jl0 = [["forward", 0], ["forward", 1], ["backward", 0], ["backward", 1], ["optimizer", 0]]
    jl1 = [
        ["recv_forward", 0],
        ["forward", 0],
        ["backward", 0],
        ["send_backward", 0],
        ["recv_forward", 1],
        ["forward", 1],
        ["backward", 1],
        ["send_backward", 1],
        ["optimizer", 0],
    ]
    spec = {"pp": 2, "vpp": 1, "layers": 4, "schedule": "1F1B"}
    ps = stage_plan(spec, [job_memory(_doc(0, jl0, first=True)), job_memory(_doc(1, jl1))])
    assert [str(a) for a in ps.schedule.ranks[1]] == ["F0@s1", "B0@s1", "F1@s1", "B1@s1"]
    # F1@s1 runs send_backward(0) and recv_forward(1) first: -1 MiB then +1 MiB, then the forward (+2)
    jobs = ps.replay_jobs(ps.schedule)  # the stage jobs and the per-micro-batch composites
    assert set(ps.stages) == {0, 1}  # stages: per virtual stage only
    f1 = jobs[(1, 1)].F
    assert (f1.net_bytes, f1.peak_bytes) == (2 * MB, 5 * MB)
    assert ps.stages[1].layers == (2, 3) and ps.stages[0].layers == (0, 1)
    from pipemem.replay import replay

    rep = replay(
        ps.schedule, jobs, ps.static_per_rank(ps.schedule), optimizer_jobs=ps.optimizer, simulate_time=False
    )
    # card 1: static 4 MiB; recv 1 + forward peak 5 -> 6 MiB above static at F0
    assert rep.ranks[1].peak_allocated_bytes == 4 * MB + 6 * MB


def test_build_spec_refuses_what_paddlenlp_auto_parallel_has_not():
    from pipemem.model import arch_from_hf_config
    from pipemem.plan import ParallelPlan, validate_plan
    from pipemem.presets import load_model_config

    arch = arch_from_hf_config(load_model_config("llama2-7b")[1], "llama2-7b").with_layers(4)
    plan = validate_plan(
        arch,
        ParallelPlan(
            pp=2,
            tp=2,
            microbatches=8,
            convention="paddle",
            dtype="fp32",
            master_weights=False,
            seq_len=2048,
            flash_attn=False,
        ),
    )
    spec = build_spec(arch, plan)
    assert (spec["pp"], spec["mp"], spec["dp"], spec["sharding"], spec["accumulate_steps"]) == (2, 2, 1, 1, 8)
    assert spec["sp"] is True and spec["schedule"] == "1F1B" and spec["flash"] is False
    with pytest.raises(UserError, match="FThenB, 1F1B and VPP"):
        build_spec(
            arch,
            validate_plan(arch, ParallelPlan(pp=2, microbatches=4, schedule="ZBH1", convention="paddle")),
        )
    with pytest.raises(UserError, match="selective"):
        build_spec(arch, validate_plan(arch, ParallelPlan(recompute="selective", convention="paddle")))
    moe = arch_from_hf_config(load_model_config("mixtral-8x7b")[1], "mixtral")
    with pytest.raises(UserError, match="LlamaForCausalLM3DAuto"):
        build_spec(moe, validate_plan(moe, ParallelPlan(convention="paddle")))


PADDLENLP_PY = os.environ.get("PIPEMEM_PADDLENLP_PYTHON")


@pytest.mark.skipif(
    not PADDLENLP_PY or not shutil.which(PADDLENLP_PY) and not os.path.exists(PADDLENLP_PY or ""),
    reason="needs a paddlenlp interpreter ($PIPEMEM_PADDLENLP_PYTHON)",
)
def test_exact_estimate_builds_paddlenlp_programs(tmp_path, monkeypatch):
    """pp 2 on a tiny Llama through PaddleNLP and Paddle's own 1F1B pass: both cards' jobs."""
    from pipemem import estimate

    monkeypatch.setenv("PIPEMEM_CACHE_DIR", str(tmp_path))
    tiny = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 128,
        "num_hidden_layers": 2,
        "max_position_embeddings": 64,
    }
    est = estimate(
        tiny,
        mode="paddle",
        convention="paddle",
        pp=2,
        microbatches=2,
        seq_len=16,
        dtype="fp32",
        master_weights=False,
        flash_attn=False,
    )
    d = est.to_dict()
    assert [r["pp_rank"] for r in d["ranks"]] == [0, 1]
    for r in d["ranks"]:
        assert r["jobs"]["F"]["net_bytes"] > 0 and r["jobs"]["B"]["peak_bytes"] > 0
        assert r["static_bytes"]["params"] > 0 and r["static_bytes"]["grads"] > 0  # gradient-merge buffers
    # 1F1B on 2 cards, 2 microbatches: card 0 holds two forwards before its first backward
    assert d["ranks"][0]["inflight"] == 2 and d["ranks"][1]["inflight"] == 1
    cached = list(tmp_path.rglob("rank*.json"))
    assert len(cached) == 2 and json.loads(cached[0].read_text())["format"] == "pipemem.paddlenlp-rank/1"


def test_exact_says_what_it_builds_while_it_builds(tmp_path, monkeypatch, capsys):
    """--exact spends 20-50 s per card in PaddleNLP's worker: a line on stderr as each card starts
    (here the worker, a stand-in interpreter, refuses at once, as PaddleNLP refuses a plan)."""
    from pipemem.cli.main import main

    fake = tmp_path / "python"
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = "-c" ]; then echo "3.3.1 2.8.1"; exit 0; fi\n'
        'echo "this plan is refused by the worker" >&2; exit 2\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PIPEMEM_PADDLENLP_PYTHON", str(fake))
    monkeypatch.setenv("PIPEMEM_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["estimate", "--model", "llama3.2-1b", "--convention", "paddle", "--pp", "2", "--exact"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--exact: building card 0's programs with PaddleNLP" in err
    assert err.strip().splitlines()[-1] == "pipemem: error: this plan is refused by the worker"
