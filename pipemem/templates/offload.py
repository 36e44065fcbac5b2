"""Activation offloading: which saved tensors of a layer go to the CPU (pipemem.features).

torchtune's `OffloadActivations` (training/_activation_offloading.py) is a
`saved_tensors_hooks` context around the model's forward: every tensor autograd saves that is
not a parameter and has at least `min_offload_size` (1024) bytes is copied to the CPU when it
is packed and copied back when the backward unpacks it; torchtune wraps the output projection
in a no-op context (its activations are needed at once). Under activation checkpointing the
saved tensors are the checkpoint's inputs. Megatron's fine-grained offloading
(`--fine-grained-activation-offloading --offload-modules ...`) does the same for the inputs
saved by the named modules only.

In the programs: the forward no longer keeps an offloaded tensor past its last forward use
(its GPU copy is freed; with torchtune's streams the free waits for the copy, about one layer
later -- not modelled), and the layer's backward starts by allocating the reloaded copies and
reads those (the prefetch of the next layer's tensors during this one is not modelled).
"""

from __future__ import annotations

from .tape import PARAM, Tape

MIN_OFFLOAD_BYTES = 1024   # torchtune OffloadActivations(min_offload_size=1024)

# Megatron's module names -> the template nodes whose saved inputs they cover
_MODULE_NODES = {
    "attn_norm": lambda n: ".input_norm." in f".{n.outputs[0]}" or n.outputs[0].startswith("input_norm."),
    "mlp_norm": lambda n: n.outputs[0].startswith("post_attention_norm."),
    "qkv": lambda n: n.type in ("linear", "linear_sp") and any(k in n.outputs[0] for k in
                                                                ("attn.qkv", "attn.q_proj", "attn.k_proj",
                                                                 "attn.v_proj")),
    "core_attn": lambda n: n.type in ("flash_attn", "bmm_qk", "bmm_pv", "scale_mask_softmax", "softmax"),
    "attn_proj": lambda n: "attn.o_proj" in n.outputs[0],
    "expert_fc1": lambda n: "moe.experts.fc1" in n.outputs[0],
    "moe_act": lambda n: n.outputs[0].startswith("moe.experts.act") or n.outputs[0].startswith("moe.experts.silu"),
    "attn": lambda n: n.module == "attn",
    "mlp": lambda n: n.module == "mlp",
}


def _selected(feat, node) -> bool:
    if "*" in feat.offload:
        return True
    return any(_MODULE_NODES[m](node) for m in feat.offload if m in _MODULE_NODES)


def mark_offloaded(tape: Tape, feat) -> dict[str, str]:
    """Fill `tape.offloaded` with the layer's saved tensors that the plan offloads."""
    recomputed = {o for n in tape.nodes if n.region >= 0 and not n.pinned for o in n.outputs}
    saved: dict[str, None] = {}
    for n in tape.nodes:
        if not _selected(feat, n):
            continue
        names = list(n.save_i) + list(n.save_w)
        if n.region >= 0 and not n.pinned:
            # a checkpointed node saves nothing itself; its region's inputs are saved instead
            names = [x for x in n.inputs if x not in recomputed]
        for x in names:
            if x in recomputed:
                continue
            saved[x] = None
    out = {}
    for x in saved:
        t = tape.tensors.get(x)
        if t is None or t.kind is PARAM or t.nbytes < MIN_OFFLOAD_BYTES:
            continue
        copy = x + "@h2d"
        tape.t(copy, t.shape, t.dtype)
        out[x] = copy
    tape.offloaded = out
    return out
