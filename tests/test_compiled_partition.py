"""torch.compile in templates (pipemem.templates.compiled: a min-cut over the template's nodes)
against AOTAutograd's own partitioner (`min_cut_rematerialization_partition`, the one inductor
uses) run on the real Hugging Face layers in traced mode (pipemem.traced.compiled).

For a 2-layer model, what compiling every layer removes from the bytes the forward leaves for
the backward must be the same in both: traced (compiled minus eager, whole step) and templates
(2 x (compiled minus eager layer F.net)).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("networkx")

from pipemem.model import arch_from_hf_config  # noqa: E402
from pipemem.plan import ParallelPlan, validate_plan  # noqa: E402
from pipemem.templates.conventions import convention_for  # noqa: E402
from pipemem.templates.layers import layer_options, make_shard  # noqa: E402
from pipemem.templates.programs import layer_memory  # noqa: E402

S, B = 128, 2
BASE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 512, "vocab_size": 1000}
CASES = {
    "llama-bf16-pure": (dict(BASE, model_type="llama"), "bf16", False),
    "llama-autocast": (dict(BASE, model_type="llama"), "bf16", True),
    "qwen2-bf16-pure": (dict(BASE, model_type="qwen2"), "bf16", False),
}


def traced_forward_net(config, dtype, master, compiled):
    from pipemem.traced.compiled import compile_layers
    from pipemem.traced.hf import Precision, build_model, fake_tensor_quirks, hf_loss, make_config, step_inputs
    from pipemem.traced.step import trace_step

    cfg = make_config(config, "sdpa", 2)
    prec = Precision.parse(dtype, master)
    st = trace_step(lambda: build_model(cfg, prec.param_dtype), step_inputs(cfg, B, S), hf_loss, None, "cuda",
                    autocast_dtype=prec.autocast_dtype, prepare=compile_layers if compiled else None,
                    patches=fake_tensor_quirks())
    return st.phase("forward").net_bytes


def template_layer_net(config, dtype, master, compiled):
    arch = arch_from_hf_config(config, "t")
    plan = validate_plan(arch, ParallelPlan(seq_len=S, micro_batch=B, dtype=dtype, master_weights=master,
                                            convention="hf", compile=compiled))
    conv = convention_for(plan)
    return layer_memory(arch, make_shard(arch, plan, conv), conv, layer_options(arch, plan, 0, False)).F.net_bytes


@pytest.mark.parametrize("case", sorted(CASES))
def test_compile_saves_what_the_partitioner_saves(case):
    config, dtype, master = CASES[case]
    traced = traced_forward_net(config, dtype, master, False) - traced_forward_net(config, dtype, master, True)
    tmpl = 2 * (template_layer_net(config, dtype, master, False) - template_layer_net(config, dtype, master, True))
    assert traced > 0
    assert abs(tmpl - traced) <= 0.02 * traced, (case, traced, tmpl)
