"""The kernel stand-ins the traced validate workers share (pipemem/validation/kernel_stand_ins.py)."""

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses import fake_impls  # noqa: E402
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode  # noqa: E402

from pipemem.validation import kernel_stand_ins as ksi  # noqa: E402


@pytest.mark.parametrize("int_value", [0, 1])
def test_install_fake_item_gives_constants_and_undo_puts_the_table_back(int_value):
    table = fake_impls.op_implementations_dict
    before = {op: (op in table, table.get(op)) for op in ksi.ITEM_OPS}
    undo = ksi.install_fake_item(int_value)
    try:
        with FakeTensorMode():
            assert torch.ones(3, dtype=torch.int64).sum().item() == int_value
            assert torch.ones(3).sum().item() == 1.0
            assert torch.ones(3, dtype=torch.bool).all().item() is False
    finally:
        undo()
    assert {op: (op in table, table.get(op)) for op in ksi.ITEM_OPS} == before
    with FakeTensorMode(), pytest.raises(DataDependentOutputException):  # no value again
        torch.ones(3).sum().item()


def test_flash_stand_in_saves_what_the_kernel_saves_and_takes_megatrons_calls():
    class Config:
        pass

    attn = ksi.FlashAttention(Config(), layer_number=1, attn_mask_type=None, softmax_scale=None)
    s, b, a, d, dv = 8, 2, 4, 16, 12
    q = torch.randn(s, b, a, d, requires_grad=True)
    k = torch.randn(s, b, a, d)
    v = torch.randn(s, b, a, dv)
    out = attn(q, k, v, None, None, attn_mask_type=None, packed_seq_params=None)
    assert out.shape == (s, b, a * dv)  # [s, b, heads x v's head dim]
    saved = out.grad_fn.saved_tensors
    assert [t.shape for t in saved] == [q.shape, k.shape, v.shape, out.shape, (b, a, s)]
    assert saved[-1].dtype == torch.float32  # the logsumexp


def test_grouped_linear_keeps_one_weight_per_expert_and_accumulates_dummy_wgrads():
    class Config:
        params_dtype = torch.float32

    ksi.DUMMY_WGRADS.clear()
    lin = ksi.GroupedLinear(3, 8, 5, config=Config(), init_method=None, bias=False, is_expert=True)
    assert [tuple(w.shape) for w in lin.weights] == [(5, 8)] * 3
    assert not any(w.allreduce for w in lin.weights)
    x = torch.randn(6, 8, requires_grad=True)
    y, bias = lin(x, [2, 2, 2])
    assert y.shape == (6, 5) and bias is None
    y.sum().backward()
    assert list(ksi.DUMMY_WGRADS) == [(5, 8, torch.float32)]  # one cached dummy for the three
