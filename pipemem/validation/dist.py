"""`pipemem validate dist`: real multi-process training steps over gloo on the CPU, each rank
measuring itself, against pipemem's per-rank estimate of the same runs.

Runs (pipemem/validation/distributed/models.py; tiny HF Llama decoder layers, fp32, AdamW foreach):
- pipeline parallel with torch.distributed.pipelining (GPipe, 1F1B, Interleaved1F1B,
  ZBVZeroBubble, DualPipeV), a hand-split `DecoderStack` per stage, pp 2 and 4;
- DTensor tensor parallel with sequence parallel (torchtitan's plan), tp 2 and 4, each also
  with `pipemem.torch_tp.RegatherColwiseParallel` as the column-parallel style (`-regather`
  cases: the estimate has `recompute_allgather`); their rows add the saving per rank,
  measured and estimated, against the same case without it;
- FSDP2 (`fully_shard` per decoder layer and the root), dp 2 and 4;
- DistributedDataParallel, gradient_as_bucket_view off and on, dp 2 and 4 (the Reducer's
  buckets are built inside the measurement, before the step: C++ holds them).

Each rank is a process (`python -m pipemem.validation.dist_worker`, MASTER_ADDR=127.0.0.1, a
free port) that starts `torch.profiler.profile(profile_memory=True)` before it builds its
model and sums the allocation events in time order: measured = the highest
running sum during the step (params, buffers, inputs and runtime buffers included).

Estimates: every number is `pipemem.estimate(config, mode="traced", kernel_policy="cpu",
convention="torchtitan", ...)` of the case's plan, the call users make (`estimate_case`):
pipelines are traced stage jobs + the schedule + the torch runtime profile's lowering + replay;
TP and FSDP ranks are traced on FakeTensorMode under PyTorch's fake process group; a DDP rank
is the model's step traced with DDP's memory modelled on it (pipemem/traced/ddp.py). Nothing
here computes a memory number.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from ..errors import UserError
from .compare import CaseRow, add_case_options, case_names, exit_code, rel_error
from .rank_processes import free_port

EXAMPLE = """\
examples:
  pipemem validate dist                 # CI set: two pipelines, TP with and without regather, FSDP, DDP (world 2)
  pipemem validate dist --full --json   # every schedule at pp 2 and 4, TP, FSDP
  pipemem validate dist --cases pp2-ZBVZeroBubble-m4,tp2-llama
  pipemem validate dist --cases tp4-llama-regather   # with tp4-llama: the saving of RegatherColwiseParallel
  pipemem validate dist --cases ddp2-llama,ddp2-llama-view,ddp4-llama,ddp4-llama-view   # DDP, bucket view off / on
  pipemem validate dist --list
