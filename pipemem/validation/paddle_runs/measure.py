"""Measure each sub-program of a Paddle training step on the CPU, with Paddle's executor.

How (each choice was checked on paddlepaddle 3.3.1 CPU; docs/ACCURACY.md):

* The sub-programs run as the jobs of one `core.Plan` on one `core.StandaloneExecutor`,
  exactly as Paddle's pipeline passes run forward / backward / optimizer jobs: jobs of
  one micro-batch share one scope, and each job's `skip_gc_vars` (what a later job reads)
  survive it. Separate executors would each get their own micro-batch scope and could not
  see each other's vars.
* A marker op (`py_func`, reading one 4-byte persistable var so it frees nothing) opens
  every job and a last job holding only a marker closes the step. It reads
  `core.host_memory_stat_current_value("Allocated", 0)` and the peak since the previous
  marker, then resets the peak (`core.host_memory_stat_reset_peak_value`). Net change of
  job k = current at marker k+1 - current at marker k; peak = peak seen by marker k+1 -
  current at marker k. "Allocated" counts the bytes requested from the allocator, exactly
  (no rounding seen for the auto_growth CPU allocator).
* Each measured step uses a *fresh* executor, so each job runs its build pass: the
  interpreter runs the ops one by one in program order and garbage-collects each var
  right after the op of its last use, synchronously. Later runs of the same executor
  free garbage on a worker thread (the CPU event garbage collector), so their numbers
  jitter by whatever the collector has not freed yet (seen: +16 KiB peaks, a whole
  optimizer's frees landing in the next step).
* Legacy IR (`FLAGS_enable_pir_api=0`) must be set before paddle is imported: this module
  is used from `pipemem.validation.paddle_runs.worker`, which sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

MARK_VAR = "pipemem_mark"
JOB_PREFIX = "pipemem_"


@dataclass
class Measured:
    type: str
    net_bytes: int
    peak_bytes: int


def required_vars(sub_program) -> set[str]:
    """Non-persistable vars whose data the global block's ops touch (no_need_buffer-only
    reads excluded): Paddle's `pass_utils._get_required_vars_of_program`, restricted to
    the block the executor runs. Paddle's own walks *every* block, and programs built by
    the static `RecomputeOptimizer` keep two scratch blocks holding copies of the
    backward and recomputed ops that nothing runs; with Paddle's rule the forward job
    would keep every activation alive for them (3.6 MB instead of 83 KB on gpt2)."""
    from ...paddle.capture import no_need_buffer_names

    block = sub_program.global_block()
    out: set[str] = set()
    for op in block.ops:
        if op.type in ("c_sync_comm_stream", "conditional_block", "data", "nop", "while"):
            continue
        skip = set(no_need_buffer_names(op))
        for n in op.input_arg_names + op.output_arg_names:
            var = block._find_var_recursive(n)
            if var is not None and not var.persistable and n not in skip:
                out.add(n)
    return out


def skip_gc_sets(sub_programs: dict) -> dict[str, set[str]]:
    """Per type, the non-persistable vars it touches that a later type reads (what
    Paddle's pipeline passes give each job as `skip_gc_vars`)."""
    types = list(sub_programs)
    later: set[str] = set()
    out: dict[str, set[str]] = {}
    for t in reversed(types):
        req = required_vars(sub_programs[t])
        out[t] = req & later
        later |= req
    return out


def allocated_now() -> int:
    from paddle.base import core

    return int(core.host_memory_stat_current_value("Allocated", 0))


def insert_marker(block, index: int, mark_var, callable_id: int) -> None:
    """A py_func op calling `callable_id`; it reads the persistable marker var only so
    that it is a valid op (py_func needs an input or an output), which frees nothing."""
    block._insert_op(
        index,
        type="py_func",
        inputs={"X": [mark_var]},
        outputs={"Out": []},
        attrs={
            "forward_callable_id": callable_id,
            "backward_callable_id": -1,
            "backward_skip_vars": [],
            "op_role": 0,
        },
    )


def marker_factory(marks: list):
    """`marker(name)` -> the id of a py_func that appends (name, allocated now, peak since the
    previous mark) to `marks` and resets the peak: one mark per program start or op."""
    from paddle.base import core
    from paddle.static.nn.common import PyFuncRegistry

    def marker(name: str) -> int:
        def record(*_):
            marks.append((name, allocated_now(), int(core.host_memory_stat_peak_value("Allocated", 0))))
            core.host_memory_stat_reset_peak_value("Allocated", 0)

        return PyFuncRegistry(record).id

    return marker


def measure_step(
    startup_program, sub_programs: dict, feeds: dict, steps: int = 1, seed: int = 0, per_op: bool = False
) -> list[Measured]:
    """Net change and peak of each sub-program (in dict order) over one training step.

    `feeds` maps data var names to numpy arrays. The startup program runs once; `steps`
    steps run, each on a fresh executor; the last one is reported (a second step gave
    the same bytes on every line of `pipemem validate paddle`, so one is the default).
    per_op: also a marker before every op, giving one `Measured` per op ("type/index:op_type")
    - to find which op a residual comes from."""
    import numpy as np
    import paddle
    from paddle.base import core
    from paddle.base.executor import _add_feed_fetch_ops

    place = paddle.CPUPlace()
    scope = core.Scope()
    paddle.seed(seed)
    paddle.static.Executor(place).run(startup_program, scope=scope)

    marks: list[tuple[str, int, int]] = []
    marker = marker_factory(marks)

    types = list(sub_programs)
    skip = skip_gc_sets(sub_programs)
    feed_names = list(feeds)
    progs = {}
    for i, t in enumerate(types):
        p = sub_programs[t]
        if i == 0:
            p = _add_feed_fetch_ops(p, {n: None for n in feed_names}, [], "feed", "fetch", use_fetch_v2=True)
        else:
            p = p.clone()
        progs[t] = p
    progs["end"] = sub_programs[types[-1]].clone()
    end_block = progs["end"].global_block()
    for i in range(len(end_block.ops) - 1, -1, -1):
        end_block._remove_op(i, sync=False)
    for t, p in progs.items():
        block = p.global_block()
        mark_var = block.create_var(name=MARK_VAR, shape=[1], dtype="float32", persistable=True)
        positions = []
        if per_op and t != "end":
            # Index among the sub-program's own ops (the feed ops are ours), as in `to_ir`.
            own = [i for i, op in enumerate(block.ops) if op.type != "feed"]
            positions = [(i, f"{t}/{k}:{block.ops[i].type}") for k, i in enumerate(own)]
        for i, label in reversed(positions):
            insert_marker(block, i, mark_var, marker(label))
        insert_marker(block, 0, mark_var, marker(t))
        p._sync_with_cpp()
    scope.var(MARK_VAR).get_tensor().set(np.zeros(1, "float32"), place)

    jobs = []
    for t in progs:
        job = core.Job(JOB_PREFIX + t)  # not "backward": Paddle insists a "backward" job is statically built
        job.set_skip_gc_vars(skip.get(t, set()))
        jobs.append(job)
    plan = core.Plan(jobs, {JOB_PREFIX + t: p.desc for t, p in progs.items()})

    result: list[Measured] = []
    for _ in range(steps):
        # The feed list owns the inputs for the whole step (the feed op shares them).
        for i, n in enumerate(feed_names):
            t = core.DenseTensor()
            t.set(np.ascontiguousarray(feeds[n]), place)
            core.set_feed_variable(scope, t, "feed", i)
        marks.clear()
        core.StandaloneExecutor(place, plan, scope).run([], False)
        result = [Measured(name, c1 - c0, p1 - c0) for (name, c0, _), (_, c1, p1) in zip(marks, marks[1:])]
    return result
