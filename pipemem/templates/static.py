"""Static bytes per pipeline rank: parameters, gradients, optimizer states (incl. master weights).

Bytes per parameter, before sharding (FINDINGS §2):

* megatron / paddle mixed precision: weight in the training dtype (2), fp32 main grad (4),
  fp32 master weight (4), optimizer states in fp32 (Adam 8): 18 B/param. Pure bf16
  (--no-master-weights): 2 + 2 + 2x2 = 8.
* torchtitan / hf mixed precision keep the fp32 parameters themselves as the master copy
  (FSDP2 MixedPrecisionPolicy, autocast): 4 + 4 + 8 = 16, no separate master.
* hf with --zero 1-3 is DeepSpeed (ParallelPlan.deepspeed_mixed_precision): the model in the
  training dtype (2), its grads in that dtype (2), fp32 master partitions (4) and optimizer
  states (8), sharded as ZeRO shards them; the step casts the rank's grad partition to fp32
  (`optimizer_step_scratch`).
* fp32 training: 4 + 4 + 8 = 16.
* megatron with --use-precision-aware-optimizer (plan.extra): master weights and Adam moments
  in the dtypes named by main_params_dtype / exp_avg_dtype / exp_avg_sq_dtype (fp32 masters of
  bf16 weights as 2-byte remainders, fp8 moments as data + transpose: 2 bytes); the main grad
  dtype is plan.main_grad_dtype (--grad-reduce-in-bf16: 2 bytes).

Sharding over the data-parallel group (dp x cp for dense weights, the expert-data-parallel
group for expert weights):
* --zero 1 / --dist-opt: optimizer states and master weights / group (Megatron's distributed
  optimizer: 6 + 12/dp);
* --zero 2: also the gradients;
* --zero 3 / --fsdp: also the parameters.
Partial shards are rounded up (each rank holds ceil(n / group) elements). A plan whose
`extra["zero_group"]` is set (PaddleNLP: sharding_parallel_degree) shards over that many
of the data-parallel ranks only; the other data-parallel replicas each hold a copy.

What is resident when the step starts depends on --grads and --step (pipemem.plan.GRADS):
set-to-none gradients are created in the step (`grads_in_step`), DDP's buckets
(ddp-bucket) are one more resident copy of the gradients, and the first step has no
optimizer states (Adam's moments) before its optimizer step (`optimizer_in_step`; master
weights are made when the optimizer is built, so they are resident).
"""

from __future__ import annotations

from functools import lru_cache

from ..frameworks import ALL
from ..ir import dtype_bytes
from ..jobs import StaticBytes
from ..model import (
    embedding_param_shapes,
    head_param_shapes,
    layer_param_shapes,
    layer_param_tensors,
    mla_param_shapes,
    mtp_param_shapes,
)
from .conventions import Convention

STATES = {"adam": 2, "adamw": 2, "sgd": 1, "adam8bit": 2, "adam4bit": 2}
# Bytes per element of one quantized state: bitsandbytes' and torchao's 8-bit states keep a
# uint8 code per element and an fp32 scale per block of 256; torchao's AdamW4bit two codes per
# byte and an fp32 scale per block of 128 (torchao/optim/subclass_4bit.py `zeros`).
QUANTIZED_STATE_BYTES = {"adam8bit": 1 + 4 / 256, "adam4bit": 0.5 + 4 / 128}
STATE_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def bytes_per_param(plan, conv: Convention) -> tuple[float, int, int, float]:
    """(param, grad, master, optimizer-state) bytes per parameter element, unsharded.

    --optimizer-in-backward: no gradient outlives its parameter's step (the gradients are
    transient tensors of the backward programs). (--fp8-param-gather's 1-byte linear weights
    are applied in `static_bytes`.)"""
    dt = dtype_bytes(plan.dtype)
    master = plan.master_weights and plan.dtype != "fp32"
    state_dtype = 4 if (master or plan.dtype == "fp32") else dt
    if plan.optimizer in QUANTIZED_STATE_BYTES:
        per_state = QUANTIZED_STATE_BYTES[plan.optimizer]
    elif getattr(plan, "optimizer_state_dtype", None):
        per_state = STATE_DTYPE_BYTES[plan.optimizer_state_dtype]
    else:
        per_state = state_dtype
    extra = plan.extra or {}
    n_states = STATES[plan.optimizer]
    if plan.optimizer == "sgd" and not extra.get("sgd_momentum", True):
        n_states = 0  # torch.optim.SGD without momentum keeps no momentum_buffer
    states = n_states * per_state
    grad = (
        0
        if getattr(plan, "optimizer_in_backward", False)
        else dtype_bytes(plan.main_grad_dtype or plan.dtype)
    )
    fw = conv.framework
    if fw.fp32_params_are_master and master and not getattr(plan, "deepspeed_mixed_precision", False):
        return 4, grad, 0, states  # fp32 params are the master copy; compute casts to bf16
    master_bytes = 4 if master else 0
    if fw.precision_aware_optimizer and extra.get("precision_aware_optimizer") and not plan.optimizer_offload:
        # --use-precision-aware-optimizer: TE's FusedAdam stores the master weights and each
        # Adam moment in the dtypes given (--main-params-dtype, --exp-avg(-sq)-dtype). With
        # --optimizer-cpu-offload megatron builds its HybridDeviceOptimizer with fp32 masters
        # and states on both devices and passes neither dtype (optimizer/__init__.py)
        if master:
            master_bytes = _precision_aware_master_bytes(plan, extra)
        if STATES[plan.optimizer] == 2 and plan.optimizer not in QUANTIZED_STATE_BYTES:
            states = _te_adam_state_bytes(extra.get("exp_avg_dtype", "fp32")) + _te_adam_state_bytes(
                extra.get("exp_avg_sq_dtype", "fp32")
            )
    return dt, grad, master_bytes, states


