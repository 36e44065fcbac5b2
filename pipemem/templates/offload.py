"""Activation offloading: which saved tensors of a layer go to the CPU (pipemem.features).

torchtune's `OffloadActivations` (training/_activation_offloading.py) is a
`saved_tensors_hooks` context around the model's forward: every tensor autograd saves that is
not a parameter and has at least `min_offload_size` (1024) bytes is copied to the CPU when it
is packed and copied back when the backward unpacks it; torchtune wraps the output projection
in a no-op context (its activations are needed at once). Under activation checkpointing the
saved tensors are the checkpoint's inputs. Megatron's fine-grained offloading
(`--fine-grained-activation-offloading --offload-modules ...`) does the same for the inputs
saved by the named modules only.

torchtune's context works per *pack* (one call of its pack hook: one tensor one autograd node
saves; `torchtune_packs`): a tensor two nodes save is copied, and reloaded, twice, and a
linear's weight is packed as `weight.t()`, a view that is not an `nn.Parameter`, so it is
offloaded like an activation (no GPU bytes in the forward; a reloaded copy of the weight in
the backward). Its forward stash holds each packed tensor until `max_fwd_stash_size` (5)
further packs are made (every pack counts: parameters and small tensors too), so a layer's
last packs are released by the next layer's first ones (`Tape.offload_carry`). In backward a
node's packs are reloaded when autograd unpacks them, just before the node runs, and freed
when the next node that reloads anything has run (its hook): the previous layer's last
reloads are still alive while a layer's first reloading node runs. The stage's last layers'
last offloaded tensors (the stash when the forward ends) are used in place by the backward,
never reloaded (`stash_keeps`; counted in offloaded tensors, which is at least the packs
torchtune's window holds). Under activation checkpointing, and for Megatron's modules, the
offloaded tensors are reloaded when the layer's backward starts (`mark_offloaded`).
"""

from __future__ import annotations

from ..ir import Tensor, TensorKind
from .tape import PARAM, Tape

BUFFER = TensorKind.BUFFER

MIN_OFFLOAD_BYTES = 1024  # torchtune OffloadActivations(min_offload_size=1024)
FWD_STASH = 5  # torchtune OffloadActivations(max_fwd_stash_size=5)
# Megatron: TransformerConfig.min_offloaded_tensor_size, in elements (1024 x 1024)
MEGATRON_MIN_OFFLOAD_ELEMENTS = 1024 * 1024
# LayerOptions.offload_keep for a layer that offloads nothing (Megatron's last layer of a stage)
KEEP_ALL = 1 << 30

# Megatron's module names -> the template nodes whose saved inputs they cover
_MODULE_NODES = {
    "attn_norm": lambda n: ".input_norm." in f".{n.outputs[0]}" or n.outputs[0].startswith("input_norm."),
    "mlp_norm": lambda n: n.outputs[0].startswith("post_attention_norm."),
    "qkv": lambda n: (
        n.type in ("linear", "linear_sp")
        and any(k in n.outputs[0] for k in ("attn.qkv", "attn.q_proj", "attn.k_proj", "attn.v_proj"))
    ),
    "core_attn": lambda n: n.type in ("flash_attn", "bmm_qk", "bmm_pv", "scale_mask_softmax", "softmax"),
    "attn_proj": lambda n: "attn.o_proj" in n.outputs[0],
    "expert_fc1": lambda n: "moe.experts.fc1" in n.outputs[0],
    "moe_act": lambda n: (
        n.outputs[0].startswith("moe.experts.act") or n.outputs[0].startswith("moe.experts.silu")
    ),
    "attn": lambda n: n.module == "attn",
    "mlp": lambda n: n.module == "mlp",
}


def _selected(modules, node) -> bool:
    if "*" in modules:
        return True
    return any(_MODULE_NODES[m](node) for m in modules if m in _MODULE_NODES)


