"""DeepSpeed's ZeRO engine running a tiny Hugging Face Llama training step on the CPU, one rank of
a real gloo process group, its allocations measured by PyTorch's profiler.

Each rank (launched by `validate deepspeed` as `python -m pipemem.validation.deepspeed_trace
CASE.json OUT.json` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, DS_ACCELERATOR=cpu):

* joins the gloo process group (`torch.distributed`, env://) and `deepspeed.init_distributed`;
* builds `transformers.LlamaForCausalLM` from a `LlamaConfig` (SDPA attention, fp32 as HF builds it;
  under `deepspeed.zero.Init` for ZeRO-3, as HF's and Lightning's integrations do), with
  `gradient_checkpointing_enable(use_reentrant=False)` when the case asks;
* `deepspeed.initialize` with bf16 on, the case's `zero_optimization` block, DeepSpeed's AdamW
  (`"torch_adam": true`: `torch.optim.AdamW`, the CPU has no FusedAdam without building its op);
* runs the step twice (`engine(input_ids=..., labels=...).loss`, `engine.backward(loss)`,
  `engine.step()`) on random token ids, labels = input ids (HF's loss inside the model).

Measured: `torch.profiler.profile(profile_memory=True)` from before the model is built to the end of
step 2. Its `[memory]` events are every allocation and free of PyTorch's CPU allocator (the CPU
allocator frees at once: no cache), so their running sum is the bytes alive; `static_bytes` is that
sum when step 2 starts, `peak_bytes` its largest value during step 2, `peak_at` the phase
(forward / backward / step) and the innermost operator around the allocation that reached it.
`check_gc_bytes` sums the storages of every tensor the garbage collector reaches at step 2's start
(an independent count of `static_bytes`). `breakdown` lists the tensors the engine's optimizer
holds after step 1, by attribute. `events` lists step 2's large allocations (>= `event_bytes`).

`python -m pipemem.validation.deepspeed_trace --plain CASE.json OUT.json` runs the same model
without DeepSpeed (bf16 parameters, torch.optim.AdamW, one process) for checking the measurement
against an analytic count (`plain_expected`).
"""

from __future__ import annotations

import gc
import os
import sys

from .allocations import MARK, gc_storages, profiled_run
from .case_model import llama_hf_config
from .case_worker import run_case_file


def llama_config(case: dict):
    from transformers import LlamaConfig

    fields = llama_hf_config(case)
    del fields["model_type"]  # LlamaConfig's own
    return LlamaConfig(**fields | {"rope_theta": 500000.0}, attn_implementation="sdpa")


def ds_config(case: dict) -> dict:
    zero = {"stage": case["zero"]}
    zero.update(case.get("zero_config", {}))
    return {
        "train_micro_batch_size_per_gpu": case["micro_batch"],
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _build(case: dict):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(case))
    if case.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _batch(case: dict):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, case["model"]["vocab"], (case["micro_batch"], case["seq_len"]), generator=g)
    return ids, ids.clone()


def _tensors_in(obj, depth=0):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x, depth + 1)
    elif (
        depth < 2
        and type(obj).__module__.startswith("deepspeed.runtime.zero")
        and hasattr(obj, "__dict__")
        and not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
    ):
        for x in vars(obj).values():  # e.g. ZeRO-3's IPG bucket objects (their `.buffer`)
            yield from _tensors_in(x, depth + 1)


