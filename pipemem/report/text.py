"""The human report of an estimate: one row per pipeline rank, the action at each rank's
peak, and a one-line verdict; `--explain` adds what one layer keeps for backward.

All numbers are read from the `Estimate`; nothing is computed here but differences and
percentages for display.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from dataclasses import replace
from typing import Any, Mapping

from ..units import fmt_bytes

RED, GREEN, YELLOW, DIM = "bold red", "bold green", "yellow", "dim"


def terminal_width(file=None) -> int:
    """Columns to lay the report out in: the terminal's, else $COLUMNS, else 150 (a pipe)."""
    file = file or sys.stdout
    if hasattr(file, "isatty") and file.isatty():
        return shutil.get_terminal_size((150, 40)).columns
    try:
        return max(20, int(os.environ.get("COLUMNS", 150)))
    except ValueError:
        return 150


def _console(file=None, color: bool | None = None, width: int | None = None):
    from rich.console import Console

    file = file or sys.stdout
    is_tty = hasattr(file, "isatty") and file.isatty()
    if color is None:
        color = is_tty and "NO_COLOR" not in os.environ
    return Console(
        file=file,
        width=width or terminal_width(file),
        no_color=not color,
        highlight=False,
        force_terminal=True if color else None,
        color_system="standard" if color else None,
        soft_wrap=False,
    )


def _plural(n, word: str) -> str:
    return f"{n:g} {word}" if n == 1 else f"{n:g} {word}s"


def describe_precision(plan) -> str:
    """What the convention keeps per parameter, from the same rule the engine uses
    (templates.static.bytes_per_param): e.g. 'bf16 params, fp32 grads + master + optimizer
    states' (Megatron), 'fp32 params + grads + optimizer states, bf16 compute' (torchtitan, hf)."""
    from ..templates.conventions import CONVENTIONS
    from ..templates.static import STATES, bytes_per_param

    p_b, g_b, master_b, st_b = bytes_per_param(plan, CONVENTIONS[plan.convention])
    name = {1: "8-bit", 2: plan.dtype if plan.dtype != "fp32" else "bf16", 4: "fp32"}
    param = name.get(p_b, f"{p_b}-byte")
    grad = plan.main_grad_dtype or plan.dtype
    per_state = st_b // max(1, STATES.get(plan.optimizer, 1))
    # Megatron's precision-aware optimizer keeps the masters in --main-params-dtype (fp32 ones of bf16
    # weights as 16-bit remainders: still fp32 masters)
    master = (plan.extra or {}).get("main_params_dtype") or "fp32"
    kept = (
        [("params", param), ("grads", grad)]
        + ([("master", master)] if master_b else [])
        + [("optimizer states", name.get(per_state, f"{per_state}-byte"))]
    )
    groups: list[tuple[str, list[str]]] = []
    for what, dt in kept:
        if groups and groups[-1][0] == dt:
            groups[-1][1].append(what)
        else:
            groups.append((dt, [what]))
    text = ", ".join(f"{dt} {' + '.join(ws)}" for dt, ws in groups)
    if plan.dtype != "fp32" and param == "fp32":
        text += f", {plan.dtype} compute"
    return text


