"""A small model of eager autograd that writes IR programs.

Generators describe the forward as *nodes* (one autograd function each): the ops it runs, the
tensors it saves for the input-gradient pass (I) and for the weight-gradient pass (W), and
any extra ops its backward runs (a re-gather, a reduce-scatter). From the node list the tape
emits the forward program, the fused backward (B = I then W per node, in reverse order) and
the split backward (all I ops, then all W ops). Saved tensors are simply read by the
backward ops; the liveness engine then finds that they outlive the forward, and frees them
after their last backward reader, exactly as autograd drops saved tensors.

Recompute regions (activation checkpointing): the nodes of a region run in forward without
their saves mattering; at the region's first backward node, the region's forward ops are
emitted again on renamed tensors (``name@rc``) and the region's backward reads those. The
region's inputs (produced outside it) are read under their own names, so the forward keeps
them, as a checkpoint keeps its inputs.

Gradients are ``d.<name>``; a tensor used by several nodes gets its later contributions
added into the first (autograd's input buffer), through a temporary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Op, Program, Tensor, TensorKind

ACT = TensorKind.ACTIVATION
COMM = TensorKind.COMM
PARAM = TensorKind.PARAM
GRAD = TensorKind.GRAD
TEMP = TensorKind.TEMP


@dataclass(slots=True)
class BwdOp:
    """One backward op; names may be forward tensors, ``d.<name>`` grads, or new temporaries
    declared in `temps` (name -> (shape, dtype, kind))."""

    type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    workspace: int = 0


@dataclass(slots=True)
class Node:
    type: str
    inputs: tuple[str, ...]          # forward reads (activations and params)
    outputs: tuple[str, ...]         # forward writes
    diff_inputs: tuple[str, ...]     # activations that receive a gradient
    params: tuple[str, ...] = ()     # parameters whose grads the W pass computes
    save_i: tuple[str, ...] = ()     # read by the input-grad op
    save_w: tuple[str, ...] = ()     # read by the weight-grad op
    pre_i: tuple[BwdOp, ...] = ()    # backward ops before the input-grad op (e.g. a re-gather)
    post_i: tuple[BwdOp, ...] = ()   # ops after it (e.g. reduce-scatter of the input grad)
    pre_w: tuple[BwdOp, ...] = ()
    grad_via: dict = field(default_factory=dict)   # diff input -> name the I op writes instead
    workspace_f: int = 0
    workspace_i: int = 0
    region: int = -1
    module: str = ""
    fwd_ops: tuple[Op, ...] = ()     # explicit forward ops (else one op over inputs/outputs)
    grad_alias: bool = False         # input grads are the output grad itself (add, views)
    w_pre_first: bool = False        # fused B runs pre_w before the I op (Megatron's re-gather)


class Tape:
    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.tensors: dict[str, Tensor] = {}
        self.temps: dict[str, tuple] = {}
        self.nodes: list[Node] = []
        self.region = -1
        self._next_region = 0
        self.module = ""

    # Declaring ---------------------------------------------------------------------------
    def t(self, name: str, shape, dtype: str, kind: TensorKind = ACT, storage: str = "") -> str:
        self.tensors[name] = Tensor(name, tuple(shape), dtype, kind, storage=storage)
        return name

    def param(self, name: str, shape, dtype: str) -> str:
        self.tensors[name] = Tensor(name, tuple(shape), dtype, PARAM)
        return name

    def temp(self, name: str, shape, dtype: str, kind: TensorKind = TEMP) -> str:
        self.temps[name] = (tuple(shape), dtype, kind)
        return name

    def begin_region(self) -> None:
        self.region = self._next_region
        self._next_region += 1

    def end_region(self) -> None:
        self.region = -1

    def node(self, type: str, inputs, outputs, diff_inputs=(), params=(), save_i=(), save_w=(), pre_i=(),
             post_i=(), pre_w=(), grad_via=None, workspace_f=0, workspace_i=0, fwd_ops=(), grad_alias=False,
             w_pre_first=False) -> Node:
        n = Node(type, tuple(inputs), tuple(outputs), tuple(diff_inputs), tuple(params), tuple(save_i),
                 tuple(save_w), tuple(pre_i), tuple(post_i), tuple(pre_w), dict(grad_via or {}), workspace_f,
                 workspace_i, self.region, self.module, tuple(fwd_ops), grad_alias, w_pre_first)
        self.nodes.append(n)
        return n

    # Emitting ----------------------------------------------------------------------------
    def forward(self, name: str = "F") -> Program:
        prog = Program(name=name, type="forward")
        for n in self.nodes:
            for op in self._fwd_ops(n, {}):
                self._add(prog, op)
        return prog

    def backward(self, out_grads: tuple[str, ...], name: str = "B", split: bool = False) -> list[Program]:
        """Fused backward [B] or split backward [I, W]. `out_grads` are the forward tensors whose
        gradients arrive from outside (the next layer / stage)."""
        has_grad = set(out_grads)
        # Which forward tensors receive a gradient: walk the nodes backward.
        for n in reversed(self.nodes):
            if any(o in has_grad for o in n.outputs):
                has_grad.update(n.diff_inputs)
        i_prog = Program(name=("I" if split else name), type="backward_b" if split else "backward")
        w_ops: list[Op] = []
        for t in out_grads:
            self._grad_tensor(i_prog, t)
        written: set[str] = {"d." + t for t in out_grads}
        regions_done: set[int] = set()
        self._acc = 0
        for n in reversed(self.nodes):
            gouts = tuple("d." + o for o in n.outputs if ("d." + o) in written)
            if not gouts:
                continue
            ren: dict[str, str] = {}
            if n.region >= 0:
                ren = self._region_renames(n.region)
                if n.region not in regions_done:
                    regions_done.add(n.region)
                    for rn in self.nodes:
                        if rn.region == n.region:
                            for op in self._fwd_ops(rn, ren):
                                op.phase = "recompute"
                                self._add(i_prog, op)
            r = lambda x, ren=ren: ren.get(x, x)  # noqa: E731
            w_block: list[Op] = []
            if n.params:
                w_block = [self._bop(b, r, n) for b in n.pre_w]
                gparams = tuple(self._param_grad(i_prog, p) for p in n.params)
                w_block.append(Op(n.type + "_wgrad", gouts + tuple(r(s) for s in n.save_w) + gparams, gparams,
                                  module=n.module, phase="backward_w"))
            early = []
            if not split and n.w_pre_first and n.pre_w:
                early, w_block = w_block[:len(n.pre_w)], w_block[len(n.pre_w):]
            for op in early:
                self._add(i_prog, op)
            for bop in n.pre_i:
                self._add(i_prog, self._bop(bop, r, n))
            # Input grads: each diff input gets d.<x> (or the node's grad_via name, finished by
            # post_i ops); a second contribution goes to a temporary that is then accumulated.
            outs, accs = [], []
            for x in n.diff_inputs:
                if x not in has_grad:
                    continue
                target = n.grad_via.get(x, "d." + x)
                out = self._grad_target(i_prog, target, written, accs, alias_of=gouts[0] if n.grad_alias else "")
                outs.append(out)
            if outs:
                ins = gouts + tuple(r(s) for s in n.save_i)
                self._add(i_prog, Op(n.type + "_grad", ins, tuple(outs), workspace_bytes=n.workspace_i,
                                     module=n.module, phase="backward"))
            for bop in n.post_i:
                op = self._bop(bop, r, n)
                op.outputs = tuple(self._grad_target(i_prog, o, written, accs) if o.startswith("d.") else o
                                   for o in op.outputs)
                self._add(i_prog, op)
            for target, tmp in accs:
                self._add(i_prog, Op("grad_accumulate", (target, tmp), (target,), module=n.module, phase="backward"))
            if split:
                w_ops.extend(w_block)
            else:
                for op in w_block:
                    self._add(i_prog, op)
        if not split:
            return [i_prog]
        w_prog = Program(name="W", type="backward_w")
        for op in w_ops:
            self._add(w_prog, op)
        return [i_prog, w_prog]

    def _grad_target(self, prog: Program, target: str, written: set[str], accs: list, alias_of: str = "") -> str:
        """Name an op should write for gradient `target`: the target itself the first time,
        else a temporary accumulated into it afterwards."""
        if not target.startswith("d."):
            return target
        if target in written:
            self._acc += 1
            tmp = f"{target}~{self._acc}"
            base = self._lookup(target[2:])
            self.tensors[tmp] = Tensor(tmp, base.shape, base.dtype, ACT,
                                       storage=(self._lookup(alias_of).storage if alias_of else ""))
            prog.tensors[tmp] = self.tensors[tmp]
            accs.append((target, tmp))
            return tmp
        written.add(target)
        if alias_of:
            base = self._lookup(target[2:])
            self.tensors[target] = Tensor(target, base.shape, base.dtype, ACT, storage=self._lookup(alias_of).storage)
        self._grad_tensor(prog, target[2:])
        return target

    # Helpers -----------------------------------------------------------------------------
    def _region_renames(self, region: int) -> dict[str, str]:
        ren = {}
        for n in self.nodes:
            if n.region == region:
                for o in n.outputs:
                    ren[o] = o + "@rc"
                for op in n.fwd_ops:
                    for o in op.outputs:
                        ren[o] = o + "@rc"
        return ren

    def _fwd_ops(self, n: Node, ren: dict[str, str]) -> list[Op]:
        r = lambda x: ren.get(x, x)  # noqa: E731
        if n.fwd_ops:
            return [Op(o.type, tuple(map(r, o.inputs)), tuple(map(r, o.outputs)), workspace_bytes=o.workspace_bytes,
                       module=n.module, phase="forward") for o in n.fwd_ops]
        return [Op(n.type, tuple(map(r, n.inputs)), tuple(map(r, n.outputs)), workspace_bytes=n.workspace_f,
                   module=n.module, phase="forward")]

    def _bop(self, b: BwdOp, r, n: Node) -> Op:
        return Op(b.type, tuple(map(r, b.inputs)), tuple(map(r, b.outputs)), workspace_bytes=b.workspace,
                  module=n.module, phase="backward")

    def _add(self, prog: Program, op: Op) -> None:
        for nm in (*op.inputs, *op.outputs):
            if nm not in prog.tensors:
                t = prog.tensors[nm] = self._lookup(nm)
                # A view's storage is sized by its base: declare the base too, so every
                # program sizes the shared storage the same way.
                if t.storage != nm and t.storage not in prog.tensors and t.storage in self.tensors:
                    prog.tensors[t.storage] = self.tensors[t.storage]
        prog.ops.append(op)
        prog._compiled = None

    def _lookup(self, nm: str) -> Tensor:
        t = self.tensors.get(nm)
        if t is not None:
            return t
        if nm.endswith("@rc"):
            base = self.tensors[nm[:-3]]
            st = base.storage + "@rc"
            t = Tensor(nm, base.shape, base.dtype, base.kind, storage=st)
            self.tensors[nm] = t
            return t
        return self._make_temp(nm)

    def _make_temp(self, nm: str) -> Tensor:
        if nm in self.temps:
            shape, dtype, kind = self.temps[nm]
            t = Tensor(nm, shape, dtype, kind)
        elif nm.startswith("d."):
            base = self._lookup(nm[2:])
            t = Tensor(nm, base.shape, base.dtype, GRAD if base.kind is PARAM else ACT, persistent=base.kind is PARAM)
        elif nm.endswith("@rc") or "@rc" in nm:
            base = self._lookup(nm.replace("@rc", ""))
            t = Tensor(nm, base.shape, base.dtype, base.kind, storage=nm)
        else:
            raise KeyError(f"template tensor {nm!r} was never declared")
        self.tensors[nm] = t
        return t

    def _grad_tensor(self, prog: Program, fwd_name: str) -> str:
        nm = "d." + fwd_name
        if nm not in prog.tensors:
            prog.tensors[nm] = self._lookup(nm)
        return nm

    def _declare_like(self, prog: Program, nm: str, fwd_name: str) -> None:
        base = self._lookup(fwd_name)
        t = Tensor(nm, base.shape, base.dtype, ACT)
        self.tensors[nm] = t
        prog.tensors[nm] = t

    def _param_grad(self, prog: Program, p: str) -> str:
        """The persistent gradient (main-grad) buffer of `p`: static bytes, alive on entry."""
        nm = "g." + p
        if nm not in self.tensors:
            base = self.tensors[p]
            self.tensors[nm] = Tensor(nm, base.shape, base.dtype, GRAD, persistent=True)
        prog.tensors[nm] = self.tensors[nm]
        return nm
