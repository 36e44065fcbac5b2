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
(its GPU copy is freed), and the layer's backward starts by allocating the reloaded copies
and reads those. With its copy stream torchtune keeps the last `max_fwd_stash_size` (5)
offloaded tensors alive on the GPU until later copies push them out; the ones still stashed
when the forward ends are used in place by the backward, never reloaded: the stage's last
layers keep their last 5 saved tensors (`stash_keeps`). Not modelled: the previous autograd
node's reloaded tensors, released one node later in backward.
"""

from __future__ import annotations

from .tape import PARAM, Tape

MIN_OFFLOAD_BYTES = 1024   # torchtune OffloadActivations(min_offload_size=1024)
FWD_STASH = 5              # torchtune OffloadActivations(max_fwd_stash_size=5)

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


def mark_offloaded(tape: Tape, feat, keep: int = 0) -> dict[str, str]:
    """Fill `tape.offloaded` with the layer's saved tensors that the plan offloads, in forward
    order, leaving the last `keep` of them on the GPU (torchtune's forward stash)."""
    recomputed = {o for n in tape.nodes if n.region >= 0 and not n.pinned for o in n.outputs}
    # a tensor leaves the GPU only if every node that keeps it for backward is offloaded (a
    # module's offloaded copy frees nothing while another module still holds the tensor)
    saved: dict[str, bool] = {}
    for n in tape.nodes:
        names = list(n.save_i) + list(n.save_w)
        if n.region >= 0 and not n.pinned:
            # a checkpointed node saves nothing itself; its region's inputs are saved instead
            names = [x for x in n.inputs if x not in recomputed]
        chosen = _selected(feat, n)
        for x in names:
            if x not in recomputed:
                saved[x] = saved.get(x, True) and chosen
    names = [x for x, all_chosen in saved.items() if all_chosen and x in tape.tensors
             and tape.tensors[x].kind is not PARAM
             and tape.tensors[x].nbytes >= MIN_OFFLOAD_BYTES]
    out = {}
    for x in names[:len(names) - keep] if keep else names:
        t = tape.tensors[x]
        copy = x + "@h2d"
        tape.t(copy, t.shape, t.dtype)
        out[x] = copy
    tape.offloaded = out
    return out


def offload_count(tape: Tape, feat) -> int:
    """How many tensors a layer offloads (with nothing kept back)."""
    return len(mark_offloaded(tape, feat))


def stash_keeps(counts: list[int], stash: int = FWD_STASH) -> list[int]:
    """Per layer of a stage (forward order, with `counts` offloaded tensors each), how many of
    its last tensors are still in torchtune's forward stash when the forward ends."""
    keep, left = [0] * len(counts), stash
    for i in range(len(counts) - 1, -1, -1):
        if left <= 0:
            break
        keep[i] = min(left, counts[i])
        left -= keep[i]
    return keep
