"""`--from-megatron`: NVIDIA's own example scripts as pasted, and every Megatron-LM argument that
changes memory honoured or refused by name."""

import math
import re
import shlex
from pathlib import Path

import pytest

import pipemem
from pipemem.configs import read_megatron
from pipemem.configs.megatron import KNOWN, NO_MEMORY_EFFECT, REFUSED
from pipemem.errors import UserError
from pipemem.estimate import suggest_fixes
from pipemem.model import arch_from_hf_config

DATA = Path(__file__).parent / "data" / "megatron"
GIB = 1 << 30


def script_argv(name: str) -> list[str]:
    text = (DATA / name).read_text()
    return shlex.split(" ".join(line for line in text.splitlines() if not line.startswith("#")))


def without(argv: list[str], *flags: str) -> list[str]:
    """argv minus the given options and their values."""
    out, skip = [], False
    for tok in argv:
        if tok.startswith("--"):
            skip = tok[2:] in flags
        if not skip:
            out.append(tok)
    return out


FP8 = ("fp8-format", "fp8-amax-history-len", "fp8-amax-compute-algo", "fp8-param-gather")


def test_llama3_8b_fp8_script_as_pasted_runs_transformer_engine_fp8():
    tc = read_megatron(script_argv("llama3_8b_h100_fp8.txt"))
    assert tc.warnings == []
    p = tc.plan
    # --fp8-format hybrid without --fp8-recipe: Megatron's default recipe, delayed scaling
    assert (p["fp8"], p.get("fp8_param_gather"), p["loss"]) == ("delayed", True, "fused")
    fp8 = pipemem.estimate(tc.model, **p).ranks[0]
    bf16 = pipemem.estimate(tc.model, **{k: v for k, v in p.items() if not k.startswith("fp8")}).ranks[0]
    # fp8 primary weights (1 B) + their transposes (1 B) instead of bf16 weights; the linears
    # keep fp8 inputs for their weight grads, so the in-flight activations shrink
    assert fp8.static.params < bf16.static.params and fp8.static.other > 0
    assert fp8.activation_hwm_bytes < bf16.activation_hwm_bytes


def test_llama3_8b_script_in_bf16_reduces_grads_in_bf16():
    tc = read_megatron(without(script_argv("llama3_8b_h100_fp8.txt"), *FP8))
    assert tc.warnings == []  # every argument known: honoured or without memory effect
    p = tc.plan
    assert (p["dp"], p["tp"], p["seq_len"], p["dist_opt"], p["flash_attn"]) == (8, 1, 8192, True, True)
    assert (p["dtype"], p["main_grad_dtype"]) == ("bf16", "bf16")  # --grad-reduce-in-bf16
    est = pipemem.estimate(tc.model, **p)
    st = est.ranks[0].static
    assert st.grads == st.params  # bf16 main grads: 2 bytes per parameter, like the weights
    fp32 = pipemem.estimate(tc.model, **{**p, "main_grad_dtype": "fp32"})
    assert fp32.ranks[0].static.grads == 2 * st.grads
    assert fp32.max_peak_allocated_bytes - est.max_peak_allocated_bytes == st.grads


def test_mixtral_script_needs_its_multinode_world():
    argv = script_argv("mixtral_8x7b_distributed.txt")
    # one node of 8 GPUs at pp 4 leaves 2 ranks per stage: expert parallel 8 does not fit (Megatron fails too)
    with pytest.raises(UserError, match="--ep 8 must divide --dp 2"):
        tc = read_megatron(argv)
        pipemem.estimate(tc.model, **tc.plan)
    argv[argv.index("--nnodes") + 1] = "4"
    tc = read_megatron(argv)
    # every argument honoured or without memory effect, but its aux loss's [T, E] fp32 scores
    assert [w.split(":")[1].strip() for w in tc.warnings] == [
        "--moe-router-load-balancing-type aux_loss with --moe-aux-loss-coeff > 0"
    ]
    a = arch_from_hf_config(tc.model)
    assert (a.experts, a.top_k, a.expert_ffn, a.kv_heads, a.shared_experts) == (8, 2, 14336, 8, 0)
    assert (tc.plan["dp"], tc.plan["pp"], tc.plan["ep"], tc.plan["main_grad_dtype"]) == (8, 4, 8, "fp32")
    est = pipemem.estimate(tc.model, **tc.plan, gpu="h100-80g")
    assert len(est.ranks) == 4 and est.max_peak_allocated_bytes > 10 * GIB


