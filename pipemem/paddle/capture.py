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

from typing import Iterable, Mapping

from ..errors import UserError
from ..ir import Op, Program, Tensor, TensorKind, dtype_bytes

# Ops that never touch tensor memory the executor accounts for.
_SKIP_OPS = frozenset({"feed", "fetch", "fetch_v2", "py_func"})


def resolve_shapes(main_program, batch: int | None = None, seq: int | None = None,
                   feed_shapes: Mapping[str, Iterable[int]] | None = None):
    """A clone of `main_program` whose every var has a concrete shape.

    Data vars get `feed_shapes[name]` when given; otherwise their dynamic dims are bound
    positionally: the first -1 to `batch`, the second to `seq`. Paddle's shape inference
    then runs over the global block in op order."""
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
                        raise UserError(f"data var {var.name!r} has shape {list(var.shape)} with more dynamic "
                                        "dims than batch and seq bind; give its shape in feed_shapes")
                shape.append(int(d))
        var.desc.set_shape(shape)
    if feed_shapes:
        raise UserError(f"feed_shapes names {sorted(feed_shapes)}, which are not data vars of the program")
    for i, op in enumerate(block.ops):
        if op.type in _SKIP_OPS:
            continue
        try:
            op.desc.infer_shape(block.desc)
        except (ValueError, RuntimeError) as e:  # Paddle's enforce errors: the bound shapes do not fit
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"shape inference failed at op #{i} ({op.type}) with the bound input shapes "
                            f"{ {v.name: list(v.shape) for v in block.vars.values() if _is_data(v)} }: {first}") from None
    prog._sync_with_cpp()
    return prog


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
        raise UserError(f"Paddle var {var.name!r} is a {var.type.name} (sparse rows or a tensor array): "
                        "its size is not known from the program; pipemem captures dense tensors only")
    return False


def tensor_for_var(var) -> Tensor:
    """The pipemem tensor of one Paddle var (shape must be concrete)."""
    from paddle.base.framework import Parameter

    shape = tuple(int(d) for d in var.shape)
    if any(d < 0 for d in shape):
        raise UserError(f"Paddle var {var.name!r} has unresolved shape {list(shape)}: bind the dynamic dims "
                        "(batch=..., seq=... or feed_shapes) before capturing")
    dtype = str(var.dtype).rsplit(".", 1)[-1]
    dtype_bytes(dtype)
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
    Only the global block runs; an op with a sub-block (control flow) is a UserError."""
    table: dict[str, Tensor] = {}
    programs = []
    for ptype, pprog in sub_programs.items():
        block = pprog.global_block()
        prog = Program(name=f"{name_prefix}{ptype}", type=ptype)
        for op in block.ops:
            if op.type in _SKIP_OPS:
                continue
            if any(a in ("sub_block", "sub_blocks") for a in op.attr_names):
                raise UserError(f"{ptype} op {op.type!r} runs a sub-block (control flow); pipemem captures "
                                "straight-line programs only")
            ins = _dense_names(block, op.input_arg_names)
            outs = _dense_names(block, op.output_arg_names)
            for n in (*ins, *outs):
                if n not in table:
                    table[n] = tensor_for_var(block._var_recursive(n))
                prog.tensors[n] = table[n]
            nnb = tuple(n for n in no_need_buffer_names(op) if n in ins)
            prog.ops.append(Op(type=op.type, inputs=ins, outputs=outs, no_need_buffer=nnb, phase=ptype))
        programs.append(prog)
    for p in programs:
        p.validate()
    return programs


def _dense_names(block, names: Iterable[str]) -> tuple[str, ...]:
    out = []
    for n in dict.fromkeys(names):
        if not n or n == "@EMPTY@":
            continue
        var = block._find_var_recursive(n)
        if var is not None and _is_dense(var):
            out.append(n)
    return tuple(out)