def breakdown(engine, n_params: int) -> list[dict]:
    """The tensors DeepSpeed's ZeRO optimizer (and the engine's module) hold, by attribute: distinct
    storages, attributed to the first attribute that names them (largest first)."""
    import torch

    opt = engine.optimizer
    seen = set()
    rows = []

    def add(name, tensors):
        by_dtype = {}
        for t in tensors:
            if t.device.type != "cpu" or t.is_meta:
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if not st.nbytes() or key in seen:
                continue
            seen.add(key)
            by_dtype[str(t.dtype).replace("torch.", "")] = (
                by_dtype.get(str(t.dtype).replace("torch.", ""), 0) + st.nbytes()
            )
        for dt, b in by_dtype.items():
            rows.append({"what": name, "dtype": dt, "bytes": b, "bytes_per_param": round(b / n_params, 4)})

    state_tensors = {}
    base = getattr(opt, "optimizer", None)
    if base is not None:
        for st in base.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    state_tensors.setdefault(k, []).append(v)
    attrs = {k: v for k, v in vars(opt).items() if k != "optimizer"}
    # the flat buffers first (they own the storages the params view)
    order = sorted(attrs, key=lambda k: (0 if "flat" in k else 1 if "partition" in k else 2, k))
    for k in order:
        ts = list(_tensors_in(attrs[k]))
        if ts:
            add(k.replace("_DeepSpeedZeroOptimizer_Stage3__", "__"), ts)
    for k, ts in state_tensors.items():
        add(f"optimizer.state[{k}]", ts)
    add("module.parameters", [p.data for p in engine.module.parameters()])
    add(
        "module.parameters.ds_tensor",
        [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")],
    )
    add("module.parameters.grad", [p.grad for p in engine.module.parameters() if p.grad is not None])
    add("module.buffers", list(engine.module.buffers()))
    return sorted(rows, key=lambda r: -r["bytes"])


def _gathered(engine) -> dict:
    """ZeRO-3: the parameters whose full bf16 data is present (gathered or persistent) now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    avail = [
        p for p in engine.module.parameters() if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE
    ]
    return {
        "params": len(avail),
        "of": sum(1 for _ in engine.module.parameters()),
        "bytes": sum(p.ds_numel * p.element_size() for p in avail),
        "persistent_bytes": sum(
            p.ds_numel * p.element_size() for p in avail if getattr(p, "ds_persist", False)
        ),
    }


def zero_settings(engine) -> dict:
    zc = engine._config.zero_config
    keys = (
        "stage",
        "contiguous_gradients",
        "overlap_comm",
        "reduce_scatter",
        "reduce_bucket_size",
        "allgather_partitions",
        "allgather_bucket_size",
        "prefetch_bucket_size",
        "max_live_parameters",
        "max_reuse_distance",
        "param_persistence_threshold",
        "model_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save",
        "use_multi_rank_bucket_allreduce",
    )
    out = {}
    for k in keys:
        if hasattr(zc, k):
            v = getattr(zc, k)
            out[k] = v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
    return out


# ---- the rank ------------------------------------------------------------------------------------


def skip_shm_comm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op in init_distributed,
    behind a lock file in torch's extension cache: a build killed half-way (a timed-out run)
    leaves the lock, and every later run then waits on it for ever. The op only speeds up
    all-reduce between the processes (its buffers are shared memory, outside PyTorch's allocator
    and the profiler's count), so the runs use gloo's own all-reduce instead."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def run_rank(case: dict) -> dict:
    import logging

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    config = ds_config(case)
    out = {"rank": rank}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ids, labels = _batch(case)
        with record_function(MARK + "build"):
            if case["zero"] == 3:
                with deepspeed.zero.Init(config_dict_or_path=config):
                    model = _build(case)
            else:
                model = _build(case)
        n_params = sum(int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        with record_function(MARK + "initialize"):
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters()], config=config
            )
        del model
        for step in (1, 2):
            if step == 2:
                gc.collect()
                gcs = gc_storages()
                out["check_gc_bytes"] = sum(gcs.values())
                out["breakdown"] = breakdown(engine, n_params)
                out["param_dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
            with record_function(f"{MARK}step{step}"):
                with record_function(f"{MARK}step{step}.forward"):
                    loss = engine(input_ids=ids, labels=labels).loss
                if step == 2 and case["zero"] == 3:
                    loss.register_hook(
                        lambda g: out.__setitem__("gathered_at_backward_start", _gathered(engine))
                    )
                with record_function(f"{MARK}step{step}.backward"):
                    engine.backward(loss)
                with record_function(f"{MARK}step{step}.step"):
                    engine.step()
                out[f"loss{step}"] = float(loss)
                out["loss_dtype"] = str(loss.dtype)
                del loss
        gc.collect()
        end = gc_storages()
    out.update(profiled_run(prof, case, gcs, end))
    out.update(
        n_params=n_params,
        zero_settings=zero_settings(engine),
        optimizer=type(engine.optimizer).__name__,
        basic_optimizer=type(engine.basic_optimizer).__name__,
        world=dist.get_world_size(),
        deepspeed=deepspeed.__version__,
        torch=torch.__version__,
    )
    dist.barrier()
    dist.destroy_process_group()
    return out


def run_plain(case: dict) -> dict:
    """The measurement checked without DeepSpeed: bf16 model, torch.optim.AdamW (for-loop on the CPU),
    zero_grad(set_to_none=True), one process."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    out = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ids, labels = _batch(case)
        model = _build(case)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        for step in (1, 2):
            if step == 2:
                gc.collect()
                gcs = gc_storages()
                out["check_gc_bytes"] = sum(gcs.values())
            with record_function(f"{MARK}step{step}"):
                with record_function(f"{MARK}step{step}.forward"):
                    loss = model(input_ids=ids, labels=labels).loss
                with record_function(f"{MARK}step{step}.backward"):
                    loss.backward()
                with record_function(f"{MARK}step{step}.step"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                del loss
        gc.collect()
        end = gc_storages()
    out.update(profiled_run(prof, case, gcs, end))
    out["plain_expected"] = plain_expected(model, opt, ids, labels)
    return out


def plain_expected(model, opt, ids, labels) -> dict:
    """What the plain run holds at step 2's start, counted from the objects: parameters, buffers,
    AdamW's states (two moments in the parameter dtype, one fp32 `step` scalar per parameter), the batch."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    states = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    batch = ids.numel() * ids.element_size() + labels.numel() * labels.element_size()
    return {
        "params": params,
        "buffers": buffers,
        "optimizer_states": states,
        "batch": batch,
        "total": params + buffers + states + batch,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plain = bool(argv) and argv[0] == "--plain"
    run = run_plain if plain else run_rank
    return run_case_file(lambda case: {"case": case["name"], **run(case)}, argv[plain:], indent=1)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    raise SystemExit(main())