def test_argument_sets_are_disjoint():
    assert not KNOWN & NO_MEMORY_EFFECT and not KNOWN & set(REFUSED) and not NO_MEMORY_EFFECT & set(REFUSED)


BASE = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4 "
    "--seq-length 2048 --swiglu --normalization RMSNorm --position-embedding-type rope --vocab-size 32000 "
    "--disable-bias-linear --untie-embeddings-and-output-weights --micro-batch-size 1 --world-size 8 "
)


def read(extra: str):
    return read_megatron(shlex.split(BASE + extra))


@pytest.mark.parametrize(
    "flag",
    [
        "--fp8-recipe tensorwise",
        "--fp8-param-gather",
        "--fp8-recipe blockwise",
        "--fp4-format e2m1",
        "--cpu-offloading",
        "--tp-comm-overlap",
        "--fine-grained-activation-offloading",
        "--fp16-lm-cross-entropy",
        "--mtp-num-layers 1",
        "--enable-cuda-graph",
        "--transformer-impl local",
        "--overlap-moe-expert-parallel-comm",
        "--spec megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec",
    ],
)
def test_memory_flags_not_modelled_are_refused_by_name(flag):
    with pytest.raises(UserError, match="^Megatron: " + flag.split()[0]):
        read(flag)


def test_fp8_offload_and_loss_fusion_flags_map_to_the_plan():
    p = read(
        "--bf16 --fp8-format e4m3 --fp8-recipe mxfp8 --cross-entropy-loss-fusion "
        "--cross-entropy-fusion-impl te --optimizer-cpu-offload --optimizer-offload-fraction 0.5 "
        "--use-precision-aware-optimizer "
        "--fine-grained-activation-offloading --offload-modules expert_fc1,qkv_linear"
    ).plan
    assert (p["fp8"], p["loss"], p["optimizer_offload"]) == ("mxfp8", "fused_te", 0.5)
    assert p["activation_offload"] == "expert_fc1,qkv"
    # Megatron-LM asserts the precision-aware optimizer with CPU offload (its code path)
    with pytest.raises(
        UserError, match="^Megatron: --optimizer-cpu-offload needs --use-precision-aware-optimizer"
    ):
        read("--bf16 --use-distributed-optimizer --optimizer-cpu-offload")
    with pytest.raises(UserError, match="^Megatron: --offload-modules 'mystery'"):
        read("--fine-grained-activation-offloading --offload-modules mystery")


def test_refused_flag_switched_off_is_accepted():
    assert read("--tp-comm-overlap false").warnings == []


@pytest.mark.parametrize(
    "extra,grad",
    [
        ("--bf16", "fp32"),
        ("--bf16 --grad-reduce-in-bf16", "bf16"),
        ("--bf16 --main-grads-dtype bf16", "bf16"),
        ("--fp16", "fp16"),
        ("--fp16 --accumulate-allreduce-grads-in-fp32", "fp32"),
    ],
)
def test_main_grad_dtype_as_megatron_resolves_it(extra, grad):
    assert read(extra).plan["main_grad_dtype"] == grad


