"""Writes stage_1f1b.json: the programs one pipeline stage runs per microbatch under 1F1B.

The stage is the last of a pipeline: a two-layer MLP block (4096-wide, GELU) on a
[micro-batch 4, seq 512, hidden 1024] bf16 activation, an MSE-style loss, its backward
and an Adam step. Run `python -m pipemem.examples.build_stage_1f1b` to regenerate.
"""

from pathlib import Path

from pipemem.ir import Op, Program, Tensor, save_programs

B, S, H, F = 4, 512, 1024, 4096
ACT = (B, S, H)


def build() -> list[Program]:
    t = {}

    def tensor(name, shape, dtype="bf16", kind="activation", **kw):
        t[name] = Tensor(name, shape, dtype, kind, **kw)
        return name

    x = tensor("x", ACT)  # received from the previous stage
    w1, w2 = tensor("w1", (H, F), kind="param"), tensor("w2", (F, H), kind="param")
    h, a, y = tensor("h", (B, S, F)), tensor("a", (B, S, F)), tensor("y", ACT)
    loss = tensor("loss", (), "fp32")
    dy, da, dh, dx = (
        tensor("dy", ACT, kind="temp"),
        tensor("da", (B, S, F), kind="temp"),
        tensor("dh", (B, S, F), kind="temp"),
        tensor("dx", ACT),
    )
    dw1, dw2 = tensor("dw1", (H, F), kind="grad"), tensor("dw2", (F, H), kind="grad")
    m1, v1 = tensor("m1", (H, F), "fp32", "optimizer_state"), tensor("v1", (H, F), "fp32", "optimizer_state")
    m2, v2 = tensor("m2", (F, H), "fp32", "optimizer_state"), tensor("v2", (F, H), "fp32", "optimizer_state")

    def prog(name, ops):
        p = Program(name)
        for op in ops:
            for n in (*op.inputs, *op.outputs):
                p.tensors[n] = t[n]
            p.ops.append(op)
        return p

    forward = prog(
        "forward",
        [
            Op("matmul", (x, w1), (h,), module="mlp.fc1", phase="forward"),
            Op("gelu", (h,), (a,), module="mlp.act", phase="forward"),
            Op("matmul", (a, w2), (y,), module="mlp.fc2", phase="forward"),
            Op("mse_loss", (y,), (loss,), module="loss", phase="forward"),
        ],
    )
    backward = prog(
        "backward",
        [
            Op("mse_loss_grad", (loss, y), (dy,), module="loss", phase="backward"),
            Op("matmul", (dy, w2), (da,), name="fc2.dgrad", module="mlp.fc2", phase="backward"),
            Op("matmul", (a, dy), (dw2,), name="fc2.wgrad", module="mlp.fc2", phase="backward"),
            Op("gelu_grad", (da, h), (dh,), module="mlp.act", phase="backward"),
            Op(
                "matmul",
                (dh, w1),
                (dx,),
                name="fc1.dgrad",
                module="mlp.fc1",
                phase="backward",
                workspace_bytes=32 << 20,
            ),
            Op("matmul", (x, dh), (dw1,), name="fc1.wgrad", module="mlp.fc1", phase="backward"),
            Op("send_backward", (dx,), (), module="p2p", phase="backward"),
        ],
    )
    optimizer = prog(
        "optimizer",
        [
            Op("adam", (w1, dw1, m1, v1), (w1, m1, v1), name="adam.w1", phase="optimizer"),
            Op("adam", (w2, dw2, m2, v2), (w2, m2, v2), name="adam.w2", phase="optimizer"),
        ],
    )
    return [forward, backward, optimizer]


if __name__ == "__main__":
    save_programs(build(), Path(__file__).with_name("stage_1f1b.json"))
