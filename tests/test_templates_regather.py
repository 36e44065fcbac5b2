"""--recompute-allgather under the torchtitan convention (pipemem.torch_tp.RegatherColwiseParallel):
what the templates keep, what --explain shows, and the torchtitan job-config key."""

import json

import pytest

import pipemem
from pipemem.cli.main import main
from pipemem.configs import read_torchtitan
from pipemem.errors import UserError
from pipemem.model import arch_from_hf_config
from pipemem.presets import load_model_config

TITAN = """
[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 1
seq_len = 4096
[parallelism]
data_parallel_shard_degree = 2
tensor_parallel_degree = 4
pipeline_parallel_degree = 2
pipeline_parallel_microbatch_size = 1
{extra}
[activation_checkpoint]
mode = "none"
"""


def _ranks(model, **plan):
    # gradients resident all step (--grads buffer): the activation high-water mark is then the
    # activations alone, not activations plus gradients created by the first backwards
    # One cross entropy over the whole sequence (loss_chunks 1): the LM head's input is then the
    # gathered sequence, which the re-gather saves too. (torchtitan 0.3's ChunkedLossWrapper
    # replicates the hidden states before its chunks: nothing to re-gather at the head.)
    return pipemem.estimate(
        model, convention="torchtitan", grads="buffer", extra={"loss_chunks": 1}, **plan
    ).to_dict()["ranks"]


@pytest.mark.parametrize(
    "model,tp,pp,mb", [("llama3-8b", 4, 2, 1), ("qwen2.5-7b", 2, 2, 2), ("llama3-70b", 8, 4, 1)]
)
def test_each_block_keeps_its_shard_instead_of_the_gathered_input(model, tp, pp, mb):
    # Per layer and microbatch in flight, the attention and MLP inputs are kept as
    # [s/tp, b, h] shards instead of the gathered [s, b, h]; the last stage's LM head too.
    arch = arch_from_hf_config(load_model_config(model)[1])
    seq = 4096
    plain, regather = (
        _ranks(model, tp=tp, pp=pp, micro_batch=mb),
        _ranks(model, tp=tp, pp=pp, micro_batch=mb, recompute_allgather=True),
    )
    per_input = (tp - 1) * seq * mb * arch.hidden * 2 // tp  # bf16
    layers = arch.layers // pp
    for a, b in zip(plain, regather):
        head = a["pp_rank"] == pp - 1
        expected = (2 * layers * a["inflight"] + head) * per_input
        assert a["activation_hwm_bytes"] - b["activation_hwm_bytes"] == expected
        assert b["peak_allocated_bytes"] <= a["peak_allocated_bytes"]
    assert regather[0]["peak_allocated_bytes"] < plain[0]["peak_allocated_bytes"]


def test_megatron_regathers_anyway():
    a = pipemem.estimate("llama3-8b", tp=4, pp=2).to_dict()
    b = pipemem.estimate("llama3-8b", tp=4, pp=2, recompute_allgather=True).to_dict()
    assert a["max_peak_allocated_bytes"] == b["max_peak_allocated_bytes"]


def test_explain_names_the_tensors_dropped_and_the_gathers_added():
    est = pipemem.estimate(
        "llama3-70b", tp=8, pp=4, convention="torchtitan", recompute_allgather=True, explain=True
    )
    trade = [r for r in est.explain if r.get("section")]
    names = {r["tensor"]: r for r in trade}
    assert names["attn.allgather"]["why"].startswith("no longer kept")
    assert names["mlp.allgather"]["why"].startswith("no longer kept")
    assert names["attn.shard_copy"]["why"].startswith("kept instead")
    gathers = [r for r in trade if r["why"].startswith("all-gather added")]
    assert {r["tensor"] for r in gathers} == {"attn.allgather_bwd", "mlp.allgather_bwd"}
    h, s = 8192, 4096
    assert (
        names["attn.allgather"]["bytes"] == s * h * 2 and names["attn.shard_copy"]["bytes"] == s * h * 2 // 8
    )
    assert "112.00 MiB less kept" in trade[0]["section"] and "2 all-gather(s) more" in trade[0]["section"]
    # the paddle convention: one re-gather per column-parallel linear, nothing extra kept
    est = pipemem.estimate("llama3-70b", tp=8, convention="paddle", recompute_allgather=True, explain=True)
    trade = [r for r in est.explain if r.get("section")]
    assert sum(r["why"].startswith("all-gather added") for r in trade) == 2
    assert not any(r["why"].startswith("kept instead") for r in trade)
    # without the switch, or where it changes nothing (megatron), no trade section
    for kw in ({"convention": "torchtitan"}, {"convention": "megatron", "recompute_allgather": True}):
        est = pipemem.estimate("llama3-70b", tp=8, explain=True, **kw)
        assert not any(r.get("section") for r in est.explain)