def mark_offloaded(
    tape: Tape, feat, keep: int = 0, te_spec: bool = False, moe: bool = False
) -> dict[str, str]:
    """Fill `tape.offloaded` with the layer's saved tensors that the plan offloads, in forward
    order, leaving the last `keep` of them on the GPU (torchtune's forward stash). torchtune's
    context over a layer without checkpointing goes pack by pack instead (`torchtune_packs`).

    Megatron's modules (`te_spec`: its Transformer Engine layer spec) offload tensors of at
    least `MEGATRON_MIN_OFFLOAD_ELEMENTS` elements. In that spec the input norm is fused into
    the QKV linear (`input_layernorm` is an IdentityOp, transformer_layer.py), so `attn_norm`
    offloads nothing, and so does `mlp_norm` in a dense layer (fused into fc1); a MoE layer
    keeps a separate pre-MLP norm."""
    if "*" in feat.offload and all(n.region < 0 for n in tape.nodes):
        torchtune_packs(tape, keep)
        return {}
    modules = set(feat.offload)
    if te_spec:
        modules.discard("attn_norm")
        if not moe:
            modules.discard("mlp_norm")

    def big_enough(t) -> bool:
        if "*" in modules or not te_spec:
            return t.nbytes >= MIN_OFFLOAD_BYTES
        n = 1
        for d in t.shape:
            n *= d
        return n >= MEGATRON_MIN_OFFLOAD_ELEMENTS

    recomputed = {o for n in tape.nodes if n.region >= 0 and not n.pinned for o in n.outputs}
    # a tensor leaves the GPU only if every node that keeps it for backward is offloaded (a
    # module's offloaded copy frees nothing while another module still holds the tensor)
    saved: dict[str, bool] = {}
    for n in tape.nodes:
        names = list(n.save_i) + list(n.save_w)
        if n.region >= 0 and not n.pinned:
            # a checkpointed node saves nothing itself; its region's inputs are saved instead
            names = [x for x in n.inputs if x not in recomputed]
        chosen = _selected(modules, n)
        for x in names:
            if x not in recomputed:
                saved[x] = saved.get(x, True) and chosen
    names = [
        x
        for x, all_chosen in saved.items()
        if all_chosen
        and x in tape.tensors
        and tape.tensors[x].kind is not PARAM
        and big_enough(tape.tensors[x])
    ]
    out = {}
    for x in names[: len(names) - keep] if keep else names:
        t = tape.tensors[x]
        copy = x + "@h2d"
        tape.t(copy, t.shape, t.dtype)
        out[x] = copy
    tape.offloaded = out
    return out


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


def _node_packs(tape: Tape, n) -> list[str]:
    """The tensors one node's autograd function saves, in the order it packs them: a matmul
    saves the weight it read (as `weight.t()`) before its input (HF Conv1D's addmm: after it);
    a parameter saved directly
    (a norm's weight) is packed as itself. Packs the template's nodes do not list, because they
    hold no activation bytes, still move torchtune's stash window: HF's rotary multiplications
    save the model's shared cos and sin (one each per rotated tensor; their views cost nothing
    in the forward, their reloads s x head_dim elements each), SDPA its two RNG-state scalars."""
    weight = [n.params[0]] if n.type.startswith("linear") and n.params and n.params[0] in n.inputs else []
    extra = []
    if n.type == "layernorm" and any(tape.tensors[x].kind is PARAM for x in n.save_i):
        # native_layer_norm's backward node saves the bias too (a parameter: kept, but a pack)
        nm = f"{n.outputs[0]}.bias_pack"
        tape.tensors.setdefault(nm, Tensor(nm, (), "int64", BUFFER))
        extra.append(nm)
    if n.type in ("rope", "flash_attn"):
        out = tape.tensors[n.outputs[0]]
        for tag in ("cos", "sin") if n.type == "rope" else ("rng_seed", "rng_offset"):
            nm = f"{n.outputs[0]}.{tag}"
            if nm not in tape.tensors:
                if n.type == "rope":
                    tape.tensors[nm] = Tensor(nm, (out.shape[0], out.shape[-1]), out.dtype, BUFFER)
                else:
                    tape.tensors[nm] = Tensor(nm, (), "int64", BUFFER)
            extra.append(nm)
    if tape.weights_saved_as_params:  # Conv1D's addmm packs mat1 (the input), then mat2 (W)
        return list(dict.fromkeys((*n.save_i, *n.save_w, *weight, *extra)))
    return list(dict.fromkeys((*weight, *n.save_i, *n.save_w, *extra)))


