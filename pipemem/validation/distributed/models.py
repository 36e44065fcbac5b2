"""The tiny models `pipemem validate dist` trains, shared by the real ranks (validate/dist_worker.py)
and by the estimator's fake-tensor traces (distributed/), so both run the same Python.

`DecoderStack` is a contiguous slice of a decoder-only LM built from HF decoder layers: a
pipeline stage, a tensor-parallel rank and an FSDP rank all run its forward. Parallel plans
follow torchtitan: `tp_plan` (Megatron-style TP with sequence parallel on the norms) and
`fully_shard` per decoder layer plus the root.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

def model_config(spec: dict):
    """A tiny HF Llama / Mixtral config from the case's model dict."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    kind = spec.get("arch", "llama")
    common = dict(hidden_size=spec["hidden"], num_hidden_layers=spec["layers"],
                  num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                  intermediate_size=spec["ffn"], vocab_size=spec["vocab"],
                  max_position_embeddings=4096, tie_word_embeddings=False, attention_dropout=0.0)
    if kind == "mixtral":
        from transformers import MixtralConfig
        cfg = MixtralConfig(num_local_experts=spec.get("experts", 4),
                            num_experts_per_tok=spec.get("topk", 2), **common)
        # grouped_mm keeps every shape independent of the routing (fake tensors cannot follow
        # the eager loop's data-dependent slicing); its CPU kernel wants bf16 weights.
        cfg._experts_implementation = "grouped_mm"
    else:
        from transformers import LlamaConfig
        cfg = LlamaConfig(**common)
    cfg._attn_implementation = "sdpa"
    return cfg


def param_dtype(cfg) -> torch.dtype:
    """fp32, except bf16 for MoE models (HF's grouped_mm experts)."""
    return torch.bfloat16 if getattr(cfg, "model_type", "") == "mixtral" else torch.float32


class DecoderStack(nn.Module):
    """A contiguous slice of a decoder-only LM, written out top to bottom (nanoGPT style) so a
    pipeline stage, a tensor-parallel rank and an FSDP rank all run the same forward:
    [embedding] -> decoder layers -> [final norm -> lm_head]. Position embeddings are computed
    from the sequence length of the *global* sequence, so sequence-parallel shards agree."""

    def __init__(self, cfg, layer_ids, first: bool, last: bool, seq_len: int):
        super().__init__()
        arch = cfg.model_type
        if arch == "mixtral":
            from transformers.models.mixtral.modeling_mixtral import (
                MixtralDecoderLayer as Layer, MixtralRMSNorm as Norm, MixtralRotaryEmbedding as Rotary)
        else:
            from transformers.models.llama.modeling_llama import (
                LlamaDecoderLayer as Layer, LlamaRMSNorm as Norm, LlamaRotaryEmbedding as Rotary)
        self.seq_len = seq_len
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if first else None
        # Keyed by the global layer index, as torchtitan does, so FQNs match across splits.
        self.layers = nn.ModuleDict({str(i): Layer(cfg, layer_idx=i) for i in layer_ids})
        self.norm = Norm(cfg.hidden_size, eps=cfg.rms_norm_eps) if last else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if last else None
        self.rotary = Rotary(config=cfg)

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = torch.arange(self.seq_len).unsqueeze(0)
        pe = self.rotary(h, pos)          # reads only h's dtype and device
        for layer in self.layers.values():
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            h = self.lm_head(self.norm(h))
        return h


def build_stack(cfg, layer_ids, first, last, seq_len, seed=0, init=True):
    """Build on the meta device, then materialise only this slice (no full-model detour).
    init=False leaves values unset (fake-tensor traces: only shapes matter)."""
    with torch.device("meta"):
        m = DecoderStack(cfg, layer_ids, first, last, seq_len)
    _materialize(m, param_dtype(cfg))
    if not init:
        return m.train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for mod in m.modules():   # rotary tables: recompute what the meta build skipped
            if isinstance(getattr(mod, "inv_freq", None), torch.Tensor):
                inv, _ = mod.compute_default_rope_parameters(mod.config)
                for name in ("inv_freq", "original_inv_freq"):
                    if isinstance(getattr(mod, name, None), torch.Tensor):
                        getattr(mod, name).copy_(inv)
    return m.train()


def _materialize(module: nn.Module, dtype: torch.dtype) -> None:
    """Replace meta parameters and buffers by `torch.empty` ones of the same shape (floating
    ones in `dtype`): real CPU tensors, or fake ones under FakeTensorMode (where `to_empty`
    and `.to()` cannot swap)."""
    def dt(t):
        return dtype if t.is_floating_point() else t.dtype
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dt(p)),
                                                     requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.empty(b.shape, dtype=dt(b))


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def make_batch(spec: dict, batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec["vocab"], (batch, seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def make_optimizer(params):
    # foreach=True: the CUDA default path (FINDINGS §4), so the CPU step allocates what a GPU would.
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)



def tp_plan(model: "DecoderStack", regather: bool = False) -> dict:
    """torchtitan's Llama plan on HF decoder layers: vocab-sharded embedding whose output is
    reduce-scattered over the sequence, sequence-parallel norms, column-parallel q/k/v and
    gate/up, row-parallel o/down reduce-scattering back to sequence shards, and a
    column-parallel lm_head gathering full logits. regather: the column-parallel linears are
    `pipemem.torch_tp.RegatherColwiseParallel` (they keep the sequence shard of their input)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel
    if regather:
        from ...torch_tp import RegatherColwiseParallel as ColwiseParallel
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel
    plan = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in model.layers:
        p = f"layers.{i}."
        plan.update({
            p + "input_layernorm": SequenceParallel(),
            p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            p + "self_attn.q_proj": ColwiseParallel(),
            p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(),
            p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(),
            p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def make_mesh(world: int):
    """A 1-D CPU device mesh over the whole world (create it outside FakeTensorMode)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


def build_tp_model(cfg, seq: int, mesh, init: bool = True, regather: bool = False):
    from torch.distributed.tensor.parallel import parallelize_module
    model = build_stack(cfg, range(cfg.num_hidden_layers), True, True, seq, init=init)
    return parallelize_module(model, mesh, tp_plan(model, regather))


def build_fsdp_model(cfg, seq: int, mesh, init: bool = True):
    from torch.distributed.fsdp import fully_shard
    model = build_stack(cfg, range(cfg.num_hidden_layers), True, True, seq, init=init)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_tensor(t):
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def stage_ids_of_rank(schedule: str, rank: int, pp: int, vpp: int) -> list[int]:
    """Stages a rank holds: looped placement for interleaved schedules, V placement for
    ZBV / DualPipeV (torch.distributed.pipelining's stage_index_to_group_rank)."""
    name = schedule.lower()
    if vpp == 1:
        return [rank]
    if name in ("zbvzerobubble", "dualpipev"):
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(vpp)]


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        k = base + (1 if s < extra else 0)
        out.append(list(range(start, start + k)))
        start += k
    return out
