"""The plan space `pipemem plan` searches: every combination of parallel degrees, layout,
sharding, pipeline schedule and micro-batch size for a model on N GPUs.

Which combinations are valid is decided by `pipemem.plan.validate_plan` (the rules every
`pipemem estimate` obeys) and by the schedule generators; this module only proposes them.
The proposals follow the chosen convention's framework:

* tp stays within a node (`gpus_per_node`) unless the user allows otherwise;
* dp = N / (tp x cp x pp); the micro-batch size must divide the global batch per dp rank;
* where pp x vpp does not divide the layers, a balanced `pp_layout` is proposed
  (`balanced_layout`: the two end stages, which also hold the embedding and the head,
  get the fewer layers, as Llama 3 405B's 7, 8 x 14, 7);
* model-state sharding and schedules are those the framework offers (`SHARDINGS`,
  `SCHEDULES`); sequence parallelism is on whenever tp > 1 (it only removes memory);
* plain data parallelism (ddp) is not proposed where the framework has a ZeRO-1 (Megatron's
  distributed optimizer, Paddle's sharding stage 1) and keeps gradients in a resident buffer
  either way: that plan runs the same stage jobs from fewer static bytes, so
  its peak is no higher (replay adds the same job sequence to a smaller start), and it sends
  no more (a reduce-scatter of grads plus an all-gather of bf16 params vs an all-reduce of
  grads): it cannot lose. `--shardings ddp,...` asks for it explicitly;
* vpp > 1 only where pp x vpp divides the layers evenly (Megatron's
  num_layers_per_virtual_pipeline_stage);
* recomputation is not enumerated here: the search picks the cheapest setting that fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import frameworks
from ..errors import UserError

# Model-state sharding per convention: (label, estimate keyword arguments), and the pipeline
# schedules each framework runs, by chunks per rank: each framework's own (pipemem.frameworks,
# `Framework.shardings` / `.schedules`).
SHARDINGS = {name: fw.shardings for name, fw in frameworks.ALL.items()}
SCHEDULES = {name: fw.schedules for name, fw in frameworks.ALL.items()}

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)
DEFAULT_MAX_VPP = 8


@dataclass(frozen=True)
class SpaceOptions:
    """What the user lets the search vary (CLI flags of `pipemem plan`)."""

    convention: str = "megatron"
    gpus_per_node: int = 8
    tp_across_nodes: bool = False
    micro_batches: tuple[int, ...] = DEFAULT_MICRO_BATCHES
    max_vpp: int = DEFAULT_MAX_VPP
    schedules: tuple[str, ...] | None = None  # None: the convention's (SCHEDULES)
    shardings: tuple[str, ...] | None = None  # None: the convention's (SHARDINGS) labels
    fixed: dict = field(default_factory=dict)  # degrees the user pinned: {"tp": 8, "pp": 16, ...}


@dataclass(frozen=True)
class Base:
    """Everything of a plan but the micro-batch size, the schedule and recomputation."""

    tp: int
    cp: int
    pp: int
    vpp: int
    dp: int
    ep: int
    etp: int | None
    layout: tuple[int, ...] | None
    sharding: str

    def kwargs(self, convention: str) -> dict:
        kw = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "cp": self.cp, "ep": self.ep}
        if self.etp is not None:
            kw["etp"] = self.etp
        if self.layout is not None:
            kw["pp_layout"] = self.layout
        kw.update(dict(SHARDINGS[convention])[self.sharding])
        return kw


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def balanced_layout(layers: int, stages: int) -> tuple[int, ...] | None:
    """Layers per virtual stage when `stages` does not divide `layers` (None when it does):
    schedules.layout.layer_layout's balanced split."""
    from ..schedules.layout import layer_layout

    if stages > layers:
        raise UserError(f"{stages} pipeline stages exceed the {layers} layers")
    return None if layers % stages == 0 else layer_layout(layers, stages, balanced=True)


def schedules_for(
    convention: str, pp: int, vpp: int, chosen: tuple[str, ...] | None
) -> list[tuple[str, str]]:
    """(schedule name, placement) pairs to try for a pipeline of pp ranks with vpp chunks each:
    the convention's schedules (or the chosen ones) that run vpp chunks per rank. Placement
    'loop' (interleaved stages) or 'v' (V-shaped, two chunks); pp 1 runs none."""
    from ..schedules import canonical_name, spec_of

    if pp == 1:
        return [(None, "loop")] if vpp == 1 else []
    names = SCHEDULES[convention] if chosen is None else [canonical_name(n) for n in chosen]
    return [(n, "v" if spec_of(n).v_shaped else "loop") for n in names if spec_of(n).fits(vpp)]


