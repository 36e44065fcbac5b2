"""torchtitan 0.2.2's llama4 training step, traced per rank on fake tensors (`pipemem validate
torchtitan`'s llama4 cases).

torchtitan 0.3 ships no llama4 model; 0.2.2, the newest release that does (models/llama4), runs
with the same PyTorch. It is not installed beside 0.3: the harness puts a directory holding it
(`pip install --no-deps --target DIR torchtitan==0.2.2`) first on this worker's PYTHONPATH
(`PIPEMEM_TORCHTITAN_LLAMA4`, see `torchtitan_llama4.site`). The step is 0.2.2's own, as its
`Trainer` runs it: the model built on meta from `llama4_args[flavor]` after `update_from_config`,
its `parallelize_llama` (FSDP2 with its mixed-precision policy, TP, activation checkpointing),
`to_empty`, `init_weights`, `build_optimizers_with_moe_load_balancing` (AdamW and the expert-bias
update hook), its LR schedulers and cross-entropy loss, then `Trainer.train_step` itself twice;
the second step is recorded as in `torchtitan_trace.py`.

Patches, each only what a CPU-only build needs: the device type is "cpu"; `.item()` of fake
tensors is a constant; `histc` of the router's int64 expert ids gives int64 counts (CUDA's
kernel takes integer inputs, the CPU one refuses them); the GPU capability check of
`TransformerModelArgs.update_from_config` is answered as on the Hopper GPUs llama4 is trained
on (SM90: grouped GEMM experts, as torchtitan runs them there, not its for-loop fallback, whose
`.tolist()` needs data); and `fill_indices_wrapper` (a Triton kernel writing the expert-padding
permutation into the [max_len] int32 buffer it allocates) allocates that buffer and leaves it
unwritten. SDPA runs under pipemem's CUDA kernel policy (flash attention's saved tensors).

Run as `python -m pipemem.validation.torchtitan_llama4_trace CASE.json OUT.json`.
"""

from __future__ import annotations

import contextlib

import torch

from ..configs.torchtitan import from_job_config
from ..traced.torchtitan_llama4 import hf_config, version_check
from ..traced.torchtitan_model import import_stubs
from . import torchtitan_trace
from .kernel_stand_ins import install_fake_item


def _patch_fake_item() -> None:
    """`.item()` of a fake tensor: a constant (token counts, grad norms) instead of an error; and
    CUDA's histc for integer inputs."""
    from torch._subclasses import fake_impls

    install_fake_item(1)

    def histc(fake_mode, func, arg, bins=100, *args, **kwargs):
        # CUDA's histc counts integer inputs (the router's expert ids) into a tensor of their
        # dtype; the CPU kernel, whose meta function the fake tensor asks, refuses them
        with fake_mode:
            return torch.empty((bins,), dtype=arg.dtype, device=arg.device)

    fake_impls.op_implementations_dict[torch.ops.aten.histc.default] = histc


@contextlib.contextmanager
def _cpu_build_patches():
    """The patches of the module docstring, undone on exit."""
    import torchtitan.models.llama4.model.args as largs
    import torchtitan.models.moe.kernels as kernels

    def fill_indices(
        tokens_per_expert_group, start, write_offsets, experts_per_rank, ranks, max_len, *a, **k
    ):
        return torch.full((max_len,), -1, dtype=torch.int32, device=tokens_per_expert_group.device)

    saved = (largs.has_cuda_capability, kernels.fill_indices_wrapper)
    largs.has_cuda_capability = lambda *a, **k: True
    kernels.fill_indices_wrapper = fill_indices
    try:
        yield
    finally:
        largs.has_cuda_capability, kernels.fill_indices_wrapper = saved