def _precision_aware_master_bytes(plan, extra: dict) -> int:
    """Bytes per element of the master weights under Megatron's precision-aware optimizer.

    megatron-core (optimizer_config.py `use_precision_aware_optimizer_no_fp8_or_ds_fp8`,
    distrib_optimizer.py) hands the masters to TE's FusedAdam unless the masters are fp32 and
    an fp8 recipe other than delayed scaling is on; then megatron keeps its own fp32 shard.
    FusedAdam with fp32 masters of bf16 parameters stores only the low 16 bits of each fp32
    master (`store_param_remainders`, an int16 tensor: the high 16 bits are the bf16 weight);
    megatron turns it on by default with TE >= 2.1 and Megatron-LM has no flag for it
    (`extra["store_param_remainders"] = False` for trainers that turn it off)."""
    main = extra.get("main_params_dtype", "fp32")
    if main != "fp32":
        return dtype_bytes(main)
    if getattr(plan, "fp8", None) not in (None, "delayed"):
        return 4  # megatron's own fp32 shard; FusedAdam keeps no masters
    if plan.dtype == "bf16" and extra.get("store_param_remainders", True):
        return 2
    return 4


def _te_adam_state_bytes(dtype: str) -> int:
    """Bytes per element of one of TE FusedAdam's moments. An fp8 moment is a Float8Tensor made
    by a Float8Quantizer with both usages (fused_adam.py `_initialize_state`): on Hopper, whose
    fp8 GEMMs take only the TN layout, TE allocates its uint8 data and a uint8 transpose
    (csrc/quantizer.cpp `Float8Quantizer::create_tensor`); Blackwell keeps one buffer (1 B,
    which pipemem does not distinguish: it over-counts there)."""
    return 2 if dtype == "fp8" else dtype_bytes(dtype)


def rank_param_counts(
    arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages
) -> tuple[int, int]:
    """(dense, expert) parameter elements held by one pipeline rank (its tp/ep shard): the
    layers of the stages it holds, the embedding with stage 0, the head with the last stage.
    Counted per distinct layer kind, so the cost does not grow with the layer count."""
    last = plan.pp * plan.vpp - 1
    ranges = tuple(_as_range(stage_layers[s]) for s in sorted(rank_stages))
    return _rank_counts(
        arch,
        conv.vocab_multiple,
        plan.tp,
        plan.etp or 1,
        plan.ep,
        ranges,
        0 in rank_stages,
        last in rank_stages,
        _mtp_on(arch, conv),
    )


def _as_range(layers) -> range:
    if isinstance(layers, range):
        return layers
    layers = tuple(layers)
    if not layers:
        return range(0)
    r = range(layers[0], layers[-1] + 1)
    if tuple(r) != layers:
        raise ValueError(f"stage layers {layers} are not contiguous")
    return r


def moe_layers_in(arch, layers: range) -> int:
    """How many of `layers` are MoE layers (the rest are dense)."""
    if not arch.is_moe:
        return 0
    dense = sum(1 for i in arch.dense_layers if i in layers)
    return len(layers) - dense


