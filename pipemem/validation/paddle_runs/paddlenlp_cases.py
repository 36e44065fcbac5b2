"""`pipemem validate paddle` on PaddleNLP's own programs: every card of a plan, per job.

Each case is a PaddleNLP auto-parallel Llama run at a scale the CPU executes (the estimator PR's
model shape scaled down: 4 layers, hidden 64). For every card of the plan a measurement
worker (`paddlenlp_measure`, in the paddlenlp interpreter) builds the card's job programs
with Paddle's own passes, stores the captured document where `pipemem estimate --exact`
finds it, and runs the jobs of one micro-batch on Paddle's executor. pipemem's numbers
come from `pipemem.estimate(..., mode="paddle")` on the same plan: the same captured
programs, through the product's path. Rows per card: the forward's net change and peak,
the backward's peak (input-grad and weight-grad peaks with a zero-bubble split) and the
optimizer's peak, each relative to the step's start; a step is the compute job with its
micro-batch's transfer jobs (recv_forward + forward, backward + send_backward), as the
legacy-IR pipeline of the era of Paddle's estimator PR ran it in one program and as pipemem reports it.

Paddle's `PipelineMemoryEstimator` reads legacy programs only (``op.desc``); Paddle 3.3.1's
pipeline passes split PIR programs only (legacy: NotImplementedError), so it has no
number on these rows (n/a).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..compare import CaseRow

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 128,
    "num_hidden_layers": 4,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "_name_or_path": "tiny-llama (seed shape / 64)",
}

_BASE = dict(convention="paddle", dtype="fp32", master_weights=False, flash_attn=False, seq_len=16)

# name -> pipemem.estimate plan keyword arguments (the PaddleNLP run each describes)
CASES = {
    "paddlenlp-pp4": dict(_BASE, pp=4, micro_batch=1, microbatches=4, schedule="1F1B"),
    "paddlenlp-pp4-recompute": dict(
        _BASE, pp=4, micro_batch=1, microbatches=4, schedule="1F1B", recompute="full"
    ),
    "paddlenlp-pp2-mp2": dict(_BASE, pp=2, tp=2, sp=False, micro_batch=2, microbatches=4, schedule="1F1B"),
    "paddlenlp-pp2-fthenb": dict(_BASE, pp=2, micro_batch=1, microbatches=4, schedule="FThenB"),
    "paddlenlp-pp2-vpp2": dict(_BASE, pp=2, vpp=2, micro_batch=1, microbatches=4, schedule="VPP"),
    "paddlenlp-dp2-sharding2": dict(
        _BASE, dp=4, zero=1, micro_batch=1, microbatches=2, extra={"zero_group": 4}
    ),
}
CASE_NAMES = tuple(CASES)


def _spec(plan_kw: dict) -> tuple[dict, object, object]:
    from ...estimate import resolve_model
    from ...model import arch_from_hf_config
    from ...paddle.paddlenlp_programs import build_spec
    from ...plan import ParallelPlan, validate_plan

    _, _, cfg = resolve_model(TINY_LLAMA)
    arch = arch_from_hf_config(cfg, "tiny-llama")
    plan = validate_plan(arch, ParallelPlan(**plan_kw))
    return build_spec(arch, plan), arch, plan


def measure_case(name: str, trials: int = 3, parallel: int = 2, timeout: float = 900) -> dict[int, dict]:
    """{card: measurement} for every card of the case; the captured documents land in the
    cache `pipemem.estimate(mode="paddle")` reads."""
    from ...paddle.paddlenlp_programs import cache_dir, installed_versions, paddlenlp_python, spec_key, world

    spec, _, _ = _spec(CASES[name])
    python = paddlenlp_python()
    folder = cache_dir() / spec_key(spec, installed_versions(python))
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("GLOG_minloglevel", "2")
    out: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))

        def one(card: int) -> tuple[int, dict]:
            target = Path(tmp) / f"measured{card}.json"
            proc = subprocess.run(
                [
                    python,
                    "-m",
                    "pipemem.validation.paddle_runs.paddlenlp_measure",
                    str(spec_path),
                    str(card),
                    str(target),
                    str(folder / f"rank{card}.json"),
                    str(trials),
                ],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
            if proc.returncode != 0 or not target.is_file():
                raise RuntimeError(
                    f"{name}: measuring card {card} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
                )
            return card, json.loads(target.read_text())

        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for card, m in pool.map(one, range(world(spec))):
                out[card] = m
    return out


def _kind_rows(jtype: str) -> list[tuple[str, str, str]]:
    """(pipemem job kind, quantity, label) rows for one measured job type."""
    base = jtype.rstrip("0123456789")
    if base == "forward":
        return [("F", "net", "forward/net"), ("F", "peak", "forward/peak")]
    if base == "backward":
        return [("B", "peak", "backward/peak")]
    if base == "backward_b":
        return [("I", "peak", "backward_b/peak")]
    if base == "backward_w":
        return [("W", "peak", "backward_w/peak")]
    if base in ("optimizer", "optimize"):
        return [("optimizer", "peak", "optimizer/peak")]
    return []


def _step(chain: list[str], jtype: str) -> list[str]:
    """A compute job with its micro-batch's transfers (as pipemem reports a step: recv_*
    before it, send_* after it, same direction and chunk)."""
    base = jtype.rstrip("0123456789")
    suffix = jtype[len(base) :]
    if base not in ("forward", "backward", "backward_b", "backward_w"):
        return [jtype]
    direction = "forward" if base == "forward" else "backward"
    return [t for t in (f"recv_{direction}{suffix}", jtype, f"send_{direction}{suffix}") if t in chain]


def _fold_measured(rows: list[dict]) -> tuple[int, int]:
    """(net, peak) of jobs run back to back, each measured relative to its own start."""
    cur = peak = 0
    for r in rows:
        peak = max(peak, cur + r["peak_bytes"])
        cur += r["net_bytes"]
    return cur, peak


def compare_case(name: str, trials: int = 3) -> list[CaseRow]:
    from ...estimate import estimate
    from ...paddle.paddlenlp_programs import card_of_stage

    measured = measure_case(name, trials=trials)
    spec, _, _ = _spec(CASES[name])
    est = estimate(TINY_LLAMA, mode="paddle", **CASES[name])
    pp = spec["pp"]
    per_stage = spec["dp"] * spec["sharding"] * spec["mp"]
    rows = []
    for card in sorted(measured):
        rank = card // per_stage
        r = est.ranks[rank]
        by_stage = {s["stage"]: s for s in r.stage_jobs}
        jobs = {j["type"]: j for j in measured[card]["jobs"]}
        for job in measured[card]["jobs"]:
            jtype = job["type"]
            chunk = int(jtype[len(jtype.rstrip("0123456789")) :] or 0)
            stage = by_stage.get(chunk * pp + rank, {})
            step = _step(measured[card]["chain"], jtype)
            for kind, quantity, label in _kind_rows(jtype):
                jm = (
                    r.jobs.get("optimizer").to_dict()
                    if kind == "optimizer" and r.jobs.get("optimizer")
                    else stage.get(kind)
                )
                ours = None if not jm else jm["net_bytes" if quantity == "net" else "peak_bytes"]
                net, peak = _fold_measured([jobs[u] for u in step])
                meas = net if quantity == "net" else peak
                rows.append(
                    CaseRow(
                        f"{name}/card{card}/{jtype}/{quantity}",
                        meas,
                        ours,
                        extra={
                            "card": card,
                            "pp_rank": rank,
                            "estimated_from_card": card_of_stage(spec, rank),
                            "peaks": job["peaks"],
                            "nets": job["nets"],
                            "lags": job.get("lags", []),
                            "collector": job.get("policy", ""),
                            "paddle_estimated_bytes": None,
                            "paddle_rel_error": None,
                            "label": label,
                        },
                    )
                )
    return rows
