"""Paddle legacy static programs -> pipemem IR (`pipemem.ir.Program`).

What is mapped, and why:

* **Shapes.** A static program declares its inputs with dynamic dims (-1: batch, sequence).
  `resolve_shapes` binds the data vars to concrete shapes and re-runs Paddle's own shape
  inference op by op (`OpDesc.infer_shape`), so every var gets its real shape. A dim still
  unknown afterwards is a `UserError` naming the var (Paddle's estimator counts it as 1).
* **Dtypes** with their real sizes (`pipemem.ir.dtype_bytes`: bool is 1 byte, uint8 1,
  bf16 2 ...).
* **Persistables** (parameters, optimizer moments, beta powers, the learning rate) are
  persistent tensors: static bytes that no sub-program allocates or frees.
* **Fed inputs** (data vars): the executor's feed op shares the caller's tensor, and the
  feed list keeps it alive for the whole step, so they are persistent too (allocated
  before the step, never freed inside it).
* **In-place ops**: an output named like one of the op's inputs (adam's ParamOut = Param,
  ``x = x + y`` rewrites) is the same var, hence the same storage. With the legacy
  executor (FLAGS_new_executor_use_inplace off, the default) no other op shares a buffer:
  reshape2 / transpose2 / unsqueeze2 copy their input on the CPU (measured exactly without
  any alias for them; docs/ACCURACY.md).
* **no_need_buffer**: per op, Paddle's `core.infer_no_need_buffer_slots` names the input
  slots whose data the kernel never reads (e.g. X of reduce_mean_grad, X and Y of
  elementwise_add_grad). Vars seen only in such slots are `Op.no_need_buffer`: they do not
  keep their storage alive, which is what Paddle's garbage collector does too.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from ..errors import UserError
from ..ir import Op, Program, Tensor, TensorKind, dtype_bytes

# Ops that never touch tensor memory the executor accounts for.
_SKIP_OPS = frozenset({"feed", "fetch", "fetch_v2", "py_func"})
# data-dependent result sizes (masked_select's Y) -> the input slot that bounds them
_DATA_DEPENDENT = {"masked_select": "X"}
_STREAM_SYNC_OPS = frozenset({"c_sync_calc_stream", "c_sync_comm_stream"})


def resolve_shapes(
    main_program,
    batch: int | None = None,
    seq: int | None = None,
    feed_shapes: Mapping[str, Iterable[int]] | None = None,
):
    """A clone of `main_program` whose every var has a concrete shape.

    Data vars get `feed_shapes[name]` when given; otherwise their dynamic dims are bound
    positionally: the first -1 to `batch`, the second to `seq`. Paddle's shape inference
    then runs over the global block in op order (a conditional block's ops in its place:
    a declared shape can be stale, e.g. the partitioner leaves the global-norm clip's
    `stack` of gradient norms at the whole model's count on every pipeline stage)."""
    prog = main_program.clone()
    block = prog.global_block()
    feed_shapes = dict(feed_shapes or {})
    for var in block.vars.values():
        if not _is_data(var):
            continue
        if var.name in feed_shapes:
            shape = [int(d) for d in feed_shapes.pop(var.name)]
        else:
            shape, bound = [], iter((batch, seq))
            for d in var.shape:
                if d == -1:
                    d = next(bound, None)
                    if d is None:
                        raise UserError(
                            f"data var {var.name!r} has shape {list(var.shape)} with more dynamic "
                            "dims than batch and seq bind; give its shape in feed_shapes"
                        )
                shape.append(int(d))
        var.desc.set_shape(shape)
    if feed_shapes:
        raise UserError(f"feed_shapes names {sorted(feed_shapes)}, which are not data vars of the program")
    for i, (op_block, op) in enumerate(_flat_ops(block, "program")):
        if (
            op.type in _SKIP_OPS
            or op.type == "conditional_block"
            or _is_communication(op.type)
            or set(op.output_arg_names) <= set(op.input_arg_names)
        ):
            # an op writing only its inputs (in place) leaves every shape as it is; a
            # collective's output keeps the shape the partitioner declared (its inference
            # needs the process group: 3.3.1's all_gather fails without one)
            continue
        declared = {
            n: list(op_block._var_recursive(n).shape) for n in op.output_arg_names if _has_shape(op_block, n)
        }
        try:
            op.desc.infer_shape(op_block.desc)
        except (ValueError, RuntimeError) as e:  # Paddle's enforce errors: the bound shapes do not fit
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"shape inference failed at op #{i} ({op.type}) with the bound input shapes "
                f"{ {v.name: list(v.shape) for v in block.vars.values() if _is_data(v)} }: {first}"
            ) from None
        if op.type in _DATA_DEPENDENT:
            # as many elements as the input at most: the bound (every label valid, as in pretraining)
            x = op_block._var_recursive(op.input(_DATA_DEPENDENT[op.type])[0])
            for n in op.output("Y"):
                var = op_block._var_recursive(n)
                if any(d < 0 for d in var.shape) and all(d >= 0 for d in x.shape):
                    var.desc.set_shape([math.prod(x.shape)])
        for n, shape in declared.items():
            # inference that cannot see a value (range over computed bounds) answers -1 where the
            # program, traced with concrete inputs, declared the size: keep the declared one
            var = op_block._var_recursive(n)
            if any(d < 0 for d in var.shape) and all(d >= 0 for d in shape):
                var.desc.set_shape(shape)
    prog._sync_with_cpp()
    return prog