"""  # noqa: E501 (example command lines, printed as they stand)

LLAMA = {"arch": "llama", "hidden": 64, "layers": 8, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256}
MIXTRAL = {
    "arch": "mixtral",
    "hidden": 64,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "ffn": 96,
    "vocab": 256,
    "experts": 4,
    "topk": 2,
}
SEQ = 64

# (schedule, vpp): the multi-stage schedules run 2 stages per rank.
SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2))


def _pp_case(schedule: str, vpp: int, pp: int, m: int) -> dict:
    return {
        "name": f"pp{pp}-{schedule}-m{m}",
        "kind": "pp",
        "schedule": schedule,
        "pp": pp,
        "vpp": vpp,
        "microbatches": m,
        "micro_batch": 1,
        "seq_len": SEQ,
        "model": LLAMA,
        "world": pp,
    }


# A rank measures its peak from the profiler's allocation events. The profiler misses a free made
# on a gloo worker thread; dist_worker.repair_missed_frees puts each such free back at the first
# collective wait after the block's allocation, or where its address is allocated again if earlier
# (the allocator cannot hand out a block in use). Each row reports the peak as recorded
# (`raw_measured_bytes`, an upper bound), with the missed frees where reuse proves them
# (`proven_measured_bytes`) and repaired (`measured_bytes`, at least the raw peak minus
# `missed_free_bytes`). The part of the repair the events do not prove (proven minus repaired:
# frees moved from the address's reuse back to the collective's wait) may lower a peak by at most
# this; beyond it the row is not a pass (under a load of 4-5 on 2 cores the TP ranks' whole
# repairs, raw minus repaired, were 1.8 % and 4.5 %, the pipelines' and FSDP's 0).
REPAIR_BOUND = 0.05
TRUTH = "measured"  # a real run, bytes from the allocator or profiler (compare.TRUTHS)
# Real runs measured by the profiler against traces with the kernels they run: within 1 %.
TOLERANCE = 0.01

# gloo threads race on the TP collectives' frees (docs/ACCURACY.md): more repeats, whose
# smallest peak is the program-order one; 3 still left one rank +0.9 % once.
TP2 = {"kind": "tp", "micro_batch": 2, "seq_len": SEQ, "model": LLAMA, "world": 2, "repeat": 6}
TP4 = dict(TP2, model=dict(LLAMA, heads=8, kv_heads=4), world=4)  # tp 4 must divide the KV heads


def all_cases() -> list[dict]:
    # DualPipeV needs at least as many microbatches as stages (8 at pp 4).
    cases = [
        _pp_case(s, v, pp, m)
        for pp in (2, 4)
        for m in (4, 8)
        for s, v in SCHEDULES
        if not (s == "DualPipeV" and m < 2 * pp)
    ]
    cases += [
        dict(TP2, name="tp2-llama"),
        dict(TP2, name="tp2-llama-regather", regather=True, base="tp2-llama"),
        dict(TP4, name="tp4-llama"),
        dict(TP4, name="tp4-llama-regather", regather=True, base="tp4-llama"),
        {
            "name": "fsdp2-llama",
            "kind": "fsdp",
            "micro_batch": 2,
            "seq_len": SEQ,
            "model": LLAMA,
            "world": 2,
            "repeat": 3,
        },
        {
            "name": "fsdp2-mixtral",
            "kind": "fsdp",
            "micro_batch": 2,
            "seq_len": SEQ,
            "model": MIXTRAL,
            "world": 2,
            "repeat": 3,
        },
        # dp 4: FSDP2's implicit backward prefetch (the next unit's all-gather issued while a
        # unit's backward runs) and reduce-scatter buffers of a quarter shard
        {
            "name": "fsdp4-llama",
            "kind": "fsdp",
            "micro_batch": 2,
            "seq_len": SEQ,
            "model": LLAMA,
            "world": 4,
            "repeat": 3,
        },
        dict(_pp_case("1F1B", 1, 2, 4), name="pp2-1F1B-m4-mixtral", model=MIXTRAL),
    ]
    # DistributedDataParallel, default buckets (gradient_as_bucket_view off: .grad and the
    # buckets are two copies) and bucket views (one copy), dp 2 and 4. A short batch, so that
    # the peak is in the optimizer step, where gradients and buckets are both resident and the
    # two settings differ by a whole gradient copy (at SEQ the activations' peak hides it).
    cases += [
        {
            "name": f"ddp{w}-llama{'-view' if view else ''}",
            "kind": "ddp",
            "micro_batch": 1,
            "seq_len": 16,
            "model": LLAMA,
            "world": w,
            "bucket_view": view,
            "repeat": 3,
        }
        for w in (2, 4)
        for view in (False, True)
    ]
    return cases


CI_CASES = (
    "pp2-1F1B-m4",
    "pp2-ZBVZeroBubble-m4",
    "tp2-llama",
    "tp2-llama-regather",
    "fsdp2-llama",
    "ddp2-llama",
)


# ---- real runs -------------------------------------------------------------------------------


class Launch:
    """`world` worker processes running `cases` over gloo on 127.0.0.1; `collect()` waits for
    them and returns {(case name, rank): measurement}. Every process is killed on timeout,
    on error, and when collect() returns or raises."""

    def __init__(self, cases: list[dict], world: int, timeout: float = 600.0):
        self.world, self.timeout, self.cases = world, timeout, cases
        self.tmp = tempfile.TemporaryDirectory(prefix="pipemem-dist-")
        spec = os.path.join(self.tmp.name, "cases.json")
        with open(spec, "w") as f:
            json.dump(cases, f)
        self.out = os.path.join(self.tmp.name, "out")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(world),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            TRANSFORMERS_VERBOSITY="error",
            PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
        )
        self.procs, self.logs = [], []
        self.started = time.monotonic()
        try:
            for r in range(world):
                log = open(os.path.join(self.tmp.name, f"log.{r}"), "w")
                self.logs.append(log)
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "pipemem.validation.dist_worker", spec, self.out],
                        env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        except BaseException:
            self.close()
            raise

    def finished(self) -> int:
        """Cases every rank has written its result for (each worker runs them in order)."""
        counts = []
        for r in range(self.world):
            try:
                with open(f"{self.out}.{r}") as f:
                    counts.append(sum(1 for line in f if line.endswith("\n")))
            except OSError:
                return 0
        return min(counts)

    def collect(self, on_case: Callable[[int], None] | None = None) -> dict[tuple[str, int], dict]:
        """Wait for the workers; `on_case(k)` is called as the k-th case finishes on every rank."""
        try:
            procs = self.procs
            seen = 0
            while any(p.poll() is None for p in procs):
                if on_case is not None:
                    for k in range(seen, self.finished()):
                        on_case(k)
                    seen = max(seen, self.finished())
                if time.monotonic() - self.started > self.timeout:
                    raise RuntimeError(f"dist run of {self.world} ranks timed out after {self.timeout:.0f} s")
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                raise RuntimeError(
                    f"rank {bad[0]} of the {self.world}-rank dist run failed:\n{self._log_tail(bad[0])}"
                )
            if on_case is not None:
                for k in range(seen, len(self.cases)):
                    on_case(k)
            results = {}
            for r in range(self.world):
                with open(f"{self.out}.{r}") as f:
                    for line in f:
                        res = json.loads(line)
                        results[res["name"], r] = res
            return results
        finally:
            self.close()

    def _log_tail(self, rank: int) -> str:
        self.logs[rank].flush()
        with open(os.path.join(self.tmp.name, f"log.{rank}")) as f:
            return "".join(line for line in f.readlines() if "USDT" not in line)[-3000:]

    def close(self) -> None:
        _stop(self.procs)
        for log in self.logs:
            log.close()
        self.tmp.cleanup()


def launch(cases: list[dict], world: int, timeout: float = 600.0) -> dict[tuple[str, int], dict]:
    """Run `cases` (all of world size `world`) in `world` fresh processes; see `Launch`."""
    return Launch(cases, world, timeout).collect()


def _stop(procs) -> None:
    """Kill the worker processes we started (each leads its own session), then reap them."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# ---- compare -----------------------------------------------------------------------------------


