"""Measure a whole PIR training step on the CPU with Paddle's normal `Executor`.

PIR programs cannot be measured sub-program by sub-program the way legacy ones are
(`pipemem.validation.paddle_runs.measure`): PIR has no ``py_func`` op to read the allocator between
jobs. So a step is measured whole, from `core.host_memory_stat_current_value("Allocated",
0)` and `..._peak_value` (reset just before). Each choice was checked on paddlepaddle
3.3.1 CPU (docs/ACCURACY.md):

* **Program order, one thread**: ``FLAGS_new_executor_sequential_run`` and
  ``FLAGS_new_executor_serial_run`` (set here around the runs). By default the PIR
  interpreter schedules ops by data dependence on a thread pool, which reorders
  independent ops; pipemem, like Paddle's estimators, walks the program order.
* **Garbage collection is asynchronous on the CPU**: the interpreter hands each dead
  value to a one-thread work queue (`InterpreterCoreEventGarbageCollector`). On a busy
  machine that thread falls behind and a run's peak overshoots by whatever is still
  queued (seen: +25% to +150%, different in every run). So each trial runs the step
  twice on a fresh scope and executor: the first run builds the interpreter and its
  collector thread (its drained net change is the *net* reported: the fed inputs, which
  the scope keeps, plus whatever the step leaves); then the thread running the ops (a
  thread of the trial's own, with ``serial_run``) is set to nice 19 and the threads the
  first run created to nice -15 (only where the process may raise priorities), and the
  second run's peak is the *peak* reported. With the collector ahead of the ops it keeps
  up, and the second run's peak is the same in nearly every trial; the smallest over
  the trials is reported (a late free can only raise a peak).
* In the second run the feeds replace the first run's in the scope, so its peak is
  above the fed inputs, like a steady-state step.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

DRAIN_S = 0.05
COLLECTOR_NICE = -15  # the collector's threads, where the process may raise priorities
RUNNER_NICE = 19  # the thread running the measured step (lowering is always allowed)


@dataclass
class StepMeasurement:
    peak_bytes: int  # smallest second-run peak over the trials, above the step's start
    net_bytes: int  # first run: allocated after it (collector drained) minus before
    peaks: list[int]  # every trial's peak, sorted
    nets: list[int]  # every trial's net change, sorted
    boosted: bool  # whether the collector's priority could be raised


def _stat(core) -> int:
    return int(core.host_memory_stat_current_value("Allocated", 0))


def thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def boost_threads(tids) -> bool:
    ok = bool(tids)
    for t in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, t, COLLECTOR_NICE)
        except (PermissionError, OSError):
            ok = False
    return ok


def measure_step(main, startup, feeds: dict, trials: int = 5, seed: int = 0) -> StepMeasurement:
    """Peak (smallest over `trials`) and net change of a step of `main`."""
    import paddle
    from paddle.base import core

    flags = {"FLAGS_new_executor_sequential_run": True, "FLAGS_new_executor_serial_run": True}
    old = paddle.get_flags(list(flags))
    paddle.set_flags(flags)
    try:
        runs = [_one_trial(paddle, core, main, startup, feeds, seed) for _ in range(trials)]
    finally:
        paddle.set_flags(old)
    peaks = sorted(r[0] for r in runs)
    nets = sorted(r[1] for r in runs)
    return StepMeasurement(
        peak_bytes=peaks[0],
        net_bytes=nets[len(nets) // 2],
        peaks=peaks,
        nets=nets,
        boosted=all(r[2] for r in runs),
    )


def _one_trial(paddle, core, main, startup, feeds, seed) -> tuple[int, int, bool]:
    """(second-run peak, first-run drained net, collector boosted) on a fresh executor.

    Runs in a thread of its own, so that lowering that thread's priority for the second
    run (always allowed) leaves the caller's as it was."""
    out: list = []
    errors: list = []

    def trial():
        try:
            out.append(_trial_body(paddle, core, main, startup, feeds, seed))
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    t = threading.Thread(target=trial, name="pipemem-pir-trial")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def _trial_body(paddle, core, main, startup, feeds, seed) -> tuple[int, int, bool]:
    scope = core.Scope()
    paddle.seed(seed)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(startup, scope=scope)
    time.sleep(DRAIN_S)
    before_threads = thread_ids()
    before = _stat(core)
    exe.run(main, feed=feeds, fetch_list=[], scope=scope)
    time.sleep(DRAIN_S)
    net = _stat(core) - before
    # The collector thread now exists: raise it (root only) and lower this thread, which
    # runs the ops (serial run), so the collector keeps up.
    boosted = boost_threads(thread_ids() - before_threads - {threading.get_native_id()})
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), RUNNER_NICE)
    except OSError:
        pass
    before = _stat(core)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    exe.run(main, feed=feeds, fetch_list=[], scope=scope)
    peak = int(core.host_memory_stat_peak_value("Allocated", 0)) - before
    time.sleep(DRAIN_S)
    exe.close()
    return peak, net, boosted


def measure_no_gc(main, startup, feeds: dict, seed: int = 0) -> int:
    """Bytes one step allocates with garbage collection off (``FLAGS_eager_delete_tensor_gb
    = -1``: the interpreter's collector then drops nothing): every value the step writes,
    with in-place results and views sharing their input's buffer. Deterministic."""
    import paddle
    from paddle.base import core

    old = paddle.get_flags(["FLAGS_eager_delete_tensor_gb", "FLAGS_new_executor_sequential_run"])
    paddle.set_flags({"FLAGS_eager_delete_tensor_gb": -1.0, "FLAGS_new_executor_sequential_run": True})
    try:
        scope = core.Scope()
        paddle.seed(seed)
        exe = paddle.static.Executor(paddle.CPUPlace())
        exe.run(startup, scope=scope)
        before = _stat(core)
        exe.run(main, feed=feeds, fetch_list=[], scope=scope)
        return _stat(core) - before
    finally:
        paddle.set_flags(old)
