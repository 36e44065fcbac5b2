"""`pipemem plan`: every parallel plan that fits a model on N GPUs, ranked; and the smallest
memory the zero-bubble scheduler needs for the best pipeline plan."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import UserError

EXAMPLE = """\
examples:
  pipemem plan --model llama3-70b --gpus 64 --gpu h100-80g --seq-len 4096 --global-batch 512
  pipemem plan --model llama3.1-405b --gpus 16384 --gpu h100-80g --seq-len 8192 --global-batch 2048 --tp 8
  pipemem plan --model mixtral-8x7b --gpus 32 --gpu a100-80g --seq-len 4096 --global-batch 256 --json
  pipemem plan --model llama3-70b --gpus 64 --gpu h100-80g --seq-len 4096 --global-batch 512 \\
      --convention torchtitan --zero-bubble --schedule-csv zb.csv

The search screens every plan on its allocated peak plus the memory outside the caching
allocator (CUDA context, NCCL's buffers, cuBLAS workspace): a lower bound of what it takes from
the GPU. The plans shown (the --top fastest and the Pareto sets) are then judged by `pipemem
estimate`'s own verdict, reserved memory included, --jobs at a time for up to --judge-seconds
(default 10): a plan
it does not call FITS
(with --reserve more left free, if given) is dropped, and plans it did not reach are marked
"screened" ("verdict": null in --json). Plans are ranked by an estimated step time: the schedule simulated with F/B/W
durations proportional to their FLOPs, plus communication at NVLink or network speed
(docs/PLANNER.md). Each plan's flags paste into `pipemem estimate` and give the same bytes.
--tp/--pp/--cp/--dp/--vpp/--ep pin a degree; the others are searched.
"""  # noqa: E501 (help text, printed as it stands)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise UserError(f"{flag} {text!r}: write positive integers separated by commas, e.g. 1,2,4")
    from ..plan import LIMITS

    if max(vals) > LIMITS["micro_batch"] or len(vals) > 64:
        raise UserError(f"{flag} {text!r}: at most 64 values, each at most {LIMITS['micro_batch']:,}")
    return tuple(sorted(set(vals)))


def _names(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    return out or None


HELP = "every parallel plan that fits on your GPUs, ranked"
DESCRIPTION = (
    "Search dp, tp, pp (and layouts), vpp, cp, ep/etp, ZeRO/FSDP/distributed optimizer, "
    "recomputation, micro-batch size and schedule for plans whose every rank fits the GPU with "
    "a reserve; rank them by pipeline bubble and communication; list the Pareto set."
)


def add_arguments(p) -> None:
    from ..plan import CONVENTIONS, DTYPES, OPTIMIZERS
    from .cmd_estimate import add_lora_options

    p.add_argument(
        "--model",
        metavar="NAME|PATH",
        required=True,
        help="preset name (see `pipemem presets`), or a Hugging Face config.json / its directory",
    )
    w = p.add_argument_group("workload and machines")
    w.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs")
    w.add_argument("--gpu", metavar="NAME", help="GPU preset (memory, and speeds for the cost model)")
    w.add_argument("--gpu-memory", type=float, metavar="GIB", help="GPU capacity in GiB instead of --gpu")
    w.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node (default 8)")
    w.add_argument("--seq-len", type=int, required=True, metavar="N", help="sequence length")
    w.add_argument("--global-batch", type=int, required=True, metavar="N", help="sequences per step")
    w.add_argument(
        "--reserve",
        type=float,
        metavar="GIB",
        help="memory kept free beyond what pipemem estimate's FITS verdict already leaves (default 0)",
    )
    w.add_argument("--cuda-context-mib", type=float, metavar="MIB", help="as for pipemem estimate")
    w.add_argument("--nccl-mib", type=float, metavar="MIB", help="as for pipemem estimate")
    s = p.add_argument_group("search space")
    s.add_argument(
        "--convention",
        choices=CONVENTIONS,
        default="megatron",
        help="framework whose rules, layers, sharding and schedules are used (default megatron)",
    )
    for flag in ("tp", "pp", "cp", "dp", "vpp", "ep", "etp"):
        s.add_argument(f"--{flag}", type=int, metavar="N", help=f"pin the {flag} degree")
    s.add_argument(
        "--micro-batch",
        default="1,2,4,8",
        metavar="N,N,...",
        help="micro-batch sizes to try (default 1,2,4,8)",
    )
    s.add_argument("--max-vpp", type=int, default=8, metavar="N", help="largest vpp to try (default 8)")
    s.add_argument(
        "--schedules",
        metavar="A,B,...",
        help="pipeline schedules to try (default: the convention's, e.g. megatron 1F1B,VPP)",
    )
    s.add_argument(
        "--shardings",
        metavar="A,B,...",
        help="model-state sharding to try: ddp, dist-opt, zero1, zero2, zero3, fsdp as the convention "
        "offers (default: all but ddp where a ZeRO-1 exists, which it never beats)",
    )
    s.add_argument("--tp-across-nodes", action="store_true", help="allow tp groups larger than a node")
    m = p.add_argument_group("training (held fixed)")
    m.add_argument("--dtype", choices=DTYPES, help="training precision (default bf16 mixed precision)")
    m.add_argument("--optimizer", choices=OPTIMIZERS, help="default adamw")
    m.add_argument(
        "--master-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fp32 master weights (default on)",
    )
    m.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="flash attention (default on)",
    )
    m.add_argument("--layers", type=int, metavar="N", help="override the model's decoder layer count")
    add_lora_options(
        p.add_argument_group("LoRA / QLoRA fine-tuning (held fixed; --convention hf or torchtune)")
    )
    c = p.add_argument_group("cost model")
    c.add_argument(
        "--tflops", type=float, metavar="X", help="dense bf16 TFLOP/s per GPU (default from --gpu)"
    )
    c.add_argument(
        "--intra-node-gbps", type=float, metavar="X", help="GB/s per GPU inside a node (default from --gpu)"
    )
    c.add_argument(
        "--inter-node-gbps", type=float, metavar="X", help="GB/s per GPU across nodes (default from --gpu)"
    )
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, metavar="N", help="plans shown in the table (default 10)")
    o.add_argument(
        "--judge-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="time to spend judging the shown plans with reserved memory (the allocator model); "
        "plans not reached are marked screened (default 10)",
    )
    o.add_argument(
        "--zero-bubble",
        action="store_true",
        help="for the best pipeline plan, search the smallest memory under which the memory-limited "
        "scheduler reaches zero bubble on the plan's real stage jobs",
    )
    o.add_argument(
        "--schedule-csv",
        metavar="FILE",
        help="with --zero-bubble: write that schedule as CSV (PyTorch pipelining's format)",
    )
    o.add_argument("--json", action="store_true", help="print one JSON object listing every fitting plan")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="processes searching, then judging the shown plans, in parallel (default: the CPU count; "
        "the listing is the same)",
    )


def _positive(args, names) -> None:
    """Positive, and within what a training run can be (the bounds of `pipemem estimate`)."""
    from ..plan import LIMITS, MAX_WORLD

    bounds = dict(LIMITS, gpus=MAX_WORLD, gpus_per_node=MAX_WORLD, max_vpp=LIMITS["vpp"], top=1 << 20)
    for n in names:
        v = getattr(args, n)
        if v is not None and v < 1:
            raise UserError(f"--{n.replace('_', '-')} {v}: must be a positive integer")
        if v is not None and n in bounds and v > bounds[n]:
            raise UserError(f"--{n.replace('_', '-')} {v}: at most {bounds[n]:,}")


def build_inputs(args):
    """Flags -> (Target, SpaceOptions, extra plan fields)."""
    from ..estimate import gpu_capacity
    from ..outside_allocator import check_override
    from ..planner import SpaceOptions, Target
    from ..planner.hardware import speeds_for
    from ..planner.space import check_schedule_names

    _positive(
        args,
        (
            "gpus",
            "gpus_per_node",
            "seq_len",
            "global_batch",
            "tp",
            "pp",
            "cp",
            "dp",
            "vpp",
            "ep",
            "etp",
            "max_vpp",
            "layers",
            "top",
            "jobs",
        ),
    )
    if args.gpu is None and args.gpu_memory is None:
        raise UserError("give --gpu NAME (see `pipemem presets`) or --gpu-memory GIB")
    key, capacity = gpu_capacity(args.gpu, args.gpu_memory)
    if args.reserve is not None and not 0 <= args.reserve * (1 << 30) < capacity:
        raise UserError(
            f"--reserve {args.reserve:g}: give GiB between 0 and the GPU's {capacity / (1 << 30):.1f} GiB"
        )
    reserve = int(args.reserve * (1 << 30)) if args.reserve is not None else 0
    speeds = speeds_for(key if args.gpu else None, args.tflops, args.intra_node_gbps, args.inter_node_gbps)
    target = Target(
        args.gpus,
        capacity,
        reserve,
        speeds,
        gpu=key if args.gpu else None,
        gpu_memory=args.gpu_memory,
        gpus_per_node=args.gpus_per_node,
        cuda_context_mib=check_override("--cuda-context-mib", args.cuda_context_mib),
        nccl_mib=check_override("--nccl-mib", args.nccl_mib),
    )
    fixed = {k: getattr(args, k) for k in ("tp", "pp", "cp", "dp", "vpp", "ep", "etp") if getattr(args, k)}
    shardings = _names(args.shardings)  # checked against the convention's by the search
    schedules = _names(args.schedules)
    options = SpaceOptions(
        convention=args.convention,
        gpus_per_node=args.gpus_per_node,
        tp_across_nodes=args.tp_across_nodes,
        micro_batches=_int_list(args.micro_batch, "--micro-batch"),
        max_vpp=args.max_vpp,
        schedules=check_schedule_names(schedules) if schedules else None,
        shardings=shardings,
        fixed=fixed,
    )
    extra = {
        k: getattr(args, k)
        for k in ("dtype", "optimizer", "master_weights", "flash_attn", "layers", *LORA_FLAGS)
        if getattr(args, k) is not None
    }
    if any(k in extra for k in LORA_FLAGS):
        _check_fixed(args, extra)
    if args.schedule_csv and not args.zero_bubble:
        raise UserError("--schedule-csv writes the --zero-bubble schedule: add --zero-bubble")
    return target, options, extra


LORA_FLAGS = ("lora_rank", "lora_targets", "lora_alpha", "lora_dropout", "qlora")


def _check_fixed(args, extra: dict) -> None:
    """The fields held fixed, checked once on the plainest plan (one GPU, no parallelism): what
    they refuse there (LoRA with a convention or a model it is not modelled for, a bad rank) every
    plan of the search would refuse, so it is one error line, not "no plan fits"."""
    from ..estimate import resolve_model
    from ..model import arch_from_hf_config
    from ..plan import ParallelPlan, validate_plan

    name, _, config = resolve_model(args.model)
    arch = arch_from_hf_config(config, name)
    validate_plan(arch, ParallelPlan(seq_len=args.seq_len, convention=args.convention, **extra))


def run(args) -> int:
    from ..planner import search_plans

    target, options, extra = build_inputs(args)
    progress = not args.no_progress and sys.stderr.isatty()
    jobs = args.jobs or os.cpu_count() or 1
    res = search_plans(
        args.model,
        target,
        args.seq_len,
        args.global_batch,
        options,
        extra=extra,
        model_flag=args.model,
        progress=progress,
        jobs=jobs,
    )
    # the plans shown are judged by pipemem estimate's own verdict (reserved included)
    if not args.judge_seconds >= 0:
        raise UserError(f"--judge-seconds {args.judge_seconds}: give 0 or more seconds")
    res.verify(args.top, args.judge_seconds, jobs)
    if not res.plans and options.fixed:
        _explain_pinned(res, target, options)
    zb = None
    if args.zero_bubble:
        from ..planner.zero_bubble import smallest_zero_bubble_memory

        pipe = [p for p in res.plans if p.kwargs.get("pp", 1) > 1]
        if not pipe:
            raise UserError("--zero-bubble: no fitting plan has a pipeline (pp > 1); pin --pp to look at one")
        zb = smallest_zero_bubble_memory(res, pipe[0], csv_path=args.schedule_csv)
    if args.json:
        print(json.dumps(to_json(res, zb), indent=2))
    else:
        from ..report.plan_table import render_plans

        render_plans(res, args.top, zb, args.schedule_csv)
    return 0


def _explain_pinned(res, target, options) -> None:
    """Pinned degrees that no plan of the space can have, or that every such plan breaks a rule
    with: one line (exit 2) instead of "no plan fits, try more GPUs"."""
    s = res.stats
    pinned = " ".join(f"--{k} {v}" for k, v in options.fixed.items())
    if s.proposed == 0:
        node = (
            ""
            if options.tp_across_nodes
            else f", tp at most {target.gpus_per_node} GPUs per node (--tp-across-nodes lifts it)"
        )
        raise UserError(
            f"{pinned}: no plan of {target.gpus} GPUs has these degrees (dp x tp x pp x cp = the GPUs"
            f"{node}; ep divides the experts and the dp x cp x tp ranks)"
        )
    if (
        sum(s.invalid.values()) == s.proposed
        and len(s.invalid) == 1
        and s.invalid.keys() == s.invalid_why.keys()
    ):
        raise UserError(
            f"{pinned}: every plan with these degrees is refused: {next(iter(s.invalid_why.values()))}"
        )


def to_json(res, zb) -> dict:
    from .. import __version__

    t = res.target
    return {
        "pipemem_version": __version__,
        "model": res.model,
        "gpus": t.gpus,
        "gpu": t.gpu,
        "gpu_memory_bytes": t.capacity_bytes,
        "reserve_bytes": t.reserve_bytes,
        "gpus_per_node": t.gpus_per_node,
        "cost_model": {
            "tflops": t.speeds.tflops,
            "intra_node_gbps": t.speeds.intra_gbps,
            "inter_node_gbps": t.speeds.inter_gbps,
            "source": t.speeds.source,
        },
        "search": res.stats.to_dict(),
        "plans": [p.to_dict() for p in res.plans],
        "pareto": [p.flags for p in res.pareto],
        "pareto_step_time": [p.flags for p in res.pareto_step_time],
        "zero_bubble": zb.to_dict() if zb is not None else None,
    }
