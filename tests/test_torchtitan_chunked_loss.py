"""Under the torchtitan convention `--loss chunked` is torchtitan's ChunkedLossWrapper (its 0.3
default head: output layer, loss and backward per sequence chunk), not torchtune's chunked
output (whole logits kept for the loss): the same name must not mean two heads."""

import pytest

import pipemem

KW = dict(
    seq_len=1024,
    micro_batch=4,
    dp=4,
    fsdp=True,
    dtype="bf16",
    recompute="selective",
    convention="torchtitan",
    grads="set-to-none",
    layers=2,
)


def _peak(**kw) -> int:
    return pipemem.estimate("llama3-8b", **{**KW, **kw}).max_peak_allocated_bytes


def test_loss_chunked_is_the_wrapper_with_its_chunk_count():
    assert _peak(loss="chunked", loss_chunks=4) == _peak(extra={"loss_chunks": 4})
    assert _peak(loss="chunked") == _peak()  # 8 chunks: torchtitan's default either way


def test_more_chunks_hold_less_logits():
    assert _peak(loss="chunked", loss_chunks=16) < _peak(loss="chunked", loss_chunks=2)


def test_wrapper_holds_less_than_torchtunes_chunked_output():
    # torchtune's chunked CE keeps every chunk's bf16 logits for the loss's backward; the
    # wrapper runs each chunk's backward at once
    hf = pipemem.estimate("llama3-8b", **{**KW, "convention": "hf", "loss": "chunked"})
    assert _peak(loss="chunked") < hf.max_peak_allocated_bytes


def test_wrapper_runs_under_tensor_parallel():
    # torchtitan's wrapper composes with loss parallel (it was refused at tp > 1 as if it
    # were torchtune's); Liger's fused linear CE still needs whole logits
    tp = {"dp": 2, "tp": 2}
    assert _peak(loss="chunked", **tp) == _peak(**tp)
    with pytest.raises(pipemem.UserError, match="--loss fused_linear"):
        _peak(loss="fused_linear", **tp)
