"""Split a Paddle legacy `Program` into sub-programs by op role.

Paddle tags every op of a static training program with an ``op_role`` bit set
(`core.op_proto_and_checker_maker.OpRole`): Forward = 0, Backward = 1, Optimize = 2,
RPC = 4, Dist = 8, LRSched = 16, Loss = 256. Loss is combined with Forward (the loss op,
256) or Backward (the loss-gradient seed, 257). Paddle's pipeline passes classify the same
way (`auto_parallel.static.utils.is_forward_op / is_backward_op / is_optimize_op`):
an op is *optimizer* if Optimize or LRSched is set, else *backward* if Backward is set,
else *forward*.

Each sub-program is a clone of the main program with the other ops removed, so every
sub-program keeps the main program's variable table (names, shapes, dtypes,
persistable flags): vars flow between sub-programs by name, through one scope.
"""

from __future__ import annotations

from ..errors import UserError

FORWARD, BACKWARD, OPTIMIZE, RPC, DIST, LR_SCHED, LOSS = 0, 1, 2, 4, 8, 16, 256

# The order the sub-programs run in for one training step.
SUB_PROGRAM_TYPES = ("forward", "backward", "optimizer")


def role_type(op_role: int) -> str:
    """Sub-program type of an op with this ``op_role`` bit set."""
    role = int(op_role)
    if role & (OPTIMIZE | LR_SCHED):
        return "optimizer"
    if role & BACKWARD:
        return "backward"
    return "forward"


def op_role(op) -> int:
    """The op's ``op_role`` attribute (ops without one, e.g. feed, count as Forward)."""
    return int(op.attr("op_role")) if op.has_attr("op_role") else FORWARD


def split_program(main_program, types: tuple[str, ...] = SUB_PROGRAM_TYPES) -> dict:
    """{type: paddle Program} for each of `types`, keeping the ops of that type in order.

    Only the global block is split (control-flow sub-blocks stay with their parent op)."""
    unknown = [t for t in types if t not in SUB_PROGRAM_TYPES]
    if unknown:
        raise UserError(
            f"split_program: unknown sub-program type(s) {unknown}; use {', '.join(SUB_PROGRAM_TYPES)}"
        )
    roles = [role_type(op_role(op)) for op in main_program.global_block().ops]
    out = {}
    for t in types:
        prog = main_program.clone()
        block = prog.global_block()
        for i in range(len(block.ops) - 1, -1, -1):
            if roles[i] != t:
                block._remove_op(i, sync=False)
        prog._sync_with_cpp()
        out[t] = prog
    return out


# Ops whose input-gradient and weight-gradient halves can run apart: (input-grad output
# slot, weight-grad output slot). Their kernels take either output as optional, which is
# how Paddle's zero-bubble passes split matmul_grad too (PIR only in Paddle 3.3).
_SPLITTABLE = {"matmul_v2_grad": ("X@GRAD", "Y@GRAD"), "mul_grad": ("X@GRAD", "Y@GRAD")}

ZB_SUB_PROGRAM_TYPES = ("forward", "backward_b", "backward_w", "optimizer")


def _is_param_grad(block, name: str) -> bool:
    from paddle.base.framework import Parameter

    if not name.endswith("@GRAD"):
        return False
    var = block._find_var_recursive(name[: -len("@GRAD")])
    return isinstance(var, Parameter)


def split_backward_bw(sub_programs: dict) -> dict:
    """forward / backward_b / backward_w / optimizer from a forward / backward / optimizer
    split, the zero-bubble way: backward_w holds the ops that only produce parameter
    gradients, plus the weight-gradient half of each matmul_v2_grad / mul_grad whose Y
    gradient is a parameter's; backward_b holds everything else (with those matmuls
    computing only their input gradient). backward_w runs after the whole backward_b, so
    whatever it reads (the matmul inputs and output gradients) stays alive in between."""
    missing = [t for t in SUB_PROGRAM_TYPES if t not in sub_programs]
    if missing:
        raise UserError(f"split_backward_bw needs the {', '.join(missing)} sub-program(s)")
    backward = sub_programs["backward"]
    block = backward.global_block()
    kinds = []
    for op in block.ops:
        outs = [n for n in op.output_arg_names if n]
        slots = _SPLITTABLE.get(op.type)
        if (
            slots
            and op.output(slots[1])
            and all(_is_param_grad(block, n) for n in op.output(slots[1]))
            and op.output(slots[0])
        ):
            kinds.append("split")
        elif outs and all(_is_param_grad(block, n) for n in outs):
            kinds.append("W")
        else:
            kinds.append("B")
    progs = {}
    for ptype, drop, empty_slot in (("backward_b", "W", 1), ("backward_w", "B", 0)):
        prog = backward.clone()
        pblock = prog.global_block()
        for i in range(len(kinds) - 1, -1, -1):
            if kinds[i] == drop:
                pblock._remove_op(i, sync=False)
            elif kinds[i] == "split":
                pblock.ops[i].desc.set_output(_SPLITTABLE[pblock.ops[i].type][empty_slot], [])
        prog._sync_with_cpp()
        progs[ptype] = prog
    return {"forward": sub_programs["forward"], **progs, "optimizer": sub_programs["optimizer"]}
