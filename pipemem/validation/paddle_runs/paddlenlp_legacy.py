"""`validate paddle --ir paddlenlp-legacy`: PaddleNLP's legacy-IR pipeline job programs (Paddle 2.6).

Paddle's estimator PR measured Paddle's `PipelineMemoryEstimator` on PaddleNLP's `run_pretrain_auto_static.py`
with paddle 2.6-era legacy IR, where the `pipeline_scheduler_{FThenB,1F1B}` passes split each
card's program into forward / backward / optimizer jobs. Paddle 3.3.1 no longer splits legacy
programs, so the programs are built where they still are built: paddlepaddle 2.6.2 +
paddlenlp 2.8.1, in the interpreter ``$PIPEMEM_PADDLE26_PYTHON`` (`paddlenlp_legacy_build`,
one process per card). Each card's job programs travel as serialized ProgramDescs and are
compared here, in the main interpreter's paddlepaddle (3.3.1, legacy IR), three ways on
the very same programs:

* measured: the jobs of micro-batch 0 (forward, backward, optimizer) run as one plan on
  Paddle's legacy `StandaloneExecutor` (synchronous garbage collection on a fresh
  executor), each job with the ``skip_gc_vars`` the pipeline pass gave it, the host
  allocator read by a marker op at each job's start (`measure.py`'s method);
  communication ops run locally (below);
* pipemem: `pipemem.paddle.capture.to_ir` + `analyze_sequence`, the route every legacy
  `validate paddle` case takes (the executor's ``share_buffer`` aliases and the gradient
  merge's conditional optimizer block are read by `to_ir`);
* Paddle's own `PipelineMemoryEstimator` (3.3.1's; 2.6.2 has none), with the serial
  dist-context shim of `compare.py`: it sees each var as declared in the card's program.

Communication ops have no process group here; each becomes a local op with the same
effect on this card's memory: ``recv_v2`` -> ``fill_constant`` of its shape and dtype (the
received buffer is allocated), ``send_v2`` / in-place collectives / stream syncs -> a
``py_func`` reading the same vars (a use that allocates nothing, so lifetimes are kept).
The estimates read the original programs (with the communication ops).

Persistables are created before the first job (zeros; values do not change sizes) except
gradient merge's step counter, set to k - 1 so that the optimizer's conditional block runs
in the measured step (the step the optimizer row is about).
"""

from __future__ import annotations

import json
from pathlib import Path

from .measure import JOB_PREFIX, MARK_VAR, Measured, insert_marker, marker_factory
from .paddlenlp_measure import numel

SUB_PROGRAMS = ("forward", "backward", "optimizer")


def load_card(folder: str | Path) -> tuple[dict, dict]:
    """({type: legacy Program}, card.json) of one built card."""
    import paddle

    paddle.enable_static()
    folder = Path(folder)
    doc = json.loads((folder / "card.json").read_text())
    progs = {
        t: paddle.static.Program.parse_from_string((folder / f"{t}.pb").read_bytes()) for t in doc["types"]
    }
    for p in progs.values():
        _rename_retired_ops(p)
    return progs, doc


# Collectives 2.6 spells with the c_ prefix and 3.3.1 no longer registers (Paddle's estimator
# and `to_ir` ask each op's no_need_buffer slots, which fails on an unregistered op): the 3.x
# op of the same slots (X -> Out) and effect.
_RETIRED_OPS = {
    "c_allreduce_sum": "all_reduce",
    "c_allreduce_max": "all_reduce",
    "c_allreduce_min": "all_reduce",
    "c_allreduce_prod": "all_reduce",
    "c_allgather": "all_gather",
    # ZeRO's update: each shard's owner broadcasts its updated parameters (in place)
    "c_broadcast": "broadcast",
}


def _rename_retired_ops(program) -> None:
    for block in _blocks(program):
        for op in block.ops:
            if op.type in _RETIRED_OPS:
                op.desc.set_type(_RETIRED_OPS[op.type])
    program._sync_with_cpp()


