"""pipemem.torch_tp.RegatherColwiseParallel: bitwise the numerics of ColwiseParallel (real
gloo ranks at tp 2 and 4, with activation checkpointing and with FSDP2 over dp), and the
memory it saves (one rank's step traced on fake tensors under a fake process group)."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_tp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, tmp_path, timeout: float = 240.0) -> list[list[dict]]:
    out = str(tmp_path / "out")
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, out],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    return [[json.loads(line) for line in open(f"{out}.{r}")] for r in range(world)]


@pytest.mark.slow
def test_outputs_and_grads_bitwise_equal_to_colwise_parallel(tmp_path):
    # one launch of 4 ranks: tp 4, and tp 2 within a 2 x 2 mesh (alone and with FSDP2 over dp)
    ranks = _launch(4, tmp_path)
    expected = {
        "tp4",
        "tp4-checkpoint",
        "tp4-split-backward",
        "tp4-seq-first",
        "tp2",
        "tp2-checkpoint",
        "dp2-fsdp2-tp2",
    }
    for rank, rows in enumerate(ranks):
        assert {r["name"] for r in rows} == expected
        for r in rows:
            assert r["outputs_equal"], (rank, r)
            assert r["grads_differ"] == [], (rank, r)
            assert r["n_grads"] > (3 if r["name"].endswith("seq-first") else 10) and r["grads_nonzero"], (
                rank,
                r,
            )


def _traced(world: int, regather: bool, checkpoint: bool = False, layers: int = 3) -> dict:
    """Rank 0's step as `pipemem.estimate` traces it (traced mode, --tp, --recompute-allgather)."""
    import pipemem
    from pipemem.validation.distributed.models import hf_config

    spec = {
        "arch": "llama",
        "hidden": 64,
        "layers": layers,
        "heads": 8,
        "kv_heads": 4,
        "ffn": 128,
        "vocab": 256,
    }
    est = pipemem.estimate(
        hf_config(spec),
        mode="traced",
        kernel_policy="cpu",
        convention="torchtitan",
        step="first",
        dtype="fp32",
        tp=world,
        micro_batch=2,
        seq_len=64,
        recompute_allgather=regather,
        recompute="full" if checkpoint else "none",
    )
    r = est.ranks[0]
    return {"peak_bytes": r.peak_allocated_bytes, "peak_at": r.peak_at, "static_bytes": r.static.total}


@pytest.mark.parametrize("world", [2, 4])
def test_keeps_the_shard_instead_of_the_gathered_input(world):
    # Peak at the loss's backward, every forward's saves alive: each of the 2 block inputs per
    # layer (attention, MLP) and the LM head's input is kept as a [b, s/tp, h] shard instead
    # of the gathered [b, s, h]: (tp - 1) / tp * b*s*h fp32 elements each.
    layers, b, s, h = 3, 2, 64, 64
    plain, regather = _traced(world, False, layers=layers), _traced(world, True, layers=layers)
    assert plain["peak_at"] == regather["peak_at"]
    assert plain["static_bytes"] == regather["static_bytes"]
    per_input = (world - 1) * b * s * h * 4 // world
    assert plain["peak_bytes"] - regather["peak_bytes"] == (2 * layers + 1) * per_input


def test_under_checkpointing_keeps_no_more_than_colwise_parallel():
    # A checkpointed layer keeps only its input either way; the re-gathered shard lives inside
    # the layer's backward, where the gathered input of the plain style lived.
    plain, regather = _traced(2, False, checkpoint=True), _traced(2, True, checkpoint=True)
    assert regather["peak_bytes"] <= plain["peak_bytes"]


def test_embedding_is_sharded_like_colwise_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from pipemem.torch_tp import RegatherColwiseParallel
    from pipemem.traced.dist_capture import fake_process_group

    with fake_process_group(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        a = parallelize_module(torch.nn.Embedding(16, 8), mesh, ColwiseParallel())
        b = parallelize_module(torch.nn.Embedding(16, 8), mesh, RegatherColwiseParallel())
        assert a.weight.placements == b.weight.placements
        assert len(b._forward_pre_hooks) == len(a._forward_pre_hooks)
        lin = parallelize_module(torch.nn.Linear(8, 8), mesh, RegatherColwiseParallel(sequence_dim=0))
        assert len(lin._forward_pre_hooks) == len(a._forward_pre_hooks) + 1
