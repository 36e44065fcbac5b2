"""The last stage's head under torchtitan 0.3's default loss, `ChunkedLossWrapper` (num_chunks 8).

The model runs with `_skip_lm_head`: its forward ends at the final norm. The loss wrapper then
(torchtitan/components/loss.py) splits the normed hidden states into N sequence chunks
(contiguous copies, leaves that collect `.grad`), pre-allocates an fp32 gradient accumulator
of the whole hidden states, keeps the output layer unsharded for all chunks
(`lm_head.unshard()`, gradient sync only on the last chunk), and for each chunk runs the
output layer, an fp32 cross entropy and that chunk's backward at once: the logits, their fp32
copy, log-softmax and its gradients exist for one chunk at a time. The output layer's weight
gradients accumulate unsharded in fp32 (FSDP2 without gradient sync), and are reduce-scattered
after the last chunk. The decoder's backward then starts from the accumulated gradient (cast
to the hidden dtype).

Written as explicit programs (no tape: the chunks' backwards run inside the forward), op for op
as a trace of torchtitan's own step shows them (`pipemem validate torchtitan`). FSDP2's
all-gather / reduce-scatter buffers: an all-gather allocates its input (the shard, cast to
bf16) and output (the whole unit), copies out into the unsharded parameters and frees both;
a reduce-scatter's fp32 input (the unit's gradients) is kept until the next reduce-scatter
starts, its output is added into the sharded gradient (resident) or becomes it (set to None).
"""

from __future__ import annotations

from ..ir import Op, Program, Tensor, TensorKind, dtype_bytes
from ..liveness import analyze_program, touched_storages

ACT, TEMP, COMM, GRAD = TensorKind.ACTIVATION, TensorKind.TEMP, TensorKind.COMM, TensorKind.GRAD


class _Builder:
    def __init__(self, name: str, kind: str):
        self.prog = Program(name=name, type=kind)

    def t(self, name: str, nbytes: int, kind=ACT, dtype="uint8", persistent=None) -> str:
        self.prog.tensors[name] = Tensor(name, (), dtype, kind, persistent=persistent, bytes=int(nbytes))
        return name

    def op(self, type_: str, inputs=(), outputs=(), frees=()) -> None:
        for n in (*inputs, *outputs, *frees):
            if n not in self.prog.tensors:
                raise KeyError(n)
        self.prog.add_op(Op(type_, tuple(inputs), tuple(outputs), frees=tuple(frees)))


