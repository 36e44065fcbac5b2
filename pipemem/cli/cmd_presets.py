"""`pipemem presets`: the built-in model shapes and GPU capacities."""

from __future__ import annotations

import json

EXAMPLE = """\
examples:
  pipemem presets
  pipemem presets --json
  pipemem estimate --model mixtral-8x7b --gpu h100-80g --tp 2 --ep 4 --pp 4
"""


HELP = "list built-in models and GPUs"
DESCRIPTION = (
    "List the model presets (published Hugging Face config.json shapes, shipped "
    "with pipemem) and GPU presets (total device memory) that --model and --gpu "
    "accept."
)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


def model_rows() -> list[dict]:
    from ..model import UnmodelledFamily, arch_from_hf_config, text_model_config
    from ..presets import load_model_config, model_names

    rows = []
    for name in model_names():
        _, cfg = load_model_config(name)
        text, _ = text_model_config(cfg)
        try:
            a = arch_from_hf_config(text, name)
        except UnmodelledFamily:
            rows.append(_traced_only_row(name, text, cfg))
            continue
        row = {
            "name": name,
            "model_type": a.model_type,
            "layers": a.layers,
            "hidden": a.hidden,
            "heads": a.heads,
            "kv_heads": a.kv_heads,
            "ffn": a.ffn or a.expert_ffn,
            "experts": a.experts,
            "top_k": a.top_k,
            "vocab": a.vocab,
            "source": cfg.get("_pipemem_source", ""),
            "modes": "templates, traced",
        }
        try:
            row["params"] = a.param_count()
        except ImportError:  # the templates package is not installed in this build
            row["params"] = None
        rows.append(row)
    return rows


def _traced_only_row(name: str, c: dict, cfg: dict) -> dict:
    """A family only traced mode runs: the sizes its config.json states (None where it leaves
    transformers' default), without importing transformers."""
    experts = next((c[k] for k in ("n_routed_experts", "num_local_experts", "num_experts") if c.get(k)), 0)
    return {
        "name": name,
        "model_type": c.get("model_type"),
        "layers": c.get("num_hidden_layers"),
        "hidden": c.get("hidden_size"),
        "heads": c.get("num_attention_heads"),
        "kv_heads": c.get("num_key_value_heads"),
        "ffn": (c.get("moe_intermediate_size") if experts else None) or c.get("intermediate_size"),
        "experts": experts,
        "top_k": c.get("num_experts_per_tok", 0) if experts else 0,
        "vocab": c.get("vocab_size"),
        "source": cfg.get("_pipemem_source", ""),
        "params": None,
        "modes": "traced",
    }


def gpu_rows() -> list[dict]:
    from ..presets import gpu_info, gpu_names

    return [{k: v for k, v in gpu_info(n).items()} for n in gpu_names()]


def run(args) -> int:
    from ..units import fmt_bytes

    models, gpus = model_rows(), gpu_rows()
    if args.json:
        print(json.dumps({"models": models, "gpus": gpus}, indent=2))
        return 0
    from rich import box
    from rich.table import Table

    from ..report.text import console, table_width, terminal_width

    def table(title: str, columns) -> Table:
        """One of the two listings: (header, justification) per column, cells never wrapped."""
        out = Table(
            title=title, title_justify="left", header_style="bold", pad_edge=False, box=box.SIMPLE_HEAD
        )
        for c, j in columns:
            out.add_column(c, justify=j, no_wrap=True)
        return out

    t = table(
        "models (--model NAME)",
        (
            ("name", "left"),
            ("type", "left"),
            ("params", "right"),
            ("layers", "right"),
            ("hidden", "right"),
            ("heads/kv", "right"),
            ("ffn", "right"),
            ("experts", "right"),
            ("vocab", "right"),
        ),
    )

    def v(x):
        return "-" if x is None else str(x)

    for m in models:
        params = "-" if m["params"] is None else f"{m['params'] / 1e9:.2f} B"
        experts = f"{m['experts']} (top {m['top_k']})" if m["experts"] else "-"
        kind = v(m["model_type"]) + ("" if m["modes"] != "traced" else " *")
        heads = f"{v(m['heads'])}/{v(m['kv_heads'])}"
        t.add_row(
            m["name"],
            kind,
            params,
            v(m["layers"]),
            v(m["hidden"]),
            heads,
            v(m["ffn"]),
            experts,
            v(m["vocab"]),
        )
    g = table(
        "GPUs (--gpu NAME)",
        (
            ("name", "left"),
            ("device", "left"),
            ("memory", "right"),
            ("MiB", "right"),
            ("compute", "right"),
            ("flash-attn", "left"),
        ),
    )
    for row in gpus:
        g.add_row(
            row["key"],
            row["name"],
            fmt_bytes(row["bytes"]),
            str(row["mib"]),
            str(row.get("compute_capability", "?")),
            "yes" if row.get("flash_attention", True) else "no",
        )
    models_note = (
        "* --mode traced only (transformers' own modules; templates do not model the family); "
        "- = transformers' default for a key the config.json leaves out"
    )
    gpus_note = (
        "GPU memory = the device total as nvidia-smi reports it; compute = CUDA compute capability (AMD: "
        "gfx target); flash-attn no: --flash-attn defaults off. Sources: pipemem/presets/gpus.json."
    )
    width = terminal_width()
    con = console(width=width)
    if max(table_width(t), table_width(g)) <= width:
        for table, note in ((t, models_note), (g, gpus_note)):
            con.print(table)
            con.print(note, style="dim")
        return 0
    # narrower than the tables: one block per model / GPU, `name value` items wrapped whole (as
    # pipemem estimate and plan stack theirs), so that no name or number is cut
    _stacked(con, "models (--model NAME)", [_model_items(m) for m in models], models_note, width)
    con.print()
    _stacked(con, "GPUs (--gpu NAME)", [_gpu_items(row) for row in gpus], gpus_note, width)
    return 0


def _model_items(m: dict) -> tuple[list[str], list[str]]:
    def v(x):
        return "-" if x is None else str(x)

    params = "-" if m["params"] is None else f"{m['params'] / 1e9:.2f} B"
    head = [m["name"], v(m["model_type"]) + ("" if m["modes"] != "traced" else " *"), f"{params} params"]
    body = [
        f"{v(m['layers'])} layers",
        f"hidden {v(m['hidden'])}",
        f"heads/kv {v(m['heads'])}/{v(m['kv_heads'])}",
        f"ffn {v(m['ffn'])}",
    ]
    if m["experts"]:
        body.append(f"{m['experts']} experts (top {m['top_k']})")
    return head, body + [f"vocab {v(m['vocab'])}"]


def _gpu_items(row: dict) -> tuple[list[str], list[str]]:
    from ..units import fmt_bytes

    head = [row["key"], row["name"]]
    body = [
        fmt_bytes(row["bytes"]),
        f"{row['mib']} MiB",
        f"compute {row.get('compute_capability', '?')}",
        f"flash-attn {'yes' if row.get('flash_attention', True) else 'no'}",
    ]
    return head, body


def _stacked(con, title: str, blocks, note: str, width: int) -> None:
    import textwrap

    from rich.text import Text

    from ..report.text import wrap_items

    out = Text(title + "\n", style="bold")
    for head, body in blocks:
        for i, line in enumerate(wrap_items(head, width) + wrap_items(body, width - 2, indent="  ")):
            out.append(line + "\n", style="bold" if i == 0 else "")
    con.print(out, end="")
    con.print("\n".join(textwrap.wrap(note, width)), style="dim")