def describe_plan(est) -> str:
    p = est.plan
    parts = [f"dp {p.dp}", f"tp {p.tp}", f"pp {p.pp}"]
    if p.vpp > 1:
        parts.append(f"vpp {p.vpp}")
    if p.cp > 1:
        parts.append(f"cp {p.cp}")
    if p.ep > 1:
        parts.append(f"ep {p.ep}")
    if p.sp:
        parts.append("sp")
    shard = []
    if p.zero:
        group = (p.extra or {}).get("zero_group")
        shard.append(f"zero {p.zero}" + (f" over {group} of the {p.dp * p.cp} dp ranks" if group else ""))
    if p.fsdp:
        shard.append("fsdp")
    if p.dist_opt:
        shard.append("dist-opt")
    batch = f"micro-batch {p.micro_batch} x seq {p.seq_len}"
    if p.microbatches:
        batch += f", {_plural(p.microbatches, 'microbatch')}".replace("microbatchs", "microbatches")
    rec = f"recompute {p.recompute}" + (
        f" ({p.recompute_layers} layers/stage)"
        if p.recompute_layers is not None and p.recompute != "none"
        else ""
    )
    traced = est.mode == "traced"
    framework = (
        "HF modules, traced"
        if traced
        else "PaddleNLP's own programs (Paddle's passes)"
        if est.mode == "paddle"
        else f"{p.convention} convention"
    )
    # traced mode runs HF modules under torch autocast and torch.optim as recorded
    prec_plan = replace(p, convention="hf") if traced else p
    opt = p.optimizer + (
        f" ({p.optimizer_impl})" if getattr(p, "optimizer_impl", None) and not traced else ""
    )
    sched = [est.schedule] if p.pp > 1 else []  # one stage runs no pipeline schedule
    bits = (
        [" ".join(parts)]
        + shard
        + sched
        + [batch, describe_precision(prec_plan), opt, rec, _flash_text(est), framework]
    )
    from ..features import describe

    bits += describe(p)
    return ", ".join(bits)


def _flash_text(est) -> str:
    if est.plan.flash_attn:
        return "flash-attn"
    from ..presets import gpu_info

    try:
        info = gpu_info(est.gpu_name) if est.gpu_name else {}
    except Exception:  # --gpu-memory: no preset to consult
        info = {}
    if info and not info.get("flash_attention", True):
        return (
            f"no flash-attn ({info['key']}, compute capability "
            f"{info.get('compute_capability')}, cannot run it)"
        )
    return "no flash-attn"


def _inflight_text(r, vpp: int) -> str:
    """In-flight microbatches in units of one microbatch's activations on the rank (all its
    chunks), as `pipemem schedule` counts them: 11 chunk forwards at vpp 2 = 5.5 mb."""
    return f"{r.inflight / max(vpp, 1):g} mb"


FOOTNOTE = (
    "peak = params + grads (resident, and '+ made': those the step's backward has created by the "
    "peak) + optimizer + other static (runtime buffers, cached weight copies, gathered parameters) + "
    "activations "
    "held around the action at the peak "
    "(in brackets: the most microbatches in flight, in microbatches of the rank's activations) + transient "
    "(that action's working memory; the optimizer step's scratch when the peak is there). F3@s1 = forward "
    "of microbatch 3 on stage 1, B backward, I/W split backward. Allocated bytes, as "
    "torch.cuda.max_memory_allocated counts them; reserved = what PyTorch's caching allocator holds at "
    "most for that allocation stream (torch.cuda.max_memory_reserved, modelled; --alloc-conf sets its "
    "settings). headroom = GPU minus the rank's device peak: reserved plus the CUDA context, NCCL's "
    "buffers and the cuBLAS workspace (the verdict line itemizes them)."
)


def row_cells(est, r) -> dict:
    gpu = est.gpu_memory_bytes
    head = r.headroom(gpu)
    head_txt = "-" if head is None else (f"OOM by {fmt_bytes(-head)}" if head < 0 else fmt_bytes(head))
    act = r.activations_at_peak_bytes
    act_txt = fmt_bytes(act)
    if r.peak_is_optimizer:
        act_txt += " (step)"
    elif r.inflight:
        act_txt += f" ({_inflight_text(r, est.plan.vpp)})"
    style = {"oom": RED, "tight": YELLOW}.get(r.verdict(gpu), "")
    return {
        "rank": str(r.pp_rank),
        "layers": _layers_text(r),
        "params": fmt_bytes(r.static.params),
        "grads": _grads_text(r),
        "optimizer": fmt_bytes(r.static.optimizer),
        "other": fmt_bytes(r.static.other),
        "activations": act_txt,
        "transient": fmt_bytes(r.transient_bytes),
        "peak": fmt_bytes(r.peak_allocated_bytes),
        "reserved": _reserved_text(r),
        "headroom": head_txt,
        "peak at": str(r.peak_at),
        "_style": style,
    }


