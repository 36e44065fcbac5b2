"""`pipemem validate cuda`: real training steps on the user's GPU, measured peaks vs estimates.

For every case of the matrix (validate/cuda_cases.py) it builds the HF model from its config
(random weights), runs one warm-up step (optimizer states, cuBLAS workspaces, lazy inits),
resets the peak counters and runs one measured step, reading
`torch.cuda.max_memory_allocated()` and `memory_stats()["reserved_bytes.all.peak"]`.
A pipeline case is measured rank by rank, one process per rank, each walking its rank's
real action order (validate/stage_emulation.py), so a pipeline's per-rank memory is
measured on one GPU. It then asks pipemem for the same run (traced and templates modes,
`cuda` kernel policy) and writes one JSON file per run (reference data for validation/cuda/)
and prints a table.

Without a CUDA GPU it says so in one line and exits 2. torch is imported inside functions.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from ..errors import UserError
from .compare import CaseRow, beyond_tolerance, exit_code, header_line, rel_error, verdict_line
from .cuda_cases import CONFIG_SETS, Case, get_cases, hf_config_dict, to_plan

FORMAT = "pipemem.validation.cuda/1"
ESTIMATE_MODES = ("traced", "templates")
TRUTH = "measured"  # a real run, bytes from the allocator or profiler (compare.TRUTHS)
# A real GPU step against the estimate with the cuda kernel policy, whose kernels' workspaces
# (cuBLAS, attention) are assumed from their sources, not traced: 3 %, as the other real runs
# whose kernels pipemem does not trace (deepspeed, hf-trainer). No GPU run is committed yet
# (docs/ACCURACY.md): the first one tests this bound.
TOLERANCE = 0.03

EXAMPLE = """\
examples:
  pipemem validate cuda --configs small
  pipemem validate cuda --configs full --out validation/cuda/h100-2026-12-01.json
  pipemem validate cuda --case mixtral --json
  pipemem validate cuda --list
