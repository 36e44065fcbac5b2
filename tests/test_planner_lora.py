"""`pipemem plan` with LoRA / QLoRA held fixed: the search prices the frozen base and the adapters
(the plans re-estimate to the same bytes with their flags, the static bound prunes nothing it
should list), and its cost model counts the adapters' gradients only."""

from __future__ import annotations

import shlex

import pytest

from pipemem.cli.main import main
from pipemem.estimate import estimate
from pipemem.plan import ParallelPlan, validate_plan
from pipemem.planner import SpaceOptions, Target, search_plans
from pipemem.planner.cost import communication, stage_flops
from pipemem.planner.hardware import speeds_for
from pipemem.presets import gpu_info

LORA = dict(lora_rank=16, lora_targets="all-linear")


def _search(extra, prune=True):
    target = Target(4, gpu_info("rtx3090")["bytes"], 0, speeds_for("rtx3090"), gpu="rtx3090")
    opts = SpaceOptions(convention="hf", micro_batches=(1,), max_vpp=1, shardings=("zero1", "zero3"))
    return search_plans("llama3.2-1b", target, 2048, 8, opts, extra=extra, prune=prune)


def test_lora_plan_search_is_the_estimate_of_the_lora_plan():
    lora = _search(LORA)
    assert lora.plans
    for p in lora.plans[:4]:
        args = shlex.split(p.flags)
        assert "--lora-rank" in args and args[args.index("--lora-targets") + 1] == "all-linear"
        assert p.kwargs["lora_rank"] == 16
        est = estimate("llama3.2-1b", **{k: v for k, v in p.kwargs.items()}, gpu="rtx3090")
        assert [r.peak_allocated_bytes for r in est.ranks] == list(p.rank_peaks)
    # the static-bytes bound (the frozen base has no grads nor optimizer states) skips no LoRA plan
    full = _search(LORA, prune=False)
    assert [(p.flags, p.rank_peaks) for p in lora.plans] == [(p.flags, p.rank_peaks) for p in full.plans]
    # the same plans fine-tuned whole hold more (gradients, optimizer states, saved inputs)
    whole = {p.flags: p for p in _search({}).plans}
    for p in lora.plans:
        same = whole[p.flags.split(" --lora-rank")[0]]
        assert max(p.rank_peaks) < max(same.rank_peaks) and p.cost.comm_bytes < same.cost.comm_bytes


def test_lora_cost_counts_the_adapters_gradients_only():
    from pipemem.model import arch_from_hf_config
    from pipemem.presets import load_model_config

    arch = arch_from_hf_config(load_model_config("llama3.2-1b")[1], "llama3.2-1b")
    base = dict(seq_len=2048, dp=8, convention="hf", zero=1)
    full = validate_plan(arch, ParallelPlan(**base))
    lora = validate_plan(arch, ParallelPlan(**base, **LORA))
    rank = list(range(arch.layers))
    params = (arch.param_count(), 0)

    def dp_bytes(plan):
        return sum(
            c.bytes
            for c in communication(arch, plan, [0], params, 8, speeds_for("h100-80g"))
            if c.group == "dp"
        )

    from pipemem.lora import adapter_elems, parse_targets

    adapters = adapter_elems(arch, parse_targets("all-linear"), 16) * len(rank)
    # ZeRO-1: the gradients reduce-scattered and the parameters all-gathered, adapters only
    assert dp_bytes(lora) == pytest.approx(dp_bytes(full) * adapters / params[0])
    # no weight-gradient matmuls of the frozen base: W is the adapters' alone
    ((f, i, w),) = stage_flops(arch, (arch.layers,), 2048, "none", None)
    ((lf, li, lw),) = stage_flops(arch, (arch.layers,), 2048, "none", None, adapters // arch.layers)
    assert lw == 2.0 * adapters and lf == f + lw and li == i + lw


def test_plan_refuses_lora_once_where_every_plan_would(capsys):
    argv = ["plan", "--model", "llama3.2-1b", "--gpus", "4", "--gpu", "rtx3090", "--seq-len", "2048"]
    argv += ["--global-batch", "8", "--lora-rank", "16"]
    assert main(argv) == 2  # the default convention (megatron) has no LoRA model
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipemem: error: --lora-rank with --convention megatron") and "\n" not in err


def test_plan_and_estimate_take_the_same_lora_flags():
    import argparse

    from pipemem.cli import cmd_estimate, cmd_plan

    def lora_actions(add):
        p = argparse.ArgumentParser(add_help=False)
        add(p)
        return {
            a.option_strings[0]: (a.type, a.const, a.default, a.metavar, a.help)
            for a in p._actions
            if a.option_strings and ("lora" in a.option_strings[0] or a.option_strings[0] == "--qlora")
        }

    plan, est = lora_actions(cmd_plan.add_arguments), lora_actions(cmd_estimate.add_arguments)
    assert set(plan) == {"--lora-rank", "--lora-targets", "--lora-alpha", "--lora-dropout", "--qlora"}
    assert plan == est
