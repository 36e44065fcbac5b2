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
  value to a one-thread work queue (`InterpreterCoreEventGarbageCollector`; on a CPU place
  Paddle always builds this one, whatever ``FLAGS_fast_eager_deletion_mode`` says, and no
  flag makes it free on the calling thread; ``FLAGS_eager_delete_tensor_gb=0``, the
  default, hands each value over at once rather than in batches). On a busy machine that
  thread falls behind and a run's peak overshoots by whatever is still queued (seen:
  +25% to +150%, different in every run). So the collector is made to run the moment it
  has work: each trial runs the step twice on a fresh scope and executor; the first run
  builds the interpreter and its collector thread (its drained net change is the *net*
  reported: the fed inputs, which the scope keeps, plus whatever the step leaves); then
  the threads the first run created get the real-time policy ``SCHED_FIFO`` and the CPU
  of the thread running the ops (``serial_run``: a thread of the trial's own, pinned to
  one CPU). A real-time thread that becomes runnable preempts a normal one on its CPU at
  once, so each free is done before the op thread allocates again: the second run's peak
  is the peak with synchronous frees. Checked per trial: every trial's peak is the same,
  and what the collector still holds when ``run`` returns (``lag_bytes``: allocated right
  after the run minus allocated once drained) is 0. Where the process may not use
  ``SCHED_FIFO`` (it needs ``CAP_SYS_NICE``), the collector gets nice -15 instead
  (``StepMeasurement.policy`` says which): frees usually keep up, and the smallest peak
  over the trials is reported (a late free can only raise a peak).
* In the second run the feeds replace the first run's in the scope, so its peak is
  above the fed inputs, like a steady-state step.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

DRAIN_S = 0.05
COLLECTOR_NICE = -15  # the collector's threads, where real-time scheduling is not allowed
RUNNER_NICE = 19  # the thread running the measured step (lowering is always allowed)
COLLECTOR_RT_PRIORITY = 10  # SCHED_FIFO priority of the collector's threads (any of 1..99 preempts)


@dataclass
class StepMeasurement:
    peak_bytes: int  # smallest second-run peak over the trials, above the step's start
    net_bytes: int  # first run: allocated after it (collector drained) minus before
    peaks: list[int]  # every trial's peak, sorted
    nets: list[int]  # every trial's net change, sorted
    policy: str  # how the collector was kept ahead in every trial: "realtime", "nice" or "none"
    lag_bytes: int = 0  # most any trial's collector still held when the step returned

    @property
    def boosted(self) -> bool:
        return self.policy != "none"


def _stat(core) -> int:
    return int(core.host_memory_stat_current_value("Allocated", 0))


def thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def boost_threads(tids, cpu: int | None = None) -> str:
    """Keep the collector threads `tids` ahead of the thread running the ops: ``SCHED_FIFO``
    on CPU `cpu` (the op thread's) where allowed, else nice -15 where allowed. Returns the
    weakest policy any thread got: "realtime", "nice" or "none"."""
    if not tids:
        return "none"
    policies = []
    for t in tids:
        try:
            if cpu is not None:
                os.sched_setaffinity(t, {cpu})
            os.sched_setscheduler(t, os.SCHED_FIFO, os.sched_param(COLLECTOR_RT_PRIORITY))
            policies.append("realtime")
            continue
        except (AttributeError, PermissionError, OSError):
            pass
        try:
            os.setpriority(os.PRIO_PROCESS, t, COLLECTOR_NICE)
            policies.append("nice")
        except (PermissionError, OSError):
            policies.append("none")
    return min(policies, key=POLICY_RANK.index)


POLICY_RANK = ("none", "nice", "realtime")


def pin_this_thread() -> int | None:
    """Pin the calling thread to one of its CPUs (the last); that CPU, or None."""
    try:
        cpu = sorted(os.sched_getaffinity(0))[-1]
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


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
        policy=min((r[2] for r in runs), key=POLICY_RANK.index),
        lag_bytes=max(r[3] for r in runs),
    )


def _one_trial(paddle, core, main, startup, feeds, seed) -> tuple[int, int, str, int]:
    """(second-run peak, first-run drained net, collector policy, collector lag) on a fresh
    executor.

    Runs in a thread of its own, so that pinning it and lowering its priority leave the
    caller's as they were."""
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


def _trial_body(paddle, core, main, startup, feeds, seed) -> tuple[int, int, str, int]:
    cpu = pin_this_thread()
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
    # The collector thread now exists: put it ahead of this thread, which runs the ops
    # (serial run), on this thread's CPU.
    policy = boost_threads(thread_ids() - before_threads - {threading.get_native_id()}, cpu)
    if policy != "realtime":
        # without real-time scheduling, give the collector the CPU by lowering this thread
        # (always allowed); with it, lowering would only slow the step on a loaded machine
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), RUNNER_NICE)
        except OSError:
            pass
    before = _stat(core)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    exe.run(main, feed=feeds, fetch_list=[], scope=scope)
    peak = int(core.host_memory_stat_peak_value("Allocated", 0)) - before
    returned = _stat(core)
    time.sleep(DRAIN_S)
    lag = returned - _stat(core)
    exe.close()
    return peak, net, policy, lag


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
