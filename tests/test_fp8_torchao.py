"""torchao Float8 linears in templates (--fp8 tensorwise) against torchao's own
`convert_to_float8_training` on a Hugging Face Llama, traced on fake tensors (eager, pure
bf16). torchao keeps the high-precision input and weight for backward, so what the forward
leaves for the backward is unchanged; its casts raise the transient peaks, which the template
models per linear.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("torchao.float8")

from pipemem.model import arch_from_hf_config  # noqa: E402
from pipemem.plan import ParallelPlan, validate_plan  # noqa: E402
from pipemem.templates.conventions import convention_for  # noqa: E402
from pipemem.templates.layers import layer_options, make_shard  # noqa: E402
from pipemem.templates.programs import layer_memory  # noqa: E402

S, B = 256, 2
CONFIG = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 768, "vocab_size": 512}


def traced(fp8: bool):
    from pipemem.traced.hf import build_model, fake_tensor_quirks, hf_loss, make_config, step_inputs
    from pipemem.traced.step import trace_step
    from torchao.float8 import convert_to_float8_training

    cfg = make_config(CONFIG, "sdpa", 2)

    def prepare(model):
        if fp8:   # torchtitan's filter: every linear but the output projection
            convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")

    st = trace_step(lambda: build_model(cfg, torch.bfloat16), step_inputs(cfg, B, S), hf_loss, None, "cuda",
                    prepare=prepare, patches=fake_tensor_quirks())
    layer_of = st.op_layers["forward"]
    return st, layer_of


def template(fp8: bool):
    arch = arch_from_hf_config(CONFIG, "t")
    plan = validate_plan(arch, ParallelPlan(seq_len=S, micro_batch=B, dtype="bf16", master_weights=False,
                                            convention="hf", fp8="tensorwise" if fp8 else None,
                                            extra={"first_step": True}))
    conv = convention_for(plan)
    return layer_memory(arch, make_shard(arch, plan, conv), conv, layer_options(arch, plan, 0, False))


def test_float8_keeps_what_bf16_keeps():
    bf16, _ = traced(False)
    f8, _ = traced(True)
    assert f8.phase("forward").net_bytes == bf16.phase("forward").net_bytes
    assert template(True).F.net_bytes == template(False).F.net_bytes


def layer1_peaks(step, layer_of_fwd):
    """Peaks of layer 1's forward and backward segments above the bytes in use when each starts."""
    from pipemem.liveness import analyze_sequence
    res = analyze_sequence(step.programs, live_on_entry=step.entry_storages)
    out = []
    for k, phase in ((0, "forward"), (1, "backward")):
        lay = step.op_layers[phase]
        idx = [i for i, x in enumerate(lay) if x == 1]
        r = res[k]
        base = int(r.after[idx[0] - 1]) if idx[0] else 0
        out.append(max(int(r.during[i]) for i in idx) - base)
    return out


def test_float8_forward_peak_follows_torchao():
    """The forward's transient peak of a layer, where torchao's casts dominate it. (The traced
    backward is not compared: on fake CPU tensors `_scaled_mm` runs torchao's emulation, which
    dequantizes its fp8 operands to bf16 copies a CUDA kernel never makes.)"""
    (f8, lf8), (bf16, lbf) = traced(True), traced(False)
    t_f8, t_bf = layer1_peaks(f8, lf8)[0], layer1_peaks(bf16, lbf)[0]
    m_f8 = template(True).F.peak_bytes
    assert t_f8 > t_bf
    assert abs(m_f8 - t_f8) <= 0.01 * t_f8, (m_f8, t_f8)
