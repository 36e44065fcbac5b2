"""A small model of eager autograd that writes IR programs.

Generators describe the forward as *nodes* (one autograd function each): the ops it runs, the
tensors it saves for the input-gradient pass (I) and for the weight-gradient pass (W), and
any extra ops its backward runs (a re-gather, a reduce-scatter). From the node list the tape
emits the forward program, the fused backward (B = I then W per node, in reverse order) and
the split backward (all I ops, then all W ops). Saved tensors are simply read by the
backward ops; the liveness engine then finds that they outlive the forward. In the fused
backward a node's saved tensors are released when the node's whole backward returns (as
autograd does); in the split backward, I releases what only I reads and W the rest.

Recompute regions (activation checkpointing): the nodes of a region run in forward without
their saves mattering; at the region's first backward node, the region's forward ops are
emitted again on renamed tensors (``name@rc``) and the region's backward reads those. The
region's inputs (produced outside it) are read under their own names, so the forward keeps
them, as a checkpoint keeps its inputs.

Gradients are ``d.<name>``; a tensor used by several nodes gets its later contributions
added into the first (autograd's input buffer), through a temporary -- in place, unless a
deferred W op still reads that storage (split backward), then into a new tensor. Residual
adds and views pass their output grad on without a copy (`grad_alias`).

Weight grads: either accumulated by the GEMM into the persistent grad buffer (Megatron,
Paddle) or materialised as eager temporaries (`wgrad_chain`) that are accumulated, become
`.grad` on the first step, or are held for FSDP's reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Op, Program, Tensor, TensorKind, dtype_bytes

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
    inputs: tuple[str, ...]  # forward reads (activations and params)
    outputs: tuple[str, ...]  # forward writes
    diff_inputs: tuple[str, ...]  # activations that receive a gradient
    params: tuple[str, ...] = ()  # parameters whose grads the W pass computes
    save_i: tuple[str, ...] = ()  # read by the input-grad op
    save_w: tuple[str, ...] = ()  # read by the weight-grad op
    read_w: tuple[str, ...] = ()  # also read by the weight-grad op, made in backward by another
    # node (a re-gather shared by several linears): freed after
    # its last reader, not with this node's saved tensors; a
    # split backward gathers it in the input-grad pass as well
    pre_i: tuple[BwdOp, ...] = ()  # backward ops before the input-grad op (e.g. a re-gather)
    post_i: tuple[BwdOp, ...] = ()  # ops after it (e.g. reduce-scatter of the input grad)
    pre_w: tuple[BwdOp, ...] = ()
    grad_via: dict = field(default_factory=dict)  # diff input -> name the I op writes instead
    workspace_f: int = 0
    workspace_i: int = 0
    region: int = -1
    module: str = ""
    fwd_ops: tuple[Op, ...] = ()  # explicit forward ops (else one op over inputs/outputs)
    grad_alias: bool | tuple = False  # input grads are the output grad itself (add, views);
    # a tuple names the inputs that alias (the rest get a copy)
    w_pre_first: bool = False  # fused B runs pre_w before the I op (Megatron's re-gather)
    pinned: bool = False  # selective checkpointing keeps its outputs: not recomputed
    promote_grads: bool = False  # mixed-dtype op: an input's grad is computed in the output's
    # dtype, then cast to the input's (autograd's validate_outputs)
    wgrad_saved: str = ""  # the weight grad was computed in forward and saved under this
    # name (Liger's fused linear CE): the backward scales it in place
    wgrad_chain: tuple[str, ...] = ()  # this node's weight-grad dtypes, if not the tape's
    meta_i: tuple[str, ...] = ()  # read by the input-grad op for their shapes only (Paddle's
    # no_need_buffer): they keep nothing alive in the backward,
    # but the forward still keeps them for it and the backward
    # never frees them (Paddle's pipeline skip_gc rule: retain_reads)


class Tape:
    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.tensors: dict[str, Tensor] = {}
        self.temps: dict[str, tuple] = {}
        self.nodes: list[Node] = []
        self.region = -1
        self._next_region = 0
        self.module = ""
        # Weight gradients: () = the GEMM accumulates into the persistent grad (Megatron's
        # gradient_accumulation_fusion, Paddle's fused_linear_param_grad_add). Otherwise the
        # dtypes of the temporaries eager autograd materialises (dW, then autocast's fp32
        # cast), and `wgrad_final` is the op that moves the last one into the grad buffer:
        # "accumulate_grad" (grad += dW; steady state) or "steal_grad" (first step: the
        # temporary becomes .grad, so the last cast writes the grad buffer directly).
        self.wgrad_chain: tuple[str, ...] = ()
        self.wgrad_final = "accumulate_grad"
        # None: every parameter is trained; else only these (LoRA's adapters; the rest frozen)
        self.trainable: set[str] | None = None
        # ZeRO-3 / FSDP: the part's parameters are all-gathered into one buffer before its
        # forward and its backward and released after; eager weight grads are held unsharded
        # until one reduce-scatter at the end of the part's backward (FSDP2's per-module unit).
        self.fsdp = False
        # False: the forward's gathered parameters stay until the backward, which gathers none
        # (FSDP2 reshard_after_forward=False)
        self.fsdp_reshard = True
        # FSDP2's all-gather buffers (torchtitan): the output buffer lives with the unit; group size
        self.fsdp_ag_state = False
        self.fsdp_group = 1
        self.fsdp_reduce_dtype = "fp32"  # FSDP2's reduce-scatter dtype
        # parameters another part of the stage holds gathered while this one runs (ZeRO-3's tied
        # word embedding, kept from the embedding's forward to its backward): not gathered again
        self.fsdp_gathered_elsewhere: frozenset[str] = frozenset()
        # the forward's last unit, kept unsharded: no later copy-out in the forward frees its
        # all-gather buffer, which stays until the backward's first copy-out (the unit's end here)
        self.fsdp_state_to_backward = False
        # nodes [0, fsdp_unit_end) run inside the tape's FSDP unit (None: all of them); the
        # unit reshards after its forward, before the nodes outside it (the loss) run
        self.fsdp_unit_end: int | None = None
        # FSDP2's root unit (torchtune without custom_sharded_layers: the embedding, the final
        # norm and the output layer; `root_role` "first" for the embedding's part, "last" for the
        # head's). Its parts gather nothing of their own: the first gathers the whole unit
        # (`root_bytes`) when the forward starts and hands it on; the last reshards it when the
        # model's forward ends (`model_end`), gathers it again when its backward reaches the
        # parameters and hands that on with its unsharded grads, which the first part releases
        # after its own at the root's reduce-scatter, when the backward ends (torch 2.13's
        # FSDP2 with torchtune's explicit reshard_after_forward=True)
        self.root_role = ""
        self.root_bytes = 0
        self.root_grad_bytes = 0
        self.root_grad_elem_bytes = 2  # bytes per element of the head's unsharded grads
        self.root_bwd_prefetch_bytes = 0  # the next unit's all-gather buffer the head's backward prefetches
        self.model_end: int | None = None
        self.entry_f: tuple[str, ...] = ()  # made by an earlier part, freed here
        self.entry_b: tuple[str, ...] = ()
        self.handed_on_f: tuple[str, ...] = ()  # made here, freed by a later part
        self._handed_on_b: tuple[str, ...] = ()
        # (dtype, shard) when this backward creates the .grad tensors (set to None before it)
        # instead of writing resident grad buffers; None = resident (static bytes).
        self.grad_create: tuple[str, int] | None = None
        # Parameters whose .grad another part of the step has created already (a tied word
        # embedding: the head's backward creates it): accumulated into, even with grad_create.
        self.existing_grads: frozenset[str] = frozenset()
        # Selective (op-level) checkpointing: a callable node type -> keep its outputs, or None
        self.pin = None
        # Activation offloading: saved tensor -> its reloaded copy (pipemem.templates.offload);
        # the backward reads the copies, which it allocates when it starts
        self.offloaded: dict[str, str] = {}
        # torchtune's per-pack offloading (templates.offload.torchtune_packs): node index ->
        # {saved tensor: reloaded copy}; node index -> tensors the forward stash lets go after
        # it; (node index -> bytes of the previous layer's stash tail released there, bytes of
        # the previous layer's last reloads alive when this layer's backward starts)
        self.offload_packs: dict[int, dict[str, str]] = {}
        self.offload_release: dict[int, tuple[str, ...]] = {}
        self.offload_release_before: dict[int, tuple[str, ...]] = {}  # ... let go as it packs its inputs
        self.offload_carry: tuple[dict[int, int], int] = ({}, 0)
        # a linear saves its weight parameter itself (HF Conv1D), not a `weight.t()` view
        self.weights_saved_as_params = False
        # forward tensors the caller references until the part returns (the layer's input), and
        # until a block returns (node index -> a block's input: attention's, the MLP's)
        self.held_to_return: tuple[str, ...] = ()
        self.held_until: dict[int, list[str]] = {}
        # torchtune's optimizer_in_bwd: each weight grad is stepped and freed as soon as it exists
        self.step_in_backward = False
        # Reentrant checkpointing (Megatron): a recomputed region's outputs are held until the
        # region's backward has finished
        self.keep_recompute_outputs = False

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

    def node(
        self,
        type: str,
        inputs,
        outputs,
        diff_inputs=(),
        params=(),
        save_i=(),
        save_w=(),
        pre_i=(),
        post_i=(),
        pre_w=(),
        grad_via=None,
        workspace_f=0,
        workspace_i=0,
        fwd_ops=(),
        grad_alias=False,
        w_pre_first=False,
        promote_grads=False,
        read_w=(),
        wgrad_saved="",
        meta_i=(),
        wgrad_chain=(),
    ) -> Node:
        if self.trainable is not None:
            # frozen parameters (LoRA's base): no weight grad, so nothing is saved for one
            params = tuple(p for p in params if p in self.trainable)
            if not params:
                save_w, read_w, pre_w = (), (), ()
        n = Node(
            type,
            tuple(inputs),
            tuple(outputs),
            tuple(diff_inputs),
            tuple(params),
            tuple(save_i),
            tuple(save_w),
            tuple(read_w),
            tuple(pre_i),
            tuple(post_i),
            tuple(pre_w),
            dict(grad_via or {}),
            workspace_f,
            workspace_i,
            self.region,
            self.module,
            tuple(fwd_ops),
            grad_alias,
            w_pre_first,
            self._pinned(type),
            promote_grads,
            wgrad_saved,
            tuple(wgrad_chain),
            tuple(meta_i),
        )
        self.nodes.append(n)
        return n

    def share_pin(self, linears: int) -> None:
        """The next `linears` linear nodes are one matmul to the selective-checkpointing policy
        (torchtitan's fused wqkv projection): one decision for all of them."""
        self._pin_share, self._pin_first = linears, True

    def _pinned(self, node_type: str) -> bool:
        if self.region < 0 or self.pin is None:
            return False
        if getattr(self, "_pin_share", 0) and node_type == "linear":
            if self._pin_first:
                self._pin_decision, self._pin_first = self.pin(node_type), False
            self._pin_share -= 1
            return self._pin_decision
        return self.pin(node_type)

    # Emitting ----------------------------------------------------------------------------
    def forward(self, name: str = "F") -> Program:
        prog = Program(name=name, type="forward")
        gather = self._fsdp_gather(prog, "fwd")
        root_ag = ""
        if self.root_role == "first":
            self.handed_on_f = (self._root_gather(prog, "fwd"),)
            root_ag = "root.params_fwd.ag_out"
        elif self.root_role == "last":
            self.entry_f = (self._root_tensor(prog, "params_fwd", self.root_bytes),)
        carried = self._carry_in(prog, "fwd", self.offload_carry[0])
        for i, n in enumerate(self.nodes):
            if i in self.offload_release_before:
                self._add(
                    prog, Op("offload_stash_release", self.offload_release_before[i], (), phase="offload")
                )
            for op in self._fwd_ops(n, {}):
                self._add(prog, op)
            let_go = self.offload_release.get(i, ()) + carried.get(i, ())
            if let_go:  # torchtune's forward stash drops its references
                self._add(prog, Op("offload_stash_release", let_go, (), phase="offload"))
            if i in self.held_until:
                self._add(prog, Op("block_return", tuple(self.held_until[i]), (), phase="forward"))
            if self.fsdp_reshard and i + 1 == self.fsdp_unit_end:
                self._fsdp_release(prog, gather)  # the unit's post-forward reshard
            if self.root_role == "last" and self.fsdp_reshard and i + 1 == self._model_end():
                self._add(prog, Op("fsdp_root_reshard", self.entry_f, (), frees=self.entry_f, phase="fsdp"))
        if self.held_to_return:
            self._add(prog, Op("return", self.held_to_return, (), phase="forward"))
        if root_ag:
            self._add(prog, Op("fsdp_all_gather_done", (root_ag,), (), frees=(root_ag,), phase="fsdp"))
        if self.root_role == "last" and not self.fsdp_reshard:
            self.handed_on_f = self.entry_f  # kept unsharded: the backward uses it
        if self.fsdp_reshard:
            if self.fsdp_unit_end is None:
                self._fsdp_release(prog, gather)
        elif gather and gather + ".ag_out" in self.tensors and not self.fsdp_state_to_backward:
            state = gather + ".ag_out"  # kept unsharded; the buffer goes with the next unit's copy-out
            self._add(prog, Op("fsdp_all_gather_done", (state,), (), frees=(state,), phase="fsdp"))
        return prog

    def _carry_in(self, prog: Program, tag: str, at: dict[int, int]) -> dict[int, tuple[str, ...]]:
        """Bytes the previous identical layer leaves alive into this program (torchtune's
        offloading stash), allocated at its start; node index -> the placeholders it releases."""
        out = {}
        for i, nbytes in sorted(at.items()):
            if nbytes:
                nm = f"{self.prefix}offload.{tag}_carry{i}"
                self.tensors[nm] = Tensor(nm, (), "uint8", ACT, bytes=nbytes)
                self._add(prog, Op("offload_carry_in", (), (nm,), phase="offload"))
                out[i] = (nm,)
        return out

    def _fsdp_param_bytes(self) -> int:
        seen: dict[str, int] = {}
        for t in self.tensors.values():
            if t.kind is PARAM and t.name not in self.fsdp_gathered_elsewhere:
                seen[t.storage] = max(seen.get(t.storage, 0), t.nbytes)
        return sum(seen.values())

    def _model_end(self) -> int:
        """Nodes [0, n) run inside the model's forward (the rest: the loss)."""
        for end in (self.model_end, self.fsdp_unit_end):
            if end is not None:
                return end
        return len(self.nodes)

    def handed_on_b(self) -> tuple[str, ...]:
        return self._handed_on_b

    def _root_tensor(self, prog: Program, name: str, nbytes: int) -> str:
        nm = "root." + name
        self.tensors[nm] = Tensor(nm, (), "uint8", COMM, bytes=nbytes)
        prog.tensors.setdefault(nm, self.tensors[nm])
        return nm

    def _root_gather(self, prog: Program, tag: str) -> str:
        """FSDP2's all-gather of the root unit: its output buffer and the unsharded parameters.
        In the forward the buffer is freed when the next unit's copy-out runs (here when this
        program ends). In the backward the head's pre-backward hook waits for it and copies out,
        which releases the buffer there, and prefetches the next unit's (the stage's last decoder
        layer's, `root_bwd_prefetch_bytes`), alive through the rest of the head's backward; that
        layer's backward gathers its own (validate torchtune, its chunked output)."""
        nm = self._root_tensor(prog, f"params_{tag}", self.root_bytes)
        ag = self._root_tensor(prog, f"params_{tag}.ag_out", self.root_bytes)
        self._add(prog, Op("fsdp_all_gather", (), (ag,), phase="fsdp"))
        if tag == "bwd":
            self._add(prog, Op("fsdp_all_gather_copy_out", (ag,), (nm,), frees=(ag,), phase="fsdp"))
            if self.root_bwd_prefetch_bytes:
                pf = self._root_tensor(prog, "prefetch_next.ag_out", self.root_bwd_prefetch_bytes)
                self._add(prog, Op("fsdp_all_gather", (), (pf,), phase="fsdp"))
        else:
            self._add(prog, Op("fsdp_all_gather_copy_out", (ag,), (nm,), phase="fsdp"))
        return nm

    def _fsdp_gather(self, prog: Program, tag: str) -> str:
        if not self.fsdp or self.root_role:
            return ""
        nm = f"{self.prefix}fsdp.params_{tag}"
        unit = self._fsdp_param_bytes()
        self.tensors[nm] = Tensor(nm, (), "uint8", COMM, bytes=unit)
        if not self.fsdp_ag_state:
            self._add(prog, Op("fsdp_all_gather", (), (nm,), phase="fsdp"))
            return nm
        # FSDP2: all-gather input (the bf16 shard) and output (the whole unit), copied out into
        # the unsharded parameters; the output buffer stays (the all-gather state the next
        # unit's copy-out releases; counted here with the unit that made it)
        shard = -(-unit // self.fsdp_group)
        ag_in, ag_out = nm + ".ag_in", nm + ".ag_out"
        self.tensors[ag_in] = Tensor(ag_in, (), "uint8", COMM, bytes=shard)
        self.tensors[ag_out] = Tensor(ag_out, (), "uint8", COMM, bytes=shard * self.fsdp_group)
        self._add(prog, Op("fsdp_all_gather_copy_in", (), (ag_in,), phase="fsdp"))
        self._add(prog, Op("fsdp_all_gather", (ag_in,), (ag_out,), frees=(ag_in,), phase="fsdp"))
        self._add(prog, Op("fsdp_all_gather_copy_out", (ag_out,), (nm,), phase="fsdp"))
        return nm

    def _fsdp_release(self, prog: Program, gathered: str) -> None:
        if gathered:
            state = gathered + ".ag_out"
            gathered_here = any(state in op.outputs for op in prog.ops)
            carried = (
                self.fsdp_state_to_backward and gathered.endswith("params_fwd") and state in self.tensors
            )
            frees = (gathered, state) if gathered_here or carried else (gathered,)
            for t in frees:
                prog.tensors.setdefault(t, self.tensors[t])
            self._add(prog, Op("fsdp_reshard", frees, (), frees=frees, phase="fsdp"))

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
        root_gathered = ""
        self._handed_on_b = ()
        if self.root_role == "first":
            # the root unit (gathered again by the head's backward) and the head's unsharded
            # grads: released when this backward ends
            params = self._root_tensor(
                i_prog, "params_bwd" if self.fsdp_reshard else "params_fwd", self.root_bytes
            )
            # (no head grads when the head is frozen: LoRA)
            grads = (
                (self._root_tensor(i_prog, "head_grads", self.root_grad_bytes),)
                if self.root_grad_bytes
                else ()
            )
            self.entry_b = (params,) + grads
        elif self.root_role == "last" and not self.fsdp_reshard:
            self.entry_b = ()
            root_gathered = "root.params_fwd"  # never resharded; the first part frees it
            self._root_tensor(i_prog, "params_fwd", self.root_bytes)
        if self.root_role:
            gathered = ""
        elif self.fsdp and not self.fsdp_reshard:  # still gathered since the forward
            gathered = f"{self.prefix}fsdp.params_fwd"
            i_prog.tensors[gathered] = self.tensors[gathered]
        else:
            # FSDP2 all-gathers a unit for backward in its pre-backward hook, when the gradient
            # of the unit's output arrives: after the backward of what runs outside the unit
            # (the loss), just before the first node that reads the parameters or recomputes
            gathered = None
        for copy in self.offloaded.values():
            self._add(i_prog, Op("h2d_reload", (), (copy,), phase="offload"))
        # per-pack offloading: the reloads of the node that ran before (the previous layer's
        # last, at first) are freed once the next reloading node has run
        first = min(self.offload_packs) if self.offload_packs else -1
        held = self._carry_in(i_prog, "bwd", {first: self.offload_carry[1]}).get(first, ())
        self._held_grads: list[tuple[str, str]] = []
        # parameters several nodes read (torchtune's chunked output layer): their weight grads
        # meet in autograd's input buffer before the one AccumulateGrad (_wgrad_ops)
        self._w_uses: dict[str, int] = {}
        for node in self.nodes:
            for p in node.params:
                self._w_uses[p] = self._w_uses.get(p, 0) + 1
        self._w_seen: dict[str, int] = {}
        self._w_buf: dict[str, str] = {}
        for t in out_grads:
            self._grad_tensor(i_prog, t)
        written: set[str] = {"d." + t for t in out_grads}
        regions_done: set[int] = set()
        i_regathered: dict[str, str] = {}  # split backward: re-gathered tensor -> its input-pass copy
        self._acc = 0
        # Split backward: a grad storage a deferred W op still reads cannot take later
        # contributions in place (autograd accumulates out of place while another reference
        # holds it), so accumulation then makes a new tensor and later readers use it.
        self._cur: dict[str, str] = {}
        w_storages: set[str] = set()
        cur = self._cur.get
        for idx in range(len(self.nodes) - 1, -1, -1):
            n = self.nodes[idx]
            gouts = tuple(cur("d." + o, "d." + o) for o in n.outputs if ("d." + o) in written)
            if not gouts:
                continue
            # FSDP gathers a unit for the backward of the first node that needs its parameters
            # (a frozen one's too: LoRA's base weights compute the input grads)
            needs = n.params or n.region >= 0 or (self.trainable is not None and self._reads_param(n))
            if gathered is None and needs:
                gathered = self._fsdp_gather(i_prog, "bwd")
            if self.root_role == "last" and not root_gathered and needs:
                root_gathered = self._root_gather(i_prog, "bwd")
            ren: dict[str, str] = self.offloaded
            reloads = self.offload_packs.get(idx, {})
            if reloads:
                self._add(
                    i_prog, Op("h2d_reload", (), tuple(reloads.values()), module=n.module, phase="offload")
                )
                ren = {**ren, **reloads}
            if n.region >= 0:
                ren = {**self.offloaded, **self._region_renames(n.region)}
                if n.region not in regions_done:
                    regions_done.add(n.region)
                    for rn in self.nodes:
                        if rn.region == n.region and not rn.pinned:
                            for op in self._fwd_ops(rn, ren):
                                op.phase = "recompute"
                                self._add(i_prog, op)
            r = lambda x, ren=ren: ren.get(x, x)  # noqa: E731
            w_block: list[Op] = []
            if n.params:
                w_block = [self._bop(b, r, n) for b in n.pre_w]
                w_block.extend(self._wgrad_ops(n, gouts, r, i_prog))
                if split:
                    w_storages.update(self._lookup(nm).storage for op in w_block for nm in op.inputs)
            early = []
            if not split and n.w_pre_first and n.pre_w:
                early, w_block = w_block[: len(n.pre_w)], w_block[len(n.pre_w) :]
            for op in early:
                self._add(i_prog, op)
            if split and n.w_pre_first and n.pre_w and n.read_w:
                # a re-gather shared by several nodes runs in both passes of a split backward
                # (autograd unpacks every saved tensor of a node it runs): the input-grad pass
                # gathers its own copy, which its nodes read and which dies in that pass
                for b in n.pre_w:
                    op = self._bop(b, r, n)
                    for o in op.outputs:
                        base = self._lookup(o)
                        self.tensors[o + "@i"] = Tensor(o + "@i", base.shape, base.dtype, base.kind)
                        i_regathered[o] = o + "@i"
                    op.outputs = tuple(o + "@i" for o in op.outputs)
                    self._add(i_prog, op)
            for bop in n.pre_i:
                self._add(i_prog, self._bop(bop, r, n))
            # Input grads: each diff input gets d.<x> (or the node's grad_via name, finished by
            # post_i ops); a second contribution goes to a temporary that is then accumulated.
            outs, accs, casts = [], [], []
            for x in n.diff_inputs:
                if x not in has_grad:
                    continue
                target = n.grad_via.get(x, "d." + x)
                alias = n.grad_alias is True or (isinstance(n.grad_alias, tuple) and x in n.grad_alias)
                wide_dtype = self._lookup(gouts[0]).dtype
                if n.promote_grads and self._lookup(x).dtype != wide_dtype:
                    # computed in the output's dtype (or passed through, for an add), then cast
                    src = gouts[0]
                    if not alias:
                        self._acc += 1
                        src = f"{target}@wide{self._acc}"
                        self.tensors[src] = Tensor(src, self._lookup(x).shape, wide_dtype, TEMP)
                        outs.append(src)
                    casts.append((src, target))
                    continue
                out = self._grad_target(i_prog, target, written, accs, alias_of=gouts[0] if alias else "")
                outs.append(out)
            ins = (
                gouts
                + tuple(r(s) for s in n.save_i)
                + tuple(i_regathered[x] for x in n.read_w if x in i_regathered)
            )
            if outs:
                meta = tuple(m for m in dict.fromkeys(r(x) for x in n.meta_i) if m not in ins)
                self._add(
                    i_prog,
                    Op(
                        n.type + "_grad",
                        ins + meta,
                        tuple(outs),
                        workspace_bytes=n.workspace_i,
                        module=n.module,
                        phase="backward",
                        no_need_buffer=meta,
                        retain_reads=meta,
                    ),
                )
            for k, (src, target) in enumerate(casts):
                # the engine casts before it releases the node's grad inputs and saved tensors
                held = ins if k == len(casts) - 1 and outs else ()
                dst = self._grad_target(i_prog, target, written, accs)
                self._add(i_prog, Op("cast", (src,), (dst,), frees=held, module=n.module, phase="backward"))
            for bop in n.post_i:
                op = self._bop(bop, r, n)
                op.outputs = tuple(
                    self._grad_target(i_prog, o, written, accs) if o.startswith("d.") else o
                    for o in op.outputs
                )
                self._add(i_prog, op)
            for target, tmp in accs:
                now = cur(target, target)
                if split and self._lookup(now).storage in w_storages:
                    self._acc += 1
                    new = f"{target}#{self._acc}"
                    base = self._lookup(target)
                    self.tensors[new] = Tensor(new, base.shape, base.dtype, ACT)
                    self._cur[target] = new
                    self._add(
                        i_prog, Op("grad_accumulate", (now, tmp), (new,), module=n.module, phase="backward")
                    )
                else:
                    self._add(
                        i_prog, Op("grad_accumulate", (now, tmp), (now,), module=n.module, phase="backward")
                    )
            if split:
                w_ops.extend(w_block)
            else:
                # autograd releases a node's saved tensors when its whole backward returns
                # (input and weight grads), not after their last read
                if w_block:
                    saved = tuple(
                        dict.fromkeys(
                            r(x) for x in (*n.save_i, *n.save_w) if self.tensors[x].kind is not PARAM
                        )
                    )
                    last = w_block[-1]
                    last.frees = tuple(dict.fromkeys((*last.frees, *saved)))
                for op in w_block:
                    self._add(i_prog, op)
            if reloads:
                if held:
                    self._add(i_prog, Op("offload_release", held, (), module=n.module, phase="offload"))
                held = tuple(reloads.values())
            if self.keep_recompute_outputs and n.region >= 0 and n is self._region_first(n.region):
                held = tuple(ren[o] for o in self._region_outputs(n.region) if o in ren)
                if held:
                    self._add(
                        i_prog, Op("checkpoint_backward_done", held, (), module=n.module, phase="backward")
                    )
        if gathered is None:
            gathered = self._fsdp_gather(i_prog, "bwd")
        self._fsdp_release(i_prog, gathered)
        if self.root_role == "last":
            if root_gathered == "root.params_bwd" and self.root_bwd_prefetch_bytes:
                # the prefetched buffer is the next layer's to count (its backward gathers it)
                pf = "root.prefetch_next.ag_out"
                self._add(i_prog, Op("fsdp_all_gather_handed_on", (pf,), (), frees=(pf,), phase="fsdp"))
            self._handed_on_b = (root_gathered,) if root_gathered else ()
        if not split:
            self._fsdp_reduce_scatter(i_prog)
            self._root_release(i_prog)
            return [i_prog]
        w_prog = Program(name="W", type="backward_w")
        for op in w_ops:
            self._add(w_prog, op)
        self._fsdp_reduce_scatter(w_prog)
        self._root_release(w_prog)
        return [i_prog, w_prog]

    def _reads_param(self, n: Node) -> bool:
        return any(i in self.tensors and self.tensors[i].kind is PARAM for i in n.inputs)

    def _root_release(self, prog: Program) -> None:
        """The root's reduce-scatter when the backward ends: the unit and the head's unsharded
        grads go; a backward that creates the grads makes the head's grad shards here (its
        reduce-scatter buffers, at the backward's lowest point, are not counted)."""
        if self.root_role == "first" and self.entry_b:
            for t in self.entry_b:
                prog.tensors.setdefault(t, self.tensors[t])
            made: tuple[str, ...] = ()
            if self.grad_create is not None and self.root_grad_bytes:
                dt, shard = self.grad_create
                elems = self.root_grad_bytes // max(1, self.root_grad_elem_bytes)
                made = (
                    self._root_tensor(prog, "head_grad_shards", -(-elems // max(1, shard)) * dtype_bytes(dt)),
                )
                self._handed_on_b += made
            self._add(
                prog, Op("fsdp_root_reduce_scatter", self.entry_b, made, frees=self.entry_b, phase="fsdp")
            )

    def _fsdp_reduce_scatter(self, prog: Program) -> None:
        if not self._held_grads:
            return
        # a parameter read by several nodes (torchtune's chunked output layer) has one grad
        held = tuple(dict.fromkeys(self._held_grads))
        temps = tuple(t for t, _ in held)
        grads = tuple(g for _, g in held)
        released = temps
        if self.root_role == "last":
            # the head's unsharded grads stay until the root's reduce-scatter when the backward
            # ends: the first part frees bytes equal to them (`root_grad_bytes`) and makes their
            # shards there (`_root_release`)
            self._handed_on_b += temps
            return
        if not self.fsdp_ag_state:
            reads = temps if self.grad_create is not None else temps + grads
            self._add(prog, Op("fsdp_reduce_scatter", reads, grads, frees=released, phase="fsdp"))
            return
        # FSDP2: the unsharded grads are copied (cast to the reduce dtype) into one
        # reduce-scatter input, whose output shard is added into the sharded grad (or becomes
        # it). The input stays until the next unit's reduce-scatter: stages.py counts it with
        # the next part (PartMemory.rs_state_bytes); here it is freed with the output.
        elems = sum(self.tensors[t].nbytes // dtype_bytes(self.tensors[t].dtype) for t in temps)
        shard = -(-elems // self.fsdp_group)
        # (a root member's buffers are not the reduce-scatter state the next part sees: the
        # root's reduce-scatter runs when the backward ends; PartMemory.rs_state_bytes)
        tag = "fsdp.root_rs" if self.root_role == "last" else "fsdp.rs"
        rs_in, rs_out = f"{self.prefix}{tag}_in", f"{self.prefix}{tag}_out"
        width = dtype_bytes(self.fsdp_reduce_dtype)
        self.tensors[rs_in] = Tensor(rs_in, (), "uint8", COMM, bytes=shard * self.fsdp_group * width)
        self.tensors[rs_out] = Tensor(rs_out, (), "uint8", COMM, bytes=shard * width)
        self._add(prog, Op("fsdp_reduce_scatter_copy_in", temps, (rs_in,), frees=released, phase="fsdp"))
        self._add(prog, Op("fsdp_reduce_scatter", (rs_in,), (rs_out,), phase="fsdp"))
        if self.grad_create is not None and self.grad_create[0] == self.fsdp_reduce_dtype:
            # no grads yet (set to none) and the reduce dtype is theirs: FSDP2 makes each sharded
            # grad a view of the reduce-scatter output (foreach_reduce's as_strided), no copy
            self._add(prog, Op("fsdp_accumulate_grad", (rs_out,), (), frees=(rs_out, rs_in), phase="fsdp"))
            self._add(prog, Op("fsdp_grad_views", (), grads, phase="fsdp"))
            return
        reads = (rs_out,) if self.grad_create is not None else (rs_out,) + grads
        self._add(prog, Op("fsdp_accumulate_grad", reads, grads, frees=(rs_out, rs_in), phase="fsdp"))

    def _wgrad_ops(self, n: Node, gouts: tuple[str, ...], r, prog: Program) -> list[Op]:
        gparams = tuple(self._param_grad(prog, p) for p in n.params)
        reads = gouts + tuple(r(s) for s in (*n.save_w, *n.read_w))
        chain = n.wgrad_chain or self.wgrad_chain
        created = self.grad_create is not None
        if not chain:
            # a fused GEMM accumulates into the grad buffer; a created grad is only written
            return [
                Op(
                    n.type + "_wgrad",
                    reads + (() if created else gparams),
                    gparams,
                    module=n.module,
                    phase="backward_w",
                )
            ]
        ops = []
        for p, g in zip(n.params, gparams):
            shape = self.tensors[p].shape
            names = []
            for k, dt in enumerate(chain):
                nm = f"dw{k}.{p}"
                self.tensors[nm] = Tensor(nm, shape, dt, TEMP)
                names.append(nm)
            if n.wgrad_saved:
                names = [r(n.wgrad_saved)]  # scaled in place, then handed to autograd as is
                ops.append(Op(n.type + "_wgrad", reads, (names[0],), module=n.module, phase="backward_w"))
            elif self._w_uses.get(p, 1) > 1:
                if not self._buffer_contribution(n, p, shape, chain[0], reads, ops):
                    continue  # more contributions to come before the AccumulateGrad
                names[0] = self._w_buf[p]
            else:
                ops.append(Op(n.type + "_wgrad", reads, (names[0],), module=n.module, phase="backward_w"))
            for a, b in zip(names, names[1:]):
                ops.append(Op("cast", (a,), (b,), module=n.module, phase="backward_w"))
            if self.step_in_backward:
                # the post-accumulate-grad hook steps this parameter and drops its grad
                ops.append(
                    Op(
                        "optimizer_step",
                        (names[-1],),
                        (),
                        frees=(names[-1],),
                        module=n.module,
                        phase="backward_w",
                    )
                )
                continue
            if self.fsdp:
                self._held_grads.append((names[-1], g))  # reduce-scattered at the part's end
            elif p in self.existing_grads:
                ops.append(Op("accumulate_grad", (names[-1], g), (g,), module=n.module, phase="backward_w"))
            elif self.wgrad_final == "steal_grad":
                # the last result (the cast's, or the GEMM's / the buffer's sum) becomes .grad: its op
                # writes the grad buffer itself
                last = ops[-1]
                ops[-1] = Op(
                    last.type,
                    last.inputs + (() if created else (g,)),
                    (g,),
                    module=n.module,
                    phase="backward_w",
                )
            else:
                ops.append(Op("accumulate_grad", (names[-1], g), (g,), module=n.module, phase="backward_w"))
        return ops

    def _buffer_contribution(self, n: Node, p: str, shape, dtype: str, reads: tuple, ops: list) -> bool:
        """One contribution to the weight grad of `p`, which several nodes read: the GEMM writes a
        new dW, which autograd's input buffer adds to the sum so far out of place (the weight grad
        is a transposed view, so it cannot take the add in place: the `add` torchtune's chunked
        output shows, validate torchtune). True on the last contribution, when `_w_buf[p]` holds
        the whole sum for the chain's casts and the AccumulateGrad."""
        j = self._w_seen[p] = self._w_seen.get(p, 0) + 1
        new = f"dw0.{p}" if j == 1 else f"dw0.{p}#{j}"
        self.tensors[new] = Tensor(new, shape, dtype, TEMP)
        ops.append(Op(n.type + "_wgrad", reads, (new,), module=n.module, phase="backward_w"))
        if j > 1:
            total = f"dw_sum.{p}#{j}"
            self.tensors[total] = Tensor(total, shape, dtype, TEMP)
            ops.append(
                Op("grad_buffer_add", (self._w_buf[p], new), (total,), module=n.module, phase="backward_w")
            )
            new = total
        self._w_buf[p] = new
        return j == self._w_uses[p]

    def _grad_target(
        self, prog: Program, target: str, written: set[str], accs: list, alias_of: str = ""
    ) -> str:
        """Name an op should write for gradient `target`: the target itself the first time,
        else a temporary accumulated into it afterwards."""
        if not target.startswith("d."):
            return target
        if target in written:
            self._acc += 1
            tmp = f"{target}~{self._acc}"
            base = self._lookup(target[2:])
            self.tensors[tmp] = Tensor(
                tmp, base.shape, base.dtype, ACT, storage=(self._lookup(alias_of).storage if alias_of else "")
            )
            prog.tensors[tmp] = self.tensors[tmp]
            accs.append((target, tmp))
            return tmp
        written.add(target)
        if alias_of:
            base = self._lookup(target[2:])
            self.tensors[target] = Tensor(
                target, base.shape, base.dtype, ACT, storage=self._lookup(alias_of).storage
            )
        self._grad_tensor(prog, target[2:])
        return target

    # Helpers -----------------------------------------------------------------------------
    def _region_first(self, region: int) -> Node:
        return next(n for n in self.nodes if n.region == region)

    def _region_outputs(self, region: int) -> list[str]:
        """Outputs of a region's nodes read outside it or by nobody (the region's results)."""
        inside = [n for n in self.nodes if n.region == region]
        made = [o for n in inside for o in n.outputs]
        read_outside = {x for n in self.nodes if n.region != region for x in n.inputs}
        read_inside = {x for n in inside for x in n.inputs}
        return [o for o in made if o in read_outside or o not in read_inside]

    def _region_renames(self, region: int) -> dict[str, str]:
        ren = {}
        for n in self.nodes:
            if n.region == region and not n.pinned:
                for o in n.outputs:
                    ren[o] = o + "@rc"
                for op in n.fwd_ops:
                    for o in op.outputs:
                        ren[o] = o + "@rc"
        return ren

    def _fwd_ops(self, n: Node, ren: dict[str, str]) -> list[Op]:
        """The node's forward ops (its own list, else the node as one op), tensors renamed by `ren`."""
        r = lambda x: ren.get(x, x)  # noqa: E731
        parts = [(o.type, o.inputs, o.outputs, o.workspace_bytes) for o in n.fwd_ops] or [
            (n.type, n.inputs, n.outputs, n.workspace_f)
        ]
        return [
            Op(
                t,
                tuple(map(r, ins)),
                tuple(map(r, outs)),
                workspace_bytes=ws,
                module=n.module,
                phase="forward",
            )
            for t, ins, outs, ws in parts
        ]

    def _bop(self, b: BwdOp, r, n: Node) -> Op:
        cur = getattr(self, "_cur", {})
        ins = tuple(cur.get(x, x) if x.startswith("d.") else r(x) for x in b.inputs)
        return Op(
            b.type,
            ins,
            tuple(map(r, b.outputs)),
            workspace_bytes=b.workspace,
            module=n.module,
            phase="backward",
        )

    def grad_name(self, x: str) -> str:
        """The tensor holding x's gradient at the end of the last backward built."""
        return getattr(self, "_cur", {}).get("d." + x, "d." + x)

    def _add(self, prog: Program, op: Op) -> None:
        for nm in (*op.inputs, *op.outputs, *op.frees):
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
            t = Tensor(
                nm, base.shape, base.dtype, GRAD if base.kind is PARAM else ACT, persistent=base.kind is PARAM
            )
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
            if self.grad_create is None or p in self.existing_grads:
                self.tensors[nm] = Tensor(nm, base.shape, base.dtype, GRAD, persistent=True)
            else:
                # a new .grad (the FSDP shard only): persistent, so allocated where an op first
                # writes it and never freed by this backward
                dt, shard = self.grad_create
                numel = 1
                for d in base.shape:
                    numel *= d
                self.tensors[nm] = Tensor(
                    nm, base.shape, dt, GRAD, persistent=True, bytes=-(-numel // shard) * dtype_bytes(dt)
                )
        prog.tensors[nm] = self.tensors[nm]
        return nm