def _reserved_text(r) -> str:
    """The allocator's peak reserved (pipemem.reserved), '-' where not modelled."""
    v = r.peak_reserved_bytes
    return "-" if v is None else fmt_bytes(v)


_COLUMNS = [
    ("rank", "right"),
    ("layers", "left"),
    ("params", "right"),
    ("grads", "right"),
    ("optimizer", "right"),
    ("activations", "right"),
    ("transient", "right"),
    ("peak", "right"),
    ("reserved", "right"),
    ("headroom", "right"),
    ("peak at", "left"),
]


def columns(est) -> list[tuple[str, str]]:
    """The table's columns: an `other` column (static bytes besides params, grads and optimizer
    states) when a rank holds any, so that every row adds up to its peak."""
    if not any(r.static.other for r in est.ranks):
        return list(_COLUMNS)
    at = [n for n, _ in _COLUMNS].index("optimizer") + 1
    return _COLUMNS[:at] + [("other", "right")] + _COLUMNS[at:]


def _table(est, rows):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(
        show_header=True,
        header_style="bold",
        show_lines=False,
        pad_edge=False,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 1),
        collapse_padding=True,
    )
    cols = columns(est)
    for name, justify in cols:
        header = "activations\n(in flight)" if name == "activations" else name
        t.add_column(header, justify=justify, no_wrap=True, overflow="fold")
    for c in rows:
        styles = {"peak": c["_style"] or "bold", "headroom": c["_style"]}
        cells = [Text(c[name], style=styles[name]) if name in styles else c[name] for name, _ in cols]
        t.add_row(*cells)
    return t


def table_width(table) -> int:
    """Columns the table needs to print without shrinking any cell."""
    from rich.console import Console
    from rich.measure import Measurement

    con = Console(file=io.StringIO(), width=10_000, no_color=True, soft_wrap=False)
    return Measurement.get(con, con.options, table).maximum


def _stacked(rows, width: int):
    """One block per rank, `name value` items wrapped whole to the width: no number is cut."""
    from rich.text import Text

    out = Text()
    for c in rows:
        head = [
            f"rank {c['rank']}",
            f"layers {c['layers']}",
            f"peak {c['peak']}",
            f"reserved {c['reserved']}",
            c["headroom"] if c["headroom"].startswith("OOM") else f"headroom {c['headroom']}",
            f"at {c['peak at']}",
        ]
        body = (
            [f"params {c['params']}", f"grads {c['grads']}", f"optimizer {c['optimizer']}"]
            + ([f"other {c['other']}"] if c["other"] != fmt_bytes(0) else [])
            + [f"activations {c['activations']}", f"transient {c['transient']}"]
        )
        for i, line in enumerate(_wrap_items(head, width) + _wrap_items(body, width - 2, indent="  ")):
            out.append(line + "\n", style=(c["_style"] or "bold") if i == 0 else "")
    return out


def _wrap_items(items: list[str], width: int, indent: str = "") -> list[str]:
    lines, cur = [], ""
    for it in items:
        if cur and len(cur) + 2 + len(it) > width:
            lines.append(indent + cur)
            cur = it
        else:
            cur = f"{cur}  {it}" if cur else it
    if cur:
        lines.append(indent + cur)
    return lines


