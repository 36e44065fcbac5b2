"""torchtune's distributed full fine-tune step, traced for one rank on fake tensors.

What `recipes/full_finetune_distributed.py` (torchtune 0.6.1) does with the model (or
`lora_finetune_distributed.py`, whose model setup differs only in building the LoRA model and
leaving only its adapters trainable, `set_trainable_params(model, get_adapter_params(model))`,
before checkpointing and sharding; its step is the same), in one
process holding rank 0 of PyTorch's fake process group (`pipemem.traced.dist_capture`):
torchtune's own decoder from its `llama3_2` component builder, built on the meta device;
with `enable_activation_checkpointing`, its `set_activation_checkpointing` on every decoder layer;
torchtune's `training.shard_model` with its `get_shard_conditions` (every decoder layer, the
config's `custom_sharded_layers`, then the root: FSDP2 `fully_shard`, no mixed-precision
policy: torchtune trains in bf16); `to_empty` on fake CPU tensors; `torch.optim.AdamW(fused=
True)` (30 of the 33 AdamW full-finetune configs torchtune ships pass `fused: True`); then the
recipe's step twice -- forward, shifted labels, the loss times the token count, backward,
`training.scale_grads`, the optimizer step and `zero_grad(set_to_none=True)` -- the second
recorded with pipemem's FSDP2 recorder and walked with liveness.

torchtune's package `__init__` imports datasets and a torchao module newer torchao releases
moved: its model and training code are imported under bare package modules
(`features.torchtune_packages`). The loss is `torch.nn.CrossEntropyLoss` (torchtune's
`CEWithChunkedOutputLoss` with `loss_chunks` > 1, as its configs name it). Attention runs
under pipemem's CUDA kernel policy (SDPA's flash kernel).

Run as `python -m pipemem.validation.torchtune_trace CASE.json OUT.json` (validate torchtune
does, one subprocess per case: each gets a fresh process group).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from pathlib import Path

import torch

from .case_model import llama_hf_config, torchtune_decoder_kwargs, torchtune_lora_llama
from .case_worker import run_case_file
from .recorded_step import default_dtype, recorded_peak


@contextlib.contextmanager
def torchtune_training():
    """torchtune's model code and `torchtune.training._distributed`, imported without the
    package `__init__`s."""
    from .features import torchtune_packages

    with torchtune_packages():
        name = "torchtune.training"
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(Path(sys.modules["torchtune"].__path__[0]) / "training")]
        pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        pkg.__spec__.submodule_search_locations = pkg.__path__
        sys.modules[name] = pkg
        yield


def _build(case: dict):
    from torchtune.models.llama3_2._component_builders import llama3_2

    config = llama_hf_config(case)
    seq = case["seq_len"]
    builder = dict(tie_word_embeddings=config["tie_word_embeddings"], rope_base=config["rope_theta"])
    lora = case.get("lora")
    if not lora:
        return llama3_2(**torchtune_decoder_kwargs(config, seq), **builder)
    # lora_finetune_distributed's _setup_model: the LoRA builder, then only the adapters trainable
    return torchtune_lora_llama(
        config,
        seq,
        lora["attn_modules"],
        mlp=lora["mlp"],
        rank=lora["rank"],
        alpha=2 * lora["rank"],
        **builder,
    )


def trace_rank(case: dict, rank: int = 0) -> dict:
    """The second step of `rank`: its peak, the bytes alive when it starts, and its phases."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..ir import TensorKind
    from ..traced import kernel_policy as policies
    from ..traced.capture import ModuleScope
    from ..traced.dist_capture import DistStorageRecorder, fake_process_group
    from ..traced.stack import local_tensor

    world = case["world"]
    with torchtune_training(), fake_process_group(rank, world):
        from functools import partial

        import torchtune.training._distributed as tt_dist
        from torchtune.modules.loss import CEWithChunkedOutputLoss
        from torchtune.training._grad_scaler import scale_grads

        with torch.device("meta"), default_dtype(torch.bfloat16):
            model = _build(case)
        if case.get("activation_checkpointing"):
            # the recipe's enable_activation_checkpointing (ac_mode unset): every decoder layer
            from torchtune.modules import TransformerSelfAttentionLayer
            from torchtune.training.memory import set_activation_checkpointing

            set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
        custom = case.get("custom_sharded_layers") or None
        if world > 1:  # the recipe shards only with a data-parallel dimension above 1
            tt_dist.shard_model(
                model,
                [partial(tt_dist.get_shard_conditions, names_to_match=custom)],
                cpu_offload=False,
                reshard_after_forward=case.get("reshard_after_forward", True),
            )
        chunks = case.get("loss_chunks", 1)
        if chunks > 1:
            model.set_num_output_chunks(chunks)
            loss_fn = CEWithChunkedOutputLoss(num_output_chunks=chunks)
        else:
            loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100)
        ropes = _rope_caches(model)
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model.to_empty(device="cpu")
            for mod, buffers in ropes:
                for name, value in buffers.items():
                    mod.register_buffer(name, fake.from_tensor(value), persistent=False)
                mod.is_cache_built = True
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
            out = _record(
                model,
                opt,
                loss_fn,
                case,
                DistStorageRecorder,
                ModuleScope,
                TensorKind,
                policies,
                local_tensor,
                scale_grads,
            )
    return out


def _rope_caches(model) -> list:
    """torchtune's RoPE caches, which a model built on meta leaves unbuilt (the recipe builds
    them on the device at init): computed for real here (small: max_seq_len x head_dim),
    made fake tensors of the traced model."""
    out = []
    for mod in model.modules():
        if hasattr(mod, "rope_init") and hasattr(mod, "is_cache_built"):
            real = object.__new__(type(mod))
            real.__dict__ = {k: dict(v) if isinstance(v, dict) else v for k, v in mod.__dict__.items()}
            real._buffers = {}
            real.rope_init()
            out.append((mod, dict(real._buffers)))
    return out


def _record(
    model, opt, loss_fn, case, Recorder, Scope, TensorKind, policies, local_tensor, scale_grads
) -> dict:
    b, s = case["micro_batch"], case["seq_len"]
    ignore = torch.full((b, 1), -100, dtype=torch.long)
    scope = Scope(model)
    rec = Recorder(scope)
    rec.register([local_tensor(p) for p in model.parameters()], TensorKind.PARAM)
    rec.register([local_tensor(x) for x in model.buffers()], TensorKind.BUFFER)

    def step():
        # full_finetune_distributed.train(), one step without gradient accumulation
        tokens = torch.empty((b, s), dtype=torch.long)
        labels = torch.empty((b, s), dtype=torch.long)
        num_tokens = (labels != -100).sum()
        logits = model(tokens)
        labels = torch.hstack((labels[..., 1:], ignore))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        loss = loss_fn(logits, labels) * num_tokens
        del logits
        rec.begin("backward")
        loss.backward()
        torch.distributed.all_reduce(num_tokens)
        scale_grads(model, case["world"] / num_tokens)
        rec.begin("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)

    with scope, rec.fsdp_resizes(), rec, policies.context("cuda"):
        step()  # step 1: the optimizer states are made
        rec.restart()
        rec.begin("forward")
        step()  # step 2, recorded
    return recorded_peak(rec)


def main(argv=None) -> int:
    return run_case_file(lambda case: {"case": case["name"], **trace_rank(case)}, argv)


if __name__ == "__main__":
    raise SystemExit(main())
