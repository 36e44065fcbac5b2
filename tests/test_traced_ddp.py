"""DistributedDataParallel in traced mode (pipemem.traced.ddp): the bucket layout against torch's
own assignment and its own Reducer, the traced estimate's buckets and gradient copies, and the
plans traced mode refuses. (The per-rank peaks against real gloo runs: `pipemem validate dist
--cases ddp2-llama,...`, and ddp2-llama in the CI set of test_validate_dist_runs.py.)"""

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

import pipemem  # noqa: E402
from pipemem.cli.main import main  # noqa: E402
from pipemem.errors import UserError  # noqa: E402
from pipemem.traced.ddp import DDPBuckets, assign_by_size, bucket_layout, bucket_limits  # noqa: E402

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# a batch this short puts the first step's peak in the optimizer step, after every gradient exists
DDP = dict(
    mode="traced",
    kernel_policy="cpu",
    convention="hf",
    step="first",
    dtype="fp32",
    seq_len=8,
    micro_batch=1,
    dp=2,
)


def _mixed_model():
    """Parameters of two dtypes, interleaved, of unequal sizes."""
    return torch.nn.Sequential(
        torch.nn.Linear(300, 700),
        torch.nn.Linear(700, 30).double(),
        torch.nn.Linear(30, 900),
        torch.nn.Embedding(50, 20).double(),
        torch.nn.Linear(900, 5),
    )


@contextlib.contextmanager
def _gloo_world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "limits",
    [
        [1 << 62],
        bucket_limits(None, first_iteration=False),
        bucket_limits(0.5, first_iteration=False),
        [20_000, 900_000],
    ],
)
def test_assignment_is_torchs_own(limits):
    params = list(_mixed_model().parameters())
    theirs, _ = dist._compute_bucket_assignment_by_size(params, limits)
    assert assign_by_size(params, limits) == [list(b) for b in theirs]


def test_rebuilt_limits_are_torchs():
    # the default cap: a 1 MiB first bucket, then 25 MiB; a cap given: that cap throughout
    assert bucket_limits(None, first_iteration=False) == [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024]
    assert bucket_limits(4, first_iteration=False) == [4 * 1024 * 1024]


def test_first_step_buckets_are_the_reducers():
    # A real DDP (gloo, world 1): even with a tiny bucket_cap_mb the Reducer starts with one
    # bucket per dtype (static_graph and find_unused_parameters off), in reversed order.
    model = _mixed_model()
    with _gloo_world_of_one():
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
        theirs = ddp.reducer._get_zeros_like_grad_buckets()
        real = [
            (b.buffer().numel() * b.buffer().element_size(), [tuple(p.shape) for p in b.parameters()])
            for b in sorted(theirs, key=lambda b: b.index())
        ]
    ours = DDPBuckets(model, 1)
    params = ours.params
    assert len(real) == 2
    assert [
        (n, [tuple(params[i].shape) for i in idx]) for n, idx in zip(ours.bucket_bytes, ours.layout)
    ] == real
    assert sum(ours.bucket_bytes) == sum(p.numel() * p.element_size() for p in model.parameters())
    ours.remove()


def test_bucket_copy_and_view_swap():
    # the Reducer's post-accumulate step on real tensors: the bucket gets grad / world; as a
    # bucket view the .grad is then that slot of the bucket, otherwise it keeps its own storage
    x = torch.arange(8.0).reshape(2, 4)
    ref = torch.nn.Linear(4, 3)
    ref(x).pow(2).sum().backward()
    for as_view in (False, True):
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(ref.state_dict())
        ddp = DDPBuckets(model, 2, gradient_as_bucket_view=as_view)
        model(x).pow(2).sum().backward()
        (flat,) = ddp.buckets
        assert torch.allclose(ddp.views[model.weight], ref.weight.grad / 2)
        assert torch.allclose(ddp.views[model.bias], ref.bias.grad / 2)
        in_bucket = model.weight.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert in_bucket == as_view
        if not as_view:
            assert torch.allclose(model.weight.grad, ref.weight.grad)
        assert bucket_layout(ddp.params) == [[0, 1]]
        ddp.remove()


def test_traced_estimate_holds_the_buckets_and_the_grad_copies():
    copy = pipemem.estimate(TINY, grads="ddp-bucket", **DDP)
    view = pipemem.estimate(TINY, grads="ddp-bucket-view", **DDP)
    params = copy.ranks[0].static.params
    for e in (copy, view):
        st = e.ranks[0].static
        assert st.params == params and st.grads == params  # the fp32 buckets: every gradient once
        assert e.ranks[0].peak_at.startswith("optimizer")
        assert any("1 first-step gradient bucket" in w for w in e.warnings)
    # .grad tensors of their own (created in the step) vs views of the buckets
    assert copy.ranks[0].static.grads_in_step == params and view.ranks[0].static.grads_in_step == 0
    # at the optimizer peak every gradient exists: the copies are the whole difference
    assert copy.ranks[0].peak_allocated_bytes - view.ranks[0].peak_allocated_bytes == params
    # the world size changes the scaling, not the memory
    four = pipemem.estimate(TINY, grads="ddp-bucket", **dict(DDP, dp=4))
    assert four.ranks[0].peak_allocated_bytes == copy.ranks[0].peak_allocated_bytes


def test_hf_convention_data_parallel_is_ddp_by_default():
    e = pipemem.estimate(TINY, **DDP)
    assert e.plan.grads == "ddp-bucket" and e.ranks[0].static.grads == e.ranks[0].static.params


@pytest.mark.parametrize(
    "extra,needle",
    [
        (dict(step="steady"), "--step first"),
        (dict(pp=2), "--pp"),
        (dict(recompute="selective"), "--recompute selective"),
        (dict(dtype="bf16"), "master weights"),
    ],
)
def test_plans_traced_ddp_does_not_run_are_refused(extra, needle):
    with pytest.raises(UserError, match=needle.replace("-", r"\-")):
        pipemem.estimate(TINY, grads="ddp-bucket", **dict(DDP, **extra))


def test_cli_refusal_is_one_line(tmp_path, capsys):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    rc = main(
        [
            "estimate",
            "--model",
            str(cfg),
            "--mode",
            "traced",
            "--convention",
            "hf",
            "--dp",
            "2",
            "--grads",
            "ddp-bucket-view",
            "--dtype",
            "fp32",
            "--seq-len",
            "8",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--step first" in err[0]