def render(
    est,
    file=None,
    color: bool | None = None,
    explain: bool = False,
    wide: bool = False,
    width: int | None = None,
) -> None:
    """The report. The per-rank table when it fits `width` (the terminal's) or with `wide`;
    else one block per rank (stacked), so that no number is ever cut."""
    from rich.text import Text

    width = width or terminal_width(file)
    rows = [row_cells(est, r) for r in est.ranks]
    table = _table(est, rows)
    need = table_width(table)
    stacked = need > width and not wide
    con = _console(file, color, width=max(width, need) if wide else width)
    gpu = est.gpu_memory_bytes
    gpu_txt = f"{est.gpu_name} ({fmt_bytes(gpu)})" if gpu is not None else "no GPU given"
    con.print(Text(f"{est.model_name}: {_plural(est.world_size, 'GPU')}, {gpu_txt}", style="bold"))
    con.print(Text(describe_plan(est), style=DIM))
    if est.mode == "traced":
        con.print(Text("traced mode: the real PyTorch training step recorded on fake tensors", style=DIM))
    con.print(Text(step_note(est.plan), style=DIM))
    if stacked:
        con.print(_stacked(rows, width), end="")
    else:
        con.print(table)
    con.print(Text(FOOTNOTE, style=DIM))
    if est.mode == "paddle":
        render_jobs(est, con)
    con.print(verdict(est, markup=True))
    if explain and est.explain is not None:
        render_explain(est.explain, con, wide=wide)


GRADS_WORDS = {
    "buffer": "gradients resident all step (contiguous grad buffer / zero_grad(set_to_none=False))",
    "set-to-none": "gradients set to None by zero_grad, created by the step's first backward",
    "ddp-bucket": "DDP: .grad set to None by zero_grad and created in backward, plus DDP's resident buckets "
    "(gradient_as_bucket_view=False)",
    "ddp-bucket-view": "DDP: .grad are views of DDP's resident buckets (gradient_as_bucket_view=True)",
}


def step_note(plan) -> str:
    """Which training step the numbers are for, in words (--step, --grads)."""
    step = (
        "steady state (a step after the first: optimizer states resident)"
        if plan.step == "steady"
        else "first training step (optimizer states created in its optimizer step)"
    )
    return f"{step}; {GRADS_WORDS.get(plan.grads, plan.grads)} (--grads {plan.grads})"


def _grads_text(r) -> str:
    """Resident gradient bytes, plus those the step's backward has made by the peak (of the
    `static.grads_in_step` it makes in all) when it makes any."""
    static = r.static
    if not static.grads_in_step:
        return fmt_bytes(static.grads)
    made = f"+{fmt_bytes(r.grads_at_peak_bytes)} made"
    return f"{fmt_bytes(static.grads)} {made}" if static.grads else made


def _layers_text(r) -> str:
    if not any(len(row.get("layers") or ()) for row in r.stage_jobs):
        return "-" if r.stage_jobs else "all"
    chunks = []
    for row in r.stage_jobs:
        ls = row.get("layers") or []
        if ls:
            chunks.append(f"{ls[0]}-{ls[-1]}" if len(ls) > 1 else str(ls[0]))
        else:
            chunks.append("-")
    return ",".join(chunks)


KIND_WORDS = {"F": "forward", "B": "backward", "I": "input-grad backward", "W": "weight-grad backward"}


def describe_action(peak_at: Any) -> str:
    """'B3@s1' -> 'backward mb 3 stage 1 (B3@s1)'; 'optimizer' -> 'the optimizer step'."""
    text = str(peak_at)
    import re

    if text == "optimizer":
        return "the optimizer step"
    m = re.fullmatch(r"(RECV_F|RECV_B|FREE_\w+)(\d+)@s(\d+)", text)
    if m:  # a memory action of the pipeline runtime (pipemem.runtime)
        what = {"RECV_F": "receiving the input", "RECV_B": "receiving the output grad"}.get(
            m.group(1), "a free"
        )
        return f"{what} of mb {m.group(2)} stage {m.group(3)} ({text})"

    m = re.fullmatch(r"([FBIW])(\d+)@s(\d+)", text)
    if m:
        return f"{KIND_WORDS[m.group(1)]} mb {m.group(2)} stage {m.group(3)} ({text})"
    return text


