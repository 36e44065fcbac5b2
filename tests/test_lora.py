"""LoRA / QLoRA plans (pipemem.lora): static bytes against the libraries' own models and
storage formats, and the refusals of what is not modelled. The activations are held against
PEFT's and torchtune's own modules traced in tests/test_features_vs_libraries.py."""

import re

import pytest

import pipemem
from pipemem.errors import UserError
from pipemem.lora import nf4_bytes, parse_targets

CFG = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "intermediate_size": 1536,
    "vocab_size": 32000,
}


def est(**kw):
    kw.setdefault("convention", "hf")
    return pipemem.estimate(CFG, seq_len=128, micro_batch=1, dtype="bf16", **kw)


def test_static_bytes_match_a_peft_model():
    # the parameters PEFT's get_peft_model leaves (bf16 base, fp32 adapters), their trainable
    # share, and AdamW's two states per trainable element
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**CFG), dtype=torch.bfloat16
        )
        pm = peft.get_peft_model(
            model, peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj", "down_proj"])
        )
    params = sum(p.numel() * p.element_size() for p in pm.parameters())
    trainable = sum(p.numel() * p.element_size() for p in pm.parameters() if p.requires_grad)
    st = est(master_weights=False, lora_rank=16, lora_targets="q_proj,v_proj,down_proj").ranks[0].static
    assert st.params == params
    assert st.grads_in_step == trainable  # set-to-none grads, fp32 as the adapters
    assert st.optimizer == 2 * trainable
    full = est(master_weights=False).ranks[0].static
    assert st.optimizer < full.optimizer / 50


def test_torchtune_adapters_in_the_model_dtype():
    st = est(convention="torchtune", lora_rank=16, lora_targets="all-linear").ranks[0].static
    per_layer = 16 * sum(o + i for o, i in [(512, 512), (256, 512), (256, 512), (512, 512)])
    per_layer += 16 * 3 * (1536 + 512)
    assert st.grads_in_step == 4 * per_layer * 2
    assert st.optimizer == 2 * 4 * per_layer * 2


def test_nf4_bytes_match_bitsandbytes():
    # bitsandbytes' own quantize_4bit (NF4, blocksize 64, double quantization) on CPU tensors:
    # the packed codes, the quantized absmax, the second level's absmax / code and the offset,
    # and the NF4 code itself
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    for shape in [(512, 512), (1536, 512), (4096, 1000)]:
        w = torch.randn(*shape, dtype=torch.bfloat16)
        for dq in (True, False):
            q, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=dq, quant_type="nf4")
            tensors = [q, state.absmax, state.code]
            if dq:
                tensors += [state.offset, state.state2.absmax, state.state2.code]
            real = sum(t.numel() * t.element_size() for t in tensors)
            assert nf4_bytes(w.numel(), dq) == real, (shape, dq)
            assert real < 0.3 * w.numel() * 2  # about a quarter of the bf16 weight


def test_qlora_quantizes_the_layer_linears():
    lora = est(lora_rank=16, lora_targets="all-linear").ranks[0].static
    q = est(lora_rank=16, lora_targets="all-linear", qlora=True).ranks[0].static
    linears = [512 * 512, 256 * 512, 256 * 512, 512 * 512] + 3 * [1536 * 512]  # one layer's
    assert lora.params - q.params == 4 * sum(2 * n - nf4_bytes(n) for n in linears)
    # torchtune quantizes only the targeted linears
    tt = est(convention="torchtune", lora_rank=16, lora_targets="q_proj,v_proj", qlora=True).ranks[0].static
    tt_lora = est(convention="torchtune", lora_rank=16, lora_targets="q_proj,v_proj").ranks[0].static
    assert tt_lora.params - tt.params == 4 * sum(2 * n - nf4_bytes(n) for n in [512 * 512, 256 * 512])