def job_config(case: dict):
    """torchtitan 0.2.2's JobConfig for a case (its ConfigManager, from command-line style
    overrides): llama4's flavor, the case's parallelism, activation checkpointing and batch."""
    from torchtitan.config import ConfigManager

    par = case["parallelism"]
    ac = case.get("ac", "none")
    args = [
        "--model.name=llama4",
        f"--model.flavor={case['model']['flavor']}",
        f"--training.seq_len={case['seq_len']}",
        f"--training.local_batch_size={case['local_batch_size']}",
        "--training.steps=10",
        f"--parallelism.data_parallel_shard_degree={par.get('dp_shard', 1)}",
        f"--parallelism.tensor_parallel_degree={par.get('tp', 1)}",
        f"--parallelism.fsdp_reshard_after_forward={par.get('reshard_after_forward', 'default')}",
        f"--activation_checkpoint.mode={ac}",
        "--activation_checkpoint.selective_ac_option=op",
    ]
    return ConfigManager().parse_args(args)


def trace_rank(case: dict, rank: int) -> dict:
    """Trace the second training step of `rank`; returns its peak, static bytes and phases."""
    from ..ir import TensorKind
    from ..traced import kernel_policy as policies
    from ..traced.capture import ModuleScope
    from ..traced.dist_capture import DistStorageRecorder, fake_process_group

    version_check()
    world = case["world"]
    with import_stubs():
        import torchtitan.distributed.parallel_dims as pdm
        import torchtitan.tools.utils as tu
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.llama4 import get_train_spec
        from torchtitan.train import Trainer
    tu.device_type = "cpu"
    pdm.device_type = "cpu"
    _patch_fake_item()
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = job_config(case)
    spec = get_train_spec()
    with fake_process_group(rank, world), _cpu_build_patches():
        p = cfg.parallelism
        pd = ParallelDims(
            dp_shard=p.data_parallel_shard_degree,
            dp_replicate=p.data_parallel_replicate_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            etp=p.expert_tensor_parallel_degree,
            world_size=world,
        )
        args = spec.model_args[cfg.model.flavor]
        args.update_from_config(cfg)
        if case.get("layers"):
            args.n_layers = case["layers"]
        with torch.device("meta"):
            model = spec.model_cls(args)
        model_config = hf_config(args, model, max_position=case["seq_len"])
        tr = object.__new__(Trainer)
        tr.job_config, tr.parallel_dims, tr.device = cfg, pd, torch.device("cpu")
        tr.model_args, tr.train_spec = args, spec
        tr.loss_fn = spec.build_loss_fn(cfg, parallel_dims=pd)
        tr.gradient_accumulation_steps = 1
        tr.ntokens_seen = 0
        tr.step = 1
        tr.model_parts = [spec.parallelize_fn(model, pd, cfg)]
        del model
        with FakeTensorMode(allow_non_fake_inputs=True):
            torchtitan_trace.materialize(tr.model_parts)
            tr.optimizers = spec.build_optimizers_fn(tr.model_parts, cfg.optimizer, pd)
            tr.lr_schedulers = spec.build_lr_schedulers_fn(
                tr.optimizers, cfg.lr_scheduler, cfg.training.steps
            )
            tr.metrics_processor = tr.checkpointer = torchtitan_trace.NoLog()
            tr.train_context = dist_utils.get_train_context(pd.tp_enabled)
            tr.maybe_enable_amp = dist_utils.maybe_enable_amp(pd, cfg.training.mixed_precision_param, "cpu")
            out = torchtitan_trace.record_two_steps(
                tr, case, DistStorageRecorder, ModuleScope, TensorKind, policies, zero_grad_first=True
            )
    # the plan --from-torchtitan reads from the job tables the ranks ran (0.2.2's JobConfig)
    plan = from_job_config(cfg, f"torchtitan llama4 {cfg.model.flavor}", model=model_config).plan
    out["model"], out["plan"] = model_config, plan
    return out


def main(argv=None) -> int:
    """The job file holds the case and the rank to trace."""
    return torchtitan_trace.main(argv, trace=trace_rank)


if __name__ == "__main__":
    raise SystemExit(main())
