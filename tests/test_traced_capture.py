"""Traced mode, capture layer: hand-derived programs of tiny modules, and traced vs real CPU
steps of generic (non-HF) modules measured with the profiler."""

import pytest

torch = pytest.importorskip("torch")

from pipemem.ir import TensorKind  # noqa: E402
from pipemem.traced.step import trace_step  # noqa: E402
from pipemem.validation.cpu import measure_step  # noqa: E402


def test_linear_sum_hand_derived():
    # y = x @ W^T (2x3 fp32 = 24 B), loss = y.sum() (4 B). Sum's backward needs no input, so y is
    # dropped as soon as loss_fn returns: 4 B stay after the forward, the peak is 24 + 4.
    model = torch.nn.Linear(4, 3, bias=False)
    step = trace_step(
        model, torch.randn(2, 4), loss_fn=lambda y: y.sum(), optimizer_factory=None, kernel_policy="cpu"
    )
    assert step.static["params"] == 3 * 4 * 4
    assert step.static["inputs"] == 2 * 4 * 4
    assert step.net_after_forward == 4
    assert step.phase("forward").peak_bytes == 24 + 4
    # without an optimizer the 48-byte weight gradient outlives the step: persistent grad
    bw = step.programs[1]
    grads = {t.storage for t in bw.tensors.values() if t.kind is TensorKind.GRAD}
    assert len(grads) == 1 and bw.tensors[grads.pop()].nbytes == 48
    assert step.phase("backward").net_bytes == 48 - 4  # grad kept, loss dropped at the end


def test_views_share_storage_and_inplace_costs_nothing():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = x @ self.w  # 8x8 fp32 = 256 B
            h = h.relu_()  # in place: same storage
            return h.t().reshape(-1).sum()  # t: view; reshape of a transposed tensor copies (256 B)

    step = trace_step(M(), torch.randn(8, 8), optimizer_factory=None, kernel_policy="cpu")
    fwd = step.programs[0]
    relu = next(op for op in fwd.ops if op.type.startswith("relu_"))
    assert fwd.tensors[relu.outputs[0]].storage == fwd.tensors[relu.inputs[0]].storage
    # peak: h (256, kept by relu_ backward) + the reshape copy (256) + sum (4)
    assert step.phase("forward").peak_bytes == 256 + 256 + 4
    assert step.net_after_forward == 256 + 4


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(64, 256)
        self.drop = torch.nn.Dropout(0.1)
        self.l2 = torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.l2(self.drop(torch.nn.functional.gelu(self.l1(x)))).pow(2).mean()


@pytest.mark.parametrize("opt", ["adamw", "sgd", "none"])
def test_generic_module_matches_real_cpu_step(opt):
    factories = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
        "sgd": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
        "none": None,
    }
    torch.manual_seed(0)
    model = MLP().train()
    x = torch.randn(32, 64)
    est = trace_step(model, (x,), optimizer_factory=factories[opt], kernel_policy="cpu")
    optimizer = factories[opt](model.parameters()) if factories[opt] else None
    real = measure_step(model, (x,), {}, lambda out: out, optimizer, inputs=[x])
    assert est.static["total"] == real.static_bytes
    assert est.net_after_forward == real.net_after_forward
    assert est.peak_bytes == real.peak_bytes


def test_phases_and_module_labels():
    est = trace_step(MLP().train(), torch.randn(8, 64), kernel_policy="cpu")
    assert [p.name for p in est.programs] == ["forward", "backward", "optimizer"]
    modules = {op.module for op in est.programs[0].ops}
    assert {"l1", "l2", "drop"} <= modules
    kinds = {t.kind for p in est.programs for t in p.tensors.values()}
    assert {TensorKind.PARAM, TensorKind.GRAD, TensorKind.OPTIMIZER_STATE, TensorKind.ACTIVATION} <= kinds
    # optimizer states are created in the step and never freed
    states = [t for t in est.programs[2].tensors.values() if t.kind is TensorKind.OPTIMIZER_STATE]
    assert states and all(t.persistent for t in states)


def test_trace_stage_forward_and_backward_from_output_grad():
    from pipemem.traced import trace_stage

    stage = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(4, 16, requires_grad=True)  # activation from the previous stage
    step = trace_stage(stage, (x,), kernel_policy="cpu")
    # the forward keeps its 4x16 fp32 output (256 B) for the stage's caller
    assert step.net_after_forward == 4 * 16 * 4
    bw = step.programs[1]
    grads = {t.storage for t in bw.tensors.values() if t.kind is TensorKind.GRAD}
    assert len(grads) == 1  # dW; dX goes to x.grad of the input (not a parameter)


def test_trace_stage_takes_an_optimizer_only_when_named():
    from pipemem.traced import trace_stage
    from pipemem.traced.step import adamw

    def states(step):
        return [t for p in step.programs for t in p.tensors.values() if t.kind is TensorKind.OPTIMIZER_STATE]

    x = torch.randn(4, 16, requires_grad=True)
    assert not states(trace_stage(torch.nn.Linear(16, 16, bias=False), (x,), kernel_policy="cpu"))
    with_opt = trace_stage(
        torch.nn.Linear(16, 16, bias=False), (x,), optimizer_factory=adamw, kernel_policy="cpu"
    )
    assert states(with_opt)


def test_import_pipemem_and_traced_package_do_not_import_torch():
    import subprocess
    import sys

    code = "import sys, pipemem, pipemem.traced, pipemem.validation.cpu; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