def first_job_skips(doc: dict) -> dict[str, set[str]]:
    """skip_gc_vars of each job type's micro-batch-0 job, as the pipeline pass set them."""
    out: dict[str, set[str]] = {}
    for (t, mb), skip in zip(doc["job_list"], doc["skip_gc_vars"]):
        if mb == 0 and t not in out:
            out[t] = set(skip)
    return out


def _blocks(program):
    return [program.block(i) for i in range(program.num_blocks)]


def replace_comm_ops(program) -> list[str]:
    """Local stand-ins for the communication ops, in every block (module docstring)."""
    from paddle.static.nn.common import PyFuncRegistry

    from ...paddle.capture import COMMUNICATION_OPS

    noop = PyFuncRegistry(lambda *_: None).id
    done = []
    for block in _blocks(program):
        for i in range(len(block.ops) - 1, -1, -1):
            op = block.ops[i]
            op_type = op.type  # `op` is gone once removed below
            if op_type not in COMMUNICATION_OPS:
                continue
            ins = list(dict.fromkeys(op.input_arg_names))
            outs = list(dict.fromkeys(op.output_arg_names))
            role = op.attr("op_role") if op.has_attr("op_role") else 0
            if op.type in ("recv_v2", "p_recv"):
                new = (
                    "fill_constant",
                    {},
                    {"Out": outs},
                    {
                        "shape": [int(d) for d in op.attr("out_shape")],
                        "dtype": op.attr("dtype"),
                        "value": 0.0,
                    },
                )
            elif set(outs) <= set(ins):
                # a send, an in-place collective or a stream sync: a read that allocates nothing
                new = (
                    "py_func",
                    {"X": [block._var_recursive(n) for n in ins]},
                    {"Out": []},
                    {"forward_callable_id": noop, "backward_callable_id": -1, "backward_skip_vars": []},
                )
            elif len(ins) == 1 and len(outs) == 1:
                x, out = block._var_recursive(ins[0]), block._var_recursive(outs[0])
                n_in, n_out = numel(x.shape), numel(out.shape)
                if n_out == n_in:  # c_identity...: a copy
                    new = ("assign", {"X": [ins[0]]}, {"Out": outs}, {})
                elif n_out > n_in and n_out % n_in == 0 and list(out.shape[1:]) == list(x.shape[1:]):
                    # a gather along the first dim: the copies side by side
                    new = ("concat", {"X": [ins[0]] * (n_out // n_in)}, {"Out": outs}, {"axis": 0})
                elif n_out > n_in and n_out % n_in == 0 and list(out.shape[:-1]) == list(x.shape[:-1]):
                    new = ("concat", {"X": [ins[0]] * (n_out // n_in)}, {"Out": outs}, {"axis": -1})
                elif n_out < n_in and list(out.shape[:-1]) == list(x.shape[:-1]):  # c_split: a slice
                    new = (
                        "slice",
                        {"Input": [ins[0]]},
                        {"Out": outs},
                        {
                            "axes": [len(x.shape) - 1],
                            "starts": [0],
                            "ends": [int(out.shape[-1])],
                            "infer_flags": [1],
                            "decrease_axis": [],
                        },
                    )
                else:
                    raise NotImplementedError(
                        f"{op.type} {list(x.shape)} -> {list(out.shape)}: no local stand-in"
                    )
            else:
                raise NotImplementedError(
                    f"{op.type} with inputs {ins} and outputs {outs}: no local stand-in"
                )
            kind, inputs, outputs, attrs = new
            attrs["op_role"] = role
            block._remove_op(i, sync=False)
            block._insert_op(i, type=kind, inputs=inputs, outputs=outputs, attrs=attrs)
            done.append(op_type)
    program._sync_with_cpp()
    return done


def _scope_values(programs: dict, doc: dict) -> dict:
    """Persistables every job reads (zeros; the gradient-merge counter at k - 1)."""
    import numpy as np
    from paddle.base import core

    k = int(doc["spec"]["accumulate_steps"])
    out = {}
    for p in programs.values():
        for block in _blocks(p):
            for v in block.vars.values():
                if not v.persistable or v.name in out or v.type != core.VarDesc.VarType.DENSE_TENSOR:
                    continue
                dt = str(v.dtype).rsplit(".", 1)[-1]
                shape = [max(int(d), 1) for d in v.shape]
                arr = np.zeros(shape, {"bfloat16": "uint16"}.get(dt, dt))
                if v.name == "gradient_merge_step":
                    arr[...] = k - 1
                elif v.name == "gradient_merge_k":
                    arr[...] = k
                out[v.name] = arr
    return out


def job_programs(programs: dict, doc: dict) -> tuple[dict, dict[str, set[str]]]:
    """({type: Program} forward / backward / optimizer, {type: skip_gc_vars}) of micro-batch 0.
    A pipeline card has them from Paddle's pass; a card without pipeline runs one "default"
    job, split here by op role with the same retention rule (`measure.skip_gc_sets`), as the
    hand-written legacy cases are."""
    if "default" in programs:
        from ...paddle.split import SUB_PROGRAM_TYPES, split_program
        from .measure import skip_gc_sets

        subs = split_program(programs["default"], SUB_PROGRAM_TYPES)
        return subs, skip_gc_sets(subs)
    return {t: programs[t] for t in SUB_PROGRAMS if t in programs}, first_job_skips(doc)


def measure_card(programs: dict, doc: dict, per_op: bool = False) -> list[Measured]:
    """Net change and peak of forward, backward, optimizer of micro-batch 0, in that order
    (per_op: a `Measured` per op as well, "type/bBLOCK/INDEX:op", to find a gap's op)."""
    import numpy as np
    import paddle
    from paddle.base import core
    from paddle.base.executor import _add_feed_fetch_ops  # noqa: F401  (feed ops are in the forward already)

    place = paddle.CPUPlace()
    subs, skips = job_programs(programs, doc)
    types = list(subs)
    progs = {t: subs[t].clone() for t in types}
    for p in progs.values():
        replace_comm_ops(p)
    end = subs[types[-1]].clone()
    for blk in reversed(_blocks(end)):
        for i in range(len(blk.ops) - 1, -1, -1):
            blk._remove_op(i, sync=False)
    progs["end"] = end

    scope = core.Scope()
    for name, arr in _scope_values(programs, doc).items():
        scope.var(name).get_tensor().set(arr, place)
    marks: list[tuple[str, int, int]] = []
    marker = marker_factory(marks)

    for t, p in progs.items():
        block = p.global_block()
        mark_var = block.create_var(name=MARK_VAR, shape=[1], dtype="float32", persistable=True)
        if per_op and t != "end":
            for blk in _blocks(p):
                for i in range(len(blk.ops) - 1, -1, -1):
                    if blk.ops[i].type not in ("feed", "conditional_block"):
                        insert_marker(blk, i, mark_var, marker(f"{t}/b{blk.idx}/{i}:{blk.ops[i].type}"))
        insert_marker(block, 0, mark_var, marker(t))
        p._sync_with_cpp()
    scope.var(MARK_VAR).get_tensor().set(np.zeros(1, "float32"), place)

    jobs = []
    for t in progs:
        job = core.Job(JOB_PREFIX + t)
        job.set_skip_gc_vars(skips.get(t, set()))
        jobs.append(job)
    plan = core.Plan(jobs, {JOB_PREFIX + t: p.desc for t, p in progs.items()})
    rng = np.random.default_rng(0)
    vocab = int(doc["spec"]["vocab"])
    for i, n in enumerate(doc["feed"]):
        t = core.DenseTensor()
        t.set(rng.integers(0, vocab, size=doc["feed_shapes"][n]).astype("int64"), place)
        core.set_feed_variable(scope, t, "feed", i)
    core.StandaloneExecutor(place, plan, scope).run([], False)
    return [Measured(name, c1 - c0, p1 - c0) for (name, c0, _), (_, c1, p1) in zip(marks, marks[1:])]


def paddle_estimates(sub_programs: dict) -> tuple[dict, dict]:
    """({type: (net, peak)}, {type: error}) from Paddle's own PipelineMemoryEstimator (the
    shim of `compare.py`), one type at a time in run order: a type it fails on has an error
    line instead of numbers (on the optimizer: the conditional block's scope variable, which
    it sizes like a tensor; the estimator PR ran it on forward and backward only)."""
    from paddle.distributed.passes.pass_utils import PipelineMemoryEstimator

    from .compare import PADDLE_TYPE_KEYS, SerialDistContext

    est = PipelineMemoryEstimator()
    keyed = {PADDLE_TYPE_KEYS[t]: p for t, p in sub_programs.items()}
    est.set_program_skip_gc_vars(keyed, list(keyed))
    ctx = SerialDistContext()
    out, errors = {}, {}
    for t, p in sub_programs.items():
        try:
            out[t] = tuple(int(v) for v in est.estimate_memory(p, PADDLE_TYPE_KEYS[t], ctx))
        except (RuntimeError, ValueError, AssertionError) as e:
            errors[t] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return out, errors


def compare_card(folder: str | Path, label: str, measure: bool = True) -> list:
    """Rows for one card: forward net and peak, backward peak, optimizer peak; measured,
    pipemem's, Paddle's estimator's. `measure=False`: estimates only (programs at shapes the
    CPU cannot run; the measured fields are None)."""
    from ...paddle.capture import resolve_job_shapes
    from .compare import paddle_row, pipemem_estimates

    programs, doc = load_card(folder)
    subs, _ = job_programs(programs, doc)
    ours = pipemem_estimates(resolve_job_shapes(subs), name_prefix=f"{label}/")
    theirs, their_errors = paddle_estimates(subs)
    measured = {m.type: m for m in measure_card(programs, doc)} if measure else {}
    rows = []
    for t, quantity in (
        ("forward", "net"),
        ("forward", "peak"),
        ("backward", "net"),
        ("backward", "peak"),
        ("optimizer", "peak"),
    ):
        if t not in subs:
            continue
        m = measured.get(t)
        meas = None if m is None else m.net_bytes if quantity == "net" else m.peak_bytes
        est = ours[t].net_bytes if quantity == "net" else ours[t].peak_bytes
        pest = None if t not in theirs else theirs[t][0] if quantity == "net" else theirs[t][1]
        peak_op = ours[t].peak_op_label if quantity == "peak" else ""
        rows.append(
            paddle_row(
                f"{label}/{t}/{quantity}",
                meas,
                est,
                pest,
                peak_op,
                paddle_error=their_errors.get(t, ""),
                built_with=f"paddlepaddle {doc['paddle']}",
            )
        )
    return rows


# The main interpreter's side: build every card in the 2.6 interpreter, compare in a worker ------

PYTHON_ENV = "PIPEMEM_PADDLE26_PYTHON"
TINY = {"hidden": 64, "ffn": 128, "heads": 4, "vocab": 128, "layers": 4, "seq": 16}


def _run(
    shape: dict,
    pp: int,
    accumulate_steps: int,
    mp: int = 1,
    dp: int = 1,
    micro_batch: int = 1,
    schedule: str = "1F1B",
    recompute: bool = False,
    **sharding,
) -> dict:
    """One run_pretrain_auto_static.py run: the model's shape, the parallel degrees (`sharding`:
    the sharding group's size and stage, when there is one), the batch, the schedule, recompute."""
    return dict(
        shape,
        pp=pp,
        mp=mp,
        dp=dp,
        **sharding,
        micro_batch=micro_batch,
        accumulate_steps=accumulate_steps,
        schedule=schedule,
        recompute=recompute,
    )


# The estimator PR's three runs (run_pretrain_auto_static.py: 1F1B, no flash attention, fp32), at the
# tiny shape of the other paddlenlp cases, gradient accumulation 4; plus FThenB.
CASES = {
    "paddlenlp-legacy-pp4": _run(TINY, pp=4, accumulate_steps=4),
    "paddlenlp-legacy-pp4-recompute": _run(TINY, pp=4, accumulate_steps=4, recompute=True),
    "paddlenlp-legacy-pp2-mp2": _run(TINY, pp=2, accumulate_steps=4, mp=2, micro_batch=2),
    "paddlenlp-legacy-pp2-fthenb": _run(TINY, pp=2, accumulate_steps=4, schedule="FThenB"),
    # no pipeline: the executor's one job, split by op role; ZeRO-1 over the sharding group
    "paddlenlp-legacy-dp2-sharding2": _run(
        TINY, pp=1, accumulate_steps=4, dp=2, sharding=2, sharding_stage=1
    ),
}
CASE_NAMES = tuple(CASES)
# The estimator PR's three runs at their full size (llama-7b's shape, 4 layers): built and estimated
# only (bench/paddlenlp_legacy_seed_shapes.py), the CPU does not run them.
LLAMA_7B_4L = {"hidden": 4096, "ffn": 11008, "heads": 32, "vocab": 32000, "layers": 4, "seq": 2048}
SEED_RUNS = {
    "seed-pp4-recompute": _run(LLAMA_7B_4L, pp=4, accumulate_steps=8, recompute=True),
    "seed-pp4": _run(LLAMA_7B_4L, pp=4, accumulate_steps=8),
    "seed-pp2-mp2": _run(LLAMA_7B_4L, pp=2, accumulate_steps=8, mp=2, micro_batch=2),
}


def paddle26_python() -> str:
    """The interpreter with paddlepaddle 2.6.x and paddlenlp 2.8.1 ($PIPEMEM_PADDLE26_PYTHON)."""
    import os

    from ...errors import UserError

    exe = os.environ.get(PYTHON_ENV)
    if not exe:
        raise UserError(
            f"the paddlenlp-legacy cases build programs with paddlepaddle 2.6 (legacy-IR pipeline "
            f"passes): python -m venv ~/venvs/paddle26 && ~/venvs/paddle26/bin/pip install "
            f"paddlepaddle==2.6.2 paddlenlp==2.8.1 huggingface-hub==0.23.5 aistudio-sdk==0.2.1 "
            f"datasets==2.19.2 'numpy<2' pyarrow==17.0.0 scipy==1.13.1, then export "
            f"{PYTHON_ENV}=~/venvs/paddle26/bin/python"
        )
    if not Path(exe).exists():
        raise UserError(f"${PYTHON_ENV}={exe}: no such interpreter")
    return exe


def build_case(
    name: str, folder: Path, cards=None, parallel: int = 2, timeout: float = 600, spec: dict | None = None
) -> dict[int, Path]:
    """{card: folder} of case `name`'s job programs (every card, or `cards`), built in the 2.6
    interpreter under `folder` (`spec`: instead of CASES[name])."""
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    spec = spec or CASES[name]
    python = paddle26_python()
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root
    env.setdefault("GLOG_minloglevel", "2")
    world = spec["pp"] * spec["mp"] * spec["dp"] * spec.get("sharding", 1)

    def one(card: int) -> Path:
        out = folder / f"card{card}"
        proc = subprocess.run(
            [
                python,
                "-m",
                "pipemem.validation.paddle_runs.paddlenlp_legacy_build",
                str(spec_path),
                str(card),
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        if proc.returncode != 0 or not (out / "card.json").is_file():
            raise RuntimeError(
                f"{name}: building card {card} with paddle 2.6 failed (exit {proc.returncode}):\n"
                f"{proc.stderr[-3000:]}"
            )
        return out

    cards = list(range(world) if cards is None else cards)
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return dict(zip(cards, pool.map(one, cards)))


def compare_built(name: str, cards: dict, timeout: float = 900, measure: bool = True) -> list[dict]:
    """Rows of the built `cards` ({card: folder}) of case `name`, compared in a legacy-IR worker
    of this interpreter's Paddle (`python -m pipemem.validation.paddle_runs.worker --ir
    paddlenlp-legacy LABEL=FOLDER...`)."""
    import os
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "pipemem.validation.paddle_runs.worker",
        "--ir",
        "paddlenlp-legacy",
        *([] if measure else ["--estimate-only"]),
        "--",
        *[f"{name}/card{i}={c}" for i, c in cards.items()],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(
            f"{name}: comparing on this Paddle failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])["cases"]


def compare_case(name: str) -> list[dict]:
    """Rows of case `name`: every card built (2.6 interpreter), then compared (`compare_built`)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return compare_built(name, build_case(name, Path(tmp) / name))
