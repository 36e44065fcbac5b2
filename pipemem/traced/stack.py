"""A decoder-only LM from Hugging Face decoder layers, split and sharded the way torchtitan
does it: the model of traced mode's parallel plans (pipemem.traced.parallel) and of the real
runs that validate them (pipemem.validation.dist).

`DecoderStack` is a contiguous slice [embedding] -> layers -> [final norm -> lm_head]: a
pipeline stage (torch.distributed.pipelining runs one per stage), or the whole model for a
tensor-parallel (`tp_plan`: torchtitan's Llama plan) or FSDP2 (`fully_shard` per decoder
layer and the root) rank. The loss is torchtitan's cross entropy over the flattened logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# Families whose causal LM runs embedding -> decoder layers -> final norm -> head and nothing
# else (no scaled embedding, no logit soft-capping, no per-layer-type rotary tables), so a slice of
# their own decoder layers is the model: the stack builds these, from transformers' modules.
STACK_FAMILIES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "olmo2",
    "deepseek_v2",
    "deepseek_v3",
)


def layer_classes(model_type: str):
    """The decoder layer, final norm and rotary embedding classes of `model_type`'s own module in
    transformers (named after its causal LM class: LlamaForCausalLM -> LlamaDecoderLayer...)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in STACK_FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not one of the stack's families {STACK_FAMILIES}")
    prefix = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type].removesuffix("ForCausalLM")
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return (
        getattr(mod, f"{prefix}DecoderLayer"),
        getattr(mod, f"{prefix}RMSNorm"),
        getattr(mod, f"{prefix}RotaryEmbedding"),
    )


class DecoderStack(nn.Module):
    """A contiguous slice of a decoder-only LM of one of `STACK_FAMILIES`, from its own decoder
    layers, written out top to bottom (nanoGPT style) so a pipeline stage, a tensor-parallel
    rank and an FSDP rank all run the same forward:
    [embedding] -> decoder layers -> [final norm -> lm_head]. Position embeddings are computed
    from the sequence length of the *global* sequence, so sequence-parallel shards agree."""

    def __init__(self, cfg, layer_ids, first: bool, last: bool, seq_len: int):
        super().__init__()
        Layer, Norm, Rotary = layer_classes(cfg.model_type)
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
        pe = self.rotary(h, pos)  # reads only h's dtype and device
        for layer in self.layers.values():
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            h = self.lm_head(self.norm(h))
        return h


def build_stack(cfg, layer_ids, first, last, seq_len, dtype=torch.float32, seed=0, init=True):
    """Build on the meta device, then materialise only this slice (no full-model detour), its
    floating parameters in `dtype`. init=False leaves values unset (fake-tensor traces: only
    shapes matter)."""
    with torch.device("meta"):
        m = DecoderStack(cfg, layer_ids, first, last, seq_len)
    _materialize(m, dtype)
    if not init:
        return m.train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for mod in m.modules():  # rotary tables: recompute what the meta build skipped
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
                mod._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=dt(p)), requires_grad=p.requires_grad
                )
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.empty(b.shape, dtype=dt(b))


def causal_lm_loss(logits, target):
    """torchtitan's cross_entropy_loss: over the flattened logits in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def tp_plan(model: "DecoderStack", regather: bool = False) -> dict:
    """torchtitan's Llama plan on HF decoder layers: vocab-sharded embedding whose output is
    reduce-scattered over the sequence, sequence-parallel norms, column-parallel q/k/v and
    gate/up, row-parallel o/down reduce-scattering back to sequence shards, and a
    column-parallel lm_head gathering full logits. regather: the column-parallel linears are
    `pipemem.torch_tp.RegatherColwiseParallel` (they keep the sequence shard of their input)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    if regather:
        from ..torch_tp import RegatherColwiseParallel as ColwiseParallel
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in model.layers:
        p = f"layers.{i}."
        plan.update(
            {
                p + "input_layernorm": SequenceParallel(),
                p + "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                p + "self_attn.q_proj": ColwiseParallel(),
                p + "self_attn.k_proj": ColwiseParallel(),
                p + "self_attn.v_proj": ColwiseParallel(),
                p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                p + "post_attention_layernorm": SequenceParallel(),
                p + "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                p + "mlp.gate_proj": ColwiseParallel(),
                p + "mlp.up_proj": ColwiseParallel(),
                p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    return plan


def make_mesh(world: int):
    """A 1-D CPU device mesh over the whole world (create it outside FakeTensorMode)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def build_tp_model(cfg, seq: int, mesh, init: bool = True, dtype=torch.float32, regather: bool = False):
    from torch.distributed.tensor.parallel import parallelize_module

    model = build_stack(cfg, range(cfg.num_hidden_layers), True, True, seq, dtype, init=init)
    return parallelize_module(model, mesh, tp_plan(model, regather))


def build_fsdp_model(cfg, seq: int, mesh, init: bool = True, dtype=torch.float32):
    from torch.distributed.fsdp import fully_shard

    model = build_stack(cfg, range(cfg.num_hidden_layers), True, True, seq, dtype, init=init)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_ddp_module(
    model, mesh, gradient_as_bucket_view: bool = False, bucket_cap_mb=None, init_sync: bool = True
):
    """`model` in torch's DistributedDataParallel over the mesh's group (CPU: no device_ids);
    real runs only (traced mode models its memory: pipemem.traced.ddp)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        process_group=mesh.get_group(),
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        init_sync=init_sync,
    )


def local_tensor(t):
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t
