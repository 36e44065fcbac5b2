"""`--plot FILE.png|FILE.html`: each pipeline rank's allocated memory over its schedule.

One panel per rank; x = the rank's actions in order, y = allocated bytes. The static part
(params, grads, optimizer states) is shaded, each action is drawn from the bytes before it,
through its peak, to the bytes after it, the rank's peak is marked, and the GPU capacity is a
dashed line. PNG uses matplotlib (Agg backend, imported only here); HTML is one
self-contained file (inline SVG and a few lines of our own JavaScript for the hover
read-out; no network).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from ..errors import UserError
from ..units import GiB, fmt_bytes

MAX_POINTS = 4000  # per rank; longer timelines are thinned (keeping each window's peak)


def write_plot(est, path: str) -> str:
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".png", ".html", ".htm"):
        raise UserError(f"--plot {path}: give a file ending in .png or .html")
    if not p.parent.exists():
        raise UserError(f"--plot {path}: directory {p.parent} does not exist")
    if not any(r.timeline for r in est.ranks):
        raise UserError("--plot: this estimate has no per-action timeline to draw")
    if suffix == ".png":
        _png(est, p)
    else:
        p.write_text(html_document(est), encoding="utf-8")
    return str(p)


def _series(rank) -> tuple[list[float], list[int], list[str]]:
    """Polyline through (before, peak, after) of each action: x in action units."""
    xs, ys, labels = [], [], []
    tl = _thin(rank.timeline)
    for i, (label, before, peak, after) in enumerate(tl):
        xs += [i, i + 0.5, i + 1]
        ys += [before, peak, after]
        labels += [label] * 3
    return xs, ys, labels


def _thin(timeline) -> list[tuple[str, int, int, int]]:
    pts = [(t.label, t.before, t.peak, t.after) for t in timeline]
    if len(pts) <= MAX_POINTS:
        return pts
    step = -(-len(pts) // MAX_POINTS)
    out = []
    for i in range(0, len(pts), step):
        win = pts[i : i + step]
        top = max(win, key=lambda x: x[2])
        out.append((top[0], win[0][1], top[2], win[-1][3]))
    return out


def _png(est, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(
            "--plot FILE.png needs matplotlib (pip install matplotlib), or write FILE.html"
        ) from None
    n = len(est.ranks)
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.9 * n + 1.2), sharex=False, squeeze=False)
    gpu = est.gpu_memory_bytes
    top = max(max(est.max_peak_allocated_bytes, gpu or 0) / GiB * 1.08, 1e-9)
    for ax, r in zip(axes[:, 0], est.ranks):
        xs, ys, labels = _series(r)
        ys_g = [y / GiB for y in ys]
        static = r.static.total / GiB
        ax.axhspan(0, static, color="#9db4d0", alpha=0.6, lw=0, label="static (params, grads, optimizer)")
        ax.plot(xs, ys_g, color="#1f4e8c", lw=1.0, label="allocated")
        ax.fill_between(
            xs,
            static,
            ys_g,
            where=[y >= static for y in ys_g],
            color="#f2b36b",
            alpha=0.5,
            lw=0,
            label="activations + transient",
        )
        if gpu:
            ax.axhline(gpu / GiB, color="#b00020", ls="--", lw=1, label=f"{est.gpu_name}")
        k = max(range(len(ys)), key=lambda i: ys[i]) if ys else 0
        if ys:
            over = gpu is not None and ys[k] > gpu
            ax.plot([xs[k]], [ys_g[k]], marker="v", color="#b00020" if over else "black", ms=7)
            right = xs[k] > 0.7 * xs[-1]  # keep the label inside the panel
            ax.annotate(
                f"peak {fmt_bytes(ys[k])} at {labels[k]}",
                (xs[k], ys_g[k]),
                textcoords="offset points",
                xytext=(-6, 4) if right else (6, 4),
                ha="right" if right else "left",
                fontsize=8,
            )
        ax.set_ylim(0, top)
        ax.set_xlim(0, max(xs[-1] if xs else 1, 1))
        ax.set_ylabel(f"rank {r.pp_rank}\nGiB", fontsize=8)
        ax.tick_params(labelsize=7)
    height = 1.9 * n + 1.2
    fig.suptitle(
        f"{est.model_name}: allocated memory per pipeline rank over the schedule ({est.schedule})",
        fontsize=10,
        y=1 - 0.12 / height,
    )
    axes[-1, 0].set_xlabel("actions on the rank, in schedule order", fontsize=8)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="upper center",
        fontsize=7,
        ncol=4,
        frameon=False,
        bbox_to_anchor=(0.5, 1 - 0.38 / height),
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.65 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- HTML

_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 960, 150, 70, 20, 18, 22

_SCRIPT = """
(function(){
  var data = JSON.parse(document.getElementById('pipemem-data').textContent);
  var tip = document.getElementById('tip');
  function fmt(b){var u=['B','KiB','MiB','GiB','TiB'],i=0;while(Math.abs(b)>=1024&&i<4){b/=1024;i++;}
    return (i?b.toFixed(2):b)+' '+u[i];}
  document.querySelectorAll('svg.rank').forEach(function(svg){
    var r = data.ranks[+svg.dataset.rank], marker = svg.querySelector('.cursor');
    svg.addEventListener('mousemove', function(ev){
      var box = svg.getBoundingClientRect(), x = (ev.clientX - box.left) * svg.viewBox.baseVal.width / box.width;
      var i = Math.floor((x - data.padL) / data.plotW * r.n);
      if (i < 0 || i >= r.n) { tip.style.display='none'; return; }
      var a = r.actions[i];
      marker.setAttribute('x1', data.padL + (i + 0.5) * data.plotW / r.n);
      marker.setAttribute('x2', data.padL + (i + 0.5) * data.plotW / r.n);
      marker.style.display = '';
      tip.style.display = 'block';
      tip.style.left = (ev.pageX + 12) + 'px'; tip.style.top = (ev.pageY + 12) + 'px';
      tip.textContent = 'rank ' + r.rank + ' - ' + a[0] + ': before ' + fmt(a[1]) + ', peak ' + fmt(a[2]) +
                        ', after ' + fmt(a[3]) + (data.gpu ? ' (' + (100*a[2]/data.gpu).toFixed(1) + '% of GPU)' : '');
    });
    svg.addEventListener('mouseleave', function(){ tip.style.display='none'; marker.style.display='none'; });
  });
})();
"""  # noqa: E501 (JavaScript written into the page as it stands)


def html_document(est) -> str:
    from .text import describe_plan, verdict

    gpu = est.gpu_memory_bytes
    top = max(est.max_peak_allocated_bytes, gpu or 0) * 1.08 or 1
    plot_w = _W - _PAD_L - _PAD_R
    data = {"gpu": gpu, "padL": _PAD_L, "plotW": plot_w, "ranks": []}
    panels = []
    for idx, r in enumerate(est.ranks):
        tl = _thin(r.timeline)
        n = max(len(tl), 1)
        data["ranks"].append({"rank": r.pp_rank, "n": len(tl), "actions": [list(t) for t in tl]})
        panels.append(_svg_panel(idx, r, tl, n, top, gpu, est.gpu_name, plot_w))
    title = f"pipemem: {est.model_name}"
    payload = json.dumps(data).replace("</", "<\\/")  # never close the script element early
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 20px; color: #222; }}
h1 {{ font-size: 17px; margin: 0 0 4px; }} .plan {{ color: #666; margin-bottom: 8px; }}
.verdict {{ margin: 8px 0 14px; font-weight: 600; }} svg.rank {{ display: block; margin-bottom: 6px; width: 100%;
max-width: {_W}px; height: auto; }} #tip {{ position: absolute; display: none; background: #222; color: #fff;
padding: 4px 7px; border-radius: 4px; font-size: 12px; pointer-events: none; }}
.legend span {{ margin-right: 14px; }} table {{ border-collapse: collapse; margin-bottom: 12px; }}
td, th {{ padding: 2px 10px; text-align: right; border-bottom: 1px solid #ddd; }} tr.oom td {{ color: #b00020;
font-weight: 600; }} .sw {{ display: inline-block; width: 11px; height: 11px; margin-right: 4px;
vertical-align: -1px; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<div class="plan">{html.escape(describe_plan(est))}</div>
<div class="verdict">{html.escape(verdict(est))}</div>
{_html_table(est)}
<div class="legend"><span><i class="sw" style="background:#9db4d0"></i>static (params, grads, optimizer)</span>
<span><i class="sw" style="background:#f2b36b"></i>activations + transient</span>
<span><i class="sw" style="background:#b00020"></i>GPU capacity / peak</span></div>
{"".join(panels)}
<div id="tip"></div>
<script type="application/json" id="pipemem-data">{payload}</script>
<script>{_SCRIPT}</script>
</body></html>
"""  # noqa: E501 (HTML/CSS written into the page as it stands)