def test_lora_alpha_moves_nothing_and_targets_read_both_namings():
    a = est(lora_rank=8, lora_targets="q_proj,output_proj,w1", lora_alpha=16)
    b = est(lora_rank=8, lora_targets="q,o,gate", lora_alpha=64)
    assert a.max_peak_allocated_bytes == b.max_peak_allocated_bytes
    assert parse_targets("all") == parse_targets("all-linear") == parse_targets("q,k,v,o,gate,up,down")
    assert est(lora_rank=8).to_dict()["plan"]["lora_targets"] == "q,v"  # PEFT's default


def test_dropout_keeps_more():
    a = est(lora_rank=8, lora_targets="all-linear").ranks[0].activations_at_peak_bytes
    b = est(lora_rank=8, lora_targets="all-linear", lora_dropout=0.05).ranks[0].activations_at_peak_bytes
    assert b > a


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(qlora=True), "--qlora needs --lora-rank"),
        (dict(lora_dropout=0.1), "--lora-dropout needs --lora-rank"),
        (dict(lora_alpha=16), "--lora-alpha needs --lora-rank"),
        (dict(lora_rank=8, lora_targets="mlp.c_fc"), "--lora-targets 'mlp.c_fc'"),
        (dict(lora_rank=-1), "--lora-rank -1"),
        (dict(lora_rank=8, lora_dropout=1.5), "--lora-dropout 1.5"),
        (dict(lora_rank=8, convention="megatron"), "--lora-rank with --convention megatron"),
        (dict(lora_rank=8, compile=True), "--compile with --lora-rank"),
        (dict(lora_rank=8, qlora=True, dtype="fp32"), "--qlora computes in bf16"),
    ],
)
def test_refusals_name_the_flag(kw, words):
    kw.setdefault("convention", "hf")
    dtype = kw.pop("dtype", "bf16")
    with pytest.raises(UserError, match=re.escape(words)):
        pipemem.estimate(CFG, seq_len=128, micro_batch=1, dtype=dtype, **kw)


def test_lora_refused_on_unmodelled_layers():
    gpt2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 8, "vocab_size": 512}
    with pytest.raises(UserError, match="LoRA is modelled on Llama-like layers"):
        pipemem.estimate(gpt2, seq_len=128, convention="hf", lora_rank=8)


TRL = [
    "trl",
    "sft",
    "--model_name_or_path",
    "meta-llama/Meta-Llama-3-8B",
    "--max_length",
    "1024",
    "--bf16",
    "--per_device_train_batch_size",
    "1",
]


def test_trl_peft_flags_are_read():
    # TRL's ModelConfig (trl/trainer/model_config.py): --use_peft with lora_r 16 and lora_dropout
    # 0.05 by default; --lora_target_modules takes a list; --load_in_4bit is nf4 without nested
    # quantization unless --use_bnb_nested_quant
    _, plan = pipemem.read_config("hf-trainer", TRL + ["--use_peft"], layers=2)
    assert (plan["lora_rank"], plan["lora_dropout"]) == (16, 0.05) and "lora_targets" not in plan
    argv = TRL + [
        "--use_peft",
        "--lora_r",
        "32",
        "--lora_alpha",
        "64",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
    ]
    _, plan = pipemem.read_config("hf-trainer", argv + ["--load_in_4bit"], layers=2)
    assert (plan["lora_rank"], plan["lora_targets"], plan["qlora"]) == (32, "q_proj,v_proj", True)
    assert plan["extra"]["qlora_double_quant"] is False
    model, nested = pipemem.read_config(
        "hf-trainer", argv + ["--load_in_4bit", "--use_bnb_nested_quant"], layers=2
    )
    plain = pipemem.estimate(model, **plan).ranks[0].static.params
    dq = pipemem.estimate(model, **nested).ranks[0].static.params
    # nested quantization stores one byte per 64 weights instead of an fp32 absmax: 3/64 B per weight
    linears = 2 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    assert abs((plain - dq) - linears * 3 / 64) < 0.01 * linears * 3 / 64


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--lora_r", "8"], "--lora_r without --use_peft"),
        (["--load_in_4bit"], "--load_in_4bit without --use_peft"),
        (["--use_peft", "--use_dora"], "--use_dora"),
        (["--use_peft", "--load_in_4bit", "--bnb_4bit_quant_type", "fp4"], "fp4"),
    ],
)
def test_trl_refusals(extra, words):
    with pytest.raises(UserError, match=re.escape(words)):
        pipemem.read_config("hf-trainer", TRL + extra)


