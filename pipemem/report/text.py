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
from typing import Any, Mapping

from ..units import fmt_bytes

RED, GREEN, YELLOW, DIM = "bold red", "bold green", "yellow", "dim"
NEAR_FULL = 0.90   # a rank above this share of the GPU is shown in yellow


def _console(file=None, color: bool | None = None):
    from rich.console import Console

    file = file or sys.stdout
    is_tty = hasattr(file, "isatty") and file.isatty()
    width = shutil.get_terminal_size((150, 40)).columns if is_tty else int(os.environ.get("COLUMNS", 150))
    if color is None:
        color = is_tty and "NO_COLOR" not in os.environ
    return Console(file=file, width=max(width, 100), no_color=not color, highlight=False,
                   force_terminal=True if color else None, color_system="standard" if color else None,
                   soft_wrap=False)


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
        batch += f", {p.microbatches} microbatches"
    prec = p.dtype + ("" if p.dtype == "fp32" else (" + fp32 master" if p.master_weights else " (no master)"))
    rec = f"recompute {p.recompute}" + (f" ({p.recompute_layers} layers/stage)"
                                        if p.recompute_layers is not None and p.recompute != "none" else "")
    framework = "HF modules, traced" if est.mode == "traced" else f"{p.convention} convention"
    bits = [" ".join(parts)] + shard + [est.schedule, batch, prec, p.optimizer, rec,
                                         "flash-attn" if p.flash_attn else "no flash-attn", framework]
    return ", ".join(bits)


def render(est, file=None, color: bool | None = None, explain: bool = False) -> None:
    from rich.table import Table
    from rich.text import Text

    con = _console(file, color)
    gpu = est.gpu_memory_bytes
    gpu_txt = f"{est.gpu_name} ({fmt_bytes(gpu)})" if gpu is not None else "no GPU given"
    con.print(Text(f"{est.model_name}: {est.world_size} GPUs, {gpu_txt}", style="bold"))
    con.print(Text(describe_plan(est), style=DIM))
    if est.mode == "traced":
        con.print(Text("traced mode: the real PyTorch training step recorded on fake tensors", style=DIM))
    con.print(Text(step_note(est.plan), style=DIM))

    from rich import box

    t = Table(show_header=True, header_style="bold", show_lines=False, pad_edge=False, box=box.SIMPLE_HEAD,
              show_edge=False, padding=(0, 1, 0, 1), collapse_padding=True)
    cols = [("rank", "right"), ("layers", "left"), ("params", "right"), ("grads", "right"),
            ("optimizer", "right"), ("activations\n(in flight)", "right"), ("transient", "right"),
            ("peak", "right"), ("headroom", "right"), ("peak at", "left")]
    for name, justify in cols:
        t.add_column(name, justify=justify, no_wrap=True)
    for r in est.ranks:
        head = r.headroom(gpu)
        style = ""
        if head is not None and head < 0:
            style = RED
        elif gpu and r.peak_allocated_bytes > NEAR_FULL * gpu:
            style = YELLOW
        head_txt = "-" if head is None else (f"OOM by {fmt_bytes(-head)}" if head < 0 else fmt_bytes(head))
        t.add_row(str(r.pp_rank), _layers_text(r), fmt_bytes(r.static.params), _grads_text(r.static),
                  fmt_bytes(r.static.optimizer),
                  f"{fmt_bytes(r.activation_hwm_bytes)} ({r.inflight} mb)", fmt_bytes(r.transient_bytes),
                  Text(fmt_bytes(r.peak_allocated_bytes), style=style or "bold"),
                  Text(head_txt, style=style), str(r.peak_at))
    con.print(t)
    con.print(Text("peak = params + grads + optimizer (+ other static) + activations (high-water mark, with the "
                   "microbatches in flight) + transient (working memory of the action at the peak; F3@s1 = "
                   "forward of microbatch 3 on stage 1, B backward, I/W split backward). Allocated bytes, as "
                   "torch.cuda.max_memory_allocated counts them; the allocator's reserve, the CUDA context "
                   "and NCCL buffers come on top.", style=DIM))
    con.print(verdict(est, markup=True))
    if explain and est.explain is not None:
        render_explain(est.explain, con)


GRADS_WORDS = {
    "buffer": "gradients resident all step (contiguous grad buffer / zero_grad(set_to_none=False))",
    "set-to-none": "gradients set to None by zero_grad, created by the step's first backward",
    "ddp-bucket": "DDP: .grad set to None by zero_grad and created in backward, plus DDP's resident buckets "
                  "(gradient_as_bucket_view=False)",
    "ddp-bucket-view": "DDP: .grad are views of DDP's resident buckets (gradient_as_bucket_view=True)",
}