@lru_cache(maxsize=65536)
def _rank_counts(
    arch,
    vocab_multiple: int,
    tp: int,
    etp: int,
    ep: int,
    ranges: tuple[range, ...],
    has_embedding: bool,
    has_head: bool,
    mtp: bool = False,
) -> tuple[int, int]:
    m = vocab_multiple * tp
    vocab = -(-arch.vocab // m) * m
    n_layers = sum(len(r) for r in ranges)
    n_moe = sum(moe_layers_in(arch, r) for r in ranges)
    dense = expert = 0
    for moe, n in ((True, n_moe), (False, n_layers - n_moe)):
        if n:
            d, e = layer_kind_counts(arch, moe, tp, etp, ep)
            dense += n * d
            expert += n * e
    if has_embedding:
        dense += sum(_prod(v) for v in embedding_param_shapes(arch, vocab, tp, head=False).values())
    if has_head:
        dense += sum(
            _prod(v)
            for v in head_param_shapes(arch, vocab, tp, same_stage_as_embedding=has_embedding).values()
        )
    if has_head and mtp:
        d, e = _dense_expert(mtp_param_shapes(arch, vocab, tp, etp, ep, not has_embedding))
        dense += d
        expert += e
    return dense, expert


def _dense_expert(shapes) -> tuple[int, int]:
    """The elements of (shape, is_expert) parameter tensors: (dense, expert)."""
    counts = [0, 0]
    for shape, is_expert in shapes:
        counts[bool(is_expert)] += _prod(shape)
    return counts[0], counts[1]


def _mtp_on(arch, conv: Convention) -> bool:
    """Whether the last stage holds megatron-core's multi-token prediction block."""
    return bool(arch.mtp_layers) and conv.framework.mtp_block


@lru_cache(maxsize=8192)
def layer_kind_counts(arch, moe: bool, tp: int, etp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) elements of one MoE or dense layer (all layers of a kind have the same shapes)."""
    return _dense_expert(layer_param_shapes(arch, _layer_of_kind(arch, moe), tp, etp, ep).values())


def _layer_of_kind(arch, moe: bool) -> int:
    """An index of a layer of that kind (layer_param_shapes reads the kind from the index)."""
    if not arch.is_moe:
        return 0
    if not moe:
        return arch.dense_layers[0] if arch.dense_layers else 0
    dense = set(arch.dense_layers)
    return next(i for i in range(len(dense) + 1) if i not in dense)


def _dp_groups(plan) -> tuple[int, int]:
    """(dense, expert) data-parallel groups that ZeRO / FSDP / the distributed optimizer shard
    over: dp x cp, and the expert-data-parallel group; PaddleNLP's sharding group when the
    states are sharded over a sub-group of the data-parallel ranks."""
    dp_group = plan.dp * plan.cp
    edp_group = max(1, (plan.dp * plan.cp * plan.tp) // (plan.ep * (plan.etp or 1)))
    zero_group = (plan.extra or {}).get("zero_group")
    if zero_group:
        replicas = max(1, dp_group // int(zero_group))
        dp_group = int(zero_group)
        edp_group = max(1, edp_group // replicas)
    return dp_group, edp_group


def _layer_tensors(arch, plan, conv: Convention, moe: bool) -> list[tuple]:
    """(shape, is_expert) of each parameter tensor of a dense or MoE layer as the framework's
    modules hold them (fused projections where its modules fuse them)."""
    fw = conv.framework
    return layer_param_tensors(
        arch,
        _layer_of_kind(arch, moe),
        plan.tp,
        plan.etp or 1,
        plan.ep,
        fused_qkv=fw.fused_qkv_params or arch.fused_qkv,
        fused_gate_up=fw.fused_gate_up_params,
    )


def _rank_param_shapes(
    arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages
) -> list[tuple]:
    """(shape, is_expert) of every parameter tensor kind the rank holds, after tp / ep sharding."""
    m = conv.vocab_multiple * plan.tp
    vocab = -(-arch.vocab // m) * m
    kinds = set()
    for s in rank_stages:
        n_moe = moe_layers_in(arch, stage_layers[s])
        kinds.update(k for k, n in ((True, n_moe), (False, len(stage_layers[s]) - n_moe)) if n)
    shapes = [x for moe in kinds for x in _layer_tensors(arch, plan, conv, moe)]
    if 0 in rank_stages:
        shapes += [(s, False) for s in embedding_param_shapes(arch, vocab, plan.tp, head=False).values()]
    if plan.pp * plan.vpp - 1 in rank_stages:
        shapes += [
            (s, False)
            for s in head_param_shapes(
                arch, vocab, plan.tp, same_stage_as_embedding=0 in rank_stages
            ).values()
        ]
        if _mtp_on(arch, conv):
            shapes += mtp_param_shapes(arch, vocab, plan.tp, plan.etp or 1, plan.ep, 0 not in rank_stages)
    return shapes


def rank_param_tensor_elems(
    arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages
) -> list[int]:
    """Elements of every parameter tensor the rank holds, one entry per tensor (after tp / ep
    sharding, not dp's), in module order: embedding, layers, head."""
    m = conv.vocab_multiple * plan.tp
    vocab = -(-arch.vocab // m) * m
    last = plan.pp * plan.vpp - 1
    per_kind: dict = {}
    out: list[int] = []
    for s in sorted(rank_stages):
        if s == 0:
            out += [_prod(x) for x in embedding_param_shapes(arch, vocab, plan.tp, head=False).values()]
        for i in stage_layers[s]:
            moe = arch.is_moe_layer(i)
            if moe not in per_kind:
                per_kind[moe] = [_prod(x) for x, _ in _layer_tensors(arch, plan, conv, moe)]
            out += per_kind[moe]
        if s == last:
            out += [
                _prod(x)
                for x in head_param_shapes(
                    arch, vocab, plan.tp, same_stage_as_embedding=0 in rank_stages
                ).values()
            ]
            if _mtp_on(arch, conv):
                out += [
                    _prod(x)
                    for x, _ in mtp_param_shapes(
                        arch, vocab, plan.tp, plan.etp or 1, plan.ep, 0 not in rank_stages
                    )
                ]
    return out


def largest_param_elems(arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages) -> int:
    """Elements of the rank's largest parameter tensor, after tp / ep sharding (not dp's)."""
    return max(
        (_prod(s) for s, _ in _rank_param_shapes(arch, plan, conv, stage_layers, rank_stages)), default=0
    )


def optimizer_elems(
    arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages
) -> tuple[int, int]:
    """(elements the rank's optimizer step updates, elements of its largest parameter tensor),
    after tp/ep sharding and the optimizer's dp sharding (ZeRO >= 1, dist-opt, FSDP)."""
    dense, expert = rank_param_counts(arch, plan, conv, stage_layers, rank_stages)
    dp_group, edp_group = _dp_groups(plan)
    shapes = _rank_param_shapes(arch, plan, conv, stage_layers, rank_stages)
    on = plan.zero >= 1 or plan.dist_opt
    if getattr(plan, "lora_rank", 0):
        # LoRA: the optimizer updates only the adapters
        from ..lora import layer_linears, parse_targets

        targets = parse_targets(plan.lora_targets)
        layers = sum(len(_as_range(stage_layers[s])) for s in rank_stages)
        per = [
            plan.lora_rank * n for t, io in layer_linears(arch, plan.tp).items() if t in targets for n in io
        ]
        dense, expert = layers * sum(per), 0
        shapes = [((n,), False) for n in per]

    def shard(n: int, group: int) -> int:
        return -(-n // group) if on else n

    largest = max((shard(_prod(s), edp_group if e else dp_group) for s, e in shapes), default=0)
    return shard(dense, dp_group) + shard(expert, edp_group), largest


def pipelined_fsdp(plan, conv: Convention) -> bool:
    """FSDP2 under torch's pipelining (torchtitan with pp): the stage (torch 2.13,
    pipelining/stage.py backward_maybe_with_nosync) turns off reshard-after-backward and
    gradient sync (recursively) for every microbatch's backward and runs FSDP's post-backward
    once, at the end (perform_reduce_grad). A stage's unsharded gradients accumulate (in the
    reduce dtype: FSDPParam.to_accumulated_grad_if_needed) until then, and its parameters stay
    gathered: from the first forward with reshard_after_forward=False (torchtitan's default with
    pp), from each backward on with "always" (a unit gathered for its backward is not resharded
    after it, so every backward ends with the whole stage gathered). Once per stage, not per
    microbatch: the programs run on gathered parameters (no per-part all-gather) and both copies
    are static (`static_bytes`' other; above the truth only in forwards under "always")."""
    return conv.fsdp2 and (plan.zero >= 3 or bool(plan.fsdp)) and plan.pp * plan.vpp > 1


def lora_adapter_dtype(plan) -> str:
    """The adapters' dtype under a LoRA plan: the framework's (PEFT upcasts bf16 / fp16 adapters
    to fp32; torchtune keeps the model's), `extra["lora_dtype"]` if given; DeepSpeed's engine
    converts the whole model, adapters included, to its dtype (its fp32 master is separate)."""
    if getattr(plan, "deepspeed_mixed_precision", False):
        return plan.dtype
    dt = (plan.extra or {}).get("lora_dtype") or ALL[plan.convention].lora_adapter_dtype or "model"
    return plan.dtype if dt == "model" else dt


def _lora_static(arch, plan, conv: Convention, stage_layers, rank_stages, dense: int, expert: int):
    """(params, grads, master, states) bytes of a LoRA plan's rank, and the adapters' elements:
    the base frozen in its dtype (QLoRA: its quantized linears as NF4 tensors), the adapters
    with gradients and optimizer states (pipemem.lora)."""
    from ..lora import adapter_elems, nf4_bytes, parse_targets, quantized_linears

    targets = parse_targets(plan.lora_targets)
    layers = sum(len(_as_range(stage_layers[s])) for s in rank_stages)
    adapters = layers * adapter_elems(arch, targets, plan.lora_rank, plan.tp)
    base_bytes = (dense + expert) * dtype_bytes(plan.dtype)
    if plan.qlora:
        quant = quantized_linears(arch, targets, conv.framework.qlora_quantizes_all_linears, plan.tp)
        dq = bool((plan.extra or {}).get("qlora_double_quant", True))
        base_bytes += layers * sum(nf4_bytes(n, dq) - n * dtype_bytes(plan.dtype) for n in quant)
    adt = dtype_bytes(lora_adapter_dtype(plan))
    master = 4 if getattr(plan, "deepspeed_mixed_precision", False) else 0
    per_state = QUANTIZED_STATE_BYTES.get(plan.optimizer, max(adt, master))
    n_states = STATES[plan.optimizer]
    if plan.optimizer == "sgd" and not (plan.extra or {}).get("sgd_momentum", True):
        n_states = 0
    dp_group, _ = _dp_groups(plan)

    def shard(n, on: bool) -> int:
        return -(-n // dp_group) if on else n

    opt_shard = plan.zero >= 1 or plan.dist_opt
    params = shard(base_bytes, plan.zero >= 3) + shard(adapters, plan.zero >= 3) * adt
    grads = shard(adapters, plan.zero >= 2) * adt
    return (
        params,
        grads,
        shard(adapters, opt_shard) * master,
        int(shard(adapters, opt_shard) * n_states * per_state),
    )


def static_bytes(arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages) -> StaticBytes:
    dense, expert = rank_param_counts(arch, plan, conv, stage_layers, rank_stages)
    if getattr(plan, "lora_rank", 0):
        params, grads, master, states = _lora_static(
            arch, plan, conv, stage_layers, rank_stages, dense, expert
        )
        return step_state(
            StaticBytes(params=int(params), grads=int(grads), optimizer=master + states, other=0),
            plan.grads,
            plan.step,
            states,
        )
    dp_group, edp_group = _dp_groups(plan)
    per_param = bytes_per_param(plan, conv)
    params, grads, master, states = _sharded(
        dense, expert, per_param, dp_group, edp_group, plan.zero, plan.zero >= 1 or plan.dist_opt
    )
    # --optimizer-offload f: that fraction of the optimizer states and master weights lives in
    # CPU memory (DeepSpeed ZeRO-Offload: all; Megatron --optimizer-offload-fraction)
    on_gpu = 1.0 - float(plan.optimizer_offload or 0.0)
    master, states = int(master * on_gpu), int(states * on_gpu)
    (dense_linear, expert_linear), per = _fp8_linear_weights(arch, plan, conv, stage_layers, rank_stages)
    linear = dense_linear + expert_linear
    if plan.fp8_param_gather and linear:
        # fp8 primary weights: 1 byte each (norms, embeddings stay), sharded as the parameters are
        # (Megatron-FSDP optim_grads_params keeps only its shard of them)
        held = _sharded(dense_linear, expert_linear, (1, 0, 0, 0), dp_group, edp_group, plan.zero, False)[0]
        params -= held * (per_param[0] - 1)
    other = int(linear * per)
    if pipelined_fsdp(plan, conv):
        # the stages' gathered parameters and their unsharded gradients (in the reduce dtype),
        # held from the first forward / backward to the step's end: counted as static
        grad_dt = plan.main_grad_dtype or plan.dtype
        other += (dense + expert) * (dtype_bytes(plan.dtype) + dtype_bytes(grad_dt))
    ranges = tuple(_as_range(stage_layers[st]) for st in rank_stages)
    n_layers = sum(len(r) for r in ranges)
    n_moe = sum(moe_layers_in(arch, r) for r in ranges)
    if conv.framework.te_runtime_buffers:
        other += megatron_runtime_bytes(
            arch,
            plan,
            conv,
            n_layers - n_moe > 0,
            n_moe > 0,
            plan.pp * plan.vpp - 1 in rank_stages,
            layers=n_layers,
        )
    # buffers the framework's modules register per decoder layer (torchtitan: rotary caches)
    other += conv.framework.layer_buffer_bytes(arch, plan, n_layers, n_moe)
    if plan.zero == 3:
        other += deepspeed_bucket_bytes(plan)  # DeepSpeed ZeRO-3's resident reduce bucket
    if getattr(plan, "deepspeed_mixed_precision", False) and plan.optimizer_offload:
        # DeepSpeed's ZeRO-Offload (offload_optimizer), from its code, not measured: ZeRO-3's flat
        # grad partition buffer lives on the CPU with the master (stage3 `grad_partitions_flat_buffer`
        # on `self.device`, the CPU); ZeRO-1/2 keep a GPU staging buffer of the largest parameter's
        # size in the model's dtype for the copies to the CPU (`temp_grad_buffer_for_gpu_offload`)
        if plan.zero == 3:
            grads = 0
        else:
            other += largest_param_elems(arch, plan, conv, stage_layers, rank_stages) * dtype_bytes(
                plan.dtype
            )
    optimizer = master + states + _offload_fp32_grads(arch, plan, conv, stage_layers, rank_stages)
    return step_state(
        StaticBytes(params=int(params), grads=int(grads), optimizer=optimizer, other=other),
        plan.grads,
        plan.step,
        states,
    )


def _offload_fp32_grads(arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages) -> int:
    """Megatron's HybridDeviceOptimizer (--optimizer-cpu-offload) with main grads narrower than
    fp32: its GPU share's fp32 masters get `.grad = grad.float()` copies that its zero_grad never
    clears (the distributed optimizer clears only the decoupled grads): resident, 4 bytes per
    element of the rank's shard left on the GPU."""
    if not conv.framework.fp32_grad_copies or not plan.optimizer_offload or not plan.master_weights:
        return 0
    if dtype_bytes(plan.main_grad_dtype or plan.dtype) >= 4:
        return 0
    return int(
        _megatron_shard_elements(arch, plan, conv, stage_layers, rank_stages)
        * 4
        * (1.0 - float(plan.optimizer_offload))
    )


def _megatron_shard_elements(
    arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages
) -> int:
    """Parameter elements of the rank's optimizer shard (all local ones without sharding)."""
    dense, expert = rank_param_counts(arch, plan, conv, stage_layers, rank_stages)
    if not (plan.dist_opt or plan.zero >= 1):
        return dense + expert
    edp = max(1, (plan.dp * plan.cp * plan.tp) // (plan.ep * (plan.etp or 1)))
    return -(-dense // (plan.dp * plan.cp)) + -(-expert // edp)


@lru_cache(maxsize=65536)
def _sharded(
    dense: int, expert: int, per_param: tuple, dp_group: int, edp_group: int, zero: int, opt_shard: bool
) -> tuple[int, int, int, int]:
    """(params, grads, master weights, optimizer states) bytes of (dense, expert) parameter
    elements after ZeRO / FSDP / distributed-optimizer sharding over their data-parallel
    groups (partial shards rounded up)."""
    p, g, m, st = per_param

    def shard(n: int, group: int, on: bool) -> int:
        return -(-n // group) if on else n

    params = grads = master = states = 0
    for n, group in ((dense, dp_group), (expert, edp_group)):
        params += shard(n, group, zero >= 3) * p
        grads += shard(n, group, zero >= 2) * g
        master += shard(n, group, opt_shard) * m
        states += shard(n, group, opt_shard) * st
    return params, grads, master, states


def clear_caches() -> None:
    _rank_counts.cache_clear()
    layer_kind_counts.cache_clear()
    _sharded.cache_clear()
    _fp8_layer_linear.cache_clear()


def step_state(full: StaticBytes, grads_mode: str | None, step: str, states: int) -> StaticBytes:
    """`full` (every model state resident) as the reported step starts: see the module
    docstring. `states`: the optimizer's moment bytes within `full.optimizer`."""
    resident_grads, in_step = full.grads, 0
    if grads_mode in ("set-to-none", "ddp-bucket"):
        in_step = full.grads
        resident_grads = full.grads if grads_mode == "ddp-bucket" else 0  # DDP's buckets stay
    first = step == "first"
    return StaticBytes(
        params=full.params,
        grads=resident_grads,
        optimizer=full.optimizer - (states if first else 0),
        other=full.other,
        grads_in_step=in_step,
        optimizer_in_step=states if first else 0,
    )


FP8_LINEAR_WEIGHTS = ("qkv", "o_proj", "mlp", "experts", "shared_mlp")


def _fp8_linear_weights(
    arch, plan, conv: Convention, stage_layers, rank_stages
) -> tuple[tuple[int, int], float]:
    """((dense, expert) elements of the rank's decoder-layer linear weights that Transformer Engine runs in
    fp8, extra bytes per element for its cached fp8 weight copies). TE keeps an fp8 copy of
    each weight (rowwise, for the forward GEMM) and its transpose (columnwise, for the
    input-grad GEMM) for the whole step (`_fp8_workspaces`, cached across microbatches by
    `is_first_microbatch`). With --fp8-param-gather the weight itself is the fp8 rowwise copy
    and only the transpose is extra. MXFP8 adds a 1-byte scale per 32 elements to each.
    torchao Float8 casts weights per use (transients in the programs): (0, 0)."""
    fp8 = getattr(plan, "fp8", None)
    if not conv.framework.te_fp8_weight_caches or not fp8:
        return (0, 0), 0.0
    per = (1 if plan.fp8_param_gather else 2) * (1 + 1 / 32 if fp8 == "mxfp8" else 1)
    n = [0, 0]
    dense_idx = set(arch.dense_layers) if arch.is_moe else set()
    for st in rank_stages:
        layers = stage_layers[st]
        dense = sum(1 for i in dense_idx if i in layers) if arch.is_moe else len(layers)
        for moe, count in ((False, dense), (True, len(layers) - dense)):
            if count:
                d, e = _fp8_layer_linear(arch, _layer_of_kind(arch, moe), plan.tp, plan.etp or 1, plan.ep)
                n[0] += count * d
                n[1] += count * e
    return (n[0], n[1]), per


@lru_cache(maxsize=4096)
def _fp8_layer_linear(arch, index: int, tp: int, etp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) elements of one layer's fp8 linear weights."""
    shapes = layer_param_shapes(arch, index, tp, etp, ep).items()
    fp8 = [(_prod(shp), e) for name, (shp, e) in shapes if name in FP8_LINEAR_WEIGHTS]
    return sum(n for n, e in fp8 if not e), sum(n for n, e in fp8 if e)


# DeepSpeed's default reduce_bucket_size (elements); plan.extra["reduce_bucket_size"] (HF's Trainer
# fills in hidden^2 for "auto", Lightning's DeepSpeedStrategy 2e8)
DEEPSPEED_REDUCE_BUCKET = 500_000_000


def _deepspeed_zero(plan) -> bool:
    fw = ALL.get(plan.convention)
    return fw is not None and fw.zero_is_deepspeed


def deepspeed_bucket_bytes(plan) -> int:
    """DeepSpeed's reduce bucket under --convention hf --zero N: `reduce_bucket_size` elements in
    the gradients' dtype (stage_1_and_2 / stage3 `ipg_buckets`). ZeRO-1/2 allocate it when the
    backward starts and free it when it ends, two of them with `overlap_comm` (a double buffer, so
    the next bucket fills while the last one reduces); ZeRO-3 holds one from initialize on. Only
    with `contiguous_gradients` (DeepSpeed's default): without it the grads are reduced where
    they are (validate deepspeed). 0 for every other plan."""
    if not _deepspeed_zero(plan) or not 1 <= plan.zero <= 3 or plan.fsdp:
        return 0
    extra = plan.extra or {}
    if not extra.get("contiguous_gradients", True):
        return 0
    elems = int(extra.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET))
    buffers = 2 if plan.zero in (1, 2) and extra.get("overlap_comm", False) else 1
    return buffers * elems * dtype_bytes(plan.main_grad_dtype or plan.dtype)


def optimizer_step_scratch(
    arch, plan, conv: Convention, stage_layers: dict[int, range], rank_stages: list[int]
) -> int:
    """Bytes the optimizer step allocates beyond the model states. Megatron with main grads
    narrower than fp32 (--grad-reduce-in-bf16, fp16 grads) and the usual fp32 optimizer hands
    Adam fp32 copies of its grads: `main_param.grad = main_grad.float()` for every local
    parameter (Float16OptimizerWithFloat16Params) or for the rank's shard (DistributedOptimizer
    `_copy_model_grads_to_main_grads`); they live until the next step's zero_grad.
    --use-precision-aware-optimizer reads the narrow grads directly.
    DeepSpeed's ZeRO optimizer does the same for the rank's partition at the step (stage_1_and_2 /
    stage3 `step`: the partition's grads flattened and cast to fp32, handed to the optimizer as
    the fp32 master's grad, freed when it has stepped); with ZeRO-Offload that fp32 partition is
    on the CPU with the master (stage_1_and_2 `self.device` is 'cpu' under cpu_offload)."""
    extra = plan.extra or {}
    if getattr(plan, "deepspeed_mixed_precision", False):
        elems, _ = optimizer_elems(arch, plan, conv, stage_layers, rank_stages)
        return int(elems * 4 * (1.0 - float(plan.optimizer_offload or 0.0)))
    if (
        not conv.framework.fp32_grad_copies
        or not plan.master_weights
        or extra.get("precision_aware_optimizer")
    ):
        return 0
    if dtype_bytes(plan.main_grad_dtype or plan.dtype) >= 4:
        return 0
    return _megatron_shard_elements(arch, plan, conv, stage_layers, rank_stages) * 4


def megatron_runtime_bytes(
    arch, plan, conv: Convention, has_dense: bool, has_moe: bool, has_head: bool, layers: int = 0
) -> int:
    """What a Megatron-LM rank keeps for the whole run besides model states (validated against
    megatron-core's own step, `pipemem validate megatron`):

    * Transformer Engine's dummy weight gradients: with gradient-accumulation fusion the wgrad
      GEMM writes the main grad and autograd is handed `get_dummy_wgrad(shape, dtype)`, one
      cached tensor per distinct local weight shape (and dtype), kept for the run
      (transformer_engine/pytorch/module/base.py; megatron tensor_parallel/layers.py);
    * the rotary embedding's cached frequencies, fp32 [seq, 1, 1, head_dim] per stage
      (RotaryEmbedding.forward is lru_cached in megatron-core); multi-head latent attention
      builds a RotaryEmbedding over qk_pos_emb_head_dim in each layer's MLASelfAttention, so
      one [seq, 1, 1, qk_pos_emb_head_dim] per layer of the rank (`layers`)."""
    total = 0
    if conv.wgrad_fused and not (plan.zero >= 3 or plan.fsdp):
        shapes = set()
        for moe, present in ((False, has_dense), (True, has_moe)):
            if present:
                shapes.update(_linear_weight_shapes(arch, moe, plan.tp, plan.etp or 1, plan.ep))
        if has_head:
            m = conv.vocab_multiple * plan.tp
            shapes.add((-(-arch.vocab // m) * m // plan.tp, arch.hidden))
        if has_head and _mtp_on(arch, conv):  # the MTP layers' linears and eh_proj
            mtp_moe = arch.is_moe_layer(arch.layers - 1)
            shapes.update(_linear_weight_shapes(arch, mtp_moe, plan.tp, plan.etp or 1, plan.ep))
            shapes.add((arch.hidden // plan.tp, 2 * arch.hidden))
        total += sum(_prod(sh) for sh in shapes) * dtype_bytes(plan.dtype)
    if arch.kv_lora_rank:
        mtp = arch.mtp_layers if has_head and _mtp_on(arch, conv) else 0
        total += plan.seq_len * arch.qk_rope_head_dim * 4 * (layers + mtp)
    elif arch.position == "rope" and (has_dense or has_moe):
        total += plan.seq_len * arch.head_dim * 4
    return total


def _linear_weight_shapes(arch, moe: bool, tp: int, etp: int, ep: int) -> list[tuple[int, int]]:
    """Local weight shapes of the linears of one decoder layer that go through the fused
    wgrad path (attention qkv and output projections, MLP fc1 / fc2, shared-expert MLP)."""
    h, d = arch.hidden, arch.head_dim
    a = arch.heads // tp
    kv = arch.kv_heads // tp if arch.kv_heads >= tp else 1
    gated = 2 if arch.activation in ("swiglu", "geglu") else 1
    if arch.kv_lora_rank:
        # multi-head latent attention's down and up projections and its output projection
        out = [shape for shape, _ in mla_param_shapes(arch, tp).values() if len(shape) == 2]
    else:
        out = [((a + 2 * kv) * d, h), (h, a * d)]
    if moe:
        f = arch.expert_ffn // etp
        out += [(gated * f, h), (h, f)]
        if arch.shared_experts:
            sf = arch.shared_experts * arch.shared_ffn // tp
            out += [(gated * sf, h), (h, sf)]
    else:
        f = arch.ffn // tp
        out += [(gated * f, h), (h, f)]
    return out
