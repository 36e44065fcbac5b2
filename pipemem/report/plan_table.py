"""The human report of `pipemem plan`: the best plans, the Pareto set, the zero-bubble answer.

Numbers are read from the PlanSearch (each plan's estimate and cost); nothing is computed here.
"""

from __future__ import annotations

from ..units import fmt_bytes
from .text import DIM, GREEN, RED
from .text import console as _console


def short_plan(kw: dict) -> str:
    """'dp2 tp8 pp4 vpp2 mb1 dist-opt full-recompute:3 VPP' (the flags say the same at length)."""
    deg = [f"dp{kw['dp']}", f"tp{kw['tp']}", f"pp{kw['pp']}"]
    for k in ("vpp", "cp", "ep"):
        if kw.get(k, 1) > 1:
            deg.append(f"{k}{kw[k]}")
    if kw.get("etp") is not None:
        deg.append(f"etp{kw['etp']}")
    if kw.get("pp_layout"):
        deg.append("layout:" + ",".join(_runs(kw["pp_layout"])))
    deg.append(f"mb{kw['micro_batch']}")
    deg.append(
        "fsdp"
        if kw.get("fsdp")
        else "dist-opt"
        if kw.get("dist_opt")
        else f"zero{kw['zero']}"
        if kw.get("zero")
        else "ddp"
    )
    rec = kw.get("recompute", "none")
    if rec != "none":
        deg.append(f"{rec}-recompute" + (f":{kw['recompute_layers']}" if kw.get("recompute_layers") else ""))
    if kw.get("schedule"):
        deg.append(kw["schedule"])
    return " ".join(deg)


def _runs(layout) -> list[str]:
    """7,8,8,8,7 -> ['7', '8x3', '7']."""
    out, prev, n = [], None, 0
    for x in list(layout) + [None]:
        if x == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev}x{n}" if n > 1 else str(prev))
        prev, n = x, 1
    return out


def _comm_text(cost) -> str:
    gb = cost.comm_bytes / 1e9
    cross = cost.crosses_nodes
    return f"{gb:,.1f}" + (f" ({','.join(cross)} x-node)" if cross else "")


_PLAN_COLUMNS = (
    ("#", "right"),
    ("verdict", "left"),
    ("peak", "right"),
    ("headroom", "right"),
    ("bubble", "right"),
    ("comm GB/step", "right"),
    ("step s", "right"),
    ("plan", "left"),
)


def _cells(i, p) -> list[str]:
    return [
        str(i),
        "FITS" if p.verdict == "fits" else "screened",
        fmt_bytes(p.peak_bytes),
        fmt_bytes(p.headroom_bytes),
        f"{p.cost.bubble:.1%}",
        _comm_text(p.cost),
        f"{p.cost.step_s:.2f}",
        short_plan(p.kwargs),
    ]


def _print_plans(con, plans, target, title) -> None:
    """The plans as a table when it fits the console (the plan column may wrap), else one
    block per plan, each `name value` item whole: no number is cut (as `pipemem estimate`)."""
    from .text import table_width

    t = _table(plans, target, title)
    # the narrowest the table gets without cutting: every number whole, the plan column wrapped
    # to its longest word
    narrowest = _table(plans, target, title, plan_words=True)
    if table_width(narrowest) <= con.width:
        con.print(t)
    else:
        con.print(_stacked(plans, title, con.width), end="")


def _stacked(plans, title: str, width: int):
    import textwrap

    from rich.text import Text

    from .text import wrap_items

    out = Text()
    out.append("\n".join(textwrap.wrap(title, width, break_long_words=False)) + "\n", style="bold")
    for i, p in plans:
        c = _cells(i, p)
        items = [
            f"#{c[0]}",
            c[1],
            f"peak {c[2]}",
            f"headroom {c[3]}",
            f"bubble {c[4]}",
            f"comm {c[5]} GB/step",
            f"step {c[6]} s",
        ]
        for line in wrap_items(items, width):
            out.append(line + "\n")
        for line in textwrap.wrap(c[7], max(width - 2, 10), break_long_words=False, break_on_hyphens=False):
            out.append("  " + line + "\n", style=DIM)
    return out


def _table(plans, target, title, plan_words: bool = False):
    from rich import box
    from rich.table import Table

    t = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 1),
    )
    for name, justify in _PLAN_COLUMNS:
        t.add_column(name, justify=justify, no_wrap=name != "plan")
    for i, p in plans:
        cells = _cells(i, p)
        if plan_words:
            cells[-1] = max(cells[-1].split(), key=len)
        t.add_row(*cells)
    return t