def _fsdp_all_gather(b: _Builder, tag: str, full: int, group: int) -> tuple[str, str]:
    """FSDP2's all-gather of a unit of `full` bytes: input shard and output buffer, copy-out
    into the unsharded parameters. Returns (unsharded, output buffer): the output stays until
    the next all-gather's copy-out (here: until the unit is resharded)."""
    shard = -(-full // group)
    ag_in = b.t(f"ag_in.{tag}", shard, COMM)
    ag_out = b.t(f"ag_out.{tag}", shard * group, COMM)
    unsharded = b.t(f"unsharded.{tag}", full, COMM)
    b.op("all_gather_copy_in", (), (ag_in,))
    b.op("all_gather", (ag_in,), (ag_out,), frees=(ag_in,))
    b.op("all_gather_copy_out", (ag_out,), (unsharded,))
    return unsharded, ag_out


def chunked_head_programs(arch, sh, keep_input: bool = False) -> tuple:
    """(F, B, W, input name, output name, liveness results {F, B, I, W}) of the chunked-loss
    head (I is B: no split backward); see the module docstring. `keep_input`: the head is a
    stage's first part, whose input the pipeline runtime frees."""

    n = sh.loss_chunks
    dt = dtype_bytes(sh.dt)
    h, V = sh.h, sh.vocab
    tokens_sp = sh.s_sp * sh.b
    tokens = sh.s * sh.b  # the hidden states are whole on each TP rank
    chunk = -(-tokens // n)
    group = sh.grad_shard if sh.fsdp else 1
    norm_w = h  # RMSNorm weight
    lm_w = V * h
    unit = (norm_w + lm_w) * dt  # FSDP unit [norm, lm_head] in the compute dtype

    F = _Builder("F", "forward")
    x = F.t("input", tokens_sp * h * dt)
    if sh.fsdp:
        u, u_state = _fsdp_all_gather(F, "fwd", unit, group)
    rstd = F.t("rstd", tokens_sp * 4)
    hn = F.t("normed", tokens_sp * h * dt)
    F.op("rms_norm", (x,) + ((u,) if sh.fsdp else ()), (hn, rstd))
    if sh.fsdp:
        F.op("reshard", (u, u_state), (), frees=(u, u_state))
    src = hn
    if sh.tp > 1 and sh.sp:  # the norm output is gathered (replicated) before chunking
        src = F.t("normed_full", tokens * h * dt, COMM)
        F.op("all_gather_sequence", (hn,), (src,), frees=(hn,))
    chunks = F.t("chunks", tokens * h * dt)
    labels = F.t("label_chunks", tokens * 8)
    acc = F.t("grad_accumulator", tokens * h * 4)
    F.op("chunk", (src,), (chunks, labels))
    F.op("zeros_like", (), (acc,))
    lm, lm_state = _fsdp_all_gather(F, "loss", unit, group) if sh.fsdp else (None, None)
    prev_logits = None
    acc_w = F.t("lm_head.unsharded_grad_fp32", lm_w * 4, COMM)
    for i in range(n):
        logits = F.t(f"logits{i}", chunk * V * dt)
        F.op(
            "lm_head",
            (chunks,) + ((lm,) if lm else ()),
            (logits,),
            frees=(prev_logits,) if prev_logits else (),
        )
        lf = F.t(f"logits_fp32.{i}", chunk * V * 4, TEMP)
        ls = F.t(f"log_softmax.{i}", chunk * V * 4, TEMP)
        F.op("to_fp32", (logits,), (lf,))
        F.op("log_softmax", (lf,), (ls,))
        F.op("nll_loss", (ls, labels), (), frees=(lf,))
        g1 = F.t(f"d_nll.{i}", chunk * V * 4, TEMP)
        g2 = F.t(f"d_log_softmax.{i}", chunk * V * 4, TEMP)
        gb = F.t(f"d_logits.{i}", chunk * V * dt, TEMP)
        F.op("nll_loss_backward", (ls,), (g1,))
        F.op("log_softmax_backward", (g1, ls), (g2,), frees=(g1, ls))
        F.op("to_dtype", (g2,), (gb,), frees=(g2,))
        dw = F.t(f"d_lm_head.{i}", lm_w * dt, TEMP)
        dx = F.t(f"d_chunk.{i}", chunk * h * dt, TEMP)
        F.op("lm_head_wgrad", (gb, chunks), (dw,))
        F.op("lm_head_dgrad", (gb,) + ((lm,) if lm else ()), (dx,), frees=(gb,))
        if i == 0:  # FSDP2 without gradient sync keeps the unsharded grad in fp32 (reduce dtype)
            F.op("to_accumulated_grad", (dw,), (acc_w,), frees=(dw,))
        else:
            F.op("accumulate_grad", (dw, acc_w), (acc_w,), frees=(dw,))
        if i == n - 1:
            _reduce_scatter(F, sh, "lm_head", lm_w * 4, group, acc_w)
        dxf = F.t(f"d_chunk_fp32.{i}", chunk * h * 4, TEMP)
        F.op("to_fp32", (dx,), (dxf,))
        F.op("accumulate_chunk_grad", (dxf, acc), (acc,), frees=(dxf, dx))
        prev_logits = logits
    if lm:
        F.op("reshard", (lm, lm_state), (), frees=(lm, lm_state))
    grad = F.t("accumulated_grad", tokens * h * dt)
    F.op("to_dtype", (acc,), (grad,))
    F.op("loss_wrapper_return", (), (), frees=(acc, chunks, labels, prev_logits, src))

    B = _Builder("B", "backward")
    for nm in (x, rstd, grad, "rs_in.lm_head"):
        B.prog.tensors[nm] = F.prog.tensors[nm]
    if sh.fsdp:
        u, u_state = _fsdp_all_gather(B, "bwd", unit, group)
    dx_in = B.t("d.input", tokens_sp * h * dt)
    dgrad = grad
    if sh.tp > 1 and sh.sp:
        dgrad = B.t("d_normed_shard", tokens_sp * h * dt, COMM)
        B.op("reduce_scatter_sequence", (grad,), (dgrad,), frees=(grad,))
    dnw = B.t("d_norm_weight", norm_w * dt, TEMP)
    B.op(
        "rms_norm_backward",
        (dgrad, x, rstd) + ((u,) if sh.fsdp else ()),
        (dx_in, dnw),
        frees=(dgrad, rstd) if keep_input else (dgrad, x, rstd),
    )
    if sh.fsdp:
        B.op(
            "reshard", (u, u_state), (), frees=(u, u_state, "rs_in.lm_head")
        )  # the next reduce-scatter starts
        _reduce_scatter(B, sh, "norm", norm_w * 4, group, dnw)
    W = Program(name="W", type="backward_w")

    f, b = F.prog, B.prog
    kept_f = touched_storages(b)
    owned = {x} if keep_input else set()
    rf = analyze_program(f, live_on_entry={x}, keep=kept_f | owned)
    rb = analyze_program(b, live_on_entry=rf.live_after, keep={dx_in} | owned)
    rw = analyze_program(W, live_on_entry=rb.live_after)
    return f, b, W, x, grad, {"F": rf, "B": rb, "I": rb, "W": rw}


def _reduce_scatter(b: _Builder, sh, tag: str, full: int, group: int, grads: str) -> None:
    """FSDP2's reduce-scatter of `full` fp32 gradient bytes: the input is kept (until the next
    reduce-scatter), the output added into the resident sharded grad and freed, or kept as
    the new grad when the step created them."""
    shard = -(-full // group)
    rs_in = b.t(f"rs_in.{tag}", shard * group, COMM)
    b.op("reduce_scatter_copy_in", (grads,), (rs_in,), frees=(grads,))
    if sh.grads_created:
        out = b.t(f"grad.{tag}", shard, GRAD, persistent=True)
        b.op("reduce_scatter", (rs_in,), (out,))
    else:
        out = b.t(f"rs_out.{tag}", shard, COMM)
        b.op("reduce_scatter", (rs_in,), (out,))
        b.op("accumulate_sharded_grad", (out,), (), frees=(out,))