def test_precision_aware_optimizer_dtypes_change_static_bytes():
    base = read("--bf16 --use-distributed-optimizer")
    low = read(
        "--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --main-params-dtype fp16 "
        "--exp-avg-dtype bf16 --exp-avg-sq-dtype fp8"
    )
    assert low.plan["extra"] == {
        "precision_aware_optimizer": True,
        "main_params_dtype": "fp16",
        "exp_avg_dtype": "bf16",
        "exp_avg_sq_dtype": "fp8",
    }
    o_base = pipemem.estimate(base.model, **base.plan).ranks[0].static.optimizer
    o_low = pipemem.estimate(low.model, **low.plan).ranks[0].static.optimizer
    # per parameter (then sharded over dp 8): master 4 + m 4 + v 4 = 12 vs 2 + 2 + 2 = 6 (an fp8
    # moment is TE's Float8Tensor: uint8 data and, on Hopper, a uint8 transpose)
    assert o_low * 12 == pytest.approx(o_base * 6, rel=1e-3)
    # fp32 masters of bf16 weights: TE keeps the int16 remainders megatron asks for (2 bytes),
    # unless an fp8 recipe other than delayed scaling leaves megatron its own fp32 masters
    default = read("--bf16 --use-distributed-optimizer --use-precision-aware-optimizer")
    o_default = pipemem.estimate(default.model, **default.plan).ranks[0].static.optimizer
    assert o_default * 12 == pytest.approx(o_base * 10, rel=1e-3)
    current = read(
        "--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --fp8-format hybrid "
        "--fp8-recipe tensorwise"
    )
    assert current.plan.get("fp8") == "current"
    o_current = pipemem.estimate(current.model, **current.plan).ranks[0].static.optimizer
    assert o_current == pytest.approx(o_base, rel=1e-3)
    with pytest.raises(UserError, match="--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"):
        read("--bf16 --exp-avg-dtype bf16")


def test_no_gradient_accumulation_fusion_keeps_eager_weight_grads():
    fused = read("--bf16 --vocab-size 1000")
    eager = read("--bf16 --vocab-size 1000 --no-gradient-accumulation-fusion")
    assert eager.plan["extra"] == {"wgrad_fused": False}
    w_fused = pipemem.estimate(fused.model, **fused.plan).ranks[0].jobs["W"].peak_bytes
    w_eager = pipemem.estimate(eager.model, **eager.plan).ranks[0].jobs["W"].peak_bytes
    # fused: the wgrad GEMM accumulates into the main grad; eager: a dW temporary first
    assert w_fused == 0 and w_eager > 0


def test_recompute_arguments():
    assert (
        read("--recompute-granularity full --recompute-method block --recompute-num-layers 4").plan[
            "recompute_layers"
        ]
        == 4
    )
    assert (
        read("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1").plan[
            "recompute"
        ]
        == "full"
    )
    with pytest.raises(UserError, match="--recompute-num-layers 2 with --recompute-method uniform"):
        read("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2")
    with pytest.raises(UserError, match="--recompute-modules"):
        read("--recompute-granularity selective --recompute-modules mlp")
    assert (
        read("--recompute-granularity selective --recompute-modules core_attn").plan["recompute"]
        == "selective"
    )


MOE = "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 --moe-token-dispatcher-type alltoall "


def test_moe_shape_shared_experts_and_layer_freq():
    tc = read(
        MOE + "--moe-shared-expert-intermediate-size 1024 --moe-layer-freq ([1]*3+[0])*2 "
        "--expert-model-parallel-size 2"
    )
    a = arch_from_hf_config(tc.model)
    assert (a.experts, a.expert_ffn, a.shared_experts, a.shared_ffn, a.ffn) == (8, 512, 1, 1024, 2688)
    assert a.dense_layers == (3, 7)
    assert arch_from_hf_config(read(MOE + "--moe-layer-freq 2").model).dense_layers == (1, 3, 5, 7)
    with pytest.raises(UserError, match="--moe-layer-freq"):
        read(MOE + "--moe-layer-freq [1,0]")


