"""`pipemem validate torchtitan`: the torchtitan convention held against torchtitan's own code.

Each case is a torchtitan 0.3 job (a debug flavour of one of its models: llama3, qwen3 dense and
MoE, deepseek_v3 with its multi-head latent attention and MoE; a parallelism, activation
checkpointing). Measured: torchtitan's own step traced per rank on fake tensors
with the fake process group (`torchtitan_trace.py`: its parallelize / pipelining functions,
optimizer, loss and `Trainer.train_step`, second step recorded). Estimated: the same job
through `pipemem.estimate` with the model and plan `--from-torchtitan` reads from the
`Trainer.Config` the ranks ran (`configs.torchtitan.from_trainer_config`), the rank's pipeline
stage. One row
per traced rank; `rel_error` = (estimated - measured) / measured.

Every rank of a case traces in its own subprocess (a fresh fake process group each); ranks
that differ only in their data-parallel / tensor-parallel coordinate hold the same shapes,
so one rank is traced unless the case lists more.

Not traced yet (so not validated here): pipeline parallelism (torchtitan 0.3 calls
`schedule.step(arg_mbs=...)`, a newer PyTorch's signature, shimmed in torchtitan_trace.py, but
its stages exchange shape metadata with their peers at the first step, which a one-process
fake process group cannot answer) and expert parallelism (the all-to-all splits are data:
`.item()` of fake tensors gives shapes the dispatch rejects).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .compare import CaseRow, peak_row, timed_rows

EXAMPLE = """\
examples:
  pipemem validate torchtitan                  # the CI subset
  pipemem validate torchtitan --full --json    # every case
  pipemem validate torchtitan --cases fsdp2-tp2,cp2
  pipemem validate torchtitan --list
