"""Paddle PIR programs (Paddle 3's default IR) -> pipemem IR.

A PIR `paddle.static.Program` (built with ``FLAGS_enable_pir_api=1``, the default) is an
SSA program: ops produce unnamed `pir.Value`s. What is mapped, and why (each point was
checked on paddlepaddle 3.3.1, CPU):

* **Names.** A value is named by its defining op's position and result index,
  ``v<op>.<result>`` (stable for a given program); parameters and the other persistables
  (optimizer moments, beta powers, the learning rate) keep their Paddle names.
* **Shapes.** Dynamic dims (-1) of a PIR program cannot be re-inferred from Python in
  Paddle 3.3 (the symbolic shape analysis returns `DimExpr`s that have no Python
  binding). So sizes come from a second build of the same program with concrete input
  shapes (`sizes_program`), matched op by op; a value whose size is still unknown is a
  `UserError` naming the op and value. The declared (dynamic) shapes are kept for the
  in-place rule below, which the executor applies to them.
* **Persistables** are persistent static tensors (parameter or optimizer state); **fed
  inputs** (`pd_op.data` without ``persistable``) are persistent activations: the
  executor copies each feed into the scope before the step and keeps it after.
* **In-place.** (a) Ops whose name ends with ``_`` (``adam_``, ``relu_``...): Paddle's
  `get_op_inplace_info(op)` maps result slots to operand slots; the result shares the
  operand's storage. (b) The executor's `inplace_pass` (``FLAGS_pir_apply_inplace_pass``,
  on by default) turns an op into its ``_`` variant when the operand dies there; pipemem
  applies the same rule (`executor_inplace`, on the declared shapes, as the executor
  does) and aliases those results too.
* **Views.** On the CPU a PIR reshape / squeeze / unsqueeze returns a view of its input
  (same buffer, even while the input lives on), except of a fed input or a persistable,
  which it copies; flatten and transpose copy (`VIEW_OPS`; measured by the data pointers
  in the scope after a step with garbage collection off).
* **Data-dependent sizes** (``masked_select`` of the loss over the valid labels): the
  upper bound, every element selected (`DATA_DEPENDENT`).
* **no_need_buffer** operands (`op.is_no_need_buffer(value)`) do not keep a value alive:
  the PIR interpreter's garbage collector skips them too, a vector's parts included
  (concat_grad reads only the shapes of the concatenated parts: rope's slices die after
  the forward concat, not at the concat_grad). Across pipeline jobs, Paddle's skip_gc rule
  (`pass_utils._set_skip_gc_vars_in_pir`, `core.get_no_need_buffer_values`) lists only
  single values read as no_need_buffer, so a job still keeps what a later job reads only
  as part of such a vector, and the later job, never reading its data, never frees it
  (`Op.retain_reads`).
* **Vectors.** ``builtin.combine`` / ``builtin.split`` only pack and unpack values: an op
  reading a combined vector reads its parts; an op producing a vector writes the parts
  that ``builtin.split`` / ``builtin.slice`` take out of it.

Sub-programs: `op_types` (forward / backward / optimizer). A whole step: `whole_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from ..ir import Op, Program, Tensor, TensorKind
from .capture import concrete_shape_dtype

SUB_PROGRAM_TYPES = ("forward", "backward", "optimizer")

# Ops that only define values the step does not allocate (parameters, persistables and
# fed inputs live in the scope) or hand values to the caller.
_DEFINE_OPS = frozenset({"builtin.parameter", "pd_op.data", "pd_op.feed"})
_SINK_OPS = frozenset({"pd_op.fetch", "builtin.shadow_output", "builtin.set_parameter"})
_PACK_OPS = frozenset({"builtin.combine", "builtin.split", "builtin.slice"})

# The executor's in-place pass (paddle/fluid/pir/transforms/general/inplace_pass.cc), as
# paddle 3.3.1 behaves (measured): these skip the element-count check; these compare
# element counts loosely (add_grad does not, and does go in place on the CPU in 3.3.1,
# unlike newer sources say); transpose never goes in place.
_IGNORE_SHAPE_CHECK = frozenset({"pd_op.reshape", "pd_op.squeeze", "pd_op.unsqueeze"})
_RELAX_SHAPE_CHECK = frozenset({"pd_op.reshape_grad"})
_NEVER_INPLACE = frozenset({"pd_op.transpose"})

# Kernels that return a view of their input on the CPU (the output shares the input's
# buffer even when the input lives on), unless the input is a fed value or a persistable
# (then they copy); flatten and transpose always copy (measured: docs/ACCURACY.md).
VIEW_OPS = frozenset({"pd_op.reshape", "pd_op.squeeze", "pd_op.unsqueeze"})


# Ops whose output size depends on the data: sized as if every element were selected (the
# upper bound, and what a pretraining batch with no ignored label gives), from this operand.
DATA_DEPENDENT = {"pd_op.masked_select": 0, "pd_op.nonzero": 0}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise UserError(
                f"cannot bound a data-dependent size: its input has unresolved shape {list(shape)}"
            )
        n *= d
    return n


def _fake(v) -> bool:
    from paddle.base.libpaddle import pir

    return v is None or pir.is_fake_value(v)


def _is_vector(v) -> bool:
    """A vector of values (builtin.combine's result, split_with_num's...). `as_vec_type()`
    answers None for some producers' vectors in 3.3.1 (split_with_num), so the printed type
    decides too."""
    if _fake(v):
        return False
    try:
        if v.type().as_vec_type() is not None:
            return True
    except (AttributeError, ValueError, RuntimeError, TypeError):
        pass
    try:
        return str(v.type()).startswith("vec[")
    except (AttributeError, ValueError, RuntimeError, TypeError):
        return False


def _is_dense(v) -> bool:
    return not _fake(v) and v.is_dense_tensor_type()


def _persistable(v) -> bool:
    try:
        return bool(v.persistable)
    except (AttributeError, RuntimeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------
# Split


def op_types(program) -> list[str]:
    """Sub-program type of every op of the global block.

    By ``op_role`` where the program sets it (auto-parallel programs: 0 forward, 1
    backward, 2 optimizer, as in `pipemem.paddle.split.role_type`). A plain PIR program
    has op_role -1 everywhere; then by structure, the way `paddle.static.append_backward`
    and `Optimizer.minimize` append ops:

    * backward starts at the loss-gradient seed: the run of ``pd_op.full`` /
      ``pd_op.full_like`` ops right before the first gradient op (``*_grad``/``*_grad_``);
    * the backward ends at its last gradient op, or at a later ``pd_op.add_n`` (gradient
      accumulation) fed by one;
    * everything after is the optimizer (constants, clipping, the ``*_`` update ops).

    A program without gradient ops is all forward."""
    from .split import role_type

    ops = list(program.global_block().ops)
    roles = [int(op.op_role) for op in ops]
    if any(r >= 0 for r in roles):
        return [role_type(r) if r >= 0 else "forward" for r in roles]
    grad = [i for i, op in enumerate(ops) if _is_grad_op(op.name())]
    if not grad:
        return ["forward"] * len(ops)
    start = grad[0]
    while start > 0 and ops[start - 1].name() in ("pd_op.full", "pd_op.full_like"):
        start -= 1
    end = grad[-1]
    bwd_values = {r.id for i in range(start, end + 1) for r in ops[i].results() if not _fake(r)}
    for i in range(end + 1, len(ops)):
        if ops[i].name() in ("pd_op.add_n", "builtin.combine") and any(
            not _fake(v) and v.id in bwd_values for v in ops[i].operands_source()
        ):
            end = i
            bwd_values.update(r.id for r in ops[i].results() if not _fake(r))
    return ["forward" if i < start else "backward" if i <= end else "optimizer" for i in range(len(ops))]


def _is_grad_op(name: str) -> bool:
    return name.endswith("_grad") or name.endswith("_grad_")


# ---------------------------------------------------------------------------------------
# In-place

_VARIANT_CACHE: dict[str, dict[int, int] | None] = {}


def inplace_variant_map(op) -> dict[int, int] | None:
    """{result slot: operand slot} of the ``_`` variant of `op` (``pd_op.relu`` ->
    ``pd_op.relu_``), or None if Paddle registers no such variant for these operands.

    Paddle 3.3 exposes the in-place map only on an op, so the variant is built once per
    op name in a scratch program with operands of the same dtypes."""
    name = op.name()
    if name in _VARIANT_CACHE:
        return _VARIANT_CACHE[name]
    import paddle
    from paddle.base.libpaddle import pir

    result = None
    short = name.split(".", 1)[-1]
    builder = getattr(pir.ops, short + "_", None) if name.startswith("pd_op.") else None
    if builder is not None:
        scratch = paddle.static.Program()
        try:
            with paddle.static.program_guard(scratch):
                args = []
                for i, v in enumerate(op.operands_source()):
                    if _fake(v):
                        args.append(None)
                    else:
                        args.append(
                            paddle.static.data(
                                f"pipemem_probe_{i}", [1 if d < 0 else d for d in v.shape], v.dtype
                            )
                        )
                attrs = op.attrs()
                args += [attrs[a] for a in op.get_attr_names()]
                builder(*args)
            built = [o for o in scratch.global_block().ops if o.name() == name + "_"]
            if built and built[-1].num_operands() == op.num_operands():
                result = {int(k): int(v) for k, v in pir.get_op_inplace_info(built[-1]).items()}
        except (TypeError, ValueError, RuntimeError, KeyError):
            # The variant's signature differs from the op's (full_ takes its output as an
            # operand, for one): the pass's slot checks refuse such ops too.
            result = None
    _VARIANT_CACHE[name] = result
    return result


def _numel_equal(a, b, relax: bool) -> bool:
    def numel(shape):
        n = 1
        for d in shape:
            n *= d
        return n

    if not relax:
        for s in (a, b):
            for i, d in enumerate(s):
                if d == -1 and (len(s) == 1 or i != 0):
                    return False
    return numel(a) == numel(b)


def executor_inplace(ops, vid, skip_values=()) -> dict[int, dict[int, int]]:  # vid: value -> hashable id
    """{op index: {result slot: operand slot}} of the ops the executor's in-place pass
    turns into their ``_`` variant, by its rule, on the declared shapes:

    the operand's last use (by any op, no_need_buffer reads included) is this op; it is
    not a fed / persistable value nor the operand of an op that is already in place; the
    result is not persistable; dtypes match and element counts match (a -1 only as the
    leading dim of a 2-D-or-more shape; reshape / squeeze / unsqueeze skip the count)."""
    last_use: dict = {}
    skip: set = set(skip_values)
    for op in ops:
        if op.name() in ("pd_op.data", "pd_op.feed"):
            skip.update(vid(r) for r in op.results() if not _fake(r))
        if op.name() in _SINK_OPS:
            skip.update(vid(v) for v in op.operands_source()[:1] if not _fake(v))
    for i, op in enumerate(ops):
        for r in op.results():
            if _is_dense(r) and not _persistable(r) and vid(r) not in skip:
                last_use[vid(r)] = i
        for v in op.operands_source():
            if _is_dense(v) and not _persistable(v) and vid(v) not in skip:
                last_use[vid(v)] = i

    dies_at: dict[int, set] = {}
    for k, last in last_use.items():
        dies_at.setdefault(last, set()).add(k)
    out: dict[int, dict[int, int]] = {}
    reused_in: set = set()
    reused_out: set = set()
    for i, op in enumerate(ops):
        name = op.name()
        if not name.startswith("pd_op.") or name in ("pd_op.data", "pd_op.feed") or name in _SINK_OPS:
            continue
        if name.endswith("_"):
            reused_in.update(vid(v) for v in op.operands_source() if not _fake(v))
            reused_out.update(vid(r) for r in op.results() if not _fake(r))
            continue
        if name in _NEVER_INPLACE:
            continue
        dying = dies_at.get(i, set())
        if not dying:
            continue
        variant = inplace_variant_map(op)
        if not variant:
            continue
        ok = True
        for out_slot, in_slot in variant.items():
            if in_slot >= op.num_operands() or out_slot >= op.num_results():
                ok = False
                break
            src, res = op.operand_source(in_slot), op.result(out_slot)
            if not (_is_dense(src) and _is_dense(res)) or src.dtype != res.dtype or _persistable(res):
                ok = False
                break
            if vid(src) not in dying or vid(src) in reused_in or vid(res) in reused_out:
                ok = False
                break
            if name not in _IGNORE_SHAPE_CHECK and not _numel_equal(
                list(src.shape), list(res.shape), name in _RELAX_SHAPE_CHECK
            ):
                ok = False
                break
        if ok:
            out[i] = dict(variant)
            for out_slot, in_slot in variant.items():
                reused_in.add(vid(op.operand_source(in_slot)))
                reused_out.add(vid(op.result(out_slot)))
    return out


# ---------------------------------------------------------------------------------------
# Capture


@dataclass
class Captured:
    programs: list[Program]
    fed_bytes: int  # fed inputs: in the scope before the step, kept after
    inplace_ops: list[str] = field(default_factory=list)  # "index:name" the executor runs in place


class _BlockCapture:
    """Maps the ops of PIR blocks to pipemem programs over one shared tensor table.

    `name_of(value, op_index, slot)` names a value a block defines; values named alike in
    several blocks (a pipeline job's ``builtin.shadow_output`` and a later job's keyword
    argument of the same name) are one tensor, as they are one scope variable."""

    def __init__(self):
        self.table: dict[str, Tensor] = {}
        self.fed = 0

    def block(
        self,
        ops,
        types: list[str],
        progs: dict[str, Program],
        name_of,
        size_ops=None,
        kwargs: dict | None = None,
        kind_of_kwarg=None,
        label_prefix: str = "",
    ) -> list[str]:
        """Append the ops of one block to `progs[types[i]]`; returns the in-place labels."""
        table = self.table
        size_ops = size_ops if size_ops is not None else ops
        vid = _vid
        ids: dict[str, str] = {}
        defined: dict[str, tuple[int, int]] = {}
        for i, op in enumerate(ops):
            for j, r in enumerate(op.results()):
                if not _fake(r):
                    ids[vid(r)] = name_of(r, i, j)
                    defined[vid(r)] = (i, j)
        kw_ids: dict[str, tuple[str, object]] = {vid(v): (k, v) for k, v in (kwargs or {}).items()}
        kw_names = set(kwargs or {})
        parts: dict[str, dict[int, object]] = {}
        vectors_combined: dict[str, list] = {}
        for op in ops:
            if op.name() == "builtin.split":
                parts.setdefault(vid(op.operand_source(0)), {}).update(
                    {k: r for k, r in enumerate(op.results()) if not _fake(r)}
                )
            elif op.name() == "builtin.slice":
                parts.setdefault(vid(op.operand_source(0)), {})[int(op.attrs()["index"])] = op.result(0)
            elif op.name() == "builtin.combine":
                vectors_combined[vid(op.result(0))] = list(op.operands_source())
        inplace = executor_inplace(ops, vid, skip_values=set(kw_ids))

        def new_tensor(name: str, shape, v, kind: TensorKind, where: str) -> str:
            shape, dtype = concrete_shape_dtype(
                shape,
                v.dtype,
                f"PIR value {name} ({where})",
                "give a sizes_program built with concrete input shapes",
            )
            table[name] = Tensor(name, shape, dtype, kind)
            return name

        def tensor(op_index: int, slot: int, v, kind_hint: TensorKind | None = None) -> str:
            name = ids[vid(v)]
            if name in table:
                return name
            kind = kind_hint
            if kind is None:
                kind = (
                    TensorKind.GRAD
                    if _is_grad_op(ops[op_index].name()) or types[op_index] == "backward"
                    else TensorKind.ACTIVATION
                )
            shape = list(size_ops[op_index].result(slot).shape)
            if any(d < 0 for d in shape):
                shape = resolved_shape(ops[op_index], shape) or shape
            return new_tensor(name, shape, v, kind, f"result {slot} of op #{op_index} {ops[op_index].name()}")

        unpacked: dict[str, list[str]] = {}

        def vector_parts(op_index: int, r) -> list[str]:
            """Parts of a vector result no builtin.split unpacks (the auto-parallel loss
            hands split_with_num's vector straight to concat): one tensor per element of its
            printed type, ``vec[tensor<4x2048x16000xf32>, ...]``, as the kernel writes each."""
            sized = (
                size_ops[op_index].result(list(ops[op_index].results()).index(r))
                if size_ops is not ops
                else r
            )
            out = []
            for k, (dims, dt) in enumerate(_vector_elements(str(sized.type()))):
                n = f"{ids[vid(r)]}#{k}"
                kind = (
                    TensorKind.GRAD
                    if types[op_index] == "backward" or _is_grad_op(ops[op_index].name())
                    else TensorKind.ACTIVATION
                )
                if any(d < 0 for d in dims):
                    raise UserError(
                        f"PIR value {n} (part {k} of op #{op_index} {ops[op_index].name()}) has "
                        f"unresolved shape {dims}"
                    )
                table[n] = Tensor(n, tuple(dims), dt, kind)
                out.append(n)
            return out

        def resolved_shape(op, declared):
            """A result whose declared shape has -1 dims: a data-dependent op's bound, else the
            resolved size of an operand declared with the same shape (x and x@GRAD, ...)."""
            if op.name() in DATA_DEPENDENT:
                return [_numel(op.operand_source(DATA_DEPENDENT[op.name()]).shape)]
            for v in op.operands_source():
                if _is_dense(v) and list(v.shape) == declared:
                    names = read_names(v)
                    if names:
                        return list(table[names[0]].shape)
            return None

        def read_names(v) -> list[str]:
            if _fake(v):
                return []
            if vid(v) in vectors_combined:
                return [n for part in vectors_combined[vid(v)] for n in read_names(part)]
            if vid(v) in unpacked:
                return list(unpacked[vid(v)])
            if _is_vector(v):
                return [n for _, r in sorted(parts.get(vid(v), {}).items()) for n in read_names(r)]
            if not _is_dense(v):
                return []
            if vid(v) in kw_ids:
                name, _ = kw_ids[vid(v)]
                if name not in table:
                    new_tensor(name, v.shape, v, kind_of_kwarg(name, v), f"keyword argument {name}")
                    if _persistable(v):
                        table[name].persistent = True
                return [name]
            i, j = defined[vid(v)]
            return [tensor(i, j, v)]

        for i, op in enumerate(ops):
            name = op.name()
            if name in _DEFINE_OPS:
                r = op.result(0)
                if not _is_dense(r):
                    continue
                if name == "builtin.parameter":
                    tensor(i, 0, r, TensorKind.PARAM)
                elif _persistable(r):
                    tensor(i, 0, r, TensorKind.OPTIMIZER_STATE)
                elif ids[vid(r)] not in table:
                    n = tensor(i, 0, r, TensorKind.ACTIVATION)
                    table[n].persistent = True
                    self.fed += table[n].nbytes
                continue
            if name in _SINK_OPS or name in _PACK_OPS:
                continue
            if op.num_regions():
                raise UserError(
                    f"PIR op #{i} {name} has sub-blocks (control flow); pipemem captures "
                    "straight-line programs only"
                )
            ins, nnb, retain = [], [], []
            for v in op.operands_source():
                names = read_names(v)
                ins.extend(names)
                if names and op.is_no_need_buffer(v):
                    nnb.extend(names)
                    if _is_vector(v) or vid(v) in vectors_combined:
                        # A vector read as no_need_buffer (concat_grad's x) keeps none of its
                        # parts alive here, but the pipeline's skip_gc rule still has the
                        # earlier job keep the parts it hands over (kwargs) for this job.
                        retain.extend(n for n in names if n in kw_names)
            alias = dict(get_inplace_info(op)) if name.endswith("_") else {}
            alias.update(inplace.get(i, {}))
            if name in VIEW_OPS and not _scope_value(op.operand_source(0), kw_ids):
                alias[0] = 0
            outs = []
            for j, r in enumerate(op.results()):
                if _fake(r):
                    continue
                if _is_vector(r):
                    if vid(r) not in parts and vid(r) not in unpacked:
                        unpacked[vid(r)] = vector_parts(i, r)
                    outs.extend(read_names(r))  # its parts, sized where they are unpacked
                    continue
                if not _is_dense(r):
                    continue
                n = tensor(i, j, r)
                if j in alias:
                    src_names = read_names(op.operand_source(alias[j]))
                    if src_names:
                        base = table[src_names[0]]
                        t = table[n]
                        t.storage = base.storage
                        if base.persistent:
                            t.persistent = True
                            t.kind = base.kind
                outs.append(n)
            ins = list(dict.fromkeys(ins))
            nnb = [
                n
                for n in dict.fromkeys(nnb)
                if n in ins
                and ins.count(n) == 1
                and not any(
                    n in read_names(v) and not op.is_no_need_buffer(v)
                    for v in op.operands_source()
                    if not _fake(v)
                )
            ]
            retain = [n for n in dict.fromkeys(retain) if n in nnb]
            prog = progs[types[i]]
            for n in (*ins, *outs):
                prog.tensors[n] = table[n]
            prog.ops.append(
                Op(
                    type=name,
                    inputs=tuple(ins),
                    outputs=tuple(dict.fromkeys(outs)),
                    no_need_buffer=tuple(nnb),
                    retain_reads=tuple(retain),
                    phase=types[i],
                    name=f"{label_prefix}{types[i]}#{i}:{name}",
                )
            )
        return [f"{i}:{ops[i].name()}" for i in sorted(inplace)]


def _vid(v) -> str:
    return v.id


_PIR_DTYPES = {
    "f32": "fp32",
    "f16": "fp16",
    "bf16": "bf16",
    "f64": "float64",
    "i64": "int64",
    "i32": "int32",
    "i8": "int8",
    "u8": "uint8",
    "b": "bool",
    "i1": "bool",
}


def _vector_elements(text: str) -> list[tuple[list[int], str]]:
    """(dims, dtype) of each element of a printed PIR vector type."""
    import re

    out = []
    for body in re.findall(r"tensor<([^>]*)>", text):
        tokens = body.split("x")
        dt = _PIR_DTYPES.get(tokens[-1].strip())
        if dt is None:
            raise UserError(f"PIR vector element type {body!r}: unknown dtype {tokens[-1]!r}")
        out.append(([int(d) for d in tokens[:-1] if d.strip()], dt))
    return out


def capture(program, sizes_program=None, types: list[str] | None = None, name_prefix: str = "") -> Captured:
    """pipemem programs (forward / backward / optimizer, in run order, sharing one tensor
    table) for a PIR training program.

    sizes_program: the same program built with concrete input shapes (same ops in the
    same order); sizes are read from it. Without it, every dim must already be concrete."""
    ops = list(program.global_block().ops)
    size_ops = list(sizes_program.global_block().ops) if sizes_program is not None else ops
    if len(size_ops) != len(ops) or any(a.name() != b.name() for a, b in zip(ops, size_ops)):
        raise UserError(
            "sizes_program does not have the same ops as the program: build both from the same "
            "code, one with concrete input shapes"
        )
    types = list(types or op_types(program))

    def name_of(r, i, j):
        return r.name if _persistable(r) and r.has_name else f"v{i}.{j}"

    cap = _BlockCapture()
    progs = {t: Program(name=f"{name_prefix}{t}", type=t) for t in SUB_PROGRAM_TYPES}
    labels = cap.block(ops, types, progs, name_of, size_ops=size_ops)
    programs = [progs[t] for t in SUB_PROGRAM_TYPES]
    for p in programs:
        p.validate()
    return Captured(programs=programs, fed_bytes=cap.fed, inplace_ops=labels)


def capture_jobs(type_to_program: dict, name_prefix: str = "") -> tuple[dict[str, Program], int]:
    """pipemem programs of a pipeline pass's job programs ({job type: PIR program}, e.g.
    recv_forward / forward / backward / send_backward / optimizer), over one tensor table.

    Job programs hand values to each other through the scope, by name: a value a job
    writes with ``builtin.shadow_output`` is read by a later job as a block keyword
    argument of that name (``shadow_var_between_sub_programs``). So a value takes its
    shadow-output name, a keyword argument its key, persistables their Paddle name, and
    every other value is local to its job (``<type>/v<op>.<result>``). Persistable keyword
    arguments (the gradient-merge buffers ``*@GRAD@MERGE``, parameters, optimizer states)
    are static tensors. Returns ({type: Program}, fed input bytes)."""
    cap = _BlockCapture()
    out: dict[str, Program] = {}
    for jtype, prog in type_to_program.items():
        ops = list(prog.global_block().ops)
        shadow = {}
        for op in ops:
            if op.name() == "builtin.shadow_output":
                shadow[_vid(op.operand_source(0))] = str(op.attrs()["output_name"])

        def name_of(r, i, j, jtype=jtype, shadow=shadow):
            if _persistable(r) and r.has_name:
                return r.name
            return shadow.get(_vid(r)) or f"{jtype}/v{i}.{j}"

        def kind_of_kwarg(name, v):
            if _persistable(v):
                if "@GRAD" in name:
                    return TensorKind.GRAD
                is_param = getattr(v, "is_parameter", False)
                is_param = is_param() if callable(is_param) else bool(is_param)
                return TensorKind.PARAM if is_param else TensorKind.OPTIMIZER_STATE
            return TensorKind.ACTIVATION

        p = Program(name=f"{name_prefix}{jtype}", type=jtype)
        cap.block(
            ops,
            [jtype] * len(ops),
            {jtype: p},
            name_of,
            kwargs=dict(prog.global_block().kwargs()),
            kind_of_kwarg=kind_of_kwarg,
        )
        for t in cap.table.values():  # a persistable GRAD kwarg is static; make sure it stays so
            if t.kind is TensorKind.GRAD and "@GRAD@MERGE" in t.name:
                t.persistent = True
        p.validate()
        out[jtype] = p
    return out, cap.fed


def _scope_value(v, kwargs=()) -> bool:
    """A value the scope holds by name (fed input, parameter, persistable, a job's keyword
    argument, a value a job hands on with ``builtin.shadow_output``): views of these copy."""
    if _persistable(v) or v.id in kwargs:
        return True
    d = v.get_defining_op()
    if d is not None and d.name() in _DEFINE_OPS:
        return True
    return any(u.name() == "builtin.shadow_output" for u in v.all_used_ops())


def get_inplace_info(op) -> dict[int, int]:
    from paddle.base.libpaddle import pir

    return {int(k): int(v) for k, v in pir.get_op_inplace_info(op).items()}


def whole_step(captured: Captured) -> tuple[int, int, str]:
    """(peak, net, peak op label) of one step over its sub-programs in order.

    peak: the highest of entry + peak over the sub-programs, above the step's start with
    the fed inputs in place (a steady-state step); net: what the step leaves allocated,
    counting the fed inputs as new (the first step: the executor copies them into the
    scope, which keeps them)."""
    from ..jobs import compose_at
    from ..liveness import analyze_sequence

    results = analyze_sequence(captured.programs)
    step, at = compose_at(results)
    return step.peak_bytes, captured.fed_bytes + step.net_bytes, results[at].peak_op_label if at >= 0 else ""


def allocated_total(captured: Captured) -> int:
    """Bytes the step allocates if nothing is ever freed (Paddle with garbage collection
    off, ``FLAGS_eager_delete_tensor_gb=-1``): the fed inputs plus every distinct
    non-persistent storage an op writes. It checks sizes and aliasing without liveness."""
    sizes: dict[str, int] = {}
    for p in captured.programs:
        for op in p.ops:
            for n in op.outputs:
                t = p.tensors[n]
                if not t.persistent:
                    sizes[t.storage] = max(sizes.get(t.storage, 0), t.nbytes)
    return captured.fed_bytes + sum(sizes.values())