def test_aux_loss_scores_are_said_with_their_size():
    """An auxiliary load-balancing loss with a coefficient above 0 keeps the router's [T, E] fp32
    scores per MoE layer (not modelled): a warning gives T x E x 4 for the plan's T
    (micro batch x seq / tp); the default coefficient 0, none and a zero coefficient say nothing."""
    tc = read(MOE + "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4")
    said = [w for w in tc.warnings if "auxiliary loss" in w]
    assert len(said) == 1 and "seq_aux_loss" in said[0]
    tokens = 1 * 2048  # micro batch 1, seq 2048, tp 1
    assert f"{tokens} x 8 x 4 B = {tokens * 8 * 4 / 2**20:.2f} MiB per MoE layer" in said[0]
    tp2 = read(
        MOE + "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01 "
        "--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 2"
    )
    assert any(f"{2 * 2048 // 2} x 8 x 4 B" in w for w in tp2.warnings), tp2.warnings
    # several types, one coefficient each; only those above 0 are named
    both = read(
        MOE + "--moe-router-load-balancing-type seq_aux_loss global_aux_loss --moe-aux-loss-coeff 0 1e-3"
    )
    assert [w.split(" with ")[0] for w in both.warnings if "auxiliary loss" in w] == [
        "Megatron: --moe-router-load-balancing-type global_aux_loss"
    ]
    for quiet in (
        "",
        "--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01",
        "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0",
    ):
        assert not [w for w in read(MOE + quiet).warnings if "auxiliary loss" in w]


@pytest.mark.parametrize(
    "extra,message",
    [
        ("--moe-router-load-balancing-type balanced", "--moe-router-load-balancing-type 'balanced'"),
        ("--moe-aux-loss-coeff lots", "--moe-aux-loss-coeff 'lots'"),
        ("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.1", "one per type"),
    ],
)
def test_aux_loss_flags_bad_values_are_one_line(extra, message):
    with pytest.raises(UserError, match="^Megatron.*" + re.escape(message)) as e:
        read(MOE + extra)
    assert "\n" not in str(e.value)


def test_deepseek_script_says_its_seq_aux_loss():
    argv = without(deepseek_r1_argv(), "moe-layer-recompute") + ["--vocab-size", "129280"]
    said = [w for w in read_megatron(argv).warnings if "auxiliary loss" in w]
    assert len(said) == 1 and "seq_aux_loss" in said[0] and "4096 x 256 x 4 B" in said[0]


def test_moe_default_dispatcher_with_expert_parallel_is_refused():
    with pytest.raises(UserError, match="--moe-token-dispatcher-type allgather"):
        read("--num-experts 8 --expert-model-parallel-size 2")


def test_megatron_plan_rules_in_suggestions():
    """A plan one step from tp > KV heads: the suggestions never propose it (megatron-core would
    all-gather the whole QKV projection; the plan rule refuses it)."""
    tc = read("--bf16 --tensor-model-parallel-size 4 --sequence-parallel")
    est = pipemem.estimate(tc.model, **tc.plan, gpu_memory=0.5)
    assert est.fits is False
    flags = [s["flags"] for s in suggest_fixes(est, limit=10)]
    assert flags and not any("--tp 8" in f for f in flags)
    with pytest.raises(UserError, match="--tp 8 does not divide the 4 KV heads"):
        pipemem.estimate(tc.model, **{**tc.plan, "tp": 8, "dp": 1})


def test_attention_backend_follows_transformer_engine_dtype_rules():
    """TE's flash / cuDNN fused attention take bf16 / fp16 only: an fp32 run (no --bf16/--fp16)
    gets the unfused attention under the default --attention-backend auto."""
    assert read("--bf16").plan.get("flash_attn", True) is True
    assert read("").plan["flash_attn"] is False
    assert (
        read("--bf16 --transformer-impl transformer_engine --attention-backend auto").plan["flash_attn"]
        is True
    )
    with pytest.raises(UserError, match="--attention-backend fused needs --bf16 or --fp16"):
        read("--attention-backend fused")