def check_schedule_names(names: tuple[str, ...]) -> tuple[str, ...]:
    from ..schedules import canonical_name, spec_of

    out = []
    for n in names:
        if n.lower().startswith(("csv:", "torch:")):
            raise UserError(
                f"--schedules {n}: the planner generates its schedules; give names such as 1F1B, VPP, "
                "ZBH1, Interleaved1F1B, ZBVZeroBubble"
            )
        canon = canonical_name(n)
        if spec_of(canon).searched:
            raise UserError(
                f"--schedules {n}: the memory-limited scheduler is run by --zero-bubble, not enumerated"
            )
        out.append(canon)
    return tuple(dict.fromkeys(out))


def enumerate_bases(arch, gpus: int, opts: SpaceOptions):
    """Every Base whose degrees multiply to `gpus`; rules beyond the arithmetic are left to
    validate_plan. Yields in a deterministic order."""
    fixed = opts.fixed
    labels = opts.shardings or tuple(lbl for lbl, _ in SHARDINGS[opts.convention])
    known = dict(SHARDINGS[opts.convention])
    for lbl in labels:
        if lbl not in known:
            raise UserError(f"--shardings {lbl}: the {opts.convention} convention offers {', '.join(known)}")
    layers = arch.layers
    # ddp is dominated only where its stage jobs equal ZeRO-1's: gradients in a resident buffer
    # whatever the sharding (Megatron, Paddle; HF's DDP buckets differ from DeepSpeed's ZeRO)
    zero1 = frameworks.get(opts.convention).contiguous_grad_buffer and any(
        lbl in known for lbl in ("dist-opt", "zero1")
    )
    for tp in divisors(gpus):
        if not opts.tp_across_nodes and tp > opts.gpus_per_node:
            continue
        if not _pinned(fixed, "tp", tp):
            continue
        for cp in divisors(gpus // tp):
            if not _pinned(fixed, "cp", cp):
                continue
            for pp in divisors(gpus // (tp * cp)):
                if pp > layers or not _pinned(fixed, "pp", pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if not _pinned(fixed, "dp", dp):
                    continue
                for vpp in _vpps(pp, layers, opts):
                    if not _pinned(fixed, "vpp", vpp):
                        continue
                    layout = balanced_layout(layers, pp * vpp)
                    for ep, etp in _experts(arch, tp, cp, dp, fixed):
                        single = dp * cp == 1 and (ep == 1 or dp * cp * tp == ep * (etp or tp))
                        for lbl in labels:
                            if single and lbl != "ddp":
                                continue  # sharding over one rank is plain data parallelism
                            if not single and lbl == "ddp" and opts.shardings is None and zero1:
                                continue  # dominated by ZeRO-1 (module docstring)
                            yield Base(tp, cp, pp, vpp, dp, ep, etp, layout, lbl)


def _pinned(fixed: dict, name: str, value: int) -> bool:
    return name not in fixed or fixed[name] == value


def _vpps(pp: int, layers: int, opts: SpaceOptions) -> list[int]:
    """1, and every vpp up to max_vpp that splits the layers evenly over pp x vpp virtual stages
    (Megatron's num_layers_per_virtual_pipeline_stage; uneven layouts are proposed for vpp 1 only)."""
    if pp == 1:
        return [1]
    return [1] + [v for v in range(2, opts.max_vpp + 1) if layers % (pp * v) == 0]


def _experts(arch, tp: int, cp: int, dp: int, fixed: dict):
    """(ep, etp) pairs: ep divides the experts and the dp x cp ranks; etp is tp (None, the
    default) or 1 when tp > 1."""
    if not arch.is_moe:
        yield 1, None
        return
    for ep in divisors(arch.experts):
        if not _pinned(fixed, "ep", ep):
            continue
        for etp in (None, 1) if tp > 1 else (None,):
            e = etp or tp
            if (dp * cp * tp) % (ep * e):
                continue
            if "etp" in fixed and fixed["etp"] != e:
                continue
            yield ep, etp