def resolve_job_shapes(sub_programs: Mapping[str, object]) -> dict:
    """`resolve_shapes` over the job programs of one step, in run order: a var a later job
    shares by name with an earlier one (a kept activation, its gradient's shape source)
    takes the earlier job's resolved shape first."""
    known: dict[str, list[int]] = {}
    out = {}
    for t, prog in sub_programs.items():
        prog = prog.clone()
        for i in range(prog.num_blocks):
            for var in prog.block(i).vars.values():
                if (
                    var.name in known
                    and _has_shape(prog.block(i), var.name)
                    and any(d < 0 for d in var.shape)
                ):
                    var.desc.set_shape(known[var.name])
        prog._sync_with_cpp()
        out[t] = resolve_shapes(prog)
        for i in range(out[t].num_blocks):
            for var in out[t].block(i).vars.values():
                if _has_shape(out[t].block(i), var.name) and all(d >= 0 for d in var.shape):
                    known.setdefault(var.name, list(var.shape))
    return out


# Communication ops (2.6 and 3.x spellings): their outputs keep the shapes the partitioner declared.
COMMUNICATION_OPS = frozenset(
    {
        "send_v2",
        "recv_v2",
        "p_send",
        "p_recv",
        "partial_send",
        "partial_recv",
        "partial_allgather",
        "c_allreduce_sum",
        "c_allreduce_max",
        "c_allreduce_min",
        "c_allreduce_prod",
        "all_reduce",
        "c_allgather",
        "all_gather",
        "c_reducescatter",
        "reduce_scatter",
        "c_broadcast",
        "broadcast",
        "c_identity",
        "c_concat",
        "c_split",
        "c_sync_calc_stream",
        "c_sync_comm_stream",
        "barrier",
    }
)


def _is_communication(op_type: str) -> bool:
    return op_type in COMMUNICATION_OPS


def _has_shape(block, name: str) -> bool:
    var = block._find_var_recursive(name)
    from paddle.base import core

    return var is not None and var.type == core.VarDesc.VarType.DENSE_TENSOR


def _is_data(var) -> bool:
    return bool(getattr(var, "is_data", False)) or bool(var.desc.need_check_feed())


def _is_dense(var) -> bool:
    """True for dense tensors; False for vars that hold no tensor data (feed/fetch lists,
    scopes, readers, raw); a UserError for tensor kinds whose size is not their shape."""
    from paddle.base import core

    vt = core.VarDesc.VarType
    if var.type == vt.DENSE_TENSOR:
        return True
    if var.type in (vt.SELECTED_ROWS, vt.DENSE_TENSOR_ARRAY, vt.SPARSE_COO):
        raise UserError(
            f"Paddle var {var.name!r} is a {var.type.name} (sparse rows or a tensor array): "
            "its size is not known from the program; pipemem captures dense tensors only"
        )
    return False


def concrete_shape_dtype(shape, dtype, what: str, fix: str) -> tuple[tuple[int, ...], str]:
    """A Paddle var's or PIR value's shape (ints) and the name of its dtype (a Paddle dtype, one
    pipemem knows); an unresolved (-1) dimension is one error line: `what` has it, `fix` says
    what to do."""
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise UserError(f"{what} has unresolved shape {list(shape)}: {fix}")
    name = str(dtype).rsplit(".", 1)[-1]
    dtype_bytes(name)
    return shape, name


def tensor_for_var(var) -> Tensor:
    """The pipemem tensor of one Paddle var (shape must be concrete)."""
    from paddle.base.framework import Parameter

    shape, dtype = concrete_shape_dtype(
        var.shape,
        var.dtype,
        f"Paddle var {var.name!r}",
        "bind the dynamic dims (batch=..., seq=... or feed_shapes) before capturing",
    )
    if var.persistable:
        kind = TensorKind.PARAM if isinstance(var, Parameter) else TensorKind.OPTIMIZER_STATE
        return Tensor(var.name, shape, dtype, kind)
    if _is_data(var):
        return Tensor(var.name, shape, dtype, TensorKind.ACTIVATION, persistent=True)
    kind = TensorKind.GRAD if "@GRAD" in var.name else TensorKind.ACTIVATION
    return Tensor(var.name, shape, dtype, kind)