def render_plans(
    res, top: int, zb=None, csv_path: str | None = None, file=None, color: bool | None = None
) -> None:
    from rich.text import Text

    con = _console(file, color)
    t, s = res.target, res.stats
    gpu = t.gpu or f"{t.gpu_memory:g} GiB GPU"
    con.print(
        Text(
            f"{res.model} on {t.gpus} x {gpu} ({fmt_bytes(t.capacity_bytes)}, {t.gpus_per_node} per node), "
            f"fit judged as pipemem estimate's verdict (reserved + outside the allocator, FITS)"
            + (f" with {fmt_bytes(t.reserve_bytes)} more kept free" if t.reserve_bytes else ""),
            style="bold",
        )
    )
    invalid = sum(s.invalid.values())
    con.print(
        Text(
            f"{s.proposed:,} plans proposed: {invalid:,} invalid, {s.pruned_static:,} ruled out by their "
            f"static bytes, {s.no_fit:,} estimated and too large, {len(res.plans):,} "
            "within the GPU on allocated + "
            f"outside-the-allocator bytes, {sum(p.verdict == 'fits' for p in res.plans):,} of them judged "
            f"FITS with reserved memory"
            + (
                f" ({s.dropped_on_reserved:,} dropped: not FITS once reserved is counted)"
                if s.dropped_on_reserved
                else ""
            )
            + " "
            f"({s.estimates:,} estimates"
            + (
                f", {sum(s.refused_settings.values()):,} recomputation settings refused"
                if s.refused_settings
                else ""
            )
            + ", "
            f"{s.seconds:.1f} s)",
            style=DIM,
        )
    )
    if not res.plans:
        con.print(
            Text.assemble(
                ("NO PLAN FITS", RED),
                f": no plan of the space fits {fmt_bytes(t.budget_bytes)} "
                "(the GPU less the verdict's margin and any --reserve) once reserved memory and the "
                "CUDA context, NCCL and cuBLAS are counted; try more GPUs or a smaller micro-batch",
            )
        )
        return
    index = {id(p): i + 1 for i, p in enumerate(res.plans)}
    _print_plans(
        con,
        [(i + 1, p) for i, p in enumerate(res.plans[:top])],
        t,
        f"Fastest {min(top, len(res.plans))} of {len(res.plans):,} plans within "
        "the GPU (estimated step time)",
    )
    pareto = res.pareto
    if pareto:
        shown = pareto[:top]
        more = (
            f" (the {len(shown)} smallest of {len(pareto)}; all in --json)"
            if len(shown) < len(pareto)
            else ""
        )
        _print_plans(
            con,
            [(index[id(p)], p) for p in shown],
            t,
            f"Pareto set of the pipeline plans: peak memory vs bubble{more}",
        )
    front = res.pareto_step_time
    if len(front) > 1:
        shown = front[-top:]
        more = (
            f" (the {len(shown)} fastest of {len(front)}; all in --json)" if len(shown) < len(front) else ""
        )
        _print_plans(
            con,
            [(index[id(p)], p) for p in shown],
            t,
            f"Pareto set of all plans: peak memory vs estimated step time{more}",
        )
    best = res.plans[0]
    con.print(Text.assemble(("BEST", GREEN), f": pipemem estimate {best.flags}"))
    con.print(
        Text(
            "verdict: FITS = pipemem estimate's verdict, reserved memory included; screened = allocated + "
            "outside-the-allocator bytes within the GPU, reserved not yet judged (the judging stops after "
            "--judge-seconds: run pipemem estimate with the plan's flags); "
            "peak: highest allocated peak over the pipeline ranks (pipemem estimate); headroom: GPU minus "
            "the highest device peak (reserved + CUDA context, NCCL, cuBLAS workspace; for a screened plan, "
            "allocated in place of reserved); bubble: idle share of the pipeline "
            "ranks in the schedule simulated "
            "with F/I/W durations proportional to FLOPs; comm: bytes each GPU sends per step (tp, cp, ep, "
            "pp, dp); step: makespan + communication time at the link speeds, no overlap (docs/PLANNER.md).",
            style=DIM,
        )
    )
    if zb is not None:
        render_zero_bubble(con, zb, t, csv_path)


def render_zero_bubble(con, zb, target, csv_path) -> None:
    from rich.text import Text

    what = (
        "zero bubble"
        if zb.zero_bubble
        else f"its least stage bubble ({zb.stage_bubble:.1%}; the stages are unbalanced)"
    )
    verdict = ("FITS", GREEN) if zb.fits else ("DOES NOT FIT", RED)
    con.print(
        Text.assemble(
            ("Zero bubble", "bold"),
            f": the memory-limited scheduler reaches {what} for the best "
            f"pipeline plan once static bytes + activations may reach {fmt_bytes(zb.memory_bytes)} "
            f"per GPU ({zb.probes} scheduler runs). The step's peak with that schedule (pipemem "
            f"estimate, optimizer step included) is {fmt_bytes(zb.peak_bytes)}: ",
            verdict,
            " as pipemem estimate judges it. Bubble {zb.bubble:.1%}, makespan "
            f"{zb.makespan_ratio:.3f}x the plan's own schedule.",
        )
    )
    if csv_path:
        con.print(Text(f"schedule written to {csv_path}; check it: pipemem estimate {zb.flags}", style=DIM))
    else:
        con.print(Text("add --schedule-csv FILE to write the schedule for PyTorch pipelining", style=DIM))
