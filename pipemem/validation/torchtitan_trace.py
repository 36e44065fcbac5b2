"""torchtitan's own training step, traced per rank on fake tensors (`pipemem validate torchtitan`).

One process holds one rank of a fake process group (`pipemem.traced.dist_capture.fake_process_group`)
and runs torchtitan 0.3's code as its `Trainer` does: the model built on meta from a
`model_registry` flavour, its `parallelize_fn` (TP + SP, CP, activation checkpointing,
FSDP2 with its mixed-precision policy) or `pipelining_fn` (PP stages + schedule), `to_empty`,
`init_weights`, its optimizer and LR scheduler containers and loss, then `Trainer.train_step`
itself (zero_grad, forward-backward, grad-norm clipping, optimizer step) twice on fake CPU
tensors. The second step is recorded with pipemem's DTensor/FSDP recorder
(`pipemem.traced.dist_capture.DistStorageRecorder`, restarted after the first step so optimizer states,
resident grads and FSDP's buffers count as what the step starts with) and walked with liveness.

Patches, each only what a CPU-only build needs:
torchtitan's device type is "cpu"; modules torchtitan imports at load time for what the
step never runs (triton kernels, TensorBoard, HF datasets) are stubbed while it is imported
when they are missing (`_STUBBED`);
`.item()` on fake tensors returns a constant (the token count, the grad norm); the attention
backend is SDPA (FlexAttention has no CPU backward), under pipemem's CUDA kernel policy.

Run as `python -m pipemem.validation.torchtitan_trace CASES.json OUT.json` (validate
torchtitan does, one subprocess per case, so each gets a fresh process group).
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from ..configs.torchtitan import from_trainer_config
from ..traced.torchtitan_model import hf_config, import_stubs
from .case_worker import run_case_file
from .kernel_stand_ins import flex_as_flash, install_fake_item
from .recorded_step import recorded_peak

REQUIRES = "torchtitan==0.3.0"


def available() -> str | None:
    """None when torchtitan can be imported here, else why not (one line)."""
    try:
        with import_stubs():
            importlib.import_module("torchtitan.trainer")
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"torchtitan is not importable ({type(e).__name__}: {e}); pip install 'pipemem[torchtitan]'"
    return None


@contextlib.contextmanager
def _router_autocast_as_cuda():
    """torchtitan's MoE router computes its gate under `torch.autocast(device_type, float32)`:
    on CUDA that casts the input and the weight to fp32 copies (both kept by the matmul for
    backward) and gives fp32 scores; CPU autocast refuses float32 and disables itself, so a CPU
    trace would run the gate in bf16. The gate is run as CUDA runs it:
    `F.linear(x.float(), weight.float())`."""
    import torch.nn.functional as F
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    router_forward = TokenChoiceTopKRouter.forward

    def forward(self, x_BLD, expert_bias_E=None):
        gate = self.gate

        def fp32_gate(x):
            bias = gate.bias.float() if gate.bias is not None else None
            return F.linear(x.float(), gate.weight.float(), bias)

        gate.forward = fp32_gate
        try:
            return router_forward(self, x_BLD, expert_bias_E)
        finally:
            del gate.forward

    TokenChoiceTopKRouter.forward = forward
    try:
        yield
    finally:
        TokenChoiceTopKRouter.forward = router_forward


def job_config(case: dict):
    """torchtitan's Trainer.Config for a case: its debug flavour of the model, the case's
    parallelism, activation checkpointing and batch."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    model = case["model"]
    registry = importlib.import_module(f"torchtitan.models.{model['family']}")
    configs = importlib.import_module(f"torchtitan.models.{model['family']}.config_registry")
    cfg = getattr(configs, model["config"])()
    cfg.model_spec = registry.model_registry(model["flavor"])
    if case.get("layers"):  # the flavor's first N decoder layers (a smaller case of the same model)
        cfg.model_spec.model.layers = cfg.model_spec.model.layers[: case["layers"]]
    p = cfg.parallelism
    par = case["parallelism"]
    p.data_parallel_shard_degree = par.get("dp_shard", 1)
    p.data_parallel_replicate_degree = par.get("dp_replicate", 1)
    p.tensor_parallel_degree = par.get("tp", 1)
    p.context_parallel_degree = par.get("cp", 1)
    p.pipeline_parallel_degree = par.get("pp", 1)
    p.expert_parallel_degree = par.get("ep", 1)
    p.spmd_backend = "partial_dtensor"
    p.fsdp_reshard_after_forward = par.get("reshard_after_forward", "default")
    if par.get("pp", 1) > 1:
        p.pipeline_parallel_schedule = par.get("schedule", "1F1B")
        p.pipeline_parallel_microbatch_size = case.get("microbatch_size", 1)
        if "layers_per_stage" in par:
            p.pipeline_parallel_layers_per_stage = par["layers_per_stage"]
    t = cfg.training
    t.seq_len = case["seq_len"]
    t.local_batch_size = case["local_batch_size"]
    t.global_batch_size = -1
    t.steps = 10
    t.mixed_precision_param = case.get("mixed_precision_param", "bfloat16")
    t.mixed_precision_reduce = case.get("mixed_precision_reduce", "float32")
    t.disable_cuda_graphs = case.get("disable_cuda_graphs", False)
    # torchtitan 0.3's policies: FullAC (every block) or SelectiveAC (its op-level policy)
    ac = case.get("ac", "none")
    cfg.activation_checkpoint = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[ac]
    cfg.compile.enable = False
    return cfg


