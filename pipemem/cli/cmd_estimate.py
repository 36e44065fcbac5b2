"""`pipemem estimate`: per-rank memory of one training plan (table, JSON, plot)."""

from __future__ import annotations

import argparse
import json
import sys

from ..configs.resolve import merge
from ..errors import UserError
from ..features import LOSSES

EXAMPLE = """\\
examples:
  pipemem estimate --model llama3-70b --gpu h100-80g --dp 2 --tp 8 --pp 4
  pipemem estimate --model llama3-8b --gpu a100-80g --dp 8 --zero 1 --recompute selective --json
  pipemem estimate --model ./my_model/config.json --seq-len 8192 --tp 4 --pp 2 --vpp 2 --plot mem.html
  pipemem estimate --gpu h100-80g --from-megatron -- --num-layers 32 --hidden-size 4096 \\
      --num-attention-heads 32 --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 \\
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --swiglu --normalization RMSNorm --bf16 \\
      --tokenizer-type Llama2Tokenizer
  pipemem estimate --gpu gtx1080ti --from-paddlenlp -- --model_name_or_path facebook/llama-7b \\
      --max_seq_length 2048 --per_device_train_batch_size 1 --gradient_accumulation_steps 8 \\
      --pipeline_parallel_degree 4 --recompute 1 --num_hidden_layers 4
  pipemem estimate --gpu h100-80g --dp 8 --from-torchtitan train_configs/llama3_8b.toml
  pipemem estimate --model llama3.2-3b --convention torchtune --dtype bf16 --seq-len 4096 \\
      --micro-batch 2 --compile --loss chunked --recompute full --optimizer-in-backward --activation-offload all
  pipemem estimate --gpu a100-80g --seq-len 4096 --from-torchtune recipes/configs/llama3_2/3B_full_single_device.yaml
  pipemem estimate --gpu h100-80g --from-torchtitan - -- --module llama3 --config llama3_8b \\
      --parallelism.data_parallel_shard_degree 8 --parallelism.tensor_parallel_degree 2
  pipemem estimate --model qwen2.5-7b --convention hf --dtype bf16 --dp 4 --grads ddp-bucket-view
  pipemem estimate --model llama3-8b --gpu a100-80g --dp 8 --seq-len 4096 --recompute full --deepspeed ds_config.json
  pipemem estimate --gpu a100-80g --from-hf-trainer -- torchrun --nproc_per_node 8 run_clm.py \\
      --model_name_or_path meta-llama/Meta-Llama-3-8B --block_size 4096 --per_device_train_batch_size 1 \\
      --bf16 --gradient_checkpointing --deepspeed ds_config.json
  pipemem estimate --model ./config.json --mode traced --step first    # the first step, as recorded
  pipemem estimate --model llama3-8b --convention hf --dtype bf16 --lora-rank 16 --lora-targets all-linear --qlora
  pipemem estimate --gpu a100-80g --from-llamafactory examples/train_lora/llama3_lora_sft.yaml
  pipemem estimate --model mixtral-8x7b --dp 8 --ep 8 --seq-len 4096 --moe-imbalance 1.5    # the busiest experts
  PIPEMEM_PADDLENLP_PYTHON=~/venvs/paddlenlp/bin/python pipemem estimate --gpu gtx1080ti --exact \\
      --from-paddlenlp -- --model_name_or_path facebook/llama-7b --max_seq_length 2048 \\
      --per_device_train_batch_size 1 --gradient_accumulation_steps 8 --pipeline_parallel_degree 4 \\
      --num_hidden_layers 4 --fp16 0 --use_flash_attention 0 --enable_auto_parallel 1

Without --global-batch or --microbatches a pipeline runs pp microbatches (1 without pp).
Exit status 0 whether or not the plan fits (read `fits` in --json); 2 on bad input.
"""  # noqa: E501 (example command lines, printed as they stand)


def _bool_flag(p, name: str, help_: str) -> None:
    p.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=help_)


HELP = "per-rank GPU memory of a training plan"
DESCRIPTION = (
    "Estimate the allocated memory of every pipeline rank at every moment of the schedule, "
    "for a model (preset, HF config.json, or another tool's launch configuration) and a "
    "parallel plan; print a per-rank table, JSON, or a plot."
)


