"""One gloo rank of tests/test_torch_tp.py: the same training step with `ColwiseParallel` and
with `RegatherColwiseParallel`, outputs and gradients compared bit for bit.

Run as ``python tests/torch_tp_worker.py OUT`` with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set; writes one JSON line per variant to OUT.<rank>.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipemem.validation.distributed.models import (  # noqa: E402
    build_stack,
    local_tensor,
    loss_fn,
    make_batch,
    model_config,
    tp_plan,
)

SPEC = {"arch": "llama", "hidden": 64, "layers": 2, "heads": 8, "kv_heads": 4, "ffn": 128, "vocab": 256}
SEQ, BATCH = 32, 2


def step(regather: bool, tp_mesh, dp_mesh=None, checkpoint: bool = False, split: bool = False) -> tuple:
    """Outputs and parameter grads (local shards) of one forward + backward (`split`: two
    backward passes over one graph, the norm weights' grads first, then the others, as a
    split backward runs every saved tensor's node twice)."""
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = model_config(SPEC)
    model = build_stack(cfg, range(SPEC["layers"]), True, True, SEQ, seed=0)
    model = parallelize_module(model, tp_mesh, tp_plan(model, regather=regather))
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for k in list(model.layers):
            model.layers[k] = checkpoint_wrapper(model.layers[k])
    dp_rank = 0
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        dp_rank = dp_mesh.get_local_rank()
    ids, target = make_batch(SPEC, BATCH, SEQ, seed=1 + dp_rank)
    out = model(ids)
    loss = loss_fn(out, target)
    if split:
        params = dict(model.named_parameters())
        first = [p for n, p in params.items() if "norm" in n]
        loss.backward(inputs=first, retain_graph=True)
        loss.backward(inputs=[p for n, p in params.items() if "norm" not in n])
    else:
        loss.backward()
    grads = {n: local_tensor(p.grad).detach().clone() for n, p in model.named_parameters()}
    return local_tensor(out).detach().clone(), grads


class SeqFirst(torch.nn.Module):
    """Megatron's layout, [seq, batch, hidden]: a linear gathering its own Shard(0) input, and
    two linears reading one input gathered by a PrepareModuleInput (sequence_dim=0)."""

    def __init__(self, h: int = 16):
        super().__init__()
        self.head = torch.nn.Linear(h, 8, bias=False)
        self.attn = Pair(h)

    def forward(self, x):
        return self.head(x).square().sum() + self.attn(x)


class Pair(torch.nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.q, self.k = torch.nn.Linear(h, 8), torch.nn.Linear(h, 8)

    def forward(self, x):
        return (self.q(x) * self.k(x)).sum()


def step_seq_first(regather: bool, tp_mesh) -> tuple:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    from pipemem.torch_tp import RegatherColwiseParallel

    torch.manual_seed(0)
    block = SeqFirst()
    style, extra = (RegatherColwiseParallel, {"sequence_dim": 0}) if regather else (ColwiseParallel, {})
    parallelize_module(
        block,
        tp_mesh,
        {
            "head": style(input_layouts=Shard(0), output_layouts=Replicate()),
            "attn": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
            "attn.q": style(**extra),
            "attn.k": style(**extra),
        },
    )
    g = torch.Generator().manual_seed(1 + tp_mesh.get_local_rank())
    x = torch.randn(6, 2, 16, generator=g).requires_grad_()  # this rank's [s/tp, b, h]
    out = block(x)
    out.backward()
    grads = {n: local_tensor(p.grad).detach().clone() for n, p in block.named_parameters()}
    grads["input"] = x.grad.clone()
    return local_tensor(out).detach().clone(), grads


def compare(name: str, seq_first: bool = False, **kw) -> dict:
    run = step_seq_first if seq_first else step
    out0, g0 = run(False, **kw)
    out1, g1 = run(True, **kw)
    differ = [n for n in g0 if not torch.equal(g0[n], g1[n])]
    return {
        "name": name,
        "outputs_equal": bool(torch.equal(out0, out1)),
        "grads_differ": differ,
        "n_grads": len(g0),
        "grads_nonzero": all(bool(g.abs().sum() > 0) for g in g0.values()),
    }


def main(out_path: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=2))
    try:
        rows = []
        tp4 = init_device_mesh("cpu", (world,))
        rows.append(compare(f"tp{world}", tp_mesh=tp4))
        rows.append(compare(f"tp{world}-checkpoint", tp_mesh=tp4, checkpoint=True))
        rows.append(compare(f"tp{world}-split-backward", tp_mesh=tp4, split=True))
        rows.append(compare(f"tp{world}-seq-first", tp_mesh=tp4, seq_first=True))
        if world == 4:  # tp 2 within a 2 x 2 mesh: plain, checkpointed, and FSDP2 over the other dimension
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            rows.append(compare("tp2", tp_mesh=mesh["tp"]))
            rows.append(compare("tp2-checkpoint", tp_mesh=mesh["tp"], checkpoint=True))
            rows.append(compare("dp2-fsdp2-tp2", tp_mesh=mesh["tp"], dp_mesh=mesh["dp"]))
        with open(f"{out_path}.{rank}", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
