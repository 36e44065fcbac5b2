"""MoE load per expert-parallel rank: --moe-imbalance F (the busiest rank's experts receive F x
the balanced tokens) and Megatron's capacity factor (dropping above C x, padding to exactly C x)
size what a rank's experts hold; the estimate says what it assumes."""

import shlex

import pytest

from pipemem import estimate
from pipemem.errors import UserError
from pipemem.model import arch_from_hf_config
from pipemem.plan import ParallelPlan
from pipemem.templates.moe import rank_load

MOE = dict(
    model_type="mixtral",
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=512,
    vocab_size=1000,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
)
KW = dict(seq_len=512, micro_batch=1, dp=4, ep=4, dtype="bf16", convention="megatron")


def _fnet(**kw) -> int:
    return estimate(dict(MOE), **dict(KW, **kw)).ranks[0].jobs["F"].net_bytes


def test_rank_load_rules():
    arch = arch_from_hf_config(MOE, "m")

    def load(**kw):
        return rank_load(arch, ParallelPlan(**kw))

    assert load(ep=1, moe_imbalance=3.0) == 1.0  # every expert on the rank: the mean, whatever the routing
    assert load(ep=4, moe_imbalance=1.5) == 1.5
    # at most every token of the 4 ranks to min(top_k 2, 2 local experts) of its experts
    assert load(ep=4, moe_imbalance=100.0) == 4.0
    assert load(ep=4, moe_imbalance=3.0, extra={"moe_capacity_factor": 1.25}) == 1.25  # dropped past C
    assert load(ep=4, extra={"moe_capacity_factor": 1.25}) == 1.0
    assert load(ep=1, extra={"moe_capacity_factor": 1.5, "moe_pad_to_capacity": True}) == 1.5


def test_imbalance_scales_what_the_busiest_rank_holds():
    base, f2, f3 = _fnet(), _fnet(moe_imbalance=2.0), _fnet(moe_imbalance=3.0)
    # linear in the tokens received, and at least the expert fc1 output (2 x 512 wide) and the
    # SwiGLU output (512) in bf16 per extra token (512 x 2 tokens per layer, 2 layers)
    assert f3 - base == 2 * (f2 - base)
    assert f2 - base >= 2 * 512 * 2 * (2 * 512 + 512) * 2
    assert _fnet(moe_imbalance=100.0) == _fnet(moe_imbalance=4.0)  # the cap
    assert _fnet(ep=1, dp=4, moe_imbalance=3.0) == _fnet(ep=1, dp=4)


def test_estimate_says_what_it_assumes():
    def notes(**kw):
        return [w for w in estimate(dict(MOE), **dict(KW, **kw)).warnings if w.startswith("MoE load")]

    assert "balanced routing" in notes()[0] and "--moe-imbalance" in notes()[0]
    assert "2 x the balanced tokens" in notes(moe_imbalance=2.0)[0]
    assert notes(ep=1) == []
    dense = {k: v for k, v in MOE.items() if k not in ("num_local_experts", "num_experts_per_tok")}
    dense["model_type"] = "llama"
    assert not [w for w in estimate(dense, **dict(KW, ep=1)).warnings if w.startswith("MoE load")]


def test_cli_bad_imbalance_exit_2(tmp_path, capsys):
    import json

    from pipemem.cli.main import main

    path = tmp_path / "m.json"
    path.write_text(json.dumps(MOE))
    assert main(["estimate", "--model", str(path), "--seq-len", "64", "--moe-imbalance", "0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--moe-imbalance 0.5" in err and len(err.splitlines()) == 1


BASE = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
    "--seq-length 512 --max-position-embeddings 4096 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --vocab-size 1000 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --micro-batch-size 1 --world-size 4 --bf16 "
    "--num-experts 8 --moe-router-topk 2 --ffn-hidden-size 512 --moe-token-dispatcher-type alltoall "
)


def _megatron(extra: str):
    from pipemem.configs.megatron import read

    return read(shlex.split(BASE + extra))


def test_megatron_capacity_factor_read_and_padding_costs():
    cfg = _megatron(
        "--expert-model-parallel-size 4 --moe-expert-capacity-factor 1.5 --moe-token-drop-policy probs"
    )
    assert cfg.plan["extra"]["moe_capacity_factor"] == 1.5
    padded = _megatron("--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity")
    assert padded.plan["extra"]["moe_pad_to_capacity"] is True

    def fnet(c):
        return estimate(c.model, **c.plan).ranks[0].jobs["F"].net_bytes

    assert fnet(padded) > fnet(_megatron(""))  # every expert padded to 1.5 x its share, at --ep 1 too


@pytest.mark.parametrize(
    "extra,what",
    [
        ("--moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor"),
        ("--moe-expert-capacity-factor -1", "--moe-expert-capacity-factor '-1'"),
        ("--moe-expert-capacity-factor 1 --moe-token-drop-policy random", "--moe-token-drop-policy 'random'"),
    ],
)
def test_megatron_capacity_flags_bad_input(extra, what):
    with pytest.raises(UserError, match=what) as e:
        _megatron(extra)
    assert "\n" not in str(e.value)