def step_note(plan) -> str:
    """Which training step the numbers are for, in words (--step, --grads)."""
    step = ("steady state (a step after the first: optimizer states resident)" if plan.step == "steady" else
            "first training step (optimizer states created in its optimizer step)")
    return f"{step}; {GRADS_WORDS.get(plan.grads, plan.grads)} (--grads {plan.grads})"


def _grads_text(static) -> str:
    """Resident gradient bytes, plus those the step creates (in step) when there are any."""
    if not static.grads_in_step:
        return fmt_bytes(static.grads)
    made = f"+{fmt_bytes(static.grads_in_step)} in step"
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
    """'B3@s1' -> 'backward of microbatch 3, stage 1'; other labels unchanged."""
    text = str(peak_at)
    import re

    m = re.fullmatch(r"([FBIW])(\d+)@s(\d+)", text)
    if m:
        return f"{KIND_WORDS[m.group(1)]} mb {m.group(2)} stage {m.group(3)} ({text})"
    return text


def verdict(est, markup: bool = False):
    """One line: fits or OOM, where, by how much."""
    from rich.text import Text

    worst = est.worst_rank
    gpu = est.gpu_memory_bytes
    where = f"rank {worst.pp_rank} at {fmt_bytes(worst.peak_allocated_bytes)} during {describe_action(worst.peak_at)}"
    if gpu is None:
        line = Text.assemble(("PEAK", "bold"), f": {where}; pass --gpu NAME or --gpu-memory GIB to check the fit.")
    elif est.fits:
        share = worst.peak_allocated_bytes / gpu
        line = Text.assemble(("FITS", GREEN), f" on {est.gpu_name}: worst is {where}; {share:.0%} of "
                             f"{fmt_bytes(gpu)}, {fmt_bytes(gpu - worst.peak_allocated_bytes)} headroom.")
    else:
        over = [r.pp_rank for r in est.ranks if r.peak_allocated_bytes > gpu]
        rank_word = "rank" if len(over) == 1 else "ranks"
        verb = "exceeds" if len(over) == 1 else "exceed"
        line = Text.assemble(("OOM", RED), f" on {est.gpu_name}: {rank_word} {_ranges(over)} {verb} "
                             f"{fmt_bytes(gpu)}; worst is {where}; "
                             f"{fmt_bytes(worst.peak_allocated_bytes - gpu)} over.{_advice(est, worst)}")
    return line if markup else line.plain


def _advice(est, worst) -> str:
    """Engine-checked alternatives when the CLI computed them, else the levers that apply."""
    sug = getattr(est, "suggestions", None) or []
    fit = [x for x in sug if x["fits"]]
    if fit:
        return " Fits with " + " or ".join(f"{x['flags']} ({fmt_bytes(x['max_peak_allocated_bytes'])})"
                                           for x in fit) + "."
    if sug:
        x = sug[0]
        return (f" No single change tried fits; closest: {x['flags']} "
                f"({fmt_bytes(x['max_peak_allocated_bytes'])}).")
    return _hint(est, worst)


def _hint(est, worst) -> str:
    p = est.plan
    static = worst.static.total
    levers = []
    if worst.activation_hwm_bytes + worst.transient_bytes > static:
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


def render_explain(rows: Any, con) -> None:
    """Rows from stages.layer_explain (dicts with tensor, shape, dtype, bytes, why; rows whose
    tensor is "(...)" describe the layer's transient peaks), or a dict of sections
    {title: rows or text}. Bytes columns are formatted; other values shown as given."""
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
        sections = [(f"what one layer keeps for backward, per microbatch in flight ({fmt_bytes(total)} in all)",
                     kept), ("where the layer's transient peaks come from", peaks), *extra.items()]
    for title, part in sections:
        if isinstance(part, str):
            con.print(Text(f"{title}: {part}"))
            continue
        _explain_table(str(title), [_as_dict(x) for x in (part or [])], con)


def _explain_table(title: str, items: list[dict], con) -> None:
    from rich.table import Table

    if not items:
        return
    keys: list[str] = []
    for it in items:
        keys += [k for k in it if k not in keys and any(it2.get(k) not in (None, "", [], ()) for it2 in items)]
    from rich import box

    t = Table(title=title, title_justify="left", header_style="bold", pad_edge=False, box=box.SIMPLE_HEAD,
              show_edge=False)
    for k in keys:
        t.add_column(k.replace("_", " "), justify="right" if k in _BYTES_KEYS else "left")
    for it in items:
        t.add_row(*[_cell(k, it.get(k)) for k in keys])
    con.print(t)


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