def device_text(r) -> str:
    """The rank's device peak, itemized: reserved (or allocated, where reserved is not
    modelled) plus what lives outside the caching allocator."""
    held = (
        f"{fmt_bytes(r.peak_reserved_bytes)} reserved"
        if r.peak_reserved_bytes is not None
        else f"{fmt_bytes(r.peak_allocated_bytes)} allocated (reserved not modelled)"
    )
    o = r.outside
    if o is None:
        return held
    groups = ", ".join(f"{c.name} {c.ranks}" for c in o.communicators)
    nccl = (
        f"NCCL {fmt_bytes(o.nccl_bytes)} for {len(o.communicators)} groups ({groups})"
        if o.communicators
        else "no NCCL groups"
    )
    return (
        f"{held} + {fmt_bytes(o.total_bytes)} outside the allocator (CUDA context "
        f"{fmt_bytes(o.cuda_context_bytes)}, {nccl}, cuBLAS workspace {fmt_bytes(o.cublas_workspace_bytes)}) "
        f"= {fmt_bytes(r.device_peak_bytes)}"
    )


def verdict(est, markup: bool = False):
    """One line: FITS, TIGHT (near the limit: it may OOM) or OOM, where, by how much. Judged on
    the device peak (reserved + outside the allocator), never on allocated bytes alone."""
    from rich.text import Text

    from ..estimate import NEAR_LIMIT, NEAR_LIMIT_UNMODELLED

    worst = est.device_worst_rank
    gpu = est.gpu_memory_bytes
    where = (
        f"rank {worst.pp_rank} at {fmt_bytes(worst.peak_allocated_bytes)} allocated during "
        f"{describe_action(worst.peak_at)}"
    )
    if worst.peak_is_optimizer:
        where += (
            f" ({fmt_bytes(worst.transient_bytes)} of optimizer scratch on "
            f"{fmt_bytes(worst.static.total + worst.grads_at_peak_bytes)} of "
            f"params, grads and optimizer states{_resident(worst)})"
        )
    device = device_text(worst)
    v = est.verdict
    if gpu is None:
        line = Text.assemble(
            ("PEAK", "bold"),
            f": {where}; on the device {device}; pass --gpu NAME or --gpu-memory GIB to check the fit.",
        )
    elif v == "fits":
        share = worst.device_peak_bytes / gpu
        line = Text.assemble(
            ("FITS", GREEN),
            f" on {est.gpu_name}: worst is {where}; {device}, {share:.0%} of "
            f"{fmt_bytes(gpu)}, {fmt_bytes(gpu - worst.device_peak_bytes)} headroom.",
        )
    elif v == "tight":
        share = worst.device_peak_bytes / gpu
        margin = NEAR_LIMIT if est.reserved_modelled else NEAR_LIMIT_UNMODELLED
        why = (
            "the reserved estimate and the sizes of NCCL's buffers and the CUDA context vary by a few "
            "percent between runs and versions"
            if est.reserved_modelled
            else "reserved memory is not modelled here, and the caching allocator's rounding and "
            "fragmentation add 3-27 % over allocated in Megatron's memory logs"
        )
        line = Text.assemble(
            ("TIGHT", YELLOW),
            f" on {est.gpu_name}: worst is {where}; {device}, {share:.0%} of "
            f"{fmt_bytes(gpu)}: within {margin:.0%} of the limit, it may OOM ({why})."
            f"{_advice(est, worst)}",
        )
    else:
        over = [r.pp_rank for r in est.ranks if r.device_peak_bytes > gpu]
        rank_word = "rank" if len(over) == 1 else "ranks"
        verb = "exceeds" if len(over) == 1 else "exceed"
        line = Text.assemble(
            ("OOM", RED),
            f" on {est.gpu_name}: {rank_word} {_ranges(over)} {verb} "
            f"{fmt_bytes(gpu)}; worst is {where}; {device}, "
            f"{fmt_bytes(worst.device_peak_bytes - gpu)} over.{_advice(est, worst)}",
        )
    return line if markup else line.plain