def estimate_kwargs(case: dict) -> dict:
    """The case as `pipemem.estimate` keyword arguments."""
    from .distributed.models import precision

    kw = dict(
        mode="traced",
        kernel_policy="cpu",
        convention="torchtitan",
        step="first",
        seq_len=case["seq_len"],
        micro_batch=case["micro_batch"],
        **precision(case["model"]),
    )
    if case["kind"] == "pp":
        kw.update(
            pp=case["pp"],
            vpp=case.get("vpp", 1),
            microbatches=case["microbatches"],
            schedule=case["schedule"],
            runtime="torch",
        )
    elif case["kind"] == "tp":
        kw.update(tp=case["world"], recompute_allgather=bool(case.get("regather")))
    elif case["kind"] == "ddp":
        kw.update(dp=case["world"], grads="ddp-bucket-view" if case.get("bucket_view") else "ddp-bucket")
    else:
        kw.update(fsdp=True, dp=case["world"])
    return kw


def estimate_case(case: dict) -> dict[int, dict]:
    """{rank: {estimated_bytes, peak_at, static_bytes}} of every rank of the case, from one
    `pipemem.estimate` call (a TP / FSDP estimate is one rank: every rank of the group runs it)."""
    import pipemem

    from .distributed.models import hf_config

    est = pipemem.estimate(hf_config(case["model"]), **estimate_kwargs(case))
    out = {}
    for r in range(case["world"]):
        rank = est.ranks[r] if case["kind"] == "pp" else est.ranks[0]
        out[r] = {
            "estimated_bytes": rank.peak_allocated_bytes,
            "peak_at": rank.peak_at,
            "static_bytes": rank.static.total,
        }
    return out