def test_interleaved_microbatch_group_other_than_pp_is_refused():
    vpp = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
    assert read(vpp + "--microbatch-group-size-per-virtual-pipeline-stage 2").plan["vpp"] == 2
    with pytest.raises(UserError, match="^Megatron: --microbatch-group-size-per-virtual-pipeline-stage 4"):
        read(vpp + "--microbatch-group-size-per-virtual-pipeline-stage 4")


def test_megatron_fsdp_fp8_param_gather_keeps_a_shard_of_the_fp8_weights():
    """examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh: Megatron-FSDP optim_grads_params with
    --fp8-param-gather. Each rank keeps 1/dp of the fp8 linear weights (1 byte) and 1/dp of the other
    parameters in bf16: the parameter bytes are positive and below the bf16 shard's."""
    tc = read_megatron(script_argv("llama3_8b_fsdp_h100_fp8.txt"))
    p = tc.plan
    assert p["zero"] == 3 and p["dp"] == 8 and p["fp8_param_gather"] is True
    fp8 = pipemem.estimate(tc.model, **p).ranks[0].static.params
    bf16 = pipemem.estimate(tc.model, **{**p, "fp8_param_gather": False}).ranks[0].static.params
    h, ffn, layers, kv = 4096, 14336, 32, 8 * 128  # the script's --hidden-size, --ffn-hidden-size ...
    linear = layers * (h * (h + 2 * kv) + h * h + 3 * h * ffn)  # qkv, proj, fc1 (gate + up), fc2
    assert 0 < fp8 < bf16 and bf16 - fp8 == -(-linear // 8) * (2 - 1)


# DeepSeek-V3 in Megatron-LM's own arguments (multi-head latent attention, DeepSeek's MoE, MTP)


def deepseek_r1_argv() -> list[str]:
    """NVIDIA Megatron-LM examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh, its
    MODEL_ARGS as the file gives them (tests/data/megatron/deepseek_r1_modelopt.txt)."""
    return script_argv("deepseek_r1_modelopt.txt")


def test_deepseek_v3_arguments_as_pasted_refuse_moe_layer_recompute():
    with pytest.raises(UserError, match="^Megatron: --moe-layer-recompute recomputes the MoE layer") as e:
        read_megatron(deepseek_r1_argv())
    assert "\n" not in str(e.value)


def test_deepseek_v3_arguments_read_into_its_model():
    """Megatron-LM's DeepSeek-R1 (DeepSeek-V3) arguments, less --moe-layer-recompute and with
    the tokenizer's vocabulary: every argument known, the model DeepSeek-V3's 671B shape."""
    argv = without(deepseek_r1_argv(), "moe-layer-recompute") + ["--vocab-size", "129280"]
    tc = read_megatron(argv)
    assert not [w for w in tc.warnings if "not modelled" in w], tc.warnings
    a = arch_from_hf_config(tc.model)
    assert (a.q_lora_rank, a.kv_lora_rank, a.head_dim, a.qk_rope_head_dim, a.v_head_dim) == (
        1536,
        512,
        192,
        64,
        128,
    )
    assert (a.experts, a.top_k, a.expert_ffn, a.dense_layers) == (256, 8, 2048, (0, 1, 2))
    assert (a.shared_experts * a.shared_ffn, a.ffn) == (2048, 18432)
    assert (a.router, a.router_groups, a.router_topk_groups, a.routed_scaling) == ("sigmoid_group", 8, 4, 2.5)
    assert a.mtp_layers == 0 and round(a.param_count() / 1e9) == 671
    assert (tc.plan["recompute"], tc.plan["sp"], tc.plan["convention"]) == ("selective", True, "megatron")


def test_deepseek_v3_with_mtp_on_pipeline_stages():
    """--mtp-num-layers 1 adds the MTP block to the last stage only: its enorm / hnorm / eh_proj,
    one MoE layer (the decoder's last kind), its final norm and a copy of the word embedding,
    in the param dtype; every other rank is unchanged."""
    from pipemem.model import mtp_param_shapes

    argv = without(deepseek_r1_argv(), "moe-layer-recompute") + shlex.split(
        "--vocab-size 129280 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 "
        "--decoder-first-pipeline-num-layers 5 --expert-model-parallel-size 64 --world-size 1024 "
        "--global-batch-size 512 --use-distributed-optimizer --seq-length 1024"
    )
    base = read_megatron(argv)
    mtp = read_megatron(argv + ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"])
    assert arch_from_hf_config(mtp.model).mtp_layers == 1
    e0 = pipemem.estimate(base.model, **base.plan)
    e1 = pipemem.estimate(mtp.model, **mtp.plan)
    assert [r.static.params for r in e0.ranks[:-1]] == [r.static.params for r in e1.ranks[:-1]]
    a = arch_from_hf_config(mtp.model)
    vocab = -(-a.vocab // (1280 * 2)) * 1280 * 2  # --make-vocab-size-divisible-by 1280 x tp
    etp = e1.plan.etp  # Megatron's expert tensor parallelism defaults to tp
    shapes = mtp_param_shapes(a, vocab, 2, etp, 64, with_embedding=True)
    added = sum(math.prod(shape) for shape, _ in shapes)
    assert e1.ranks[-1].static.params - e0.ranks[-1].static.params == 2 * added
    assert e1.ranks[-1].peak_allocated_bytes > e0.ranks[-1].peak_allocated_bytes
    assert any("multi-token prediction: 1 depth" in w for w in e1.warnings)


DEEPSEEK = BASE.replace("--group-query-attention --num-query-groups 4 ", "") + (
    "--bf16 --multi-latent-attention --qk-layernorm --q-lora-rank 96 --kv-lora-rank 64 --qk-head-dim 32 "
    "--qk-pos-emb-head-dim 16 --v-head-dim 32 --num-experts 8 --moe-router-topk 2 "
    "--moe-ffn-hidden-size 128 --moe-token-dispatcher-type alltoall "
)


@pytest.mark.parametrize(
    "extra,message",
    [
        ("--kv-lora-rank 64", "--kv-lora-rank needs --multi-latent-attention"),
        ("--multi-latent-attention", "without --qk-layernorm"),
        ("--multi-latent-attention --qk-layernorm --kv-lora-rank 64", "needs --qk-head-dim"),
        ("--mtp-num-layers 1", "--mtp-num-layers without --multi-latent-attention"),
    ],
)
def test_mla_arguments_inconsistent_are_one_line(extra, message):
    with pytest.raises(UserError, match=message) as e:
        read(extra)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra,message",
    [
        ("--moe-router-num-groups 3 --moe-router-group-topk 1", "--moe-router-num-groups 3 must divide"),
        ("--moe-router-group-topk 2", "--moe-router-group-topk without its pair"),
        ("--moe-router-num-groups 4 --moe-router-group-topk 5", "--moe-router-group-topk 5 must be in 1..4"),
        ("--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid"),
        ("--moe-router-score-function sinkhorn", "'sinkhorn': expected softmax or sigmoid"),
        ("--moe-shared-expert-intermediate-size 100", "not a multiple of --moe-ffn-hidden-size 128"),
        ("--moe-layer-freq [0]*3+[1]*6", "needs one 0 or 1 per layer"),
    ],
)
def test_deepseek_moe_arguments_inconsistent_are_one_line(extra, message):
    with pytest.raises(UserError, match=message) as e:
        read_megatron(shlex.split(DEEPSEEK + extra))
    assert "\n" not in str(e.value)


def test_inconsistent_mla_arguments_exit_2(capsys):
    from pipemem.cli.main import main

    argv = ["estimate", "--from-megatron", "--"] + shlex.split(BASE + "--v-head-dim 64")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--v-head-dim needs --multi-latent-attention" in err and len(err.splitlines()) == 1


def test_deepseek_router_choices_are_read():
    """sigmoid: DeepSeek-V3's router (a DeepSeek-V3 config); softmax: DeepSeek-V2's."""
    v3 = read_megatron(
        shlex.split(
            DEEPSEEK + "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
            "--moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5"
        )
    )
    a = arch_from_hf_config(v3.model)
    assert (a.router, a.router_groups, a.router_topk_groups, a.routed_scaling) == ("sigmoid_group", 4, 2, 2.5)
    v2 = arch_from_hf_config(read_megatron(shlex.split(DEEPSEEK)).model)
    assert (v2.model_type, v2.router, v2.router_groups) == ("deepseek_v2", "softmax", 1)
    # the sigmoid router keeps its [tokens, experts] fp32 scores: more than the softmax top-k
    p = dict(v3.plan, ep=2, dp=8)
    s3 = pipemem.estimate(v3.model, **p).ranks[0].jobs["F"].net_bytes
    s2 = pipemem.estimate(read_megatron(shlex.split(DEEPSEEK)).model, **p).ranks[0].jobs["F"].net_bytes
    assert s3 > s2


def case_argv(case) -> list[str]:
    """A DeepSeek-style `validate megatron` case as Megatron-LM arguments."""
    text = (
        f"--num-layers {case.layers} --hidden-size {case.hidden} --num-attention-heads {case.heads} "
        f"--ffn-hidden-size {case.ffn} --seq-length {case.seq_len} --max-position-embeddings {case.seq_len} "
        "--swiglu --normalization RMSNorm --position-embedding-type rope "
        f"--vocab-size {case.vocab} --disable-bias-linear --untie-embeddings-and-output-weights "
        f"--micro-batch-size {case.micro_batch} --global-batch-size {case.micro_batch * case.dp} --bf16 "
        f"--world-size {case.world} --tensor-model-parallel-size {case.tp} --expert-model-parallel-size "
        f"{case.ep} --use-distributed-optimizer --use-flash-attn --multi-latent-attention --qk-layernorm "
        f"--kv-lora-rank {case.kv_lora_rank} --qk-head-dim {case.qk_head_dim} "
        f"--qk-pos-emb-head-dim {case.qk_pos_emb_head_dim} --v-head-dim {case.v_head_dim} "
    )
    if case.sp and case.tp > 1:
        text += "--sequence-parallel "
    if case.q_lora_rank:
        text += f"--q-lora-rank {case.q_lora_rank} "
    if case.mtp_layers:
        text += f"--mtp-num-layers {case.mtp_layers} --mtp-loss-scaling-factor 0.1 "
    if case.experts:
        dense = "[0]*%d+[1]*%d" % (case.dense_layers, case.layers - case.dense_layers)
        text += (
            f"--num-experts {case.experts} --moe-router-topk {case.top_k} --moe-ffn-hidden-size "
            f"{case.expert_ffn} --moe-shared-expert-intermediate-size {case.shared_ffn} "
            f"--moe-layer-freq {dense} --moe-router-score-function sigmoid "
            f"--moe-router-enable-expert-bias --moe-router-num-groups {case.router_groups} "
            f"--moe-router-group-topk {case.router_group_topk} --moe-router-topk-scaling-factor "
            f"{case.topk_scaling} --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall "
        )
    return shlex.split(text)


@pytest.mark.parametrize("name", ["mla-tp1", "mla-tp2-sp", "mtp-tp2-sp", "deepseek-mtp-ep2"])
def test_validation_cases_are_what_the_reader_reads(name):
    """The DeepSeek-style `validate megatron` cases, given as Megatron-LM arguments: the
    reader's estimate is the case's to the byte."""
    from pipemem.validation.megatron import CASES, estimate_case

    case = next(c for c in CASES if c.name == name)
    tc = read_megatron(case_argv(case))
    assert tc.warnings == []
    est = pipemem.estimate(tc.model, **tc.plan).ranks[case.pp_rank]
    want = estimate_case(case)
    assert (est.peak_allocated_bytes, est.static.total) == (want["peak_bytes"], want["static_bytes"])
