"""PaddleNLP's own programs as stage jobs: build them with Paddle, walk them with liveness.

`pipemem estimate --from-paddlenlp --exact -- ...` (``mode="paddle"`` in
`pipemem.estimate`) takes this route instead of the templates:

1. `build_spec(arch, plan)`: the PaddleNLP run the plan describes (model shape, pp / mp /
   dp / sharding degrees, schedule, recompute, flash attention, sequence parallel, dtype);
2. `rank_documents(spec, ranks)`: for each card, a worker process (the interpreter that
   has paddlenlp, `paddlenlp_python`) builds Paddle's job plan for that card through
   PaddleNLP's auto-parallel model and Paddle's own passes and captures the job programs
   as pipemem IR (`pipemem.paddle.paddlenlp_worker`); documents are cached on disk, keyed
   by the spec and the versions;
3. `job_memory(doc)`: liveness over each micro-batch's chain of jobs, as Paddle's
   executor runs them: a job keeps exactly what a later job *of the same micro-batch*
   reads (`pass_utils._set_skip_gc_vars_in_pir`), frees everything else after its last
   use, never frees persistables; no_need_buffer operands keep nothing alive;
4. `stage_plan(arch, plan, docs)`: per card, the schedule is the card's own job list
   (Paddle's pass wrote it); each compute job (forward*, backward*, backward_b/_w) is an
   action, the communication jobs around it (recv_forward, send_backward, ...) are folded
   into the next action in run order, so replaying the actions walks the job list
   exactly. Static bytes: the persistables the programs hold (parameters, gradient-merge
   buffers, optimizer states and master weights).

Nothing here imports paddle: the worker does, in its own process.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from ..errors import UserError
from ..ir import TensorKind, programs_from_json
from ..jobs import JobMemory, StageJobs, StagePlan, StaticBytes, compose
from ..liveness import analyze_sequence

PYTHON_ENV = "PIPEMEM_PADDLENLP_PYTHON"
CACHE_ENV = "PIPEMEM_CACHE_DIR"

# pipemem schedule names -> the pipeline passes Paddle 3.3.1 applies to PIR programs
# (auto_parallel/static/pir_pass.py `pipeline_pass` asserts FThenB, 1F1B or VPP; its ZBH1,
# ZBVPP and Eager1F1B passes are legacy-IR only, and legacy programs cannot be split in 3.3.1).
PADDLE_SCHEDULES = {
    "1F1B": "1F1B",
    "FThenB": "FThenB",
    "GPipe": "FThenB",
    "VPP": "VPP",
    "Interleaved1F1B": "VPP",
}
COMPUTE = ("forward", "backward", "backward_b", "backward_w")
KIND = {"forward": "F", "backward": "B", "backward_b": "I", "backward_w": "W"}


def paddlenlp_python() -> str:
    """The interpreter that builds PaddleNLP programs: $PIPEMEM_PADDLENLP_PYTHON, else this
    one when it can import paddlenlp and paddle."""
    exe = os.environ.get(PYTHON_ENV)
    if exe:
        if not Path(exe).exists():
            raise UserError(f"${PYTHON_ENV}={exe}: no such interpreter")
        return exe
    if find_spec("paddlenlp") is not None and find_spec("paddle") is not None:
        return sys.executable
    raise UserError(
        "--exact builds PaddleNLP's own programs and needs paddlenlp 2.8.1 with paddlepaddle 3.x: "
        "python -m venv --system-site-packages ~/venvs/paddlenlp && ~/venvs/paddlenlp/bin/pip install "
        "paddlenlp==2.8.1 paddlepaddle==3.3.1 huggingface-hub==0.23.5 aistudio-sdk==0.2.1 "
        f"datasets==2.19.2, then export {PYTHON_ENV}=~/venvs/paddlenlp/bin/python "
        "(or drop --exact: the paddle templates need no Paddle)"
    )


# ---------------------------------------------------------------------------------------
# The run a plan describes


def build_spec(arch, plan) -> dict:
    """The `paddlenlp_build.BuildSpec` fields of a validated plan (paddle convention)."""
    if arch.model_type not in ("llama", "mistral", "qwen2") or arch.is_moe:
        raise UserError(
            f"--exact builds PaddleNLP's LlamaForCausalLM3DAuto; {arch.name} is a "
            f"{arch.model_type} model (use the templates: drop --exact)"
        )
    if plan.cp > 1 or plan.ep > 1:
        raise UserError(
            "--exact: PaddleNLP's auto-parallel Llama has no context or expert parallelism here; "
            "drop --cp/--ep or --exact"
        )
    if plan.recompute == "selective":
        raise UserError("--exact: PaddleNLP recomputes full, full_attn or core_attn (no selective)")
    if plan.recompute_layers is not None:
        raise UserError("--exact: --recompute-layers is not a PaddleNLP auto-parallel option")
    sched = plan.schedule or "1F1B"
    if plan.pp > 1 and sched not in PADDLE_SCHEDULES:
        raise UserError(
            f"--exact: Paddle 3.3.1 builds PIR pipeline programs for FThenB, 1F1B and VPP only "
            f"(its pipeline_pass refuses {sched}); drop --exact for {sched} (the templates replay it)"
        )
    extra = plan.extra or {}
    sharding = int(extra.get("zero_group") or (plan.dp if plan.zero else 1))
    if plan.dp % sharding:
        raise UserError(f"--exact: the sharding group ({sharding}) does not divide --dp {plan.dp}")
    return {
        "hidden": arch.hidden,
        "ffn": arch.ffn,
        "heads": arch.heads,
        "kv_heads": arch.kv_heads,
        "vocab": arch.vocab,
        "layers": arch.layers,
        "seq": plan.seq_len,
        "micro_batch": plan.micro_batch,
        "accumulate_steps": plan.microbatches,
        "pp": plan.pp,
        "mp": plan.tp,
        "dp": plan.dp // sharding,
        "sharding": sharding,
        "sharding_stage": plan.zero if sharding > 1 else 0,
        "vpp": plan.vpp,
        "schedule": PADDLE_SCHEDULES.get(sched, "1F1B"),
        "recompute": plan.recompute,
        "flash": bool(plan.flash_attn),
        "sp": bool(plan.sp) and plan.tp > 1,
        "dtype": plan.dtype,
        "max_positions": max(arch.max_positions, plan.seq_len),
        "tied": arch.tied_embeddings,
    }


def card_of_stage(spec: dict, pp_rank: int) -> int:
    """The first card of pipeline stage `pp_rank` on the mesh [pp, dp*sharding, mp]."""
    return pp_rank * spec["dp"] * spec["sharding"] * spec["mp"]


def world(spec: dict) -> int:
    return spec["pp"] * spec["dp"] * spec["sharding"] * spec["mp"]


# ---------------------------------------------------------------------------------------
# Building (worker processes, cached)


def installed_versions(python: str) -> str:
    out = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata as m;print(m.version('paddlepaddle'), m.version('paddlenlp'))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise UserError(
            f"{python} cannot report its paddlepaddle / paddlenlp versions: "
            f"{(out.stderr.strip().splitlines() or ['?'])[-1]}"
        )
    return out.stdout.strip()


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipemem"
    )
    return Path(base).expanduser() / "paddlenlp"


def spec_key(spec: dict, versions: str) -> str:
    from .paddlenlp_worker import CAPTURE_VERSION

    text = json.dumps({"spec": spec, "versions": versions, "capture": CAPTURE_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def rank_documents(
    spec: dict,
    cards: list[int],
    python: str | None = None,
    timeout: float = 900,
    parallel: int = 2,
    use_cache: bool = True,
    progress=None,
) -> dict[int, dict]:
    """{card: captured document} for `cards`, each built by a worker process (at most
    `parallel` at once), read from the cache when built before. `progress(card, doc)` is called
    when a card's worker starts (doc None) and when it is done."""
    python = python or paddlenlp_python()
    versions = installed_versions(python)
    folder = cache_dir() / spec_key(spec, versions)
    out: dict[int, dict] = {}
    todo = []
    for c in cards:
        path = folder / f"rank{c}.json"
        if use_cache and path.is_file():
            out[c] = json.loads(path.read_text())
        else:
            todo.append(c)
    if not todo:
        return out
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps({"spec": spec, "versions": versions}, indent=1))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("GLOG_minloglevel", "2")
    env.setdefault("GLOG_v", "0")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))

        def one(card: int) -> tuple[int, dict]:
            target = Path(tmp) / f"rank{card}.json"
            if progress:
                progress(card, None)
            proc = subprocess.run(
                [python, "-m", "pipemem.paddle.paddlenlp_worker", str(spec_path), str(card), str(target)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
            if proc.returncode == 2:
                raise UserError((proc.stderr.strip().splitlines() or ["the PaddleNLP worker refused"])[-1])
            if proc.returncode != 0 or not target.is_file():
                raise RuntimeError(
                    f"PaddleNLP worker for card {card} failed (exit {proc.returncode}):\n"
                    f"{proc.stderr[-3000:]}"
                )
            doc = json.loads(target.read_text())
            (folder / f"rank{card}.json").write_text(json.dumps(doc))
            if progress:
                progress(card, doc)
            return card, doc

        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            for card, doc in pool.map(one, todo):
                out[card] = doc
    return out


# ---------------------------------------------------------------------------------------
# Liveness over a card's jobs


@dataclass
class CardJobs:
    """One card's programs and what each job does to memory."""

    card: int
    job_list: list[tuple[str, int]]
    programs: dict  # job type -> pipemem Program
    jobs: dict[tuple[str, int], tuple[int, int, str]]  # (type, micro-batch) -> (net, peak, peak op)
    static: StaticBytes
    fed_bytes: int

    def of_type(self, jtype: str) -> JobMemory | None:
        """The job of this type with its micro-batch's own transfers folded in (recv_* before
        it, send_* after it: one micro-batch's forward or backward step, as a legacy-IR
        pipeline ran it in one program), for the micro-batch with the highest peak."""
        found = []
        for mb in {m for (t, m) in self.jobs if t == jtype}:
            found.append(_fold([self.jobs[(u, mb)][:2] for u in self.step_of(jtype, mb)]))
        if not found:
            return None
        return max(found, key=lambda j: (j.peak_bytes, j.net_bytes))

    def step_of(self, jtype: str, mb: int) -> list[str]:
        """The job types of micro-batch `mb`'s step around `jtype`: the transfers of the same
        direction and chunk right before (recv_*) and after (send_*) it in the micro-batch's chain."""
        base, chunk = _chunk(jtype)
        direction = "forward" if base == "forward" else "backward"
        suffix = jtype[len(base) :]
        chain = [t for t, m in self.job_list if m == mb]
        step = [t for t in (f"recv_{direction}{suffix}", jtype, f"send_{direction}{suffix}") if t in chain]
        return step if jtype in chain else [jtype]


def job_memory(doc: dict) -> CardJobs:
    """Liveness of every job of one card's captured document (see the module docstring)."""
    programs = {p.type: p for p in programs_from_json(doc["ir"], source=f"card {doc['rank']}")}
    job_list = [(str(t), int(m)) for t, m in doc["job_list"]]
    chains: dict[int, list[int]] = {}
    for i, (_, mb) in enumerate(job_list):
        chains.setdefault(mb, []).append(i)
    jobs: dict[tuple[str, int], tuple[int, int, str]] = {}
    for mb, idx in chains.items():
        types = [job_list[i][0] for i in idx]
        results = analyze_sequence([programs[t] for t in types])
        for t, r in zip(types, results):
            jobs[(t, mb)] = (int(r.net_bytes), int(r.peak_bytes), r.peak_op_label)
    return CardJobs(
        card=int(doc["rank"]),
        job_list=job_list,
        programs=programs,
        jobs=jobs,
        static=static_bytes(programs.values()),
        fed_bytes=int(doc.get("fed_bytes", 0)),
    )


def static_bytes(programs) -> StaticBytes:
    """Persistables the programs hold: parameters, gradient(-merge) buffers, optimizer states
    (moments, beta powers, master weights, learning rate)."""
    seen: dict[str, tuple[TensorKind, int]] = {}
    for p in programs:
        for t in p.tensors.values():
            if t.persistent and t.storage == t.name:
                seen[t.name] = (t.kind, t.nbytes)
    total = {TensorKind.PARAM: 0, TensorKind.GRAD: 0, TensorKind.OPTIMIZER_STATE: 0}
    other = 0
    for kind, n in seen.values():
        if kind in total:
            total[kind] += n
        else:
            other += n
    return StaticBytes(
        params=total[TensorKind.PARAM],
        grads=total[TensorKind.GRAD],
        optimizer=total[TensorKind.OPTIMIZER_STATE],
        other=other,
    )


# ---------------------------------------------------------------------------------------
# Stage jobs and the schedule of the cards


def _chunk(jtype: str) -> tuple[str, int]:
    base = jtype.rstrip("0123456789")
    digits = jtype[len(base) :]
    return base, int(digits) if digits else 0


@dataclass
class PaddleStages(StagePlan):
    """What replay needs (a `pipemem.jobs.StagePlan`, the program-source interface): the
    schedule (each card's job list as actions), per virtual stage jobs, per (stage, micro-batch)
    composites (the action with the communication jobs folded in), static bytes and optimizer
    jobs per pipeline rank. The programs hold the pipeline's transfers themselves: the schedule
    is replayed as it is, with no runtime profile's buffers added (`lowered` False)."""

    stages: dict
    static: list[StaticBytes]
    optimizer: list[JobMemory | None]
    stage_layers: dict[int, tuple[int, ...]]
    cards: list[CardJobs]
    schedule: object = None  # set always: each card's own job list
    microbatch_jobs: dict = field(default_factory=dict)  # (stage, micro-batch) -> composite
    label: str | None = None
    warnings: list = field(default_factory=list)
    lowered: bool = False
    first_backward: dict = field(default_factory=dict)  # Paddle's gradient-merge buffers are resident

    def static_per_rank(self, schedule) -> list[StaticBytes]:
        return list(self.static)

    def optimizer_per_rank(self, schedule) -> list[JobMemory]:
        return [o or JobMemory(0, 0) for o in self.optimizer]

    def replay_jobs(self, schedule=None) -> dict:
        return {**self.stages, **self.microbatch_jobs}


def stage_plan(spec: dict, cards: list[CardJobs], name: str = "") -> PaddleStages:
    """One card per pipeline rank, in pp order -> schedule and stage jobs (module docstring)."""
    from ..schedules.actions import Action, Schedule

    pp, vpp = spec["pp"], spec["vpp"]
    ranks, stages = [], {}
    composites: dict = {}
    optimizer = []
    for r, card in enumerate(cards):
        acts = []
        pending: list[tuple[int, int]] = []  # (net, peak) of communication jobs not yet folded
        per_stage: dict[int, dict[str, JobMemory]] = {}
        opt = None
        for jtype, mb in card.job_list:
            net, peak, _ = card.jobs[(jtype, mb)]
            base, chunk = _chunk(jtype)
            if base in ("optimizer", "optimize"):
                if pending and acts:  # transfers after the last action belong to it
                    last = acts[-1]
                    composites[last] = _fold(
                        [(composites[last].net_bytes, composites[last].peak_bytes)] + pending
                    )
                    pending = []
                opt = _fold(pending + [(net, peak)])
                pending = []
                continue
            if base not in COMPUTE:
                pending.append((net, peak))
                continue
            stage = chunk * pp + r
            a = Action(KIND[base], stage, mb)
            acts.append(a)
            composites[a] = _fold(pending + [(net, peak)])
            pending = []
            per_stage.setdefault(stage, {}).setdefault(KIND[base], card.of_type(jtype))
        if pending and acts:  # trailing sends: part of the last action
            last = acts[-1]
            composites[last] = _fold([(composites[last].net_bytes, composites[last].peak_bytes)] + pending)
        ranks.append(acts)
        optimizer.append(opt)
        for s, kinds in per_stage.items():
            stages[s] = StageJobs(
                stage=s,
                F=kinds.get("F") or JobMemory(0, 0),
                B=kinds.get("B"),
                I=kinds.get("I"),
                W=kinds.get("W"),
                layers=(),
                notes={"card": card.card},
            )
    microbatches = 1 + max((a.microbatch for acts in ranks for a in acts), default=0)
    sched = Schedule(
        name or spec.get("schedule", "1F1B"),
        pp,
        vpp,
        microbatches,
        ranks,
        placement="loop",
        notes="Paddle's own job list of each card",
    )
    layers = _stage_layers(spec)
    for s, sj in stages.items():
        sj.layers = layers.get(s, ())
    per_mb: dict = {}
    for a, j in composites.items():
        key = (a.stage, a.microbatch)
        per_mb[key] = _override(per_mb.get(key), a.kind, j)
    return PaddleStages(
        schedule=sched,
        stages=stages,
        microbatch_jobs=per_mb,
        static=[c.static for c in cards],
        optimizer=optimizer,
        stage_layers=layers,
        cards=cards,
    )


def _override(existing, kind: str, j: JobMemory):
    sj = existing or StageJobs(stage=-1, F=None, B=None)
    setattr(sj, kind, j)
    return sj


def _fold(parts: list[tuple[int, int]]) -> JobMemory:
    """(net, peak) parts run back to back, as one job: `pipemem.jobs.compose`, the one fold."""
    return compose(parts)


def _stage_layers(spec: dict) -> dict[int, tuple[int, ...]]:
    """Decoder layers of each virtual stage as PaddleNLP places them: ceil(L / pp) per stage
    (`LlamaModelAuto.get_layer_pp_info`), split evenly over the chunks with VPP."""
    pp, vpp, n = spec["pp"], spec["vpp"], spec["layers"]
    if vpp > 1:
        per = -(-n // (pp * vpp))
        return {s: tuple(range(s * per, min(n, (s + 1) * per))) for s in range(pp * vpp)}
    per = -(-n // pp)
    return {s: tuple(range(s * per, min(n, (s + 1) * per))) for s in range(pp)}
