"""Each modern-trainer feature in templates against a trace made by the feature's own library
(pipemem.validation.features, also `pipemem validate features`): AOTAutograd's partitioner for
--compile, torchtune's chunked CE for --loss chunked, torchao's Float8 for --fp8 tensorwise,
torchtune's optimizer-in-backward hooks for --optimizer-in-backward, torchao's AdamW8bit /
AdamW4bit state buffers for --optimizer adam8bit / adam4bit. A library that is not
installed skips its test (CI installs them: .ci/run)."""

import importlib.util

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("networkx")

from pipemem.validation import features as F  # noqa: E402


def close(row, tol):
    assert row.measured_bytes is not None and row.estimated_bytes is not None
    assert abs(row.estimated_bytes - row.measured_bytes) <= tol * max(row.measured_bytes, 1), row.to_dict()


@pytest.mark.parametrize("case", sorted(F.COMPILE_CASES))
def test_compile_saves_what_the_partitioner_saves(case):
    row = F.compile_case(case)
    assert row.measured_bytes > 0  # compiling does remove saved bytes
    close(row, 0.01)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_cross_entropy_matches_torchtune(compiled):
    if F.torchtune_chunked_loss() is None:
        pytest.skip("torchtune not installed")
    rows = F.chunked_ce_cases(compiled)
    bf16_logits = F.S * F.B * F.HEAD["vocab_size"] * 2
    # what is at stake: eager keeps fp32 log-softmax chunks (2x the bf16 logits), compiled the bf16 logits
    assert rows[0].measured_bytes > (1.9 if not compiled else 0.9) * bf16_logits
    for row in rows:
        close(row, 0.01)


@pytest.mark.parametrize("dtype, family", [("bf16", "llama"), ("fp32", "llama"), ("bf16", "qwen2")])
def test_torchtune_convention_matches_torchtunes_own_modules(dtype, family):
    # torchtune 0.6.1's own Llama 3.2 / Qwen2 decoders (4 query heads per K/V head) traced on fake
    # tensors against --convention torchtune's layer: what it keeps, its forward and backward peaks
    config = F.TT_QWEN2 if family == "qwen2" else F.TT_LLAMA
    if F.torchtune_decoder(config, dtype) is None:
        pytest.skip("torchtune not installed")
    kept, fwd, bwd = F.torchtune_module_cases(dtype, config)
    hf = F.template_layer(config, 1, dtype=dtype, master_weights=False)
    if dtype == "bf16":
        # what is at stake: K/V expanded to every head and the fp32 scaled norm output are kept,
        # which HF's modules (the hf convention) do not keep
        assert kept.measured_bytes > hf.F.net_bytes + 2 * F.S * F.B * F.TT_LLAMA["hidden_size"] * 2
    for row in (kept, fwd, bwd):
        close(row, 0.001)


def test_compile_on_torchtunes_own_layers():
    if F.torchtune_decoder(F.TT_LLAMA, "bf16") is None:
        pytest.skip("torchtune not installed")
    (row,) = F.torchtune_compile_case()
    assert row.measured_bytes > 0
    close(row, 0.01)


def test_shifted_cross_entropy_matches_torch():
    """--loss shifted: a step's own CE on shifted half logits, traced eagerly (torch's ops)."""
    rows = F.shifted_ce_cases()
    bf16_logits = F.S * F.B * F.HEAD["vocab_size"] * 2
    # what is at stake: it keeps the bf16 log-probabilities (+ the norm's and output layer's saved
    # inputs, a quarter of them here); the standard path's are fp32, twice the logits
    assert 0.9 * bf16_logits < rows[1].measured_bytes < 1.5 * bf16_logits
    for row in rows:
        close(row, 0.01)


def test_fused_linear_cross_entropy_matches_liger():
    # Liger-Kernel's own fused linear CE (triton kernels on the interpreter, CPU tensors) behind
    # the final norm: the saved input/weight grads are the kept bytes, one logits chunk the peak
    mod = F.liger_flce_module()
    if mod is None or F._liger_gpu_forward(mod) is None:
        pytest.skip("liger-kernel / triton (interpreter) not installed")
    kept, fwd, bwd = F.fused_linear_ce_cases()
    weight_grad = F.HEAD["vocab_size"] * F.HEAD["hidden_size"] * 2
    assert kept.measured_bytes > weight_grad  # grad_weight [V, h] is kept by the forward
    close(kept, 0.001)
    close(fwd, 0.01)
    # no logits grad exists in the backward: its peak is the final RMSNorm's eager backward
    close(bwd, 0.01)


def test_fp8_torchao_matches_torchao():
    pytest.importorskip("torchao.float8")
    kept, peak = F.fp8_cases()
    assert kept.measured_bytes == 0 and kept.estimated_bytes == 0
    close(peak, 0.01)


def test_optimizer_in_backward_matches_torchtune():
    if importlib.util.find_spec("torchtune") is None:
        pytest.skip("torchtune not installed")
    left, peak = F.optimizer_in_backward_cases()
    assert left.measured_bytes == 0
    close(peak, 0.01)


def test_activation_offloading_matches_torchtune():
    # torchtune's OffloadActivations itself (copy stream, forward stash of 5 packs, reloads
    # freed one autograd node later) around an HF Llama's decoder
    if importlib.util.find_spec("torchtune") is None:
        pytest.skip("torchtune not installed")
    removed, fwd_peak, bwd_peak = F.offload_cases()
    # what is at stake: offloading removes almost everything a layer keeps (2 layers' worth)
    per_layer = F.template_layer(F.LLAMA, 1, dtype="bf16", master_weights=False).F.net_bytes
    assert removed.measured_bytes > 1.9 * per_layer
    for row in (removed, fwd_peak, bwd_peak):
        close(row, 0.01)


