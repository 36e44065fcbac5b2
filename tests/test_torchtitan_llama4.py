"""torchtitan llama4 (torchtitan 0.2.2's modules) under `--convention torchtitan`, without
torchtitan installed: its MoE program, FSDP2's backward prefetch between layers of unequal sizes,
and set-to-none gradients made as views of the reduce-scatter output. The step itself is held
against 0.2.2's own by tests/test_validate_torchtitan.py."""

from types import SimpleNamespace

import pytest

from pipemem.configs.torchtitan import flavor_table
from pipemem.model import arch_from_hf_config
from pipemem.plan import ParallelPlan, validate_plan
from pipemem.templates.conventions import convention_for
from pipemem.templates.layers import first_backward_shard, layer_options_of, make_shard
from pipemem.templates.programs import layer_memory, layer_prefetch, layer_programs
from pipemem.templates.torchtitan_llama4 import padded_rows


def _setup(grads="set-to-none", first_backward=False, **kw):
    arch = arch_from_hf_config(dict(flavor_table()["llama4"]["debugmodel"]), "llama4-debugmodel")
    plan = validate_plan(
        arch,
        ParallelPlan(seq_len=256, micro_batch=2, convention="torchtitan", dp=2, fsdp=True, grads=grads, **kw),
    )
    conv = convention_for(plan)
    sh = make_shard(arch, plan, conv)
    return arch, first_backward_shard(sh, plan) if first_backward else sh, conv


def _layer_params(c: dict, moe: bool) -> int:
    h = c["hidden_size"]
    attn = 4 * h * h + 2 * h  # wq, wk, wv, wo and the two norms
    if not moe:
        return attn + 3 * h * c["intermediate_size_mlp"]
    e, f = c["num_local_experts"], c["intermediate_size"]
    return attn + 3 * e * f * h + 3 * h * f + e * h  # routed experts, the shared one, the gate


def test_moe_program_is_torchtitan_022s():
    """The MoE layer's backward gathers its parameters (llama4's own count) and its experts run on
    the tokens padded as 0.2.2's indices_padding_wrapper pads them."""
    arch, sh, conv = _setup()
    c = flavor_table()["llama4"]["debugmodel"]
    pp = layer_programs(arch, sh, conv, layer_options_of(arch, True, True, "none"))
    tokens = 256 * 2 * c["num_experts_per_tok"]
    rows = pp.F.tensors["moe.permuted_input"].shape[0]
    assert rows == padded_rows(tokens, c["num_local_experts"]) and rows % 8 == 0
    assert tokens + c["num_local_experts"] * 8 <= rows < tokens + c["num_local_experts"] * 8 + 8
    assert "moe.routed_fp32" in pp.F.tensors  # scores applied before the experts, in fp32
    gathered = sum(t.nbytes for k, t in pp.B.tensors.items() if k.endswith("params_bwd.ag_out"))
    assert gathered == 2 * _layer_params(c, True)  # bf16 unsharded


def test_backward_prefetch_of_a_larger_layer():
    """A dense layer's backward holds the MoE layer's all-gather (the layer before it, prefetched):
    output and copy-in buffers of bf16 parameters, whole and this rank's shard."""
    arch, sh, conv = _setup()
    c = flavor_table()["llama4"]["debugmodel"]
    dense = layer_memory(arch, sh, conv, layer_options_of(arch, False, True, "none"))
    moe = layer_memory(arch, sh, conv, layer_options_of(arch, True, True, "none"))
    gather = {m: 2 * _layer_params(c, m) + 2 * _layer_params(c, m) // 2 for m in (False, True)}
    assert (dense.layer_gather_bytes, moe.layer_gather_bytes) == (gather[False], gather[True])
    assert layer_prefetch(dense, moe) == gather[True] - gather[False] > 0
    assert layer_prefetch(moe, dense) == 0 and layer_prefetch(dense, dense) == 0
    assert layer_prefetch(dense, None) == 0
    assert layer_prefetch(dense, SimpleNamespace(layer_gather_bytes=0)) == 0  # the embedding's unit


@pytest.mark.parametrize("grads", ["set-to-none", "buffer"])
def test_set_to_none_grads_are_views_of_the_reduce_scatter_output(grads):
    """No grads yet (a step's backward after zero_grad(set_to_none)) and an fp32 reduce-scatter:
    FSDP2's sharded grads are views of its output, so the backward never holds both; with
    resident grads the output is added into them."""
    arch, sh, conv = _setup(grads=grads, first_backward=grads == "set-to-none")
    pp = layer_programs(arch, sh, conv, layer_options_of(arch, True, True, "none"))
    ops = [o.type for o in pp.B.ops]
    assert ops.count("fsdp_grad_views") == (grads == "set-to-none")
    i = ops.index("fsdp_accumulate_grad")
    made = pp.B.ops[i].outputs
    assert (made == ()) == (grads == "set-to-none")


def test_llama4_case_without_torchtitan_022_is_one_line_exit_2(capsys, monkeypatch, tmp_path):
    """validate torchtitan's llama4 case where no torchtitan 0.2.2 directory is named: one line
    saying what to install and where, exit 2, before any case runs (the others need only 0.3)."""
    from pipemem.cli.main import main
    from pipemem.validation import torchtitan

    monkeypatch.setenv("PIPEMEM_TORCHTITAN_LLAMA4", str(tmp_path))  # no torchtitan/ inside
    assert main(["validate", "torchtitan", "--cases", "llama4-fsdp2"]) == 2
    err = capsys.readouterr().err
    # (importing torchtitan 0.3 for its own check may log library warnings first)
    ours = [line for line in err.splitlines() if line.startswith("pipemem")]
    assert len(ours) == 1 and "torchtitan" in ours[0] and "Traceback" not in err
    if torchtitan.available() is None:  # the 0.3 check passed: the line is about 0.2.2
        assert "--target DIR torchtitan==0.2.2" in ours[0] and "PIPEMEM_TORCHTITAN_LLAMA4" in ours[0]
        assert torchtitan.available_for([c for c in torchtitan.all_cases() if c["name"] == "fsdp2"]) is None


def test_llama4_under_tp_or_ep_says_which_moe_module_is_modelled():
    from pipemem import estimate

    m = dict(flavor_table()["llama4"]["debugmodel"])
    kw = dict(convention="torchtitan", seq_len=256, micro_batch=2, fsdp=True, grads="set-to-none")
    plain = estimate(m, dp=2, **kw)
    assert not any("0.2.2" in w for w in plain.warnings)
    for par in (dict(dp=2, tp=2), dict(dp=4, ep=2)):
        est = estimate(m, **par, **kw)
        assert any("llama4" in w and "0.2.2" in w for w in est.warnings), est.warnings