"""


HELP = "measure real peaks on this machine's CUDA GPU and compare with the estimates"
DESCRIPTION = (
    "Run real training steps of small HF Llama / Mistral / Mixtral models on the CUDA GPU, "
    "measure max_memory_allocated and the reserved peak (pipelines: one process per rank, "
    "each walking its rank's schedule), compare with pipemem's traced and templates "
    "estimates, write the results as one JSON file and print a table."
)


def add_arguments(p) -> None:
    p.add_argument(
        "--configs",
        choices=CONFIG_SETS,
        default="small",
        help="case set: small (about a dozen, minutes) or full (every combination)",
    )
    p.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="TEXT",
        help="only the cases whose name contains TEXT (repeatable)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="where to write the JSON results (default: validation/cuda/<gpu>-<configs>-<date>.json)",
    )
    p.add_argument("--no-estimates", action="store_true", help="measure only")
    p.add_argument("--list", action="store_true", help="print the cases and exit (needs no GPU)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")


def run(args) -> int:
    cases = get_cases(args.configs, args.case)
    if args.list:
        for c in cases:
            print(c.name)
        return 0
    require_cuda()
    report = new_report(environment(), args.configs)
    from .progress import CaseProgress, quiet_profiler_chatter

    with quiet_profiler_chatter(), CaseProgress([c.name for c in cases], "validate cuda") as bar:
        for case in cases:
            bar.start(case.name)
            result = measure_case(case, "cuda")
            if not args.no_estimates:
                add_estimates(result, case)
            report["cases"].append(result)
            bar.done(case.name, note=f"error: {result['error']}" if result.get("error") else "")
    rows = verdict_rows(report)
    report.update(
        truth=TRUTH,
        tolerance=TOLERANCE,
        beyond_tolerance=beyond_tolerance(rows, TOLERANCE),
        failed_cases=[c["name"] for c in report["cases"] if c.get("error")],
    )
    report["passed"] = not report["beyond_tolerance"] and not report["failed_cases"]
    path = write_report(report, args.out or default_out(report))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(header_line("cuda", TRUTH, TOLERANCE))
        print(format_table(report))
        print(verdict_line(rows, TOLERANCE))
        print(f"wrote {path}")
    return 1 if report["failed_cases"] else exit_code(rows, TOLERANCE)


def verdict_rows(report: dict) -> list[dict]:
    """The rows the verdict covers: per case and rank, the headline estimate (traced when it has
    one, else templates) against the measured allocated peak."""
    return [r for c in report["cases"] for r in c.get("rows", []) if r.get("mode") == c.get("estimate_mode")]


# The device ---------------------------------------------------------------------------------


def require_cuda() -> None:
    """A CUDA GPU through torch, or one UserError line saying what is missing."""
    try:
        import torch
    except ImportError:
        raise UserError(
            "validate cuda: torch is not installed; install a CUDA build of torch "
            "(pip install torch) on a machine with an NVIDIA GPU"
        ) from None
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise UserError(
            f"validate cuda: no CUDA GPU is visible (torch {torch.__version__}, {build}); "
            "run it on a machine with an NVIDIA GPU and a CUDA build of torch"
        )


def environment() -> dict:
    """What the measurements depend on: GPU, driver, CUDA, torch, transformers, pipemem."""
    import platform
    import subprocess

    import torch
    import transformers

    from .. import __version__

    props = torch.cuda.get_device_properties(0)
    driver = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "gpu": {
            "name": props.name,
            "total_memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
        },
        "driver": driver,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pipemem": __version__,
        "python": platform.python_version(),
    }


def _reset_device(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peaks(device: str) -> tuple[int | None, int | None]:
    """(max allocated, max reserved) since the last reset; None off CUDA."""
    import torch

    if device != "cuda":
        return None, None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()), int(torch.cuda.memory_stats()["reserved_bytes.all.peak"])


# One rank of one case ---------------------------------------------------------------------


def rank_actions(case: Case, rank: int) -> tuple[list, list[int], str]:
    """(this rank's actions for one step, the stages it holds, where the schedule came from).

    pp == 1: F then B per microbatch on the one stage. Otherwise pipemem.schedules; if that is
    not importable, torch.distributed.pipelining's own action lists."""
    from .stage_emulation import Action, stages_of_rank

    if case.pp == 1:
        acts = [a for m in range(case.microbatches) for a in (Action("F", 0, m), Action("B", 0, m))]
        return acts, [0], "sequential"
    try:
        from ..schedules import get_schedule
    except ImportError:
        get_schedule = None
    if get_schedule is not None:
        sched = get_schedule(case.schedule, case.pp, case.microbatches, vpp=case.vpp)
        stages = [s for s, r in enumerate(sched.stage_rank) if r == rank]
        return list(sched.ranks[rank]), stages, "pipemem.schedules"
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(case.schedule, case.pp, case.microbatches, num_stages_per_rank=case.vpp)
    return (
        list(ops[rank]),
        stages_of_rank(rank, case.pp, case.vpp, case.placement),
        "torch.distributed.pipelining",
    )


def build_hf_config(case: Case) -> Any:
    from transformers import AutoConfig

    d = hf_config_dict(case)
    model_type = d.pop("model_type")
    d.pop("architectures")
    attn = d.pop("attn_implementation")
    cfg = AutoConfig.for_model(model_type, **d)
    cfg.use_cache = False
    cfg._attn_implementation = attn
    if case.experts:
        cfg._experts_implementation = "grouped_mm"  # what traced mode assumes (HF's default for MoE)
    return cfg


def param_dtype(case: Case) -> Any:
    import torch

    return torch.bfloat16 if case.precision == "bf16" else torch.float32


def recv_dtype(case: Case) -> Any:
    """The residual stream a stage receives stays in the parameter dtype: under autocast the
    embedding output is fp32 and each layer adds its bf16 branch to the fp32 residual."""
    return param_dtype(case)


def _train_step(emu: Any, actions: Any, optimizer: Any) -> Any:
    """One training step: the rank's schedule walked by the emulator, then the optimizer step."""
    walk = emu.run(actions)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return walk


def run_rank(case: Case, rank: int, device: str = "cuda", seed: int = 0) -> dict:
    """Build rank `rank`'s stages of `case` on `device`, run a warm-up step and a measured
    step (all the rank's actions, then the optimizer), and return what was measured.
    Runs on CPU too (no peaks then), which is how the tests check everything but CUDA."""
    import torch

    from .stage_emulation import (
        RankEmulator,
        checkpoint_layers,
        core_attention_recompute_impl,
        hf_stage_modules,
    )

    started = time.perf_counter()
    torch.manual_seed(seed)
    actions, stages_owned, source = rank_actions(case, rank)
    cfg = build_hf_config(case)
    if case.recompute == "selective":
        cfg._attn_implementation = core_attention_recompute_impl(case.attn)
    shape = (case.micro_batch, case.seq_len)
    labels = torch.randint(0, case.vocab, shape, device=device)
    stages = hf_stage_modules(
        cfg,
        {s: case.stage_layers(s) for s in stages_owned},
        case.num_stages,
        labels,
        device,
        param_dtype(case),
    )
    if case.recompute == "full":
        for st in stages.values():
            checkpoint_layers(st)
    params = [p for st in stages.values() for p in st.parameters()]
    impl = {"adamw_foreach": {"foreach": True}, "adamw_fused": {"fused": True}}[case.optimizer]
    optimizer = torch.optim.AdamW(params, lr=1e-4, **impl)
    dev_type = torch.device(device).type
    autocast: Callable[[], Any] = (
        (lambda: torch.autocast(dev_type, dtype=torch.bfloat16))
        if case.precision == "bf16_autocast"
        else nullcontext
    )
    hidden_shape = (case.micro_batch, case.seq_len, case.hidden)
    probe = (lambda: int(torch.cuda.memory_allocated())) if dev_type == "cuda" else None
    emu = RankEmulator(
        stages,
        case.num_stages,
        make_input=lambda mb: torch.randint(0, case.vocab, shape, device=device),
        recv_spec=lambda s: (hidden_shape, recv_dtype(case)),
        device=device,
        forward_context=autocast,
        probe=probe,
    )

    _train_step(emu, actions, optimizer)  # warm-up: creates the optimizer states
    first_alloc, first_reserved = _peaks(dev_type)
    import gc

    gc.collect()
    if dev_type == "cuda":
        # No empty_cache here: the measured step starts from the steady state a training
        # loop is in (the allocator keeps the segments of the step before).
        torch.cuda.reset_peak_memory_stats()
    start_bytes = int(torch.cuda.memory_allocated()) if dev_type == "cuda" else None
    walk = _train_step(emu, actions, optimizer)
    alloc, reserved = _peaks(dev_type)
    result = {
        "rank": rank,
        "stages": stages_owned,
        "layers": {str(s): list(case.stage_layers(s)) for s in stages_owned},
        "schedule_source": source,
        "allocated_peak_bytes": alloc,
        "reserved_peak_bytes": reserved,
        "step_start_bytes": start_bytes,
        "first_step": {"allocated_peak_bytes": first_alloc, "reserved_peak_bytes": first_reserved},
        "max_held_forwards": walk.max_held_forwards,
        "received_activations": len(walk.received_activations),
        "received_grads": len(walk.received_grads),
        "timeline": [[str(r.action), r.bytes_after] for r in walk.records],
        "seconds": round(time.perf_counter() - started, 3),
        "pid": os.getpid(),
    }
    del emu, stages, optimizer, params, walk
    return result


def _rank_worker(case: Case, rank: int, device: str) -> dict:
    return run_rank(case, rank, device)


def run_rank_isolated(case: Case, rank: int, device: str) -> dict:
    """run_rank in a fresh process, so each pipeline rank starts from an empty allocator."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_rank_worker, case, rank, device).result()


def measure_case(case: Case, device: str = "cuda", isolate: bool | None = None) -> dict:
    """Every rank of `case` measured; a failure (out of memory...) is recorded, not raised.
    isolate: one process per rank (default: for pipeline cases)."""
    isolate = case.pp > 1 if isolate is None else isolate
    result: dict = {"name": case.name, "config": case.to_dict(), "ranks": [], "error": None}
    for rank in range(case.pp):
        _reset_device(device)
        try:
            r = run_rank_isolated(case, rank, device) if isolate else run_rank(case, rank, device)
        except Exception as e:  # noqa: BLE001 - one failed case must not lose the others' numbers
            result["error"] = f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            break
        finally:
            _reset_device(device)
        result["ranks"].append(r)
    allocs = [r["allocated_peak_bytes"] for r in result["ranks"] if r["allocated_peak_bytes"] is not None]
    reserved = [r["reserved_peak_bytes"] for r in result["ranks"] if r["reserved_peak_bytes"] is not None]
    result["measured_bytes"] = max(allocs) if allocs and not result["error"] else None
    result["measured_reserved_bytes"] = max(reserved) if reserved and not result["error"] else None
    return result


# Estimates ----------------------------------------------------------------------------------


def estimate_case(case: Case, mode: str, estimator: Callable | None = None) -> dict:
    """pipemem's per-rank peak allocated bytes for `case` in `mode`, or the reason there is none.
    The estimator (pipemem.estimate.estimate) is looked up here so this command works whether
    or not the estimating layers are installed."""
    if estimator is None:
        try:
            from ..estimate import estimate as estimator
        except ImportError as e:
            return {"mode": mode, "ranks": None, "peak_bytes": None, "error": f"estimator not available: {e}"}
    plan = {k: v for k, v in vars(to_plan(case)).items() if v is not None}
    if plan.get("pp_layout") is not None:
        plan["pp_layout"] = list(plan["pp_layout"])
    try:
        out = estimator(hf_config_dict(case), mode=mode, kernel_policy="cuda", **plan)
        doc = out.to_dict() if hasattr(out, "to_dict") else out
        ranks = [
            int(r["peak_allocated_bytes"]) for r in sorted(doc["ranks"], key=lambda r: r.get("pp_rank", 0))
        ]
    except (UserError, ImportError, NotImplementedError) as e:
        return {"mode": mode, "ranks": None, "peak_bytes": None, "error": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001 - an estimator bug is a finding to record, not a crash
        return {
            "mode": mode,
            "ranks": None,
            "peak_bytes": None,
            "error": f"estimator failed: {type(e).__name__}: {e}",
        }
    return {"mode": mode, "ranks": ranks, "peak_bytes": max(ranks), "error": None}


def add_estimates(result: dict, case: Case, estimator: Callable | None = None) -> dict:
    """Attach both estimates and the headline numbers (`estimated_bytes` = traced when it has
    one, else templates; `rel_error` against the measured max allocated)."""
    result["estimates"] = {m: estimate_case(case, m, estimator) for m in ESTIMATE_MODES}
    for r in result["ranks"]:
        r["estimated_bytes"] = {
            m: (e["ranks"][r["rank"]] if e["ranks"] and r["rank"] < len(e["ranks"]) else None)
            for m, e in result["estimates"].items()
        }
    best = next((m for m in ESTIMATE_MODES if result["estimates"][m]["peak_bytes"] is not None), None)
    result["estimate_mode"] = best
    result["estimated_bytes"] = result["estimates"][best]["peak_bytes"] if best else None
    result["rel_error"] = rel_error(result["estimated_bytes"], result.get("measured_bytes"))
    # the comparison rows every validate target reports: one per rank and estimate mode
    result["rows"] = [
        CaseRow(
            f"{case.name}/rank{r['rank']}/{m}",
            r.get("allocated_peak_bytes"),
            est,
            {"rank": r["rank"], "mode": m},
        ).to_dict()
        for r in result["ranks"]
        for m, est in r["estimated_bytes"].items()
    ]
    return result


# The report ---------------------------------------------------------------------------------


def new_report(env: dict, configs: str) -> dict:
    return {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "configs": configs,
        **env,
        "cases": [],
    }


def default_out(report: dict) -> Path:
    gpu = str(report.get("gpu", {}).get("name") or "gpu")
    slug = "".join(ch if ch.isalnum() else "-" for ch in gpu.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return Path("validation") / "cuda" / f"{slug}-{report['configs']}-{report['created'][:10]}.json"


def write_report(report: dict, path: str | Path) -> Path:
    """Write the report as indented JSON with a trailing newline (diff-friendly when committed)."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    except OSError as e:
        raise UserError(f"--out {path}: cannot write ({e.strerror})") from None
    return p


def format_table(report: dict) -> str:
    """One row per (case, rank): measured allocated and reserved, each estimate and its error."""
    from ..units import fmt_bytes

    def b(n):
        return fmt_bytes(n) if n is not None else "-"

    def pct(est, meas):
        e = rel_error(est, meas)
        return f"{e * 100:+.1f}%" if e is not None else "-"

    header = ("case", "rank", "allocated", "reserved", "traced", "err", "templates", "err")
    rows = []
    for c in report["cases"]:
        if c.get("error") and not c["ranks"]:
            rows.append((c["name"], "-", "error", "-", "-", "-", "-", c["error"]))
            continue
        for r in c["ranks"]:
            est = r.get("estimated_bytes") or {}
            meas = r["allocated_peak_bytes"]
            rows.append(
                (
                    c["name"],
                    str(r["rank"]),
                    b(meas),
                    b(r["reserved_peak_bytes"]),
                    b(est.get("traced")),
                    pct(est.get("traced"), meas),
                    b(est.get("templates")),
                    pct(est.get("templates"), meas),
                )
            )
        if c.get("error"):
            rows.append((c["name"], "-", "error", "-", "-", "-", "-", c["error"]))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    gpu = report.get("gpu", {})
    lines = [
        f"GPU {gpu.get('name', '?')} (driver {report.get('driver') or '?'}, CUDA "
        f"{report.get('cuda') or '?'}, torch {report.get('torch', '?')})",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)),
    ]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.append(
        "allocated = torch.cuda.max_memory_allocated(), reserved = reserved_bytes.all.peak, "
        "both over one steady-state step; err = (estimate - allocated) / allocated."
    )
    return "\n".join(lines)
