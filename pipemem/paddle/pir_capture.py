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
* **no_need_buffer** operands (`op.is_no_need_buffer(value)`) do not keep a value alive:
  the PIR interpreter's garbage collector skips them too.
* **Vectors.** ``builtin.combine`` / ``builtin.split`` only pack and unpack values: an op
  reading a combined vector reads its parts; an op producing a vector writes the parts
  that ``builtin.split`` / ``builtin.slice`` take out of it.

Sub-programs: `op_types` (forward / backward / optimizer). A whole step: `whole_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from ..ir import Op, Program, Tensor, TensorKind, dtype_bytes

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


def _fake(v) -> bool:
    from paddle.base.libpaddle import pir

    return v is None or pir.is_fake_value(v)


def _is_vector(v) -> bool:
    try:
        return not _fake(v) and v.type().as_vec_type() is not None
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
                not _fake(v) and v.id in bwd_values for v in ops[i].operands_source()):
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
                        args.append(paddle.static.data(f"pipemem_probe_{i}", [1 if d < 0 else d for d in v.shape],
                                                       v.dtype))
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


def executor_inplace(ops, vid) -> dict[int, dict[int, int]]:  # vid: value -> hashable id
    """{op index: {result slot: operand slot}} of the ops the executor's in-place pass
    turns into their ``_`` variant, by its rule, on the declared shapes:

    the operand's last use (by any op, no_need_buffer reads included) is this op; it is
    not a fed / persistable value nor the operand of an op that is already in place; the
    result is not persistable; dtypes match and element counts match (a -1 only as the
    leading dim of a 2-D-or-more shape; reshape / squeeze / unsqueeze skip the count)."""
    last_use: dict = {}
    skip: set = set()
    for i, op in enumerate(ops):
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
            if name not in _IGNORE_SHAPE_CHECK and not _numel_equal(list(src.shape), list(res.shape),
                                                                     name in _RELAX_SHAPE_CHECK):
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
    fed_bytes: int                      # fed inputs: in the scope before the step, kept after
    inplace_ops: list[str] = field(default_factory=list)   # "index:name" the executor runs in place


def capture(program, sizes_program=None, types: list[str] | None = None, name_prefix: str = "") -> Captured:
    """pipemem programs (forward / backward / optimizer, in run order, sharing one tensor
    table) for a PIR training program.

    sizes_program: the same program built with concrete input shapes (same ops in the
    same order); sizes are read from it. Without it, every dim must already be concrete."""
    ops = list(program.global_block().ops)
    size_ops = list(sizes_program.global_block().ops) if sizes_program is not None else ops
    if len(size_ops) != len(ops) or any(a.name() != b.name() for a, b in zip(ops, size_ops)):
        raise UserError("sizes_program does not have the same ops as the program: build both from the same "
                        "code, one with concrete input shapes")
    types = list(types or op_types(program))

    ids: dict[str, str] = {}          # value id -> tensor name
    table: dict[str, Tensor] = {}
    fed = 0

    def vid(v) -> str:
        return v.id

    for i, op in enumerate(ops):
        for j, r in enumerate(op.results()):
            if _fake(r):
                continue
            if _persistable(r) and r.has_name:
                ids[vid(r)] = r.name
            else:
                ids[vid(r)] = f"v{i}.{j}"

    # Parts of vectors: builtin.split results (all parts) and builtin.slice results (one
    # part, by its "index" attribute) are the values the vector's producer writes.
    parts: dict[str, dict[int, object]] = {}
    for op in ops:
        if op.name() == "builtin.split":
            parts.setdefault(vid(op.operand_source(0)), {}).update(
                {k: r for k, r in enumerate(op.results()) if not _fake(r)})
        elif op.name() == "builtin.slice":
            parts.setdefault(vid(op.operand_source(0)), {})[int(op.attrs()["index"])] = op.result(0)
    inplace = executor_inplace(ops, vid)
    inplace_labels = [f"{i}:{ops[i].name()}" for i in sorted(inplace)]

    def tensor(op_index: int, slot: int, v, kind_hint: TensorKind | None = None) -> str:
        name = ids[vid(v)]
        if name in table:
            return name
        sv = size_ops[op_index].result(slot)
        shape = [int(d) for d in sv.shape]
        if any(d < 0 for d in shape):
            raise UserError(f"PIR value {name} (result {slot} of op #{op_index} {ops[op_index].name()}) has "
                            f"unresolved shape {shape}: give a sizes_program built with concrete input shapes")
        dtype = str(v.dtype).rsplit(".", 1)[-1]
        dtype_bytes(dtype)
        if kind_hint is not None:
            table[name] = Tensor(name, tuple(shape), dtype, kind_hint)
        else:
            kind = TensorKind.GRAD if _is_grad_op(ops[op_index].name()) or types[op_index] == "backward" \
                else TensorKind.ACTIVATION
            table[name] = Tensor(name, tuple(shape), dtype, kind)
        return name

    # Where each value is defined (op index, result slot), to size values on first read.
    defined: dict[str, tuple[int, int]] = {}
    for i, op in enumerate(ops):
        for j, r in enumerate(op.results()):
            if not _fake(r):
                defined[vid(r)] = (i, j)

    def read_names(v) -> list[str]:
        if _fake(v):
            return []
        if vid(v) in vectors_combined:
            return [n for part in vectors_combined[vid(v)] for n in read_names(part)]
        if _is_vector(v):
            return [n for r in _parts(v) for n in read_names(r)]
        if not _is_dense(v):
            return []
        i, j = defined[vid(v)]
        return [tensor(i, j, v)]

    def _parts(v) -> list:
        return [r for _, r in sorted(parts.get(vid(v), {}).items())]

    vectors_combined: dict[str, list] = {}
    for op in ops:
        if op.name() == "builtin.combine":
            vectors_combined[vid(op.result(0))] = list(op.operands_source())

    progs = {t: Program(name=f"{name_prefix}{t}", type=t) for t in SUB_PROGRAM_TYPES}
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
            else:
                n = tensor(i, 0, r, TensorKind.ACTIVATION)
                table[n].persistent = True
                fed += table[n].nbytes
            continue
        if name in _SINK_OPS or name in _PACK_OPS:
            continue
        if op.num_regions():
            raise UserError(f"PIR op #{i} {name} has sub-blocks (control flow); pipemem captures straight-line "
                            "programs only")
        ins, nnb = [], []
        for v in op.operands_source():
            names = read_names(v)
            ins.extend(names)
            if names and not _is_vector(v) and vid(v) not in vectors_combined and op.is_no_need_buffer(v):
                nnb.extend(names)
        alias = dict(get_inplace_info(op)) if name.endswith("_") else {}
        alias.update(inplace.get(i, {}))
        if name in VIEW_OPS and not _scope_value(op.operand_source(0)):
            alias[0] = 0
        outs = []
        for j, r in enumerate(op.results()):
            if _fake(r):
                continue
            if _is_vector(r):
                outs.extend(read_names(r))      # its parts, sized where they are unpacked
                continue
            if not _is_dense(r):
                continue
            n = tensor(i, j, r)
            if j in alias:
                src = op.operand_source(alias[j])
                src_names = read_names(src)
                if src_names:
                    base = table[src_names[0]]
                    t = table[n]
                    t.storage = base.storage
                    if base.persistent:
                        t.persistent = True
                        t.kind = base.kind
            outs.append(n)
        ins = list(dict.fromkeys(ins))
        nnb = [n for n in dict.fromkeys(nnb) if n in ins and ins.count(n) == 1 and
               not any(n in read_names(v) and not op.is_no_need_buffer(v)
                       for v in op.operands_source() if not _fake(v) and _is_dense(v))]
        prog = progs[types[i]]
        for n in (*ins, *outs):
            prog.tensors[n] = table[n]
        prog.ops.append(Op(type=name, inputs=tuple(ins), outputs=tuple(dict.fromkeys(outs)),
                           no_need_buffer=tuple(nnb), phase=types[i], name=f"{types[i]}#{i}:{name}"))
    programs = [progs[t] for t in SUB_PROGRAM_TYPES]
    for p in programs:
        p.validate()
    return Captured(programs=programs, fed_bytes=fed, inplace_ops=inplace_labels)


def _scope_value(v) -> bool:
    """A value the scope holds (fed input, parameter, persistable): views of these copy."""
    if _persistable(v):
        return True
    d = v.get_defining_op()
    return d is not None and d.name() in _DEFINE_OPS


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