def run_cases(cases: list[dict], timeout: float = 600.0, progress=None) -> list[CaseRow]:
    """Measure (worker processes, one launch per world size) and estimate (this process, while
    the workers run) every case; one row per rank and case. `progress` (a
    progress.CaseProgress) advances as each case's ranks finish."""
    rows = []
    by_world: dict[int, list[dict]] = {}
    for c in cases:
        by_world.setdefault(c["world"], []).append(c)
    for world, group in sorted(by_world.items()):
        run = Launch(group, world, timeout)  # the ranks start while this process estimates
        if progress is not None:
            progress.start(f"{group[0]['name']}: estimating {len(group)} case(s) while {world} ranks run")
        try:
            t0 = time.perf_counter()
            estimates = {c["name"]: estimate_case(c) for c in group}
            t_est = time.perf_counter() - t0
        except BaseException:
            run.close()
            raise
        if progress is not None:
            progress.start(f"{group[0]['name']}: {world} ranks running")
        measured = run.collect(None if progress is None else lambda k, g=group: progress.done(g[k]["name"]))
        for c in group:
            for r, est in sorted(estimates[c["name"]].items()):
                meas = measured[c["name"], r]
                row = CaseRow(
                    f"{c['name']}/rank{r}",
                    meas["measured_bytes"],
                    est["estimated_bytes"],
                    {
                        "case": c["name"],
                        "rank": r,
                        "peak_at": est["peak_at"],
                        "static_bytes": est["static_bytes"],
                        "measured_baseline_bytes": meas.get("baseline_bytes"),
                        "raw_measured_bytes": meas.get("raw_measured_bytes"),
                        "proven_measured_bytes": meas.get("proven_measured_bytes"),
                        "measured_max_bytes": meas.get("measured_max_bytes"),
                        "repeats": meas.get("repeats") or 1,
                        "missed_free_bytes": meas.get("missed_free_bytes", 0),
                        "estimate_seconds": round(t_est / len(group), 2),
                        "run_seconds": meas.get("seconds"),
                    },
                )
                check_repair(row)
                rows.append(row)
    return rows


def check_repair(row: CaseRow) -> None:
    """Marks the row `unreliable` when the unproven part of the repair of missed frees lowered its
    measured peak by more than REPAIR_BOUND: a measurement resting that much on where the repair
    put frees the profiler did not see is not counted as a pass."""
    raw, proven = row.extra.get("raw_measured_bytes"), row.extra.get("proven_measured_bytes")
    if raw is None or not row.measured_bytes:
        return
    row.extra["repair_rel"] = (raw - row.measured_bytes) / row.measured_bytes
    assumed = (proven if proven is not None else raw) - row.measured_bytes
    row.extra["assumed_repair_rel"] = assumed / row.measured_bytes
    if assumed > REPAIR_BOUND * row.measured_bytes:
        row.extra["unreliable"] = (
            f"the repair of frees missed on gloo's threads lowered the peak by "
            f"{row.extra['assumed_repair_rel']:.2%} more than address reuse proves "
            f"(bound {REPAIR_BOUND:.0%})"
        )


def add_savings(rows: list[CaseRow], cases: list[dict]) -> None:
    """Rows of a case run without and with a memory-saving switch (`base` names the case
    without it): per rank, the measured and the estimated saving (base minus this case)."""
    by_case_rank = {(r.extra["case"], r.extra["rank"]): r for r in rows}
    bases = {c["name"]: c["base"] for c in cases if c.get("base")}
    for r in rows:
        b = by_case_rank.get((bases.get(r.extra["case"]), r.extra["rank"]))
        if b is None:
            continue
        measured, estimated = b.measured_bytes - r.measured_bytes, b.estimated_bytes - r.estimated_bytes
        r.extra.update(
            saving_measured_bytes=measured,
            saving_estimated_bytes=estimated,
            saving_rel_error=rel_error(estimated, measured),
        )


HELP = "real gloo runs (pipelining, TP/SP, FSDP2, DDP) per rank vs the estimate"
DESCRIPTION = (
    "Real multi-process training steps over gloo on the CPU "
    "(torch.distributed.pipelining schedules, DTensor TP with sequence "
    "parallel, FSDP2, DistributedDataParallel), each rank measuring its own peak with the profiler, "
    "against pipemem's per-rank estimate of the same runs."
)


def add_arguments(p) -> None:
    add_case_options(
        p,
        "every case (pp 2 and 4, 4 and 8 microbatches, 5 schedules, TP 2 and 4 with and "
        "without regather, FSDP and DDP at dp 2 and 4): minutes on 2 cores",
        900.0,
        "seconds per multi-process launch",
    )


def select(args) -> list[dict]:
    known = {c["name"]: c for c in all_cases()}
    if args.cases:
        names = case_names(args.cases, known, "dist")
        # a case compared with another (its saving) brings that one along, first
        chosen: list[str] = []
        for n in names:
            chosen += [m for m in (known[n].get("base"), n) if m and m not in chosen]
        return [known[n] for n in chosen]
    if args.full:
        return list(known.values())
    return [known[n] for n in CI_CASES]


def run(args) -> int:
    if args.timeout <= 0:
        raise UserError("--timeout: must be a positive number of seconds")
    cases = select(args)
    if args.list:
        for c in all_cases():
            print(c["name"])
        return 0
    from .compare import require
    from .progress import CaseProgress, print_result, print_summary, quiet_profiler_chatter

    require("dist")

    try:
        with quiet_profiler_chatter(), CaseProgress([c["name"] for c in cases], "validate dist") as bar:
            rows = run_cases(cases, args.timeout, bar)
    except RuntimeError as e:
        print(f"pipemem: validate dist: {e}", file=sys.stderr)
        return 1
    add_savings(rows, cases)
    savings = [r for r in rows if "saving_measured_bytes" in r.extra]
    worst_saving = max(
        (abs(r.extra["saving_rel_error"]) for r in savings if r.extra["saving_rel_error"] is not None),
        default=None,
    )
    status = print_result(
        rows,
        args.json,
        "dist",
        TRUTH,
        TOLERANCE,
        dict(
            backend="gloo",
            kernel_policy="cpu",
            repair_bound=REPAIR_BOUND,
            max_abs_saving_rel_error=worst_saving,
        ),
        columns=(
            ("raw_measured_bytes", "raw measured"),
            ("proven_measured_bytes", "proven"),
            ("repeats", "runs"),
            ("peak_at", "peak at"),
        ),
        what="rank measurements",
    )
    if args.json:
        return status
    print(
        "measured = the lowest peak over the runs, frees missed on gloo's threads repaired; raw measured "
        "= the same run as recorded; proven = those frees only where address reuse proves them; a repair "
        f"beyond the proven one by over {REPAIR_BOUND:.0%} of the peak fails the row"
    )
    if savings:
        print()
        print_summary(
            [
                CaseRow(r.name, r.extra["saving_measured_bytes"], r.extra["saving_estimated_bytes"])
                for r in savings
            ],
            title="saving (vs the case without)",
            what="rank savings",
        )
    return exit_code(rows, TOLERANCE)