def _microbatch_step(schedule) -> None:
    """torchtitan 0.3 calls `schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)` with
    the microbatches already split (a newer PyTorch's signature); torch 2.13's `step` takes the
    whole batch and splits it itself, and runs the split microbatches through
    `_step_microbatches`. Route the pre-split call there."""
    whole_batch_step = schedule.step

    def step(
        *args,
        arg_mbs=None,
        kwarg_mbs=None,
        target_mbs=None,
        losses=None,
        return_outputs=True,
        loss_kwargs=None,
        **kwargs,
    ):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch_step(
                *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs
            )
        schedule._stage.has_backward = schedule._has_backward
        schedule._stage.clear_runtime_states()
        schedule._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )

    schedule.step = step


def materialize(model_parts) -> None:
    """The meta-device model parts as fake tensors in training mode, weights initialised as the
    Trainer does (inside a FakeTensorMode)."""
    for m in model_parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()


class NoLog:
    """What train_step asks of the metrics processor and the checkpointer."""

    def should_log(self, step):
        return False

    def maybe_wait_for_staging(self):
        return None


def trace_rank(case: dict, rank: int) -> dict:
    """Trace the second training step of `rank`; returns its peak, static bytes and phases."""
    from ..ir import TensorKind
    from ..traced import kernel_policy as policies
    from ..traced.capture import ModuleScope
    from ..traced.dist_capture import DistStorageRecorder, fake_process_group

    world = case["world"]
    with import_stubs():
        import torchtitan.distributed.parallel_dims as pdm
        import torchtitan.tools.utils as tu
        from torchtitan.components.loss import ChunkedLossWrapper
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.trainer import Trainer
    tu.device_type = "cpu"
    pdm.device_type = "cpu"
    install_fake_item(1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = job_config(case)
    with fake_process_group(rank, world), flex_as_flash(), _router_autocast_as_cuda():
        dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
        pd = ParallelDims.from_config(cfg.parallelism, world)
        pd.build_mesh()
        spec = cfg.model_spec
        mc = spec.model
        mc.update_from_config(config=cfg)
        with torch.device("meta"):
            model = mc.build()
        model_config = hf_config(mc, max_position=case["seq_len"])
        # the estimate's plan: what --from-torchtitan reads from the same Trainer.Config
        plan = from_trainer_config(cfg, model=model_config).plan
        tr = object.__new__(Trainer)
        tr.config, tr.parallel_dims, tr.device, tr.model_config = cfg, pd, torch.device("cpu"), mc
        tr.loss_fn = cfg.loss.build(compile_config=cfg.compile)
        tr.gradient_accumulation_steps = 1
        tr.ntokens_seen = 0
        tr.step = 1
        # what the Trainer passes to the parallelize function, and to the pipelining one with it
        parallelize_kw = dict(
            parallel_dims=pd,
            training=cfg.training,
            parallelism=cfg.parallelism,
            compile_config=cfg.compile,
            ac_config=cfg.activation_checkpoint,
            dump_folder="/tmp",
        )
        if pd.pp_enabled:
            tr.num_pipeline_parallel_microbatches = (
                cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size
            )
            tr.pp_schedule, tr.model_parts, tr.pp_has_first_stage, tr.pp_has_last_stage = spec.pipelining_fn(
                model,
                **parallelize_kw,
                device=tr.device,
                model_config=mc,
                parallelize_fn=spec.parallelize_fn,
                loss_fn=tr.loss_fn,
            )
            _microbatch_step(tr.pp_schedule)
        else:
            tr.num_pipeline_parallel_microbatches = 1
            tr.model_parts = [spec.parallelize_fn(model, **parallelize_kw)]
        del model
        with FakeTensorMode(allow_non_fake_inputs=True):
            materialize(tr.model_parts)
            if isinstance(tr.loss_fn, ChunkedLossWrapper) and (not pd.pp_enabled or tr.pp_has_last_stage):
                tr.loss_fn.set_lm_head(tr.model_parts[-1].lm_head)
                tr.model_parts[-1]._skip_lm_head = True
            tr.optimizers = cfg.optimizer.build(model_parts=tr.model_parts)
            if spec.post_optimizer_build_fn is not None:
                spec.post_optimizer_build_fn(tr.optimizers, tr.model_parts, pd)
            tr.lr_schedulers = cfg.lr_scheduler.build(
                optimizers=tr.optimizers, training_steps=cfg.training.steps
            )
            tr.metrics_processor = tr.checkpointer = NoLog()
            tr.train_context = dist_utils.get_spmd_context(parallel_dims=pd, spmd_typechecking=False)
            tr.fwd_bwd_fn = tr._forward_backward_body
            out = record_two_steps(
                tr,
                case,
                DistStorageRecorder,
                ModuleScope,
                TensorKind,
                policies,
                microbatches=tr.num_pipeline_parallel_microbatches,
            )
    out["model"], out["plan"] = model_config, plan
    return out


def record_two_steps(
    tr, case, Recorder, Scope, TensorKind, policies, microbatches: int = 1, zero_grad_first: bool = False
) -> dict:
    """The peak and phases of a torchtitan Trainer's second `train_step` (the first makes the
    optimizer states), `microbatches` pipeline microbatches per local batch. `zero_grad_first`:
    the release's train_step starts with `optimizers.zero_grad()` (set_to_none), so the last
    step's grads die before the forward allocates anything; the recording takes what is alive
    when it restarts as held throughout, so that zero_grad runs before it restarts."""
    from ..traced.stack import local_tensor

    mb = case["local_batch_size"] // microbatches
    seq = case["seq_len"]

    def batches():
        while True:
            inputs = {"input": torch.empty((mb, seq), dtype=torch.long)}
            if tr.parallel_dims.cp_enabled:  # context parallel shards the positions with the tokens
                inputs["positions"] = torch.empty((mb, seq), dtype=torch.long)
            yield inputs, torch.empty((mb, seq), dtype=torch.long)

    root = tr.model_parts[0] if len(tr.model_parts) == 1 else torch.nn.ModuleList(tr.model_parts)
    scope = Scope(root)
    rec = Recorder(scope)
    params = [local_tensor(p) for m in tr.model_parts for p in m.parameters()]
    rec.register(params, TensorKind.PARAM)
    rec.register([local_tensor(b) for m in tr.model_parts for b in m.buffers()], TensorKind.BUFFER)

    loss_fn = tr.loss_fn

    def loss_then_backward(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        rec.begin("backward")
        return out

    step_fn = tr.optimizers.step

    def optimizer_step(*args, **kwargs):
        rec.begin("optimizer")
        return step_fn(*args, **kwargs)

    def label_states():
        grads = [
            local_tensor(p.grad)
            for p in (p for m in tr.model_parts for p in m.parameters())
            if p.grad is not None
        ]
        rec.set_kind(grads, TensorKind.GRAD)
        states = [
            local_tensor(v)
            for o in tr.optimizers.optimizers
            for st in o.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ]
        rec.set_kind(states, TensorKind.OPTIMIZER_STATE)

    tr.loss_fn, tr.optimizers.step = loss_then_backward, optimizer_step
    data = batches()
    with scope, rec.fsdp_resizes(), rec, policies.context("cuda"):
        tr.train_step(data)  # step 1: optimizer states made, grads left as zero_grad leaves them
        if zero_grad_first:
            tr.optimizers.zero_grad()
        label_states()
        rec.restart()
        rec.begin("forward")
        tr.train_step(data)  # step 2, recorded
    return recorded_peak(rec, by_kind=True)


def main(argv=None, trace=None) -> int:
    """The job file holds the case and the rank to trace (`trace`: a worker's own trace_rank)."""
    trace = trace or trace_rank
    return run_case_file(
        lambda job: {"rank": job["rank"], "case": job["case"]["name"], **trace(job["case"], job["rank"])},
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