def _offloadable(tape: Tape, n, x: str) -> bool:
    t = tape.tensors[x]
    if t.nbytes < MIN_OFFLOAD_BYTES:
        return False
    # a parameter saved directly is an nn.Parameter (kept); a linear's is a view of it (moved),
    # unless the linear is HF's Conv1D, which saves the parameter itself
    return t.kind is not PARAM or (
        n.type.startswith("linear") and x == n.params[0] and not tape.weights_saved_as_params
    )


def _holds_bytes(t) -> bool:
    """Whether the forward stash's reference to a packed tensor keeps bytes of its own alive (a
    weight's view and the shared rotary tables do not)."""
    return t.kind not in (PARAM, BUFFER)


def torchtune_packs(tape: Tape, keep: int = 0) -> None:
    """torchtune's OffloadActivations over a layer without checkpointing, pack by pack: fills
    `tape.offload_packs` (node index -> {saved tensor: its reloaded copy}), `offload_release`
    (node index -> tensors its forward stash lets go after that node) and `offload_carry`
    (the previous identical layer's stash tail, and this layer's reloads still alive when the
    next layer's backward starts). The last `keep` offloaded packs stay on the GPU."""
    packs = [(i, x) for i, n in enumerate(tape.nodes) for x in _node_packs(tape, n)]
    offloadable = [k for k, (i, x) in enumerate(packs) if _offloadable(tape, tape.nodes[i], x)]
    # the last `keep` are still in the stash when the forward ends: the backward uses them in place
    moved = offloadable[: max(0, len(offloadable) - keep)] if keep else offloadable
    copies: dict[int, dict[str, str]] = {}
    for k in moved:
        i, x = packs[k]
        if x not in copies.setdefault(i, {}):
            t = tape.tensors[x]
            copies[i][x] = tape.t(f"{x}@h2d{k}", t.shape, t.dtype)
    release: dict[int, list[str]] = {}
    release_before: dict[int, list[str]] = {}
    carry: dict[int, int] = {}
    last = len(tape.nodes) - 1
    last_out = tape.nodes[-1].outputs[0] if tape.nodes else ""

    def first_moved(j: int):
        """The first offloadable pack from index j: the stash lets old packs go only when it
        takes a new offloadable one (a parameter or a small tensor packed changes nothing)."""
        return next((m for m in offloadable if m >= j), None)

    for k in moved:
        i, x = packs[k]
        t = tape.tensors[x]
        if not _holds_bytes(t):
            continue
        j = first_moved(k + FWD_STASH)
        if j is not None:
            # autograd packs a node's saved inputs before the op runs, its saved outputs after
            at_node, what = packs[j]
            before = what not in tape.nodes[at_node].outputs
            (release_before if before else release).setdefault(at_node, []).append(x)
        elif t.storage != tape.tensors[last_out].storage:
            # held to the layer's end; the next (identical) layer's offloadable pack lets it go:
            # seen from that layer, the previous layer's tail is held until that node runs
            release.setdefault(last, []).append(x)
            j = first_moved(max(0, k + FWD_STASH - len(packs)))
            at = packs[j][0] if j is not None else last
            carry[at] = carry.get(at, 0) + t.nbytes
    tape.offload_packs = copies
    tape.offload_release = {i: tuple(dict.fromkeys(v)) for i, v in release.items()}
    tape.offload_release_before = {i: tuple(dict.fromkeys(v)) for i, v in release_before.items()}
    first = min(copies) if copies else -1
    tape.offload_carry = (carry, sum(tape.tensors[c].nbytes for c in copies.get(first, {}).values()))


def pack_count(tape: Tape) -> int:
    """How many tensors a layer offloads (per pack under torchtune's per-pack mode)."""
    if tape.offload_packs:
        return sum(len(v) for v in tape.offload_packs.values())
    return len(tape.offloaded)