def add_arguments(p) -> None:
    from ..estimate import KERNEL_POLICIES, MODES
    from ..plan import CONVENTIONS, DTYPES, GRADS, OPTIMIZER_IMPLS, OPTIMIZERS, RECOMPUTE, STEPS
    from ..runtime import RUNTIMES

    src = p.add_argument_group("model (one of)")
    src.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="preset name (see `pipemem presets`), or a Hugging Face config.json / its directory",
    )
    src.add_argument(
        "--from-megatron",
        action="store_true",
        help="read Megatron-LM pretrain_gpt.py arguments given after `--`",
    )
    src.add_argument(
        "--from-paddlenlp",
        action="store_true",
        help="read PaddleNLP run_pretrain arguments given after `--` (a pasted launch line works)",
    )
    src.add_argument(
        "--from-torchtitan",
        metavar="FILE.toml|-",
        help="read a torchtitan job config: a TOML file (the tables of Trainer.Config.to_dict()), "
        "or - and torchtitan 0.3's launch arguments after `--` (--module NAME --config FN "
        "--parallelism.tensor_parallel_degree N ...; needs torchtitan installed)",
    )
    src.add_argument(
        "--from-torchtune",
        metavar="FILE.yaml|-",
        help="read a torchtune recipe config (model builder, batch_size, dtype, optimizer, loss, "
        "compile, activation checkpointing / offloading, optimizer_in_bwd); distributed "
        "recipes shard with FSDP2 over --dp ranks; or - and the `tune run "
        "[--nproc_per_node N] RECIPE --config FILE [key=value ...]` line after `--` (the "
        "recipe decides single "
        "device or distributed)",
    )
    src.add_argument(
        "--from-hf-trainer",
        action="store_true",
        help="read Hugging Face Trainer launch arguments given after `--` (run_clm.py-style: "
        "--model_name_or_path, --block_size, --per_device_train_batch_size, --bf16, "
        '--gradient_checkpointing, --optim, --deepspeed ds_config.json with its "auto" '
        "filled in as the Trainer does, --fsdp; a pasted torchrun / accelerate / deepspeed line "
        "gives the world size; accelerate launch's --use_fsdp / --use_deepspeed / "
        "--mixed_precision / --config_file FILE.yaml are read)",
    )
    src.add_argument(
        "--from-llamafactory",
        metavar="FILE.yaml",
        help="read a LLaMA-Factory train YAML (`llamafactory-cli train FILE`: model_name_or_path, "
        "finetuning_type full / freeze / lora, lora_rank / lora_target / lora_dropout, "
        "quantization_bit 4 (QLoRA), cutoff_len, per_device_train_batch_size, bf16 / pure_bf16, "
        "gradient checkpointing, deepspeed); ranks from --dp",
    )
    src.add_argument(
        "--exact",
        action="store_true",
        help="with --from-paddlenlp (or --convention paddle): build PaddleNLP's own auto-parallel "
        "programs with Paddle's passes, one card per pipeline stage, and estimate those "
        "(= --mode paddle; needs paddlenlp 2.8.1 + paddlepaddle 3.x, in this Python or "
        "$PIPEMEM_PADDLENLP_PYTHON; shapes only, no GPU)",
    )
    b = p.add_argument_group("batch")
    b.add_argument("--seq-len", type=int, metavar="N", help="sequence length (default 4096)")
    b.add_argument("--micro-batch", type=int, metavar="N", help="sequences per microbatch (default 1)")
    b.add_argument("--global-batch", type=int, metavar="N", help="sequences per step over all dp ranks")
    b.add_argument("--microbatches", type=int, metavar="N", help="microbatches per pipeline per step")
    par = p.add_argument_group("parallelism")
    for flag, what in (
        ("--dp", "data"),
        ("--tp", "tensor"),
        ("--pp", "pipeline"),
        ("--cp", "context"),
        ("--ep", "expert"),
    ):
        par.add_argument(flag, type=int, metavar="N", help=f"{what}-parallel degree (default 1)")
    par.add_argument("--vpp", type=int, metavar="N", help="virtual pipeline chunks per rank (default 1)")
    par.add_argument(
        "--etp", type=int, metavar="N", help="expert tensor-parallel degree of MoE layers (default: --tp)"
    )
    _bool_flag(par, "--sp", "sequence parallelism (default: on when tp > 1)")
    par.add_argument(
        "--pp-layout", metavar="N,N,...", help="decoder layers per (virtual) stage, in stage order"
    )
    par.add_argument(
        "--schedule",
        metavar="NAME",
        help="pipeline schedule (1F1B, GPipe, Interleaved1F1B, ZBH1, ZBVZeroBubble, DualPipeV, "
        "VPP, ... or csv:FILE); default 1F1B when pp > 1",
    )
    sh = p.add_argument_group("model states")
    sh.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage over dp (default 0)")
    sh.add_argument(
        "--fsdp", action="store_const", const=True, default=None, help="FSDP full sharding over dp"
    )
    sh.add_argument(
        "--dist-opt",
        action="store_const",
        const=True,
        default=None,
        help="Megatron distributed optimizer (optimizer states and master weights sharded over dp)",
    )
    sh.add_argument(
        "--deepspeed",
        metavar="FILE.json",
        help="read a DeepSpeed config (ds_config.json, as Hugging Face's Trainer --deepspeed or "
        "Lightning's DeepSpeedStrategy take it) for a --model: ZeRO stage, bf16 / fp16, micro-batch, "
        'reduce bucket, overlap_comm, stage3_max_reuse_distance, optimizer offload; "auto" values '
        "come from --dtype / --micro-batch / --dp",
    )
    sh.add_argument("--dtype", choices=DTYPES, help="training precision (default bf16 mixed precision)")
    _bool_flag(sh, "--master-weights", "fp32 master weights (default on; pure bf16 training keeps none)")
    sh.add_argument("--optimizer", choices=OPTIMIZERS, help="default adamw")
    sh.add_argument(
        "--optimizer-impl",
        choices=OPTIMIZER_IMPLS,
        help="how the step runs: fused kernels (no scratch), foreach (a temporary the size of the "
        "local parameters), for-loop (one parameter's); default: the convention's (fused; "
        "foreach for hf)",
    )
    sh.add_argument(
        "--grads",
        choices=GRADS,
        help="how the trainer keeps gradients between steps: buffer (resident all step: Megatron, "
        "Paddle, torchtitan 0.3 with CUDA graphs), set-to-none (zero_grad(set_to_none=True), created in "
        "backward: HF, torchtune), ddp-bucket / ddp-bucket-view (DistributedDataParallel's buckets, "
        "gradient_as_bucket_view off / on); default follows --convention (hf with --dp > 1: "
        "ddp-bucket)",
    )
    sh.add_argument(
        "--step",
        choices=STEPS,
        help="which training step: steady (default; what max_memory_allocated shows after a few "
        "steps) or first (no optimizer states before the first optimizer step)",
    )
    act = p.add_argument_group("activations")
    act.add_argument("--recompute", choices=RECOMPUTE, help="activation recomputation (default none)")
    act.add_argument("--recompute-layers", type=int, metavar="K", help="recompute only K layers per stage")
    act.add_argument(
        "--recompute-allgather",
        action="store_const",
        const=True,
        default=None,
        help="re-all-gather sequence-parallel inputs in backward instead of saving them (paddle: "
        "recompute_allgather; torchtitan: pipemem.torch_tp.RegatherColwiseParallel; "
        "megatron always does)",
    )
    _bool_flag(
        act, "--flash-attn", "flash attention (default on; off where --gpu cannot run it, e.g. gtx1080ti)"
    )
    act.add_argument("--layers", type=int, metavar="N", help="override the model's decoder layer count")
    act.add_argument(
        "--convention", choices=CONVENTIONS, help="framework whose layers are modelled (default megatron)"
    )
    act.add_argument(
        "--runtime",
        choices=RUNTIMES,
        help="pipeline runtime whose buffers and references are replayed (default from --convention: "
        "megatron -> megatron, paddle -> paddle, torchtitan/hf -> torch)",
    )
    mod = p.add_argument_group("what modern trainers switch on (see pipemem.features)")
    mod.add_argument(
        "--compile",
        nargs="?",
        const="all",
        choices=("all", "layers"),
        default=None,
        help="torch.compile each decoder layer and the loss (all, the default) or the layers only; "
        "AOTAutograd's min-cut partitioner decides what is saved",
    )
    mod.add_argument(
        "--loss",
        choices=LOSSES,
        help="cross-entropy: chunked (torchtune's chunked output; under --convention torchtitan its "
        "ChunkedLossWrapper, 0.3's default head), fused_linear (Liger), fused / fused_te "
        "(Megatron --cross-entropy-loss-fusion, native / TE impl), shifted (--convention hf: a loss the "
        "step writes on the model's logits, shifted copy, no .float(): transformers < 4.46's "
        "GPT-2, Lightning / custom steps); default standard",
    )
    mod.add_argument("--loss-chunks", type=int, metavar="N", help="chunks of --loss chunked (default 8)")
    mod.add_argument(
        "--fp8",
        choices=("delayed", "current", "mxfp8", "tensorwise", "rowwise"),
        help="fp8 linears: Transformer Engine recipes (megatron) or torchao Float8 (torchtitan, hf)",
    )
    mod.add_argument(
        "--fp8-param-gather",
        action="store_const",
        const=True,
        default=None,
        help="fp8 primary weights (Megatron --fp8-param-gather) / fp8 FSDP all-gather (torchao)",
    )
    mod.add_argument(
        "--activation-offload",
        metavar="all|MODULES",
        help="saved activations to CPU: all (torchtune) or modules, e.g. expert_fc1,moe_act "
        "(Megatron fine-grained offloading)",
    )
    mod.add_argument(
        "--optimizer-offload",
        type=float,
        metavar="FRACTION",
        help="fraction of optimizer states + master weights on the CPU (1 = DeepSpeed ZeRO-Offload)",
    )
    mod.add_argument(
        "--optimizer-in-backward",
        action="store_const",
        const=True,
        default=None,
        help="step each parameter during backward and free its grad (torchtune optimizer_in_bwd)",
    )
    mod.add_argument(
        "--moe-imbalance",
        type=float,
        metavar="F",
        help="MoE load: tokens the busiest expert-parallel rank's experts receive, as a multiple of the "
        "balanced mean (default 1 = balanced; at most --ep x min(top_k, local experts) / top_k)",
    )
    mod.add_argument(
        "--optimizer-state-dtype",
        choices=("fp32", "bf16", "fp16", "fp8"),
        help="Adam moments' dtype (Megatron precision-aware optimizer)",
    )
    add_lora_options(p.add_argument_group("LoRA / QLoRA fine-tuning (--convention hf: PEFT; torchtune)"))
    out = p.add_argument_group("GPU and output")
    out.add_argument("--gpu", metavar="NAME", help="GPU preset for the fit check (see `pipemem presets`)")
    out.add_argument("--gpu-memory", type=float, metavar="GIB", help="GPU capacity in GiB instead of --gpu")
    out.add_argument(
        "--cuda-context-mib",
        type=float,
        metavar="MIB",
        help="the CUDA context's size per GPU (default 512 MiB: the driver and the kernels a training "
        "step loads); counted beside reserved memory in the verdict",
    )
    out.add_argument(
        "--nccl-mib",
        type=float,
        metavar="MIB",
        help="NCCL's buffers per communicator the plan uses (default from NCCL's measured sizes: "
        "544-688 MB, plus NVLS buffers on intra-node groups of H100-class GPUs)",
    )
    out.add_argument(
        "--mode",
        choices=MODES,
        help="templates (default; any plan), traced (the PyTorch step on fake "
        "tensors: one rank, --pp stages, or a --tp / --fsdp rank; needs torch) "
        "or paddle (PaddleNLP's own programs: see --exact)",
    )
    out.add_argument(
        "--kernel-policy", choices=KERNEL_POLICIES, help="traced mode: whose kernels' saves (default cuda)"
    )
    out.add_argument(
        "--alloc-conf",
        metavar="CONF",
        help="the caching allocator's settings for the reserved column, PYTORCH_CUDA_ALLOC_CONF syntax "
        "(e.g. expandable_segments:True,max_split_size_mb:256; default PyTorch's)",
    )
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--plot", metavar="FILE", help="write the per-rank timeline to FILE.png or FILE.html")
    out.add_argument("--explain", action="store_true", help="list what one layer keeps for backward and why")
    out.add_argument(
        "--wide",
        action="store_true",
        help="always print the per-rank table, however narrow the terminal (default: one block "
        "per rank when the table does not fit)",
    )
    p.add_argument("tool_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


PLAN_FLAGS = (
    "seq_len",
    "micro_batch",
    "global_batch",
    "microbatches",
    "dp",
    "tp",
    "pp",
    "vpp",
    "cp",
    "ep",
    "etp",
    "sp",
    "pp_layout",
    "schedule",
    "zero",
    "fsdp",
    "dist_opt",
    "dtype",
    "master_weights",
    "optimizer",
    "optimizer_impl",
    "recompute",
    "recompute_layers",
    "recompute_allgather",
    "flash_attn",
    "layers",
    "convention",
    "grads",
    "step",
    "compile",
    "loss",
    "loss_chunks",
    "fp8",
    "fp8_param_gather",
    "activation_offload",
    "optimizer_offload",
    "optimizer_in_backward",
    "optimizer_state_dtype",
    "lora_rank",
    "lora_targets",
    "lora_alpha",
    "lora_dropout",
    "qlora",
    "moe_imbalance",
)


def add_lora_options(lora) -> None:
    """The LoRA / QLoRA flags into the argument group `lora` (pipemem estimate's, and pipemem
    plan's, which holds them fixed)."""
    lora.add_argument(
        "--lora-rank", type=int, metavar="R", help="train rank-R adapters; the base model frozen"
    )
    lora.add_argument(
        "--lora-targets",
        metavar="MODULES",
        help="linears with adapters: all-linear or e.g. q_proj,k_proj,v_proj,o_proj (torchtune's "
        "output_proj, w1, w2, w3 too; default q_proj,v_proj as PEFT's)",
    )
    lora.add_argument("--lora-alpha", type=float, metavar="A", help="adapter scale (moves no memory)")
    lora.add_argument(
        "--lora-dropout", type=float, metavar="P", help="adapters' input dropout (keeps a copy and a mask)"
    )
    lora.add_argument(
        "--qlora",
        action="store_const",
        const=True,
        default=None,
        help="base linears in 4-bit NF4 with double quantization (bitsandbytes), bf16 compute",
    )


def parse_layout(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise UserError(
            f"--pp-layout {text!r}: write layer counts separated by commas, e.g. 7,8,8,9"
        ) from None
    if not out or any(x < 0 for x in out):
        raise UserError(f"--pp-layout {text!r}: layer counts must be non-negative integers, e.g. 7,8,8,9")
    return out


def collect(args) -> tuple[object, dict, dict, list[str]]:
    """Flags (+ another tool's configuration) -> (model, plan kwargs, options, warnings)."""
    from ..configs import read_torchtitan

    tool_args = list(args.tool_args or [])
    if tool_args and tool_args[0] == "--":
        tool_args = tool_args[1:]
    sources = [
        s
        for s, on in (
            ("--model", args.model is not None),
            ("--from-megatron", args.from_megatron),
            ("--from-paddlenlp", args.from_paddlenlp),
            ("--from-torchtitan", args.from_torchtitan is not None),
            ("--from-torchtune", args.from_torchtune is not None),
            ("--from-hf-trainer", args.from_hf_trainer),
            ("--from-llamafactory", getattr(args, "from_llamafactory", None) is not None),
        )
        if on
    ]
    if args.deepspeed is not None and sources != ["--model"]:
        raise UserError(
            "--deepspeed reads a DeepSpeed config, which names no model: give it with --model "
            "NAME|config.json (and no other model source)"
        )
    if len(sources) > 1:
        raise UserError(f"give one model source, not {' and '.join(sources)}")
    if not sources:
        raise UserError(
            "no model: give --model NAME|config.json (see `pipemem presets`), or --from-megatron / "
            "--from-paddlenlp / --from-torchtitan / --from-torchtune / --from-hf-trainer"
        )
    titan_args = args.from_torchtitan == "-"
    tune_args = args.from_torchtune == "-"
    if tool_args and not (
        args.from_megatron or args.from_paddlenlp or titan_args or tune_args or args.from_hf_trainer
    ):
        raise UserError(
            f"unexpected arguments {' '.join(tool_args[:3])}...: arguments after `--` are read "
            "only with --from-megatron, --from-paddlenlp, --from-hf-trainer, --from-torchtitan - "
            "or --from-torchtune -"
        )
    if tune_args and not tool_args:
        raise UserError(
            "--from-torchtune -: give the `tune run` line after `--`, e.g. -- tune run "
            "--nproc_per_node 8 full_finetune_distributed --config ./my_8b.yaml"
        )
    if args.from_hf_trainer and not tool_args:
        raise UserError(
            "--from-hf-trainer: give the Trainer's launch arguments after `--`, e.g. -- "
            "--model_name_or_path meta-llama/Meta-Llama-3-8B --block_size 2048 --bf16"
        )
    if titan_args and not tool_args:
        raise UserError(
            "--from-torchtitan -: give torchtitan's launch arguments after `--`, e.g. "
            "-- --module llama3 --config llama3_8b --parallelism.tensor_parallel_degree 8"
        )

    flags = {k: getattr(args, k) for k in PLAN_FLAGS if getattr(args, k) is not None}
    if "pp_layout" in flags:
        flags["pp_layout"] = parse_layout(flags["pp_layout"])
    mode = args.mode
    if getattr(args, "exact", False):
        if mode not in (None, "paddle"):
            raise UserError(f"--exact builds Paddle's programs (mode paddle); drop --mode {mode}")
        mode = "paddle"
    opts = {
        "progress": _exact_progress if mode == "paddle" else None,
        "gpu": args.gpu,
        "gpu_memory": args.gpu_memory,
        "mode": mode,
        "kernel_policy": args.kernel_policy,
        "explain": args.explain,
        "runtime": args.runtime,
        "cuda_context_mib": args.cuda_context_mib,
        "nccl_mib": args.nccl_mib,
        "alloc_conf": getattr(args, "alloc_conf", None),
    }
    if args.deepspeed is not None:
        plan, warnings = _with_deepspeed(args.model, args.deepspeed, flags)
        refuse_inert(flags, plan, opts)
        return args.model, plan, opts, warnings
    if args.model is not None:
        refuse_inert(flags, flags, opts)
        return args.model, flags, opts, []

    from ..configs.resolve import finish, read_tool

    if args.from_megatron:
        tool = read_tool("megatron", tool_args)
    elif args.from_paddlenlp:
        tool = read_tool("paddlenlp", tool_args)
    elif titan_args:
        tool = read_tool("torchtitan", tool_args)
    elif tune_args:
        tool = read_tool("torchtune", tool_args)
    elif args.from_torchtune is not None:
        from ..configs.torchtune import read as read_torchtune

        tool = read_torchtune(args.from_torchtune)
    elif args.from_hf_trainer:
        tool = read_tool("hf-trainer", tool_args)
    elif getattr(args, "from_llamafactory", None) is not None:
        tool = read_tool("llamafactory", args.from_llamafactory)
    else:
        tool = read_torchtitan(args.from_torchtitan)
    source_name = (
        "the recipe" if tune_args else args.from_torchtune or getattr(args, "from_llamafactory", "") or ""
    )
    model, plan, tool_opts, warnings = finish(tool, flags, source_name)
    opts.update(tool_opts)
    refuse_inert(flags, plan, opts)
    return model, plan, opts, warnings


def _exact_progress(card: int, doc, _started: dict = {}) -> None:  # noqa: B006 - start times per card
    """A line on stderr when PaddleNLP starts building a card's programs and when it is done (each
    takes 20-50 s; a built card is cached and says nothing)."""
    import time

    if doc is None:
        _started[card] = time.perf_counter()
        print(
            f"pipemem: --exact: building card {card}'s programs with PaddleNLP (20-50 s; cached afterwards)",
            file=sys.stderr,
            flush=True,
        )
    else:
        took = time.perf_counter() - _started.pop(card, time.perf_counter())
        print(f"pipemem: --exact: card {card} built in {took:.0f} s", file=sys.stderr, flush=True)


# a DeepSpeed config's "auto" -> (its key, the pipemem flag that gives it)
_NEEDED_FLAG = {
    "dtype": ("bf16.enabled / fp16.enabled", "--dtype bf16|fp16|fp32 (the Trainer's --bf16 / --fp16)"),
    "micro_batch": (
        "train_micro_batch_size_per_gpu",
        "--micro-batch N (the Trainer's per_device_train_batch_size)",
    ),
}


def _with_deepspeed(model, path: str, flags: dict) -> tuple[dict, list[str]]:
    """The DeepSpeed config's plan for `model`, completed by the flags; its "auto" values must
    come from flags (Hugging Face's Trainer fills them from its own arguments)."""
    from ..configs.deepspeed import read as read_deepspeed
    from ..estimate import resolve_model
    from ..model import arch_from_hf_config

    name, _, cfg = resolve_model(model)
    tool = read_deepspeed(path, hidden=arch_from_hf_config(cfg, name).hidden)
    missing = [k for k in tool.needs if k not in flags]
    if missing:
        keys = " and ".join(_NEEDED_FLAG[k][0] for k in missing)
        raise UserError(
            f'--deepspeed {path}: {keys} {"is" if len(missing) == 1 else "are"} "auto" (the Trainer '
            f"fills {'it' if len(missing) == 1 else 'them'} in): give "
            f"{' and '.join(_NEEDED_FLAG[k][1] for k in missing)}"
        )
    return merge(tool, flags), list(tool.warnings)


def refuse_inert(given: dict, plan: dict, opts: dict) -> None:
    """A pipemem flag the user gave that does nothing in this plan is an error naming it (a
    silently ignored flag reads as if it had been modelled). `given`: the flags on the command
    line; `plan`: the plan with another tool's configuration merged in."""
    tp, pp, vpp = plan.get("tp", 1), plan.get("pp", 1), plan.get("vpp", 1)
    if given.get("sp") is True and tp == 1:
        raise UserError(
            "--sp does nothing at --tp 1 (sequence parallelism splits the sequence over the tensor-"
            "parallel ranks): drop --sp, or set --tp"
        )
    if given.get("recompute_allgather") and tp == 1:
        raise UserError(
            "--recompute-allgather does nothing at --tp 1 (there is no sequence-parallel all-gather): "
            "drop it, or set --tp"
        )
    if "schedule" in given and pp == 1:
        raise UserError(
            f"--schedule {given['schedule']} does nothing at --pp 1 (a pipeline schedule orders "
            "the stages' microbatches): drop --schedule, or set --pp"
        )
    if "pp_layout" in given and pp * vpp == 1:
        raise UserError("--pp-layout does nothing with one pipeline stage: drop it, or set --pp")
    if "master_weights" in given and plan.get("dtype") == "fp32":
        raise UserError(
            "--master-weights / --no-master-weights do nothing with --dtype fp32 (the weights are "
            "fp32 already): drop the flag"
        )
    if "loss_chunks" in given and str(plan.get("loss") or "standard").lower() != "chunked":
        raise UserError(
            f"--loss-chunks {given['loss_chunks']} does nothing without --loss chunked (it splits the "
            "chunked cross-entropy): add --loss chunked, or drop --loss-chunks"
        )
    if "optimizer_impl" in given and opts.get("mode") == "traced":
        raise UserError(
            "--optimizer-impl does not apply to --mode traced (it records torch.optim's own step): "
            "drop it, or use --mode templates"
        )
    if opts.get("kernel_policy") and (opts.get("mode") or "templates") != "traced":
        raise UserError("--kernel-policy applies to --mode traced only: drop it, or add --mode traced")


def run(args) -> int:
    from ..estimate import estimate

    model, plan, opts, warnings = collect(args)
    if args.plot:
        _check_plot_path(args.plot)
    est = estimate(model, **plan, **{k: v for k, v in opts.items() if v is not None})
    est.warnings = warnings + list(est.warnings)
    _ = est.max_peak_reserved_bytes  # the allocator model runs now, so its warning (if any) is printed below
    if est.fits is False:
        est.suggest()  # a few one-step changes, each estimated by the engine
        tool = (
            "Megatron"
            if args.from_megatron
            else "PaddleNLP"
            if args.from_paddlenlp
            else "torchtitan"
            if args.from_torchtitan
            else "torchtune"
            if args.from_torchtune
            else None
        )
        if tool and est.suggestions:
            est.warnings.append(
                f"the suggested changes are written as pipemem flags; make the same change in "
                f"the {tool} configuration"
            )
    for w in est.warnings:
        print(f"pipemem: warning: {w}", file=sys.stderr)
    if args.json:
        d = est.to_dict()
        if args.explain and est.explain is not None:
            from ..report.text import as_dict as _as_dict

            d["explain"] = _jsonable(est.explain, _as_dict)
        print(json.dumps(d, indent=2))
    else:
        from ..report.text import render

        render(est, explain=args.explain, wide=args.wide)
    if args.plot:
        from ..report.plot import write_plot

        path = write_plot(est, args.plot)
        print(f"pipemem: plot written to {path}", file=sys.stderr)
    return 0


def _check_plot_path(path: str) -> None:
    from pathlib import Path

    p = Path(path)
    if p.suffix.lower() not in (".png", ".html", ".htm"):
        raise UserError(f"--plot {path}: give a file ending in .png or .html")
    if not p.parent.exists():
        raise UserError(f"--plot {path}: directory {p.parent} does not exist")


def _jsonable(rows, as_dict):
    if isinstance(rows, dict):
        return {str(k): _jsonable(v, as_dict) for k, v in rows.items()}
    if isinstance(rows, str):
        return rows
    return [as_dict(r) for r in rows]
