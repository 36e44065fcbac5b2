"""Each modern-trainer feature in templates against a trace made by the feature's own library
(pipemem.validation.features, also `pipemem validate features`): AOTAutograd's partitioner for
--compile, torchtune's chunked CE for --loss chunked, torchao's Float8 for --fp8 tensorwise,
torchtune's optimizer-in-backward hooks for --optimizer-in-backward. A library that is not
installed skips its test (CI installs them: .ci/run)."""

import importlib.util

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("networkx")

from pipemem.validation import features as F  # noqa: E402


def close(row, tol):
    assert row.measured_bytes is not None and row.estimated_bytes is not None
    assert abs(row.estimated_bytes - row.measured_bytes) <= tol * max(row.measured_bytes, 1), row.to_dict()


@pytest.mark.parametrize("case", sorted(F.COMPILE_CASES))
def test_compile_saves_what_the_partitioner_saves(case):
    row = F.compile_case(case)
    assert row.measured_bytes > 0            # compiling does remove saved bytes
    close(row, 0.01)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_cross_entropy_matches_torchtune(compiled):
    if F.torchtune_chunked_loss() is None:
        pytest.skip("torchtune not installed")
    rows = F.chunked_ce_cases(compiled)
    bf16_logits = F.S * F.B * F.HEAD["vocab_size"] * 2
    # what is at stake: eager keeps fp32 log-softmax chunks (2x the bf16 logits), compiled the bf16 logits
    assert rows[0].measured_bytes > (1.9 if not compiled else 0.9) * bf16_logits
    for row in rows:
        close(row, 0.01)


def test_fp8_torchao_matches_torchao():
    pytest.importorskip("torchao.float8")
    kept, peak = F.fp8_cases()
    assert kept.measured_bytes == 0 and kept.estimated_bytes == 0
    close(peak, 0.01)


def test_optimizer_in_backward_matches_torchtune():
    if importlib.util.find_spec("torchtune") is None:
        pytest.skip("torchtune not installed")
    left, peak = F.optimizer_in_backward_cases()
    assert left.measured_bytes == 0
    close(peak, 0.01)
