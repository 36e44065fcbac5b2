"""`pipemem validate megatron`: the megatron convention against megatron-core's own training step.

Each case is one rank of a small Megatron-LM run. `megatron_trace.trace_case` runs
megatron-core's own code for it on fake tensors with a fake process group (GPTModel, its
DistributedDataParallel and optimizer, two steps through its own pipeline schedule; the GPU
kernel policy is stated there) and records every allocation. The same run is estimated
through `pipemem.estimate(...)` with the model and plan `--from-megatron` reads from the case's
Megatron-LM flags (`megatron_argv`), and two numbers are compared:

* `peak`: the rank's highest allocated bytes during the second (steady-state) step, static
  state included, against the estimate's `peak_allocated_bytes` for that pipeline rank;
* `layer_kept`: what decoder layer 0 of the rank keeps from its forward for its backward
  (the storages its forward made that are alive when the forward ends, its output
  included) against the sum of the estimate's `--explain` rows for that layer;
* `moe_layer_kept` (a DeepSeek-style case with dense first layers): the same for its first MoE
  layer.

The bytes resident when the second step's forward starts (params, grad buffer, optimizer
state, runtime buffers) are reported beside the rows as `static` (not a pass criterion:
megatron holds a few per-microbatch tensors across steps, see docs/ACCURACY.md).

Every case runs in its own Python process (megatron-core keeps global state). Exit 1 if a
row is off by more than 0.5 %.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from ..errors import UserError
from ..traced.kernel_workspace import ASSUMED
from .compare import CaseRow, add_listed_case_options, pick_cases

TRUTH = "traced"  # the framework's code on fake tensors, bytes counted by pipemem (compare.TRUTHS)
# megatron-core's step traced on fake tensors against the same flags' estimate: the same kernel
# policy on both sides, so a row may differ only by what the convention leaves out (0.5 %).
TOLERANCE = 0.005


@dataclass(frozen=True)
class MegatronCase:
    """One rank's training step as megatron-core runs it; field names follow pipemem's plan."""

    name: str
    kind: str = "dense"  # dense (Llama-style) | gpt (LayerNorm, GeLU, biases, learned positions) | moe
    layers: int = 2
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 512
    vocab: int = 1000
    seq_len: int = 128
    micro_batch: int = 2
    microbatches: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 2
    ep: int = 1
    sp: bool = True
    dist_opt: bool = True
    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"
    recompute_layers: int | None = None
    main_grad_dtype: str = "fp32"
    experts: int = 0
    top_k: int = 2
    expert_ffn: int = 0
    shared_ffn: int = 0
    grouped_gemm: bool = True
    pp_rank: int = 0
    dropout: float = 0.0
    ce_fusion: bool = False  # --cross-entropy-loss-fusion (native impl: fusions/fused_cross_entropy.py)
    offload: str = ""  # --fine-grained-activation-offloading --offload-modules (comma list)
    optimizer_offload: float | None = None  # --optimizer-cpu-offload --optimizer-offload-fraction F
    # --use-precision-aware-optimizer: "main/exp_avg/exp_avg_sq", the --main-params-dtype,
    # --exp-avg-dtype and --exp-avg-sq-dtype (e.g. "fp32/bf16/bf16")
    precision_aware: str = ""
    # kind "deepseek": --multi-latent-attention --qk-layernorm (MLASelfAttention) with these
    # --q-lora-rank (0: one q projection), --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim,
    # --v-head-dim; with experts, the DeepSeek router (--moe-router-score-function sigmoid
    # --moe-router-enable-expert-bias, group-limited top-k, --moe-router-topk-scaling-factor)
    # and the first `dense_layers` layers dense (--moe-layer-freq "([0]*k+[1]*rest)")
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_head_dim: int = 32
    qk_pos_emb_head_dim: int = 16
    v_head_dim: int = 32
    router_groups: int = 0
    router_group_topk: int = 0
    topk_scaling: float = 0.0
    dense_layers: int = 0
    mtp_layers: int = 0  # --mtp-num-layers

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def to_json(self) -> dict:
        return asdict(self)


EXAMPLE = """\
examples:
  pipemem validate megatron
  pipemem validate megatron --json
  pipemem validate megatron --cases dense-tp2-sp,moe-ep2-shared
"""

_PP = dict(layers=4, microbatches=4, dp=1)
# GPT-style: LayerNorm, GeLU MLP with biases, learned positions, dropout
_GPT = dict(kind="gpt", kv_heads=8, ffn=1024, dropout=0.1)
# Megatron's MoE over ep 2: 4 experts, top 2, one shared expert
_MOE_EP2 = dict(kind="moe", tp=1, dp=2, ep=2, experts=4, expert_ffn=256, shared_ffn=256)
# DeepSeek-style MoE over ep 2: 8 experts, top 2 within the best 2 of 4 groups, scaled, one
# shared expert, a dense first layer
_DEEPSEEK_MOE_EP2 = dict(
    kind="deepseek",
    tp=1,
    dp=2,
    ep=2,
    sp=False,
    experts=8,
    top_k=2,
    expert_ffn=128,
    shared_ffn=128,
    router_groups=4,
    router_group_topk=2,
    topk_scaling=2.5,
    dense_layers=1,
)
# activation offloading: [s, b, h] of 4M elements, so megatron's min_offloaded_tensor_size
# (1024 x 1024 elements) lets the activations go, as in real runs
_OFFLOAD = dict(layers=3, hidden=1024, ffn=2048, seq_len=4096, micro_batch=1, tp=1, dp=2, sp=False)
CASES = (
    MegatronCase("dense-tp1", tp=1, dp=2, sp=False),
    MegatronCase("dense-tp2-sp", tp=2, dp=2),
    MegatronCase("dense-tp2-nosp", tp=2, dp=2, sp=False),
    MegatronCase("dense-tp4-sp", tp=4, dp=1),
    MegatronCase("dense-tp2-sp-no-distopt", tp=2, dp=2, dist_opt=False),
    MegatronCase("dense-tp2-sp-selective", tp=2, dp=2, recompute="selective"),
    MegatronCase("dense-tp2-sp-full-uniform", tp=2, dp=2, recompute="full"),
    MegatronCase(
        "dense-tp2-sp-full-block1", tp=2, dp=2, recompute="full", recompute_method="block", recompute_layers=1
    ),
    MegatronCase("dense-tp1-ce-fusion", tp=1, dp=2, sp=False, ce_fusion=True),
    MegatronCase("dense-tp2-sp-ce-fusion", tp=2, dp=2, ce_fusion=True),
    MegatronCase("dense-tp2-sp-grad-bf16", tp=2, dp=2, main_grad_dtype="bf16"),
    MegatronCase(
        "dense-tp1-no-distopt-grad-bf16", tp=1, dp=2, sp=False, dist_opt=False, main_grad_dtype="bf16"
    ),
    MegatronCase("gpt-tp2-sp", tp=2, dp=2, **_GPT),
    MegatronCase("gpt-tp1-selective", tp=1, dp=2, sp=False, recompute="selective", **_GPT),
    MegatronCase("moe-ep2-shared", **_MOE_EP2),
    MegatronCase("pp2-first-tp2", tp=2, pp=2, pp_rank=0, **_PP),
    MegatronCase("pp2-last-tp2", tp=2, pp=2, pp_rank=1, **_PP),
    MegatronCase("pp2-last-full", tp=1, pp=2, pp_rank=1, recompute="full", layers=4, microbatches=3, dp=1),
    MegatronCase("dense-tp1-offload-attn", offload="core_attn,attn_proj", **_OFFLOAD),
    MegatronCase("dense-tp1-offload-qkv", offload="qkv_linear", **_OFFLOAD),
    MegatronCase(
        "pp2-first-offload-attn",
        offload="core_attn,attn_proj",
        pp=2,
        pp_rank=0,
        **dict(_OFFLOAD, layers=4, microbatches=4, dp=1),
    ),
    # --optimizer-cpu-offload: megatron's HybridDeviceOptimizer offloads the rank's optimizer
    # shards whole, in its order, while fewer than F x total elements are offloaded; 0.46 ends
    # at a shard boundary of this rank (3 of 8 shards, 46.1 %), 1.0 is Megatron-LM's default
    MegatronCase("dense-tp1-optimizer-offload", tp=1, dp=2, sp=False, optimizer_offload=1.0),
    MegatronCase("dense-tp1-optimizer-offload-0.46", tp=1, dp=2, sp=False, optimizer_offload=0.46),
    MegatronCase(
        "dense-tp1-optimizer-offload-0.46-grad-bf16",
        tp=1,
        dp=2,
        sp=False,
        optimizer_offload=0.46,
        main_grad_dtype="bf16",
    ),
    MegatronCase("moe-ep2-optimizer-offload", optimizer_offload=1.0, **_MOE_EP2),
    # --use-precision-aware-optimizer (Transformer Engine's FusedAdam, see megatron_trace's
    # _te_fused_adam): fp32 masters of bf16 weights kept as 16-bit remainders; fp16 masters;
    # fp8 moments (uint8 data + transpose)
    MegatronCase(
        "dense-tp1-precision-aware-bf16-states", tp=1, dp=2, sp=False, precision_aware="fp32/bf16/bf16"
    ),
    MegatronCase(
        "dense-tp1-precision-aware-fp16-main", tp=1, dp=2, sp=False, precision_aware="fp16/fp32/fp32"
    ),
    MegatronCase(
        "dense-tp1-precision-aware-fp8-states", tp=1, dp=2, sp=False, precision_aware="fp32/fp8/fp8"
    ),
    # DeepSeek-style: multi-head latent attention (MLASelfAttention), alone and with the DeepSeek
    # MoE (a dense first layer, sigmoid router with expert bias and group-limited top-k, a
    # shared expert) and multi-token prediction
    MegatronCase("mla-tp1", kind="deepseek", tp=1, dp=2, sp=False),
    MegatronCase("mla-tp1-no-q-lora", kind="deepseek", tp=1, dp=2, sp=False, q_lora_rank=0),
    MegatronCase("mla-tp1-selective", kind="deepseek", tp=1, dp=2, sp=False, recompute="selective"),
    MegatronCase("mla-tp1-full", kind="deepseek", tp=1, dp=2, sp=False, recompute="full"),
    MegatronCase("mla-tp2-sp", kind="deepseek", tp=2, dp=2),
    MegatronCase("mla-tp2-nosp", kind="deepseek", tp=2, dp=2, sp=False),
    MegatronCase("deepseek-moe-ep2", **_DEEPSEEK_MOE_EP2),
    MegatronCase("mtp-tp1", kind="deepseek", tp=1, dp=2, sp=False, mtp_layers=1),
    MegatronCase("mtp2-tp1", kind="deepseek", tp=1, dp=2, sp=False, mtp_layers=2),
    MegatronCase("mtp-tp2-sp", kind="deepseek", tp=2, dp=2, mtp_layers=1),
    # the last stage holds its own copy of the word embedding for MTP
    MegatronCase("mtp-pp2-last", kind="deepseek", tp=1, sp=False, pp=2, pp_rank=1, mtp_layers=1, **_PP),
    MegatronCase("deepseek-mtp-ep2", **_DEEPSEEK_MOE_EP2, mtp_layers=1),
)
# What CI runs against pipemem (tests/test_validate_megatron.py): one dense TP+SP case, its
# fused-CE twin, the MoE case and the DeepSeek-style one (MLA, DeepSeek's MoE with a dense first
# layer, MTP); the same tests trace the activation-offload and optimizer-offload cases for what
# megatron's own code does there.
CI_CASES = ("dense-tp2-sp", "dense-tp2-sp-ce-fusion", "moe-ep2-shared", "deepseek-mtp-ep2")


def megatron_argv(case: MegatronCase) -> list[str]:
    """The pretrain_gpt.py arguments of a case: the Megatron-LM flags that megatron_trace's
    TransformerConfig, layer spec and optimizer settings stand for."""
    gpt = case.kind == "gpt"
    argv = [
        "pretrain_gpt.py",
        f"--num-layers={case.layers}",
        f"--hidden-size={case.hidden}",
        f"--num-attention-heads={case.heads}",
        f"--ffn-hidden-size={case.ffn}",
        f"--vocab-size={case.vocab}",
        f"--seq-length={case.seq_len}",
        f"--micro-batch-size={case.micro_batch}",
        f"--global-batch-size={case.micro_batch * case.microbatches * case.dp}",
        f"--tensor-model-parallel-size={case.tp}",
        f"--pipeline-model-parallel-size={case.pp}",
        f"--data-parallel-size={case.dp}",
        f"--attention-dropout={case.dropout}",
        f"--hidden-dropout={case.dropout}",
        "--bf16",
        "--use-flash-attn",
    ]
    if not gpt:  # GPT-style cases tie the output layer to the word embedding (Megatron's default)
        argv += [
            "--untie-embeddings-and-output-weights",
            "--swiglu",
            "--normalization=RMSNorm",
            "--position-embedding-type=rope",
            "--disable-bias-linear",
        ]
        if case.kind != "deepseek":
            argv += ["--group-query-attention", f"--num-query-groups={case.kv_heads}"]
    if case.ep > 1:
        argv.append(f"--expert-model-parallel-size={case.ep}")
    if case.sp and case.tp > 1:
        argv.append("--sequence-parallel")
    if case.dist_opt:
        argv.append("--use-distributed-optimizer")
    if case.main_grad_dtype == "bf16":
        argv.append("--grad-reduce-in-bf16")
    if case.recompute == "selective":
        argv.append("--recompute-granularity=selective")
    elif case.recompute == "full":
        argv += [
            "--recompute-granularity=full",
            f"--recompute-method={case.recompute_method}",
            f"--recompute-num-layers={case.recompute_layers or 1}",
        ]
    if case.ce_fusion:
        argv += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl=native"]
    if case.offload:
        argv += ["--fine-grained-activation-offloading", f"--offload-modules={case.offload}"]
    if case.optimizer_offload is not None:
        argv += [
            "--optimizer-cpu-offload",
            f"--optimizer-offload-fraction={case.optimizer_offload}",
            "--use-precision-aware-optimizer",
        ]
    if case.precision_aware:
        main, avg, avg_sq = case.precision_aware.split("/")
        argv += [
            "--use-precision-aware-optimizer",
            f"--main-params-dtype={main}",
            f"--exp-avg-dtype={avg}",
            f"--exp-avg-sq-dtype={avg_sq}",
        ]
    if case.kind == "deepseek":
        argv += [
            "--multi-latent-attention",
            "--qk-layernorm",
            f"--kv-lora-rank={case.kv_lora_rank}",
            f"--qk-head-dim={case.qk_head_dim}",
            f"--qk-pos-emb-head-dim={case.qk_pos_emb_head_dim}",
            f"--v-head-dim={case.v_head_dim}",
        ]
        if case.q_lora_rank:
            argv.append(f"--q-lora-rank={case.q_lora_rank}")
        if case.mtp_layers:
            argv.append(f"--mtp-num-layers={case.mtp_layers}")
    if case.experts:
        argv += [
            f"--num-experts={case.experts}",
            f"--moe-router-topk={case.top_k}",
            f"--moe-ffn-hidden-size={case.expert_ffn}",
            "--moe-token-dispatcher-type=alltoall",
            "--moe-grouped-gemm",
        ]
        if case.shared_ffn:
            argv.append(f"--moe-shared-expert-intermediate-size={case.shared_ffn}")
        if case.kind == "deepseek":
            argv += [
                "--moe-router-score-function=sigmoid",
                "--moe-router-enable-expert-bias",
                f"--moe-router-num-groups={case.router_groups}",
                f"--moe-router-group-topk={case.router_group_topk}",
                f"--moe-router-topk-scaling-factor={case.topk_scaling}",
                f"--moe-layer-freq=([0]*{case.dense_layers}+[1]*{case.layers - case.dense_layers})",
            ]
    return argv


def read_case(case: MegatronCase):
    """The model and plan `--from-megatron` reads from the case's flags (a ToolConfig): what the
    estimate runs, so every case also holds the reader to megatron-core's own step."""
    from ..configs import read_megatron

    return read_megatron(megatron_argv(case))


def estimate_case(case: MegatronCase) -> dict:
    import pipemem

    tc = read_case(case)
    est = pipemem.estimate(tc.model, **tc.plan, explain=True)
    rank = est.ranks[case.pp_rank]
    kept = sum(r["bytes"] for r in est.explain if not r["tensor"].startswith("("))
    out = {
        "peak_bytes": rank.peak_allocated_bytes,
        "peak_at": rank.peak_at,
        "static_bytes": rank.static.total,
        "layer_kept_bytes": kept,
    }
    if case.kind == "deepseek" and case.experts and case.dense_layers:
        out["moe_layer_kept_bytes"] = _layer_kept_estimate(case, case.dense_layers)
    return out


def _layer_kept_estimate(case: MegatronCase, layer: int) -> int:
    """What decoder layer `layer` keeps for backward in the estimate (its `--explain` rows)."""
    from ..model import arch_from_hf_config
    from ..plan import ParallelPlan
    from ..stages import layer_explain

    tc = read_case(case)
    rows = layer_explain(arch_from_hf_config(tc.model), ParallelPlan(**tc.plan), layer)
    return sum(r["bytes"] for r in rows if not r["tensor"].startswith("("))


def trace_in_subprocess(case: MegatronCase, timeout: float = 600) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "pipemem.validation.megatron_trace", json.dumps(case.to_json())],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        if "needs megatron-core" in tail:
            raise UserError(tail.splitlines()[-1].split("error: ", 1)[-1])
        raise RuntimeError(f"tracing megatron-core for case {case.name} failed:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(case: MegatronCase, trace: dict) -> list[CaseRow]:
    est = estimate_case(case)
    common = {
        "rank": case.pp_rank,
        "measured_static_bytes": trace["static_bytes"],
        "estimated_static_bytes": est["static_bytes"],
    }
    # every case's core attention is the flash stand-in, whose backward allocates the workspace
    # the templates assume (traced/kernel_workspace.py): the peak rows rest on it, unchecked
    rows = [
        CaseRow(
            f"{case.name}/peak",
            trace["peak_bytes"],
            est["peak_bytes"],
            dict(common, measured_at=trace["peak_at"], estimated_at=est["peak_at"], kernel_workspace=ASSUMED),
        ),
        CaseRow(
            f"{case.name}/layer_kept",
            trace["layer_kept_bytes"].get("0"),
            est["layer_kept_bytes"],
            dict(common),
        ),
    ]
    if "moe_layer_kept_bytes" in est:  # the first MoE layer of a case with dense first layers
        measured = trace["layer_kept_bytes"].get(str(case.dense_layers))
        rows.append(
            CaseRow(f"{case.name}/moe_layer_kept", measured, est["moe_layer_kept_bytes"], dict(common))
        )
    return rows


def run_cases(cases=CASES, jobs: int = 2, progress=None) -> list[CaseRow]:
    """Trace every case (`jobs` processes at once) and compare; `progress` (a
    progress.CaseProgress) advances as each trace finishes."""
    from importlib.util import find_spec

    if find_spec("megatron") is None or find_spec("megatron.core") is None:
        raise UserError("pipemem validate megatron needs megatron-core: pip install -e '.[megatron]'")

    def traced(case: MegatronCase) -> dict:
        trace = trace_in_subprocess(case)
        if progress is not None:
            progress.done(case.name)
        return trace

    if progress is not None and cases:
        progress.start(f"{min(max(1, jobs), len(cases))} traces at a time")
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        traces = list(pool.map(traced, cases))
    rows: list[CaseRow] = []
    for case, trace in zip(cases, traces):
        rows.extend(compare(case, trace))
    return rows


HELP = "the megatron convention vs megatron-core's own training step"
DESCRIPTION = (
    "Trace megatron-core's own training step (GPTModel, DistributedDataParallel, "
    "optimizer, its pipeline schedule; two steps) on fake tensors with a fake process "
    "group, one rank per case, and compare its steady-state peak and the bytes a "
    "decoder layer keeps with pipemem.estimate for the same flags. Needs "
    "megatron-core (pip install -e '.[megatron]'). Exit 1 if a row is off by more "
    f"than {TOLERANCE:.1%}."
)


def add_arguments(p) -> None:
    add_listed_case_options(p, CASES)
    p.add_argument("--jobs", type=int, default=2, help="cases traced at once, one process each (default 2)")


def select(names: str) -> tuple[MegatronCase, ...]:
    """The cases --cases names (all when none)."""
    return pick_cases(names, CASES)


def run(args) -> int:
    from .progress import CaseProgress, print_result, quiet_profiler_chatter

    cases = select(getattr(args, "cases", ""))
    with quiet_profiler_chatter(), CaseProgress([c.name for c in cases], "validate megatron") as bar:
        rows = run_cases(cases, jobs=getattr(args, "jobs", 2), progress=bar)
    status = print_result(
        rows,
        args.json,
        "megatron",
        TRUTH,
        TOLERANCE,
        {"megatron_core": _version()},
        columns=(
            ("measured_static_bytes", "static (traced)"),
            ("estimated_static_bytes", "static (pipemem)"),
            ("kernel_workspace", "note"),
        ),
        what="rows",
    )
    if not args.json:
        print(f"megatron-core {_version()}")
    return status


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 -- reporting only
        return "unknown"
