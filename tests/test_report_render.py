"""Text report, verdict and plots of an Estimate, built by hand (the report only displays)."""

import json

import pytest

from pipemem.estimate import Estimate, RankEstimate, TimelinePoint
from pipemem.jobs import JobMemory, StaticBytes
from pipemem.model import arch_from_hf_config
from pipemem.plan import ParallelPlan
from pipemem.presets import load_model_config
from pipemem.report.text import render_to_string, table_rows, verdict
from pipemem.units import GiB

ARCH = arch_from_hf_config(load_model_config("llama3-8b")[1], "llama3-8b")


def rank(r, static_gib, act_gib, peak_gib, at="B3@s1"):
    static = StaticBytes(
        params=int(static_gib * GiB / 2), grads=int(static_gib * GiB / 4), optimizer=int(static_gib * GiB / 4)
    )
    act = int(act_gib * GiB)  # held when the peak action starts (a backward frees one microbatch's)
    tl = [
        TimelinePoint("F0@s0", static.total, static.total + act + GiB, static.total + act),
        TimelinePoint(at, static.total + act, int(peak_gib * GiB), static.total + act - GiB),
    ]
    return RankEstimate(
        pp_rank=r,
        static=static,
        peak_allocated_bytes=int(peak_gib * GiB),
        peak_at=at,
        activation_hwm_bytes=int(act_gib * GiB),
        inflight=4 - r,
        jobs={
            "F": JobMemory(GiB, 2 * GiB),
            "B": JobMemory(-GiB, GiB),
            "W": None,
            "optimizer": JobMemory(0, GiB),
        },
        stages=[r],
        stage_jobs=[{"stage": r, "layers": [8 * r + i for i in range(8)]}],
        timeline=tl,
    )


def est(peaks, gpu=80 * GiB, name="h100-80g"):
    ranks = [rank(i, 20, 10, p) for i, p in enumerate(peaks)]
    return Estimate(
        model_name="llama3-8b",
        model_source="preset",
        arch=ARCH,
        plan=ParallelPlan(pp=len(peaks), tp=2, dp=2, microbatches=8),
        mode="templates",
        schedule="1F1B",
        ranks=ranks,
        gpu_name=name,
        gpu_memory_bytes=gpu,
        world_size=4 * len(peaks),
    )


def test_table_has_one_row_per_rank_and_fits_verdict():
    out = render_to_string(est([40, 35, 30, 31]))
    rows = table_rows(out)
    assert len(rows) == 4
    assert "FITS" in out and "OOM" not in out
    # worst rank 0: 40 GiB of 80 GiB -> 50 %, 40 GiB headroom
    assert "rank 0 at 40.00 GiB" in out and "50%" in out and "40.00 GiB headroom" in out
    # transient = peak - static - activations held at the peak = 40 - 20 - 10
    assert rows[0].split()[12:14] == ["10.00", "GiB"], rows[0]
    assert "4 mb" in rows[0] and "1 mb" in rows[3] and "B3@s1" in rows[0]
    assert "0-7" in rows[0] and "24-31" in rows[3]


def test_oom_rows_and_verdict():
    e = est([90, 85, 70, 60])
    out = render_to_string(e)
    assert "OOM by 10.00 GiB" in out and "OOM by 5.00 GiB" in out
    line = verdict(e)
    assert line.startswith("OOM") and "ranks 0-1" in line and "10.00 GiB over" in line
    assert e.fits is False and e.headroom_bytes == -10 * GiB


def test_oom_is_red_when_colored():
    import io

    from pipemem.report.text import render

    buf = io.StringIO()
    render(est([90, 30]), file=buf, color=True)
    assert "\x1b[1;31m" in buf.getvalue()


def test_no_gpu_verdict():
    e = est([40, 30], gpu=None, name=None)
    assert e.fits is None and e.headroom_bytes is None
    assert "--gpu" in verdict(e)
    d = e.to_dict()
    assert d["fits"] is None and d["gpu_memory_bytes"] is None and d["ranks"][0]["headroom_bytes"] is None


def test_to_dict_schema_and_json():
    d = json.loads(json.dumps(est([40, 85]).to_dict()))
    assert d["max_peak_allocated_bytes"] == 85 * GiB and d["fits"] is False and d["worst_rank"] == 1
    r = d["ranks"][0]
    assert set(r["static_bytes"]) >= {"params", "grads", "optimizer"}
    assert set(r["jobs"]) >= {"F", "B", "W", "optimizer"}
    assert r["jobs"]["F"] == {"net_bytes": GiB, "peak_bytes": 2 * GiB}
    assert r["peak_at"] == "B3@s1" and r["inflight"] == 4 and r["headroom_bytes"] == 40 * GiB
    assert d["plan"]["pp"] == 2 and d["model"]["hidden"] == 4096


def test_explain_rows_render():
    import io

    from pipemem.report.text import _console, render_explain

    buf = io.StringIO()
    rows = [
        {"tensor": "attn.qkv_in", "shape": (1, 4096, 4096), "bytes": 32 * 2**20, "why": "input of qkv matmul"}
    ]
    render_explain(
        {"kept for backward": rows, "transient peak": "the fp32 logits in the loss"},
        _console(buf, color=False),
    )
    out = buf.getvalue()
    assert "attn.qkv_in" in out and "32.00 MiB" in out and "[1, 4096, 4096]" in out and "fp32 logits" in out


def test_png_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from pipemem.report.plot import write_plot

    p = tmp_path / "m.png"
    write_plot(est([40, 90]), str(p))
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_plot_is_self_contained(tmp_path):
    from pipemem.report.plot import write_plot

    p = tmp_path / "m.html"
    write_plot(est([40, 90]), str(p))
    text = p.read_text()
    assert text.count('<svg class="rank"') == 2 and "<script>" in text
    assert (
        text.count("<tr") == 3 and text.count('<tr class="oom">') == 1
    )  # header + 2 ranks; rank 1 over 80 GiB
    assert "src=" not in text and "href=" not in text and "@import" not in text
    data = json.loads(text.split('id="pipemem-data">')[1].split("</script>")[0])
    assert data["ranks"][1]["actions"][1][2] == 90 * GiB


def test_plot_bad_suffix(tmp_path):
    from pipemem.errors import UserError
    from pipemem.report.plot import write_plot

    with pytest.raises(UserError, match=".png or .html"):
        write_plot(est([40]), str(tmp_path / "m.pdf"))