def test_explain_renders_the_trade(capsys):
    assert (
        main(
            [
                "estimate",
                "--model",
                "llama3-8b",
                "--tp",
                "4",
                "--convention",
                "torchtitan",
                "--recompute-allgather",
                "--explain",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--recompute-allgather trades memory for communication" in out
    assert "attn.allgather_bwd" in out and "no longer kept" in out


def test_torchtitan_job_config_key(tmp_path, capsys):
    f = tmp_path / "job.toml"
    f.write_text(TITAN.format(extra="tensor_parallel_recompute_allgather = true"))
    assert read_torchtitan(str(f)).plan["recompute_allgather"] is True
    assert main(["estimate", "--json", "--from-torchtitan", str(f)]) == 0
    from_key = json.loads(capsys.readouterr().out)
    f.write_text(TITAN.format(extra=""))
    assert "recompute_allgather" not in read_torchtitan(str(f)).plan
    assert main(["estimate", "--json", "--recompute-allgather", "--from-torchtitan", str(f)]) == 0
    from_flag = json.loads(capsys.readouterr().out)
    assert from_key["plan"]["recompute_allgather"] is True
    assert from_key["max_peak_allocated_bytes"] == from_flag["max_peak_allocated_bytes"]
    f.write_text(TITAN.format(extra='tensor_parallel_recompute_allgather = "yes"'))
    with pytest.raises(UserError, match="tensor_parallel_recompute_allgather"):
        read_torchtitan(str(f))


def test_one_regather_per_block_in_each_backward_pass():
    # fused backward: one all-gather per block; split backward (zero-bubble schedules): autograd
    # runs each projection's node in both passes, so each pass gathers once per block, and the
    # input-grad pass's copy dies in that pass
    from pipemem.plan import ParallelPlan
    from pipemem.stages import _resolve
    from pipemem.templates.layers import layer_options
    from pipemem.templates.programs import layer_programs

    arch = arch_from_hf_config(load_model_config("llama3-8b")[1])
    progs = {}
    for regather in (False, True):
        a, plan, conv, sh = _resolve(
            arch, ParallelPlan(tp=4, convention="torchtitan", recompute_allgather=regather)
        )
        progs[regather] = layer_programs(a, sh, conv, layer_options(a, plan, 0, False))
    gathers = {k: [op for op in getattr(progs[True], k).ops if op.type == "all_gather"] for k in "BIW"}
    assert [len(gathers[k]) for k in "BIW"] == [2, 2, 2]
    assert not any(op.type == "all_gather" for op in progs[False].B.ops)
    assert all(o.endswith("@i") for op in gathers["I"] for o in op.outputs)
    assert progs[True].results["I"].net_bytes == progs[False].results["I"].net_bytes
    # what the layer keeps shrinks by 2 x (gathered - shard) = 2 x 3/4 x s*b*h bf16
    kept = {k: progs[k].results["F"].net_bytes for k in (False, True)}
    assert kept[False] - kept[True] == 2 * 3 * 4096 * arch.hidden * 2 // 4


def test_readme_table_is_what_pipemem_estimates():
    # README's 70B table (Keep only the sequence shard) comes from these two estimates
    import os
    import re

    from pipemem.units import fmt_bytes

    readme = open(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    ).read()
    section = readme[readme.index("## Keep only the sequence shard") :]
    rows = re.findall(r"^\| (\d) \| [\d-]+ \| ([\d.]+ GiB) \| ([\d.]+ GiB) \| ([\d.]+ GiB)", section, re.M)
    kw = dict(gpu="h100-80g", dp=2, tp=8, pp=4, seq_len=8192, convention="torchtitan")
    plain = pipemem.estimate("llama3-70b", **kw).ranks
    regather = pipemem.estimate("llama3-70b", recompute_allgather=True, **kw).ranks
    assert len(rows) == 4
    for (rank, a, b, saved), p, r in zip(rows, plain, regather):
        assert (a, b, saved) == (
            fmt_bytes(p.peak_allocated_bytes),
            fmt_bytes(r.peak_allocated_bytes),
            fmt_bytes(p.peak_allocated_bytes - r.peak_allocated_bytes),
        ), f"README rank {rank}"