def render_jobs(est, con) -> None:
    """Per pipeline rank, each job's net change and peak relative to the job's start (the
    numbers Paddle's PipelineMemoryEstimator reports per sub-program)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(
        show_header=True,
        header_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 1),
        collapse_padding=True,
    )
    for name in ("rank", "stage", "F net", "F peak", "B net", "B peak", "I peak", "W peak", "optimizer peak"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in est.ranks:
        opt = r.jobs.get("optimizer")
        for row in r.stage_jobs:

            def cell(kind, key, row=row):
                j = row.get(kind)
                return "-" if not j else fmt_bytes(j[key], signed=key == "net_bytes")

            t.add_row(
                str(r.pp_rank),
                str(row["stage"]),
                cell("F", "net_bytes"),
                cell("F", "peak_bytes"),
                cell("B", "net_bytes"),
                cell("B", "peak_bytes"),
                cell("I", "peak_bytes"),
                cell("W", "peak_bytes"),
                fmt_bytes(opt.peak_bytes) if opt else "-",
            )
    con.print(Text("jobs (each relative to the memory at its start):", style="bold"))
    con.print(t)


def _advice(est, worst) -> str:
    """Engine-checked alternatives when the CLI computed them, else the levers that apply."""
    sug = getattr(est, "suggestions", None) or []
    fit = [x for x in sug if x["fits"]]
    if fit:
        return (
            " Fits with "
            + " or ".join(f"{x['flags']} ({fmt_bytes(_device_peak(x))} on the device)" for x in fit)
            + "."
        )
    if sug:
        x = sug[0]
        return (
            f" No single change tried fits; the one that lowers the peak most: {x['flags']} "
            f"({fmt_bytes(_device_peak(x))} on the device)."
        )
    if getattr(est, "suggestions_tried", False):
        return " No single change on these GPUs lowers the peak; more GPUs are needed" + (
            " (e.g. --dp N with --zero 1 / --fsdp / --dist-opt to shard the optimizer states)."
            if worst.peak_is_optimizer
            else " (more --tp or --pp)."
        )
    return _hint(est, worst)


def _device_peak(suggestion: dict) -> int:
    return suggestion.get("max_device_peak_bytes", suggestion["max_peak_allocated_bytes"])


def _resident(r) -> str:
    act = r.activations_at_peak_bytes
    return f", {fmt_bytes(act)} of activations still held" if act else ""


def _hint(est, worst) -> str:
    """Levers that can lower this peak, when the engine did not try them (Python API)."""
    p = est.plan
    static = worst.static.total
    levers = []
    if worst.peak_is_optimizer:
        if p.dp * p.cp > 1 and not (p.zero or p.fsdp or p.dist_opt):
            levers.append("--dist-opt or --zero 1 or --fsdp")
        if p.optimizer_impl != "fused":
            levers.append("--optimizer-impl fused")
        levers.append("more GPUs to shard the optimizer states over")
    elif worst.activations_at_peak_bytes + worst.transient_bytes > static:
        if p.recompute in ("none", "selective", "core_attn"):
            levers.append("--recompute full")
        if p.micro_batch > 1:
            levers.append("a smaller --micro-batch")
        if p.tp > 1 and not p.sp:
            levers.append("--sp")
    else:
        if p.dp > 1 and not (p.zero or p.fsdp or p.dist_opt):
            levers.append("--dist-opt or --zero 1")
        levers.append("more --tp or --pp")
    return f" Try {' or '.join(levers)}." if levers else ""


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


# ---------------------------------------------------------------- --explain

_BYTES_KEYS = ("bytes", "size", "net_bytes", "peak_bytes")


def render_explain(rows: Any, con, wide: bool = False) -> None:
    """Rows from stages.layer_explain (dicts with tensor, shape, dtype, bytes, why; rows whose
    tensor is "(...)" describe the layer's transient peaks), or a dict of sections
    {title: rows or text}. Bytes columns are formatted; other values shown as given. A table
    wider than the console is printed one block per row (as the per-rank table), unless
    `wide`: no name, shape or number is cut."""
    from rich.text import Text

    if isinstance(rows, Mapping):
        sections = list(rows.items())
    else:
        items = [_as_dict(x) for x in (rows or [])]
        # rows naming a "section" (e.g. the --recompute-allgather trade) get a table of their own
        extra: dict[str, list] = {}
        for r in items:
            if r.get("section"):
                extra.setdefault(str(r["section"]), []).append({k: v for k, v in r.items() if k != "section"})
        items = [r for r in items if not r.get("section")]
        kept = [r for r in items if not str(r.get("tensor", "")).startswith("(")]
        peaks = [r for r in items if str(r.get("tensor", "")).startswith("(")]
        total = sum(r.get("bytes", 0) or 0 for r in kept)
        sections = [
            (
                f"what one layer keeps for backward, per microbatch in flight ({fmt_bytes(total)} in all)",
                kept,
            ),
            ("where the layer's transient peaks come from", peaks),
            *extra.items(),
        ]
    for title, part in sections:
        if isinstance(part, str):
            con.print(Text(f"{title}: {part}"))
            continue
        _explain_table(str(title), [_as_dict(x) for x in (part or [])], con, wide=wide)


def _explain_table(title: str, items: list[dict], con, wide: bool = False) -> None:
    from rich.table import Table

    if not items:
        return
    keys: list[str] = []
    for it in items:
        keys += [
            k for k in it if k not in keys and any(it2.get(k) not in (None, "", [], ()) for it2 in items)
        ]
    from rich import box

    t = Table(
        title=title,
        title_justify="left",
        header_style="bold",
        pad_edge=False,
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    for k in keys:
        t.add_column(k.replace("_", " "), justify="right" if k in _BYTES_KEYS else "left")
    for it in items:
        t.add_row(*[_cell(k, it.get(k)) for k in keys])
    need = table_width(t)
    if need <= con.width:
        con.print(t)
    elif wide:
        con.print(t, width=need, crop=False)
    else:
        con.print(_explain_stacked(title, keys, items, con.width), end="")


def _explain_stacked(title: str, keys: list[str], items: list[dict], width: int):
    """The --explain rows one block each: the short cells wrapped whole, then the "why" text
    wrapped at words, indented."""
    import textwrap

    from rich.text import Text

    out = Text()
    out.append("\n".join(textwrap.wrap(title, width, break_long_words=False)) + "\n", style="bold")
    long_keys = [k for k in keys if k == "why"]
    for it in items:
        cells = [_cell(k, it.get(k)) for k in keys if k not in long_keys]
        for line in _wrap_items([c for c in cells if c], width):
            out.append(line + "\n")
        for k in long_keys:
            text = _cell(k, it.get(k))
            for line in textwrap.wrap(
                text, max(width - 4, 10), break_long_words=False, break_on_hyphens=False
            ):
                out.append("    " + line + "\n", style=DIM)
    return out


def _as_dict(x) -> dict:
    if isinstance(x, Mapping):
        return dict(x)
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if hasattr(x, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(x)
    if isinstance(x, (tuple, list)):
        return {f"col{i}": v for i, v in enumerate(x)}
    return {"value": x}


def _cell(key: str, v) -> str:
    if v is None:
        return ""
    if key in _BYTES_KEYS and isinstance(v, (int, float)):
        return fmt_bytes(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(str(x) for x in v) + "]" if v else ""
    return str(v)


def render_to_string(est, explain: bool = False) -> str:
    buf = io.StringIO()
    render(est, file=buf, color=False, explain=explain)
    return buf.getvalue()


def table_rows(text: str) -> list[str]:
    """The per-rank rows of a rendered report (lines that start with a rank number)."""
    import re

    return [line for line in text.splitlines() if re.match(r"\s*\d+\s+\S+\s+\d", line) and "B" in line]


# The names other modules use (the CLI): public, not reached into.
as_dict = _as_dict
console = _console
wrap_items = _wrap_items