def no_need_buffer_names(op) -> tuple[str, ...]:
    """Input vars of `op` whose data it never reads (only in Paddle's no_need_buffer slots)."""
    from paddle.base import core

    inputs = {s: op.input(s) for s in op.input_names}
    outputs = {s: op.output(s) for s in op.output_names}
    attrs = {a: op.attr(a) for a in op.attr_names}
    slots = core.infer_no_need_buffer_slots(op.type, inputs, outputs, attrs)
    if not slots:
        return ()
    needed = {n for s, names in inputs.items() if s not in slots for n in names}
    needed |= {n for names in outputs.values() for n in names}
    return tuple(dict.fromkeys(n for s in slots for n in inputs.get(s, ()) if n not in needed))


def to_ir(sub_programs: Mapping[str, object], name_prefix: str = "") -> list[Program]:
    """pipemem programs for `{type: paddle Program}` (in run order), sharing one tensor table.

    The global block runs. A ``conditional_block`` runs its sub-block in place of itself (the
    branch taken: gradient merge's optimizer step, `_flat_ops`); any other op with a
    sub-block (``while``...) is a UserError. A ``share_buffer`` op (inserted by the
    executor's ``buffer_shared_inplace_pass``) puts each ``Out`` on the storage of its ``X``:
    the in-place op after it writes into the buffer of its input."""
    table: dict[str, Tensor] = {}
    programs = []

    def tensor(block, n):
        if n not in table:
            table[n] = tensor_for_var(block._var_recursive(n))
        return table[n]

    for ptype, pprog in sub_programs.items():
        prog = Program(name=f"{name_prefix}{ptype}", type=ptype)
        for block, op in _flat_ops(pprog.global_block(), ptype):
            if op.type == "feed":
                # the feed list holds what it feeds for the whole step, whether or not the
                # var is still marked as data (a program split from another one is not)
                for n in _dense_names(block, op.output_arg_names):
                    tensor(block, n).persistent = True
            if op.type in _SKIP_OPS:
                continue
            ins = _dense_names(block, op.input_arg_names)
            outs = _dense_names(block, op.output_arg_names)
            if op.type == "conditional_block":  # its sub-block ran just before (_flat_ops)
                ins, outs = tuple(dict.fromkeys((*ins, *outs))), ()
            for n in (*ins, *outs):
                prog.tensors[n] = tensor(block, n)
            if op.type == "share_buffer":
                for x, out in zip(op.input("X"), op.output("Out")):
                    if x in prog.tensors and out in prog.tensors and out != x:
                        base, t = table[x], table[out]
                        t.storage = base.storage
                        if base.persistent:
                            t.persistent, t.kind = True, base.kind
            if op.type in _STREAM_SYNC_OPS:
                # waits on a stream and reads no data: Paddle's pipeline passes do not count it
                # as a use when they choose what a job keeps for later jobs
                # (pass_utils.set_skip_gc_vars), so it keeps nothing alive
                prog.ops.append(Op(type=op.type, inputs=ins, no_need_buffer=ins, phase=ptype))
                continue
            nnb = tuple(n for n in no_need_buffer_names(op) if n in ins)
            prog.ops.append(Op(type=op.type, inputs=ins, outputs=outs, no_need_buffer=nnb, phase=ptype))
        programs.append(prog)
    for p in programs:
        p.validate()
    return programs


def _flat_ops(block, ptype: str):
    """(block, op) in run order, a ``conditional_block``'s sub-block before the op itself.

    The vars a conditional block reads or writes that its parent declares (its Input and Out
    slots) live in the parent's scope: the sub-block's garbage collector does not free
    them, the parent's frees them after the conditional_block op (measured: the global-norm
    clip's per-gradient norms and their stack stay until the block ends). So the op itself
    follows its sub-block, touching those vars (`to_ir` makes it a read of them)."""
    for op in block.ops:
        if op.type == "conditional_block":
            yield from _flat_ops(op._block_attr("sub_block"), ptype)
            yield block, op
            continue
        if any(a in ("sub_block", "sub_blocks") for a in op.attr_names):
            raise UserError(
                f"{ptype} op {op.type!r} runs a sub-block (control flow); pipemem captures "
                "straight-line programs and conditional blocks only"
            )
        yield block, op


def _dense_names(block, names: Iterable[str]) -> tuple[str, ...]:
    out = []
    for n in dict.fromkeys(names):
        if not n or n == "@EMPTY@":
            continue
        var = block._find_var_recursive(n)
        if var is not None and _is_dense(var):
            out.append(n)
    return tuple(out)