def test_bitsandbytes_qlora_linear_saves_nothing_more_and_dequantizes_once_per_pass():
    # PEFT on bitsandbytes' own Linear4bit (NF4, double quantization) on CPU tensors: its
    # MatMul4Bit saves no activation (the adapters save the same as over a bf16 base), and its
    # backward dequantizes the absmax (fp32) and the weight (bf16) once: what dequant_bytes counts
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipemem.lora import dequant_bytes

    IN, OUT = 256, 768

    def model(quantized):
        if quantized:
            lin = bnb.nn.Linear4bit(
                IN, OUT, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True
            )
            lin.weight = bnb.nn.Params4bit(
                torch.randn(OUT, IN, dtype=torch.bfloat16),
                requires_grad=False,
                quant_type="nf4",
                compress_statistics=True,
            )
            lin = lin.to("cpu")
        else:
            lin = torch.nn.Linear(IN, OUT, bias=False, dtype=torch.bfloat16)
        holder = torch.nn.Module()
        holder.proj = lin
        holder.forward = lambda x: holder.proj(x)
        return peft.get_peft_model(holder, peft.LoraConfig(r=8, target_modules=["proj"]))

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.out = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func).startswith("bitsandbytes.dequantize"):
                self.out.append(out.numel() * out.element_size())
            return out

    saved = {}
    for q in (False, True):
        m = model(q)
        x = torch.randn(2, 320, IN, dtype=torch.bfloat16, requires_grad=True)
        got = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, got=got: (got.append(t), t)[1], lambda t: t):
            y = m(x)
        saved[q] = sorted(t.numel() * t.element_size() for t in got)
        if q:
            with Record() as rec:
                y.float().sum().backward()
            assert sum(rec.out) == dequant_bytes(IN * OUT, 2)
    weight_view = IN * OUT * 2  # nn.Linear saves W^T, a view of the frozen weight
    assert [s for s in saved[False] if s != weight_view] == saved[True]


@pytest.mark.parametrize(
    "kw",
    [
        dict(convention="torchtune", fsdp=True, dp=2),
        dict(convention="torchtune", fsdp=True, dp=2, qlora=True),
        dict(convention="hf", zero=3, dp=2),
        dict(convention="hf", zero=2, dp=2, lora_dropout=0.1),
        dict(convention="hf", dp=2, recompute="full"),
    ],
)
def test_sharded_lora_plans_stream_as_they_replay(kw):
    # the allocation stream of a LoRA plan reproduces the replay's allocated peak (reserved is
    # modelled): the frozen root unit is still gathered for the head's backward, no empty grads
    from pipemem.alloc_stream import rank_stream
    from pipemem.runtime import lower

    e = est(lora_rank=8, lora_targets="all-linear", microbatches=2, **kw)
    r = e.ranks[0]
    assert r.peak_reserved_bytes is not None and r.peak_reserved_bytes >= r.peak_allocated_bytes
    sp, sched = e.reserved_inputs
    first_mb = {s: m for s, m in sp.first_backward_overrides(sched)}  # as pipemem.reserved builds it
    ev = rank_stream(sp, lower(sched, e.runtime), r.pp_rank, r.static, r.source[2], sp.stages, first_mb)
    assert ev.allocated_peak() == r.peak_allocated_bytes
    full = est(microbatches=2, **{k: v for k, v in kw.items() if k not in ("qlora", "lora_dropout")})
    assert r.static.total < full.ranks[0].static.total


def test_cli_bad_target_is_one_line(capsys):
    from pipemem.cli.main import main

    rc = main(
        [
            "estimate",
            "--model",
            "llama3-8b",
            "--seq-len",
            "1024",
            "--lora-rank",
            "8",
            "--lora-targets",
            "c_fc",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--lora-targets 'c_fc'" in err and len(err.splitlines()) == 1