@pytest.mark.parametrize("optimizer,cls", [("adam8bit", "AdamW8bit"), ("adam4bit", "AdamW4bit")])
def test_quantized_optimizer_states_match_torchao(optimizer, cls):
    # torchao's own optimizer allocates the two Adam states of every parameter of an HF Llama
    # (its _new_buffer: block-quantized codes + fp32 block scales + the code map; tensors under
    # 4096 elements stay in the parameter's dtype); pipemem's resident optimizer bytes for the
    # same model must match them
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    optim = pytest.importorskip("torchao.optim")
    import pipemem

    cfg = {
        "model_type": "llama",
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "intermediate_size": 1536,
        "vocab_size": 32000,
    }
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.bfloat16)
    params = list(model.parameters())
    opt = getattr(optim, cls)(params)

    def nbytes(t):
        if hasattr(t, "__tensor_flatten__"):
            return sum(nbytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    reference = sum(nbytes(opt._new_buffer(p, True)) + nbytes(opt._new_buffer(p, False)) for p in params)
    est = (
        pipemem.estimate(
            cfg, seq_len=128, micro_batch=1, dtype="bf16", master_weights=False, optimizer=optimizer
        )
        .ranks[0]
        .static.optimizer
    )
    assert abs(est - reference) <= 0.005 * reference, (est, reference)


def test_quantized_optimizer_states_match_bitsandbytes():
    # bitsandbytes' own AdamW8bit allocates its states (init_state: uint8 codes, an fp32 absmax
    # per block of 256 and a 256-entry code map per state; parameters under 4096 elements get
    # 32-bit states): pipemem's resident optimizer bytes for the same HF Llama must match them
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    bnb = pytest.importorskip("bitsandbytes")
    import pipemem

    cfg = {
        "model_type": "llama",
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "intermediate_size": 1536,
        "vocab_size": 32000,
    }
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.bfloat16)
    opt = bnb.optim.AdamW8bit(model.parameters())
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            opt.init_state(group, p, gi, pi)
    reference = sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
    )
    # 8-bit: about half of what two bf16 states would take (4 B per parameter)
    assert reference < 0.55 * sum(4 * p.numel() for p in model.parameters())
    est = (
        pipemem.estimate(
            cfg, seq_len=128, micro_batch=1, dtype="bf16", master_weights=False, optimizer="adam8bit"
        )
        .ranks[0]
        .static.optimizer
    )
    assert abs(est - reference) <= 0.005 * reference, (est, reference)


LORA_CASES = [(dt, d) for dt in ("bf16", "fp32") for d in (0.0, 0.1)]


@pytest.mark.parametrize("dtype, dropout", LORA_CASES)
def test_lora_matches_peft(dtype, dropout):
    # PEFT's own LoraLayer (get_peft_model, adapters on every linear, upcast to fp32 as PEFT does)
    # on an HF Llama traced on fake tensors, against --lora-rank under the hf convention
    if F.peft_prepare(dropout) is None:
        pytest.skip("peft not installed")
    kept, fwd, bwd = F.lora_peft_cases(dtype, dropout)
    full = F.template_layer(F.LLAMA, 1, dtype=dtype, master_weights=False)
    # what is at stake: the frozen linears save no input, but PEFT's fp32 copies of each input
    # (one per adapter, and with dropout a second one and its mask) are kept
    tokens_h = F.S * F.B * F.LLAMA["hidden_size"]
    assert kept.measured_bytes != full.F.net_bytes
    if dtype == "bf16":
        assert kept.measured_bytes > 4 * tokens_h * 4  # q, k, v, gate, up each keep an fp32 copy
    for row in (kept, fwd, bwd):
        close(row, 0.001)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_matches_peft_under_autocast(dropout):
    # the bf16 model under the Trainer's bf16 autocast (--bf16; LLaMA-Factory's default) with PEFT's
    # fp32 adapters, run on bf16 casts of their inputs and weights: --lora-rank with master weights
    if F.peft_prepare(dropout) is None:
        pytest.skip("peft not installed")
    kept, fwd, bwd = F.lora_peft_cases("bf16", dropout, autocast=True)
    pure = F.lora_peft_cases("bf16", dropout)[0]
    # what is at stake: autocast keeps bf16 casts of the adapters' inputs, not PEFT's fp32 copies
    assert kept.measured_bytes < pure.measured_bytes
    close(kept, 0.001)
    # the peaks: within 0.8 % (an r-wide weight-grad cast the template frees a little early)
    for row in (fwd, bwd):
        close(row, 0.01)


@pytest.mark.parametrize("dtype, dropout", LORA_CASES)
def test_lora_matches_torchtune(dtype, dropout):
    # torchtune's own LoRALinear (lora_llama3_2, every layer linear) traced, against --lora-rank
    # under the torchtune convention
    if F.torchtune_lora_decoder(dtype, dropout) is None:
        pytest.skip("torchtune not installed")
    kept, fwd, bwd = F.lora_torchtune_cases(dtype, dropout)
    full = F.template_layer(F.TT_LLAMA, 1, convention="torchtune", dtype=dtype)
    if not dropout and dtype == "bf16":
        # frozen linears save no input, nor the norms' weight products: less than full fine-tuning
        assert kept.measured_bytes < full.F.net_bytes
    if not dropout and dtype == "fp32":
        # in fp32 every input a frozen linear no longer saves is saved by its adapter's A: what
        # LoRA adds is each B's r-wide input (7 adapters), within a few scalars
        assert abs(kept.measured_bytes - full.F.net_bytes - 7 * F.S * F.B * F.LORA_RANK * 4) < 64
    for row in (kept, fwd, bwd):
        close(row, 0.001)