def _svg_panel(idx, r, tl, n, top, gpu, gpu_name, plot_w) -> str:
    ph = _H - _PAD_T - _PAD_B

    def X(x):
        return _PAD_L + x * plot_w / n

    def Y(b):
        return _PAD_T + ph * (1 - b / top)

    pts = []
    for i, (_l, before, peak, after) in enumerate(tl):
        pts += [(X(i), Y(before)), (X(i + 0.5), Y(peak)), (X(i + 1), Y(after))]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
    static_y = Y(r.static.total)
    area = (
        (
            f"{X(0):.1f},{static_y:.1f} "
            + " ".join(f"{x:.1f},{min(y, static_y):.1f}" for x, y in pts)
            + f" {X(n):.1f},{static_y:.1f}"
        )
        if pts
        else ""
    )
    parts = [
        f'<svg class="rank" data-rank="{idx}" viewBox="0 0 {_W} {_H}" xmlns="http://www.w3.org/2000/svg">',
        f'<rect x="{_PAD_L}" y="{static_y:.1f}" width="{plot_w}" height="{Y(0) - static_y:.1f}" '
        f'fill="#9db4d0" opacity="0.6"/>',
        f'<polygon points="{area}" fill="#f2b36b" opacity="0.5"/>' if area else "",
        f'<polyline points="{line}" fill="none" stroke="#1f4e8c" stroke-width="1"/>' if line else "",
    ]
    if gpu:
        parts.append(
            f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{Y(gpu):.1f}" y2="{Y(gpu):.1f}" '
            f'stroke="#b00020" stroke-dasharray="5,4"/>'
            f'<text x="{_W - _PAD_R - 4}" y="{Y(gpu) - 3:.1f}" text-anchor="end" font-size="10" '
            f'fill="#b00020">{html.escape(str(gpu_name))} {fmt_bytes(gpu)}</text>'
        )
    if tl:
        k = max(range(len(tl)), key=lambda i: tl[i][2])
        px, py = X(k + 0.5), Y(tl[k][2])
        over = gpu is not None and tl[k][2] > gpu
        color = "#b00020" if over else "#000"
        right = px > _PAD_L + 0.7 * plot_w  # keep the label inside the panel
        tx, anchor = (px - 8, "end") if right else (px + 8, "start")
        parts.append(
            f'<path d="M{px - 5:.1f},{py - 9:.1f} L{px + 5:.1f},{py - 9:.1f} L{px:.1f},{py - 1:.1f} Z" '
            f'fill="{color}"/><text x="{tx:.1f}" y="{max(py - 3, 10):.1f}" text-anchor="{anchor}" '
            f'font-size="10" fill="{color}">peak {fmt_bytes(tl[k][2])} at {html.escape(tl[k][0])}</text>'
        )
    for frac in (0, 0.5, 1):
        b = top / 1.08 * frac
        parts.append(
            f'<text x="{_PAD_L - 6}" y="{Y(b) + 3:.1f}" text-anchor="end" font-size="10" '
            f'fill="#555">{fmt_bytes(b)}</text>'
        )
    parts.append(
        f'<text x="4" y="{_PAD_T + 10}" font-size="11" font-weight="600">rank {r.pp_rank}</text>'
        f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{Y(0):.1f}" y2="{Y(0):.1f}" stroke="#999"/>'
        f'<text x="{_PAD_L}" y="{_H - 6}" font-size="10" fill="#555">{len(tl)} actions</text>'
        f'<line class="cursor" x1="0" x2="0" y1="{_PAD_T}" y2="{Y(0):.1f}" stroke="#444" '
        f'stroke-width="0.7" style="display:none"/></svg>'
    )
    return "\n".join(p for p in parts if p)


def _html_table(est) -> str:
    gpu = est.gpu_memory_bytes
    from .text import columns, row_cells

    names = [n for n, _ in columns(est) if n != "layers"]  # the terminal table's columns
    head = tuple("activations (in flight)" if n == "activations" else n for n in names)
    rows = []
    for r in est.ranks:
        room = r.headroom(gpu)
        c = row_cells(est, r)  # the same cells as the terminal table
        cells = tuple(c[n] for n in names)
        cls = ' class="oom"' if room is not None and room < 0 else ""
        rows.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return (
        "<table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )
