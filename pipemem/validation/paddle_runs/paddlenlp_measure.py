"""Measure PaddleNLP's own job programs of one card on the CPU, with Paddle's executor.

`python -m pipemem.validation.paddle_runs.paddlenlp_measure SPEC.json CARD OUT.json DOC.json`
runs in the interpreter that has paddlenlp. It builds the card's job plan exactly as
`pipemem estimate --exact` does (`pipemem.paddle.paddlenlp_build`), writes the captured
document to DOC.json (the path `pipemem.paddle.paddlenlp_programs` caches it under, so
`pipemem.estimate` reads these very programs), then runs the jobs of micro-batch 0 in
the card's job-list order and measures each.

How each job is run, and why (checked on paddlepaddle 3.3.1, CPU):

* **One job per executor**, each a `core.Plan` of that one job on a `core.StandaloneExecutor`,
  so the host allocator can be read around each job (PIR has no ``py_func`` to read it
  from inside a plan). Each job's ``skip_gc_vars`` are set by Paddle's own
  `pass_utils._set_skip_gc_vars_in_pir` over the chain, as the pipeline pass sets them.
  Job k runs over the scope an executor of jobs 0..k-1 left (`measure_chain`). Deeper
  chains of executors (each over the previous one's scope), or moving variables between
  scopes, crashed the 3.3.1 executor (segfaults, corrupted shapes), as did a plan
  holding a lone job typed "backward" (hence the `JOB_PREFIX` names).
* **Communication ops run locally**: there is no process group on one CPU, so each is
  replaced by a local op that allocates the same output: ``recv_v2`` -> ``full`` of its
  shape; ``send_v2`` -> ``share_data_`` of the sent value (a read that allocates nothing); an
  in-place collective (``*_``) passes its input through; an out-of-place one becomes a copy (``assign``,
  same shape), a concatenation of copies (gathers: larger output) or a slice (scatters:
  smaller output). The stream-event attributes (``events_to_wait``...) are dropped:
  one CPU stream. So the measured programs are Paddle's minus the wire.
* **Program order, one thread; the collector kept ahead**: ``sequential_run`` and
  ``serial_run``; the CPU garbage collector frees on its own thread, so the process is
  pinned to one CPU and a watcher thread gives each thread an executor starts (its
  collector) the real-time policy ``SCHED_FIFO`` as soon as it appears
  (`pir_measure.boost_threads`; nice -15 where real-time is not allowed): runnable, it
  preempts the thread running the ops, so a free is done before the next op allocates.
  Each job's net change is read after the collector drained; its peak is the smallest
  over `trials` runs of the whole chain (a late free can only raise a peak); ``lags``
  is what the collector still held when each run returned (0 when it kept up).
* Persistables (parameters, optimizer states, gradient-merge buffers, the learning rate)
  are created before the first job (zeros; values do not change sizes), fed inputs
  (token ids, labels: random ids, every label valid) too: neither counts in a job.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

DRAIN_S = 0.05
# Jobs run under these names: a plan holding a lone job typed "backward" crashes the 3.3.1
# executor (it expects that job's forward in the same plan); the names only key the programs.
JOB_PREFIX = "pipemem_"


def _replace_comm_ops(program) -> list[str]:
    """Local stand-ins for the communication ops (module docstring); returns what was replaced."""
    import paddle
    from paddle.base.libpaddle import pir

    done = []
    block = program.global_block()
    for op in list(block.ops):
        name = op.name()
        short = name.split(".", 1)[-1]
        comm = short in ("recv_v2", "send_v2", "p_recv", "p_send") or short.startswith(
            (
                "all_reduce",
                "all_gather",
                "reduce_scatter",
                "broadcast",
                "c_allreduce",
                "c_allgather",
                "c_reducescatter",
                "c_broadcast",
                "c_identity",
                "c_concat",
                "c_split",
                "reduce",
            )
        )
        if not comm or short in ("reduce_as",):
            continue
        if short in ("send_v2", "p_send"):
            # a read of the sent value that allocates nothing, so it dies here as it does
            # after a real send
            with paddle.static.program_guard(program):
                pir.set_insertion_point(op)
                paddle._C_ops.share_data_(op.operand_source(0))
            op.erase()
            done.append(name)
            continue
        with paddle.static.program_guard(program):
            pir.set_insertion_point(op)
            for r in op.results():
                if r.use_empty() and short not in ("recv_v2", "p_recv"):
                    continue
                shape = [int(d) for d in r.shape]
                if short in ("recv_v2", "p_recv") or op.num_operands() == 0:
                    new = paddle._C_ops.full(shape, 0.0, r.dtype, paddle.CPUPlace())
                elif name.endswith("_"):
                    new = op.operand_source(0)
                else:
                    x = op.operand_source(0)
                    n_in, n_out = numel(x.shape), numel(shape)
                    if n_out == n_in:
                        new = paddle._C_ops.assign(x)
                    elif n_out > n_in:
                        new = paddle._C_ops.concat([x] * (n_out // n_in), 0)
                    else:
                        rows = shape[0]
                        new = paddle._C_ops.slice(x, [0], [0], [rows], [1], [])
                    if list(new.shape) != shape:
                        new = paddle._C_ops.reshape(new, shape)
                r.replace_all_uses_with(new)
        op.erase()
        done.append(name)
    for op in block.ops:
        for a in ("events_to_wait", "event_to_record", "force_record_event"):
            if op.has_attr(a):
                op.erase_attr(a)
    return done


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _np_dtype(dtype) -> str:
    s = str(dtype).rsplit(".", 1)[-1]
    return {"bfloat16": "uint16", "bool": "bool"}.get(s, s)


def _scope_inputs(programs: dict, vocab: int) -> dict:
    """Persistables and fed inputs every job reads from the scope: name -> numpy array."""
    import numpy as np

    out = {}
    rng = np.random.default_rng(0)
    for p in programs.values():
        block = p.global_block()
        values = []
        for op in block.ops:
            if op.name() == "builtin.parameter":
                values.append((op.attrs()["parameter_name"], op.result(0), True))
            elif op.name() == "pd_op.data":
                values.append((op.attrs()["name"], op.result(0), bool(op.result(0).persistable)))
        for k, v in block.kwargs().items():
            if v.persistable:
                values.append((k, v, True))
        for name, v, persistable in values:
            if name in out:
                continue
            shape = [max(int(d), 1) for d in v.shape]
            dt = _np_dtype(v.dtype)
            if not persistable and dt.startswith("int"):
                out[name] = rng.integers(0, vocab, size=shape).astype(dt)
            else:
                out[name] = np.zeros(shape, dt)
    return out


def measure_chain(programs: dict, chain: list[str], vocab: int, trials: int = 3) -> list[dict]:
    """Net change and peak of each job of `chain` (the job types of one micro-batch, in run
    order). Job k is measured on an executor of its own, started where the jobs before it
    left the scope: one executor runs jobs 0..k-1 as one plan, then job k runs over that
    executor's scope (a scope looks names up in its ancestors, so its keyword arguments
    find what the earlier jobs kept). Rows {type, net_bytes, peak_bytes, peaks, nets}: the
    median net and the smallest peak over `trials` runs."""
    import paddle
    from paddle.base import core
    from paddle.distributed.passes.pass_utils import _set_skip_gc_vars_in_pir

    from .pir_measure import COLLECTOR_RT_PRIORITY, POLICY_RANK, boost_threads, thread_ids

    for p in programs.values():
        _replace_comm_ops(p)
    place = paddle.CPUPlace()
    inputs = _scope_inputs(programs, vocab)
    types = list(dict.fromkeys(chain))
    paddle.set_flags({"FLAGS_new_executor_sequential_run": True, "FLAGS_new_executor_serial_run": True})
    kept: list = []

    def stat() -> int:
        return int(core.host_memory_stat_current_value("Allocated", 0))

    def make_jobs():
        jobs = []
        for t in chain:
            job = core.Job(JOB_PREFIX + t)
            job.set_micro_batch_id(0)
            jobs.append(job)
        ttp = _set_skip_gc_vars_in_pir(1, [JOB_PREFIX + t for t in types], [programs[t] for t in types], jobs)
        return jobs, ttp

    def run(k: int) -> tuple[int, int, int]:
        root = core.Scope()
        for name, arr in inputs.items():
            root.var(name).get_tensor().set(arr, place)
        jobs, ttp = make_jobs()
        scope = root
        first = None
        if k:
            first = core.StandaloneExecutor(
                place, core.Plan(jobs[:k], {JOB_PREFIX + t: ttp[JOB_PREFIX + t] for t in chain[:k]}), root
            )
            first.run([], False)
            scope = root._kids()[-1]
        t = chain[k]
        exe = core.StandaloneExecutor(
            place, core.Plan([jobs[k]], {JOB_PREFIX + t: ttp[JOB_PREFIX + t]}), scope
        )
        time.sleep(DRAIN_S)
        before = stat()
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        baseline[0] = thread_ids()
        armed.set()  # the executor starts its collector threads when it runs
        exe.run([], False)
        armed.clear()
        peak = int(core.host_memory_stat_peak_value("Allocated", 0)) - before
        returned = stat()
        time.sleep(DRAIN_S)
        net = stat() - before
        kept.append((first, exe, root))  # executors hold their scopes: all live until the process ends
        return net, peak, returned - before - net

    results = {k: {"nets": [], "peaks": [], "lags": []} for k in range(len(chain))}
    errors: list = []

    def trials_body():
        try:
            for _ in range(trials):
                for k in range(len(chain)):
                    net, peak, lag = run(k)
                    results[k]["nets"].append(net)
                    results[k]["peaks"].append(peak)
                    results[k]["lags"].append(lag)
        except BaseException as e:  # re-raised below
            errors.append(e)

    stop = threading.Event()
    armed = threading.Event()  # set while a measured job runs and its collector is not yet boosted
    runner: list[int] = []
    baseline: list[set] = [set()]  # the threads before the measured job's run
    policies: list[str] = []

    def booster():
        """Give every thread the executors start (their garbage collectors) a higher
        priority than the thread running the ops, as soon as it appears. An executor starts
        its collector when it runs, so this thread is real-time itself (above the
        collectors): it must not wait for the op thread's time slice to end."""
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(COLLECTOR_RT_PRIORITY + 1))
        except (AttributeError, PermissionError, OSError):
            pass
        while not stop.is_set():
            if not armed.wait(0.05):
                continue
            # polling only while a measured job starts: real-time, it must not take the CPU
            # from the collectors (the kernel throttles real-time threads past 95 %)
            new = thread_ids() - baseline[0] - set(runner)
            if not new:
                time.sleep(0.0002)
                continue
            time.sleep(0.001)  # the executor starts its threads together: take any late one too
            new = thread_ids() - baseline[0] - set(runner)
            policies.append(boost_threads(new))
            armed.clear()

    th = threading.Thread(
        target=lambda: (runner.append(threading.get_native_id()), trials_body()),
        name="pipemem-paddlenlp-measure",
    )
    boost = threading.Thread(target=booster, name="pipemem-booster", daemon=True)
    boost.start()
    th.start()
    th.join()
    stop.set()
    if errors:
        raise errors[0]
    rows = []
    for k, t in enumerate(chain):
        nets, peaks = sorted(results[k]["nets"]), sorted(results[k]["peaks"])
        rows.append(
            {
                "type": t,
                "net_bytes": nets[len(nets) // 2],
                "peak_bytes": peaks[0],
                "peaks": peaks,
                "nets": nets,
                "lags": results[k]["lags"],
                "policy": min(policies, key=POLICY_RANK.index) if policies else "none",
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    spec_path, card, out_path, doc_path = argv[0], int(argv[1]), argv[2], argv[3]
    trials = int(argv[4]) if len(argv) > 4 else 3
    try:
        cpus = sorted(os.sched_getaffinity(0))
        # the collector's thread shares the CPU of the ops; cards measured side by side on
        # different CPUs
        os.sched_setaffinity(0, {cpus[card % len(cpus)]})
    except (AttributeError, OSError):
        pass
    from ...paddle.paddlenlp_build import BuildSpec, build_rank, set_rank_env
    from ...paddle.paddlenlp_worker import capture_rank

    with open(spec_path, encoding="utf-8") as f:
        spec = BuildSpec(**json.load(f))
    set_rank_env(card, spec.world)
    import warnings

    warnings.filterwarnings("ignore")
    plan = build_rank(spec, card)
    doc = capture_rank(plan)
    with open(doc_path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    chain = [t for t, mb in plan.job_list if mb == 0]
    rows = measure_chain(plan.programs, chain, spec.vocab, trials=trials)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"card": card, "chain": chain, "jobs": rows}, f)
    sys.stdout.flush()
    os._exit(0)  # skip tearing down executors and scopes (their destructors race each other)


if __name__ == "__main__":
    raise SystemExit(main())