"""

LLAMA = {"family": "llama3", "config": "llama3_debugmodel", "flavor": "debugmodel"}
QWEN3_MOE = {"family": "qwen3", "config": "qwen3_moe_debug", "flavor": "debugmodel_moe"}
QWEN3 = {"family": "qwen3", "config": "qwen3_debugmodel", "flavor": "debugmodel"}
DEEPSEEK_V3 = {"family": "deepseek_v3", "config": "deepseek_v3_debugmodel", "flavor": "debugmodel"}
# torchtitan 0.3 ships no llama4: its cases run 0.2.2's own step (torchtitan_llama4_trace.py), from
# the directory $PIPEMEM_TORCHTITAN_LLAMA4 names (traced/torchtitan_llama4.py)
LLAMA4 = {"family": "llama4", "flavor": "debugmodel", "release": "0.2.2"}
SEQ = 256
TRUTH = "traced"  # the framework's code on fake tensors, bytes counted by pipemem (compare.TRUTHS)
ROWS_ARE = "ranks"  # one row per traced rank of each case
TOLERANCE = 0.01
TIMEOUT = 600.0  # seconds per traced rank: the default --timeout


def _case(
    name: str, world: int, parallelism: dict, ac: str = "none", model=LLAMA, ranks=(0,), **extra
) -> dict:
    return {
        "name": name,
        "world": world,
        "model": model,
        "parallelism": parallelism,
        "ac": ac,
        "seq_len": SEQ,
        "local_batch_size": 2,
        "ranks": list(ranks),
        **extra,
    }


def all_cases() -> list[dict]:
    return [
        _case("fsdp2", 2, {"dp_shard": 2}),
        _case("fsdp2-no-reshard", 2, {"dp_shard": 2, "reshard_after_forward": "never"}),
        _case("fsdp4", 4, {"dp_shard": 4}),
        _case("tp2", 2, {"tp": 2}),
        _case("fsdp2-tp2", 4, {"dp_shard": 2, "tp": 2}),
        _case("cp2", 2, {"cp": 2}),
        _case("fsdp2-ac-full", 2, {"dp_shard": 2}, ac="full"),
        _case("fsdp2-ac-op", 2, {"dp_shard": 2}, ac="selective"),
        _case("moe-fsdp2", 2, {"dp_shard": 2}, model=QWEN3_MOE),
        _case("qwen3-fsdp2", 2, {"dp_shard": 2}, model=QWEN3),
        _case("dsv3-fsdp2", 2, {"dp_shard": 2}, model=DEEPSEEK_V3),
        # the CI case: deepseek_v3 debugmodel's first three layers (one dense, two MLA + MoE: the
        # last layer's backward prefetches a layer of its own kind, as in the whole model)
        _case("dsv3-3layers-fsdp2", 2, {"dp_shard": 2}, model=DEEPSEEK_V3, layers=3),
        _case("moe-tp2", 2, {"tp": 2}, model=QWEN3_MOE),
        _case("dsv3-fsdp2-ac-op", 2, {"dp_shard": 2}, ac="selective", model=DEEPSEEK_V3),
        _case("dsv3-fsdp2-ac-full", 2, {"dp_shard": 2}, ac="full", model=DEEPSEEK_V3),
        # llama4 debugmodel (torchtitan 0.2.2): three dense layers interleaved with three MoE
        # layers (8 experts, top 1, a shared expert; grouped GEMMs as on SM90)
        _case("llama4-fsdp2", 2, {"dp_shard": 2}, model=LLAMA4),
    ]


CI_CASES = ("fsdp2", "fsdp2-tp2")


# ---- measured: torchtitan's step, one subprocess per rank ----------------------------------------


def trace_case(case: dict, timeout: float = 600.0) -> dict[int, dict]:
    """{rank: trace result} for the case's traced ranks (`torchtitan_trace.main` per rank)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker, first = "pipemem.validation.torchtitan_trace", ""
    if case["model"].get("release") == "0.2.2":
        from ..traced import torchtitan_llama4

        why = torchtitan_llama4.available()
        if why is not None:
            raise RuntimeError(f"case {case['name']}: {why}")
        worker, first = "pipemem.validation.torchtitan_llama4_trace", torchtitan_llama4.site()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (first, root, os.environ.get("PYTHONPATH", "")) if p),
    )
    out: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pipemem-torchtitan-") as tmp:
        for rank in case["ranks"]:
            job, res = os.path.join(tmp, f"job{rank}.json"), os.path.join(tmp, f"out{rank}.json")
            with open(job, "w") as f:
                json.dump({"rank": rank, "case": case}, f)
            proc = subprocess.run(
                [sys.executable, "-m", worker, job, res],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if proc.returncode != 0:
                tail = "\n".join(line for line in proc.stderr.splitlines() if "Warning" not in line)[-2500:]
                raise RuntimeError(f"torchtitan trace of {case['name']} rank {rank} failed:\n{tail}")
            with open(res) as f:
                out[rank] = json.load(f)
    return out


# ---- estimated: the same job through pipemem.estimate ---------------------------------------------


def compare_case(case: dict, traces: dict[int, dict]) -> list[CaseRow]:
    from ..estimate import estimate

    rows = []
    # the model and plan --from-torchtitan reads from the Trainer.Config the ranks ran
    traced = next(iter(traces.values()))
    est = estimate(traced["model"], model_name=f"torchtitan-{case['model']['flavor']}", **traced["plan"])
    pp = traced["plan"].get("pp", 1)
    for rank, tr in sorted(traces.items()):
        stage_rank = rank // (case["world"] // pp) if pp > 1 else 0
        r = est.ranks[stage_rank]
        where = {"rank": rank, "pp_rank": stage_rank}
        gap = {"known_gap": case["known_gap"]} if case.get("known_gap") else {}
        rows.append(peak_row(f"{case['name']}/rank{rank}", case["name"], tr, r, where, **gap))
    return rows


def run_cases(cases: list[dict], timeout: float = TIMEOUT, progress=None) -> list[CaseRow]:
    return timed_rows(cases, lambda c: compare_case(c, trace_case(c, timeout)), progress)


# ---- CLI ---------------------------------------------------------------------------------------


HELP = "torchtitan's own training step (fake tensors) per rank vs the estimate"
DESCRIPTION = (
    "Trace torchtitan 0.3's own training step (its parallelize / pipelining "
    "functions, optimizer, loss and Trainer.train_step) per rank on fake tensors "
    "with the fake process group, second step, and compare each rank's peak "
    "with pipemem's torchtitan-convention estimate. Needs torchtitan==0.3.0 "
    "(pip install 'pipemem[torchtitan]'); the llama4 cases run torchtitan 0.2.2's step (0.3 "
    "ships no llama4) from a directory of its own: pip install --no-deps --target DIR "
    "torchtitan==0.2.2 and set PIPEMEM_TORCHTITAN_LLAMA4=DIR. Exit 1 if a rank is off by more "
    f"than {TOLERANCE:.0%}."
)
FULL_HELP = (
    "every case (FSDP2 with and without resharding, dp 4, TP + SP, CP, AC, qwen3, MoE, deepseek_v3; "
    "llama4 from torchtitan 0.2.2)"
)


def json_header() -> dict:
    return {"torchtitan": "0.3.0", "kernel_policy": "cuda"}


def available() -> str | None:
    from .torchtitan_trace import available

    return available()


def available_for(cases: list[dict]) -> str | None:
    """None when the chosen cases can run here: torchtitan 0.3, and for llama4's cases 0.2.2."""
    why = available()
    if why is None and any(c["model"].get("release") == "0.2.2" for c in cases):
        from ..traced.torchtitan_llama4 import available as llama4_available

        why = llama4_available()
    return why
