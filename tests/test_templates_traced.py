"""Template mode against traced mode (--kernel-policy cuda) on tp=cp=ep=pp=1: per decoder
layer, the bytes the forward keeps for backward and the backward's peak agree within 1%.

Traced side: one real HF training step of a 2-layer model on fake tensors (pipemem.traced);
layer 1's share is read from the recorded programs: the storages its forward ops create that
are still alive when the forward ends, and the peak of its backward segment above the memory
in use when that segment starts. Parameter gradients are static bytes in template mode, so
the traced programs count them as zero. Template side: the `hf` convention (HF modules in
eager PyTorch), first training step (eager weight grads become .grad).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipemem.ir import Tensor, TensorKind  # noqa: E402
from pipemem.liveness import analyze_sequence, compile_program  # noqa: E402
from pipemem.model import arch_from_hf_config  # noqa: E402
from pipemem.plan import ParallelPlan, validate_plan  # noqa: E402
from pipemem.templates.conventions import convention_for  # noqa: E402
from pipemem.templates.layers import layer_options, make_shard  # noqa: E402
from pipemem.templates.programs import layer_memory  # noqa: E402

S, B = 128, 2
BASE = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "vocab_size": 1000,
}
CASES = {
    # name: (config, traced dtype); autocast = bf16 with fp32 master weights
    "llama": (dict(BASE, model_type="llama"), "bf16"),
    "qwen2": (dict(BASE, model_type="qwen2"), "bf16"),
    "gpt2": (
        {
            "model_type": "gpt2",
            "n_embd": 256,
            "n_head": 8,
            "n_layer": 2,
            "vocab_size": 1000,
            "n_positions": 256,
        },
        "bf16",
    ),
    # under autocast HF runs its grouped_mm experts in the fp32 weights' dtype (templates do not): pure bf16
    "mixtral": (dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2), "bf16-pure"),
}


def traced_layer1(config, dtype):
    from pipemem.traced import trace_hf_step

    r = trace_hf_step(config, B, S, dtype=dtype, attn="sdpa", kernel_policy="cuda", layers=2)
    for p in r.programs:
        for n, t in list(p.tensors.items()):
            if t.kind is TensorKind.GRAD:
                p.tensors[n] = Tensor(
                    t.name, t.shape, t.dtype, t.kind, storage=t.storage, persistent=t.persistent, bytes=0
                )
        p._compiled = None
    fwd = r.programs[0]
    res = analyze_sequence(r.programs, live_on_entry=r.entry_storages)
    c = compile_program(fwd)
    layer_of = r.op_layers["forward"]
    kept = sum(
        int(c.sizes[i])
        for i, n in enumerate(c.storage_names)
        if c.first_is_write[i] and n in res[0].live_after and layer_of[c.first_op[i]] == 1
    )
    lay = r.op_layers["backward"]
    start = lay.index(1)
    end = start
    while end + 1 < len(lay) and lay[end + 1] != 0:
        end += 1
    b = res[1]
    base = int(b.after[start - 1]) if start else 0
    peak = max(int(b.during[i]) for i in range(start, end + 1)) - base
    return kept, peak


def template_layer(config, dtype):
    arch = arch_from_hf_config(config, "t")
    plan = validate_plan(
        arch,
        ParallelPlan(
            seq_len=S,
            micro_batch=B,
            convention="hf",
            dtype="bf16",
            master_weights=(dtype == "bf16"),
            extra={"first_step": True},
        ),
    )
    conv = convention_for(plan)
    return layer_memory(arch, make_shard(arch, plan, conv), conv, layer_options(arch, plan, 1, True))


@pytest.mark.parametrize("name", sorted(CASES))
def test_template_layer_matches_traced(name):
    config, dtype = CASES[name]
    kept, peak = traced_layer1(config, dtype)
    m = template_layer(config, dtype)
    assert abs(m.F.net_bytes - kept) <= 0.01 * kept
    assert abs(m.B.peak_bytes - peak) <= 0.01 * peak
