"""Stage jobs from template programs (layer 4 of DESIGN.md's flow).

A (virtual) pipeline stage is a range of decoder layers, plus the embedding on stage 0 and
the final norm, output layer and loss on the last stage. Each part's F / B / I / W programs
are analysed once per distinct shape by the liveness engine (pipemem.templates.programs);
a stage job composes its parts in run order with `pipemem.jobs.compose`:

    F: [embedding F] -> layer F ... -> [head F]
    B: [head B] -> layer B (reverse) ... -> [embedding B]

Identical consecutive layers are one part repeated (`JobMemory.repeated`), so a stage of
10^8 layers costs what a stage of one does. What crosses a stage boundary belongs to the
pipeline runtime, not to the stage (pipemem.jobs): F leaves the stage output allocated, B / I
leave the input grad allocated, and neither frees the received input or output grad; the
runtime profile (pipemem.runtime) adds when those four are allocated and freed.

Which stages a pipeline rank holds is the schedule's business (`Schedule.stage_rank`):
`StagePlan.static_per_rank(schedule)` counts each rank's parameters from the stages it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from . import frameworks
from .errors import UserError
from .ir import Op, Program, Tensor
from .jobs import JobMemory, StageJobs, StaticBytes, compose
from .jobs import StagePlan as StagePlanBase
from .liveness import analyze_program
from .plan import ParallelPlan, validate_plan
from .units import fmt_bytes

__all__ = ["StagePlan", "build_stage_jobs", "layer_explain", "stage_layer_ranges", "template_warnings"]


@dataclass(slots=True)
class StagePlan(StagePlanBase):
    """Per virtual stage jobs of a validated plan (the templates' programs), and the static
    state of any set of stages (the program-source interface: `pipemem.jobs.StagePlan`)."""

    plan: ParallelPlan
    stages: dict[int, StageJobs]
    stage_layers: dict[int, range]
    arch: object = None
    conv: object = None
    notes: dict = field(default_factory=dict)
    # Jobs of each stage's first backward of the step when it creates the gradients (--grads
    # set-to-none / ddp-bucket; replayed for the microbatch of the stage's first B or W:
    # `first_backward_overrides`); later microbatches accumulate into them.
    first_backward: dict[int, StageJobs] = field(default_factory=dict)
    allocs = "templates"  # pipemem.alloc_stream rebuilds the jobs' allocations from the programs

    @property
    def warnings(self) -> list[str]:
        return template_warnings(self.arch, self.plan)

    def _rank_key(self, stage_ids) -> tuple:
        """What a rank's static bytes and optimizer job depend on: per stage it holds, its
        layer count, MoE layer count and first-backward gradients; whether it holds the
        embedding and the head. Ranks alike (the middle ranks of most pipelines) share one
        count."""
        key = tuple(sorted(stage_ids))
        memo = self.notes.get(("rank", key))
        if memo is not None:
            return memo
        from .templates.static import moe_layers_in

        last = self.plan.pp * self.plan.vpp - 1
        fb = self.first_backward

        def stage(s):
            layers = self.stage_layers[s]
            made = fb[s].B.net_bytes - self.stages[s].B.net_bytes if fb else 0
            return len(layers), moe_layers_in(self.arch, layers), made

        memo = self.notes[("rank", key)] = (
            tuple(sorted(stage(s) for s in key if s not in (0, last))),
            key if (0 in key or last in key) else (),
        )
        return memo

    def rank_static(self, stage_ids) -> StaticBytes:
        """Params, grads and optimizer states of a rank holding these virtual stages (and the
        gradients its stages' first backwards create, with --grads set-to-none / ddp-bucket)."""
        key = tuple(sorted(stage_ids))
        memo = ("static", self._rank_key(key))
        st = self.notes.get(memo)
        if st is None:
            from .templates.static import static_bytes

            st = static_bytes(self.arch, self.plan, self.conv, self.stage_layers, key)
            if self.first_backward:
                st = replace(
                    st,
                    grads_in_step=sum(
                        self.first_backward[s].B.net_bytes - self.stages[s].B.net_bytes for s in key
                    ),
                )
            self.notes[memo] = st
        return st

    def rank_optimizer(self, stage_ids) -> JobMemory:
        key = tuple(sorted(stage_ids))
        memo = ("optimizer", self._rank_key(key))
        job = self.notes.get(memo)
        if job is None:
            job = self.notes[memo] = self._rank_optimizer(key)
        return job

    def _rank_optimizer(self, key: tuple) -> JobMemory:
        from .templates.static import optimizer_elems, optimizer_step_scratch

        elems, largest = optimizer_elems(self.arch, self.plan, self.conv, self.stage_layers, key)
        scratch = optimizer_step_scratch(self.arch, self.plan, self.conv, self.stage_layers, key)
        if self.conv.grad_clip_copy:
            # global-norm clipping writes a clipped copy of every gradient before the first
            # update (Paddle's ClipGradByGlobalNorm: multiply(grad, coef) per parameter)
            scratch += self.rank_static(key).grads
        temp = (
            4 if (self.plan.master_weights or self.plan.dtype == "fp32") else 2
        )  # the optimizer's math dtype
        if self.plan.optimizer_in_backward:  # the steps run inside the backward programs
            return JobMemory(0, 0)
        st = self.rank_static(key)
        ws = scratch + optimizer_workspace(
            self.plan.optimizer_impl or "fused",
            self.plan.optimizer,
            elems * temp,
            largest * temp,
            self.plan.optimizer_offload,
        )
        return _optimizer_job(ws, st.grads_in_step, st.optimizer_in_step)

    def to_dict(self) -> dict:
        return {
            "stages": {
                s: {k: getattr(j, k).to_dict() for k in ("F", "B", "I", "W") if getattr(j, k)}
                for s, j in self.stages.items()
            },
            "stage_layers": {s: list(v) for s, v in self.stage_layers.items()},
        }


def template_warnings(arch, plan) -> list[str]:
    """What the templates model less surely for this plan, said beside the numbers."""
    from .templates.mla import mla_warnings
    from .templates.moe import load_note

    out = mla_warnings(arch, plan)
    if arch.mtp_layers and frameworks.get(plan.convention).mtp_block:
        out.append(
            f"multi-token prediction: {arch.mtp_layers} depth(s) (--mtp-num-layers / "
            "num_nextn_predict_layers) counted on the last pipeline stage: megatron-core's MTP block "
            "(embedding, enorm / hnorm, eh_proj, one layer, the shared head and its loss per depth)"
        )
    elif arch.mtp_layers:  # DeepSeek-V3, GLM-4.5: named in the config, built by neither HF module
        out.append(
            f"num_nextn_predict_layers={arch.mtp_layers}: transformers' {arch.model_type} causal LM "
            "(--convention hf) has no multi-token prediction layers, so the step modelled has none "
            "(Megatron's --mtp-num-layers trains them: not modelled by templates)"
        )
    out += [n for n in (load_note(arch, plan),) if n]  # what the MoE routing is taken as
    out += frameworks.get(plan.convention).template_warnings(arch, plan)
    if plan.activation_offload == "all" and arch.activation not in ("swiglu", "geglu"):
        # docs/ACCURACY.md, "Modern-trainer features": torchtune's OffloadActivations traced on
        # GPT-2 layers held ~1.6 MB more of a 4.5 MB layer forward peak than the template
        out.append(
            "--activation-offload all: torchtune's offloading is checked against its own code on gated-MLP "
            "(Llama-style) layers; in this model's layers (a non-gated MLP) Python locals hold tensors the "
            "template frees and its forward stash moves differently: an offloaded layer's forward and "
            "backward peaks can be higher than shown (GPT-2: +55 % / +39 % of a layer's peak)"
        )
    if frameworks.get(plan.convention).zero_is_deepspeed and plan.zero >= 1 and not plan.fsdp:
        from .ir import dtype_bytes
        from .templates.static import DEEPSPEED_REDUCE_BUCKET
        from .units import fmt_bytes

        # docs/ACCURACY.md, "DeepSpeed's own engine" (validate deepspeed): the bucket is counted at
        # DeepSpeed's default unless plan.extra names reduce_bucket_size; the gather / prefetch
        # buckets of ZeRO-3's parameter fetches are not counted
        parts = []
        if "reduce_bucket_size" not in (plan.extra or {}):
            b = dtype_bytes(plan.main_grad_dtype or plan.dtype)
            parts.append(
                f"its reduce bucket is counted at DeepSpeed's default reduce_bucket_size 5e8 "
                f"({fmt_bytes(DEEPSPEED_REDUCE_BUCKET * b)}); HF's Trainer fills in hidden^2 for 'auto' "
                f"({fmt_bytes(arch.hidden**2 * b)}), Lightning 2e8"
            )
        if plan.zero == 3:
            parts.append("ZeRO-3's all-gather and prefetch buckets (transient) are not counted")
        if plan.optimizer_offload:
            # read from DeepSpeed's code, not measured: on its CPU accelerator (validate deepspeed)
            # host and device memory are one allocator
            parts.append(
                "ZeRO-Offload is taken from DeepSpeed's code, not measured: the fp32 master, Adam "
                "states and the step's fp32 grad partition are off the GPU (ZeRO-3: its grad partition "
                "too), ZeRO-1/2's GPU staging buffer (the largest parameter's size) is counted"
            )
        if parts:
            out.append(f"--zero {plan.zero} under --convention hf is DeepSpeed's ZeRO: " + "; ".join(parts))
    return out


def stage_layer_ranges(plan: ParallelPlan) -> dict[int, range]:
    """Decoder layer indices of each virtual stage, from the validated plan's pp_layout
    (stage order: virtual stage 0 holds the first layers)."""
    out, start = {}, 0
    for s, n in enumerate(plan.pp_layout):
        out[s] = range(start, start + n)
        start += n
    return out


def _resolve(arch, plan):
    from .templates.conventions import convention_for
    from .templates.layers import make_shard

    if plan.pp_layout is None or plan.sp is None or plan.microbatches is None:
        plan = validate_plan(arch, plan)
    if plan.layers and plan.layers != arch.layers:
        arch = arch.with_layers(plan.layers)
    conv = convention_for(plan)
    return arch, plan, conv, make_shard(arch, plan, conv)


@lru_cache(maxsize=65536)
def _layer_runs(arch, flash: bool, recompute: str, recompute_layers, layers: range) -> tuple:
    """((LayerOptions, count), ...) of a stage's layers in order: the first `recompute_layers`
    are recomputed (Megatron's block method), all of them when None; MoE and dense layers
    differ. One entry per run of identical layers."""
    from .templates.layers import layer_options_of

    n = len(layers)
    k = n if recompute_layers is None else min(recompute_layers, n)
    cuts = {0, k, n}
    # MoE and dense layers differ, so do NoPE layers (Llama 4)
    for i in (arch.dense_layers if arch.is_moe else ()) + arch.nope_layers:
        if i in layers:
            cuts.update((i - layers.start, i - layers.start + 1))
    cuts = sorted(c for c in cuts if 0 <= c <= n)
    runs = []
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            opt = layer_options_of(
                arch,
                arch.is_moe_layer(layers[a]),
                flash,
                recompute if a < k else "none",
                layers[a] in arch.nope_layers,
            )
            if runs and runs[-1][0] == opt:
                runs[-1] = (opt, runs[-1][1] + b - a)
            else:
                runs.append((opt, b - a))
    return tuple(runs)


def build_stage_jobs(arch, plan: ParallelPlan, key=None) -> StagePlan:
    """Per virtual stage F/B/I/W jobs (cached per distinct stage). Static bytes and the
    optimizer job depend on which stages a rank holds: `StagePlan.rank_static`. The same
    plan asked again gets the same StagePlan, with the per-rank static bytes it has counted."""
    key = plan_key(plan) if key is None else key  # (the caller may have it: `plan_key(plan)`)
    if key is None:
        return _build_stage_jobs(arch, plan)
    key = (arch, key)
    hit = _STAGE_PLANS.pop(key, None)
    if hit is None:
        hit = _build_stage_jobs(arch, plan)
        if len(_STAGE_PLANS) >= _STAGE_PLANS_MAX:
            del _STAGE_PLANS[next(iter(_STAGE_PLANS))]  # the least recently used
    _STAGE_PLANS[key] = hit
    return hit


def plan_key(plan: ParallelPlan):
    """A hashable picture of every field of the plan (None if a field cannot be frozen)."""
    d = plan.__dict__
    # the empty dicts and lists of a plain plan (`extra`) frozen here, every other field as it is
    key = tuple(
        [
            () if (type(v) is dict or type(v) is list) and not v else v
            for v in map(d.__getitem__, plan.__dataclass_fields__)
        ]
    )
    try:
        hash(key)  # every field hashable as it is (the common case)
        return key
    except TypeError:
        pass
    key = tuple(_freeze(getattr(plan, f)) for f in plan.__dataclass_fields__)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _freeze(v):
    """(plan_key) dicts and lists as tuples, recursively (a module-level function: a nested one
    calling itself is a reference cycle per call)."""
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


# (arch, plan key) -> StagePlan, most recently used last (ParallelPlan is not hashable)
_STAGE_PLANS: dict = {}
_STAGE_PLANS_MAX = 256


def _build_stage_jobs(arch, plan: ParallelPlan) -> StagePlan:
    arch, plan, conv, sh = _resolve(arch, plan)
    from .templates.layers import first_backward_shard

    layout = stage_layer_ranges(plan)
    n_stages = plan.pp * plan.vpp
    creates_grads = plan.grads in ("set-to-none", "ddp-bucket")
    sh_first = first_backward_shard(sh, plan) if creates_grads else None
    stages: dict[int, StageJobs] = {}
    first: dict[int, StageJobs] = {}
    # the stages' jobs looked up under the plan's (model, shard, convention, ...) once, then by
    # the stage's own (first, last, index, layers): hashing the model and the shard once per
    # plan rather than once per stage (their dataclass hashes are most of a warm lookup)
    rec = (plan.flash_attn, plan.recompute, plan.recompute_layers)
    memo = _stages_memo(arch, sh, conv, plan.seq_len, *rec)
    memo_first = _stages_memo(arch, sh_first, conv, plan.seq_len, *rec) if creates_grads else None
    for s in range(n_stages):
        key = (s == 0, s == n_stages - 1, s, layout[s])
        sj = memo.get(key)
        if sj is None:
            runs = _layer_runs(arch, *rec, layout[s])
            sj = memo[key] = _stage_jobs(arch, sh, conv, runs, key[0], key[1], plan.seq_len, s, layout[s])
        stages[s] = sj
        if creates_grads:
            fj = memo_first.get(key)
            if fj is None:
                runs = _layer_runs(arch, *rec, layout[s])
                fj = memo_first[key] = _stage_jobs(
                    arch, sh_first, conv, runs, key[0], key[1], plan.seq_len, s, layout[s]
                )
            first[s] = replace(sj, B=fj.B, I=fj.I, W=fj.W)
    return StagePlan(
        plan=plan,
        stages=stages,
        stage_layers=layout,
        arch=arch,
        conv=conv,
        notes={"convention": conv.name, "shard": sh, "grads": plan.grads, "step": plan.step},
        first_backward=first,
    )


def _layer_parts(arch, sh, conv, runs, first: bool, last: bool) -> list[tuple]:
    """(PartMemory, count) of the stage's layers in forward order; the stage's first layer
    keeps its input and its last layer its output grad (the runtime owns them)."""
    from .templates.programs import layer_memory

    total = sum(n for _, n in runs)
    out, pos = [], 0
    for opt, n in runs:
        for a, b in (
            ((pos, pos + 1), (pos + 1, pos + n - 1), (pos + n - 1, pos + n)) if n > 1 else ((pos, pos + 1),)
        ):
            if b <= a:
                continue
            keep_in = not first and a == 0
            keep_dy = not last and b == total
            out.append((layer_memory(arch, sh, conv, opt, keep_in, keep_dy), b - a))
        pos += n
    return out


def mtp_of(arch, conv, runs: tuple):
    """(depths, LayerOptions of their layers) of the multi-token prediction block the last stage
    runs before its head (Megatron's `--mtp-num-layers`: `Framework.mtp_block`), or None. Its
    layers are the decoder's last layer kind, recomputed as the stage's layers are (selective
    only: full recompute with MTP is refused by `check_mtp`)."""
    if not (arch.mtp_layers and conv.framework.mtp_block):
        return None
    if not runs:
        raise UserError(
            "multi-token prediction layers on a last pipeline stage without decoder layers: "
            "not modelled; give the last stage layers (--pp-layout)"
        )
    opt = runs[-1][0]
    rec = opt.recompute if opt.recompute in ("selective", "core_attn") else "none"
    return arch.mtp_layers, replace(
        opt, moe=arch.is_moe_layer(arch.layers - 1), recompute=rec, offload_keep=0, fsdp_keep=False
    )


def _stage_prologue(sh, conv, runs) -> list[tuple]:
    """Parts every stage runs before its layers: PaddleNLP's per-stage causal mask when the
    attention is not flash (kept for backward when layers are recomputed)."""
    if not conv.framework.stage_causal_mask or not runs or runs[0][0].flash:
        return []
    from .templates.programs import causal_mask_memory

    return [(causal_mask_memory(sh, any(o.recompute != "none" for o, _ in runs)), 1)]


def stage_runs(arch, plan: ParallelPlan, layers: range) -> tuple:
    """((LayerOptions, count), ...) of a stage's layers as its jobs run them."""
    return _layer_runs(arch, plan.flash_attn, plan.recompute, plan.recompute_layers, layers)


def stage_layer_runs(arch, sh, conv, runs: tuple) -> tuple:
    """The stage's layer runs as `_stage_jobs` strings them (offloading's and ZeRO-3's kept layers
    split off), and whether a per-stage prologue part runs first (pipemem.alloc_stream follows
    the same parts)."""
    return _zero3_kept(sh, _offload_stash(arch, sh, conv, runs)), bool(_stage_prologue(sh, conv, runs))


def _megatron_last_layer_kept(runs: tuple) -> tuple:
    """Megatron's fine-grained offloading does not offload a chunk's last layer when that
    chunk's backward comes next (fine_grained_activation_offload.py `should_bulk_offload`, and
    after the warm-up step `post_warmup_callback` turns it off for the first backward chunk's
    last layer): on the last stage that is every microbatch, on earlier stages the first one.
    The stage's last layer keeps everything (on earlier stages a bound: later microbatches do
    offload it)."""
    from .templates.offload import KEEP_ALL

    if not runs:
        return runs
    *rest, (opt, n) = runs
    out = list(rest) + ([(opt, n - 1)] if n > 1 else [])
    return tuple(out) + ((replace(opt, offload_keep=KEEP_ALL), 1),)


def _offload_stash(arch, sh, conv, runs: tuple) -> tuple:
    """torchtune's offloading (--activation-offload all) leaves the last tensors it offloaded
    on the GPU when the forward ends (its forward stash): the stage's last layers keep them,
    so they get runs of their own."""
    if not sh.feat.offload:
        return runs
    if "*" not in sh.feat.offload:
        return _megatron_last_layer_kept(runs) if conv.framework.offload_keeps_last_layer else runs
    from .templates.offload import FWD_STASH, stash_keeps
    from .templates.programs import layer_offload_count

    tail: list = []  # the stage's last FWD_STASH layers, in order
    for opt, n in reversed(runs):
        tail[:0] = [opt] * min(n, FWD_STASH - len(tail))
        if len(tail) == FWD_STASH:
            break
    keeps = stash_keeps([layer_offload_count(arch, sh, conv, o) for o in tail])
    head_n = sum(n for _, n in runs) - len(tail)
    out: list = []
    for opt, n in runs:  # the layers before the tail, as they were
        take = min(n, head_n)
        if take:
            out.append((opt, take))
        head_n -= take
    for opt, k in zip(tail, keeps):
        o = replace(opt, offload_keep=k) if k else opt
        if out and out[-1][0] == o:
            out[-1] = (o, out[-1][1] + 1)
        else:
            out.append((o, 1))
    return tuple(out)


def _zero3_kept(sh, runs: tuple) -> tuple:
    """DeepSpeed ZeRO-3 keeps the stage's last `sh.zero3_kept_layers` layers gathered from their
    forward into their backward (templates.layers.zero3_reuse): they get runs of their own."""
    k = min(sh.zero3_kept_layers, sum(n for _, n in runs))
    if not k:
        return runs
    out: list = []
    left = sum(n for _, n in runs) - k  # layers before the kept tail
    for opt, n in runs:
        plain = min(n, max(0, left))
        left -= plain
        for o, m in ((opt, plain), (replace(opt, fsdp_keep=True), n - plain)):
            if not m:
                continue
            if out and out[-1][0] == o:
                out[-1] = (o, out[-1][1] + m)
            else:
                out.append((o, m))
    return tuple(out)


@lru_cache(maxsize=4096)
def _stages_memo(arch, sh, conv, seq_len: int, flash, recompute, recompute_layers) -> dict:
    """(first, last, stage, layers) -> that stage's jobs (`_stage_jobs`) under this model, shard,
    convention, sequence and recomputation: filled by `_build_stage_jobs`."""
    return {}


@lru_cache(maxsize=65536)
def _stage_jobs(
    arch, sh, conv, runs: tuple, first: bool, last: bool, seq_len: int, stage: int, layers: range
) -> StageJobs:
    """Compose one stage's jobs from its parts (cached: equal stages of different plans share).
    The composition reads neither the stage's index nor its layer indices (its layer `runs`
    say what the layers are): stages alike in every other way, the middle stages of a
    pipeline, are composed once."""
    j = _stage_jobs_alike(arch, sh, conv, runs, first, last, seq_len)
    return replace(j, stage=stage, layers=layers, notes=dict(j.notes))


@lru_cache(maxsize=16384)
def _stage_jobs_alike(arch, sh, conv, runs: tuple, first: bool, last: bool, seq_len: int) -> StageJobs:
    """_stage_jobs without the stage's index and layer range (stage -1, no layers)."""
    stage, layers = -1, ()
    from .templates.programs import embedding_memory, head_memory, layer_prefetch

    parts = _layer_parts(arch, sh, conv, _zero3_kept(sh, _offload_stash(arch, sh, conv, runs)), first, last)
    tied_head = first and last and bool(getattr(arch, "tied_embeddings", False))
    fparts = (
        ([(embedding_memory(arch, sh, conv, seq_len, tied_head), 1)] if first else [])
        + _stage_prologue(sh, conv, runs)
        + parts
        + (
            [
                (
                    head_memory(
                        arch,
                        sh,
                        conv,
                        keep_input=not first and not parts,
                        tied_gathered=tied_head and sh.fsdp and not sh.fsdp_embed_reshard,
                        mtp=mtp_of(arch, conv, runs),
                    ),
                    1,
                )
            ]
            if last
            else []
        )
    )
    bparts = fparts[::-1]

    def walk(ps, kind):
        if kind not in ("B", "I"):
            return compose(getattr(p, kind).repeated(n) for p, n in ps)
        if sh.backward_bucket_bytes:
            # DeepSpeed ZeRO-1/2's reduce bucket: allocated by the first gradient's reduce hook (the
            # output layer's, at the head's backward end: the head's peak, the loss backward, is
            # before it), freed when the backward ends; alive under every later part's peak
            up = sh.backward_bucket_bytes
            ps = [
                (
                    p
                    if (last and i == 0)
                    else replace(
                        p, **{kind: JobMemory(getattr(p, kind).net_bytes, getattr(p, kind).peak_bytes + up)}
                    ),
                    n,
                )
                for i, (p, n) in enumerate(ps)
            ]
        # FSDP2: a part's reduce-scatter input is alive while the next part of the backward runs
        # (PartMemory.rs_state_bytes); and a unit's pre-backward frees its own all-gather buffer
        # at the copy-out and prefetches the next unit's, whose buffer then lives through this
        # unit's backward: the tape counts the unit's own buffer there, so the next one's size
        # replaces it -- larger before the embedding's unit, none before a root unit that is
        # already gathered (torchtune; validate torchtune)
        jobs, linger = [], 0
        for i, (p, n) in enumerate(ps):
            j, own = getattr(p, kind), p.rs_state_bytes
            nxt = ps[i + 1][0] if i + 1 < len(ps) else None
            prefetch = 0
            if p.bwd_gather_bytes and nxt is not None:
                prefetch = nxt.bwd_gather_bytes - p.bwd_gather_bytes
            prefetch += layer_prefetch(p, nxt)
            if linger or own or prefetch:
                head = JobMemory(j.net_bytes, j.peak_bytes + linger)
                if n > 1:
                    jobs.append(head)
                    if n > 2:
                        jobs.append(JobMemory(j.net_bytes, j.peak_bytes + own).repeated(n - 2))
                    jobs.append(JobMemory(j.net_bytes, j.peak_bytes + own + prefetch))
                else:
                    jobs.append(JobMemory(j.net_bytes, j.peak_bytes + linger + prefetch))
            else:
                jobs.append(j.repeated(n))
            linger = own
        return compose(jobs)

    act = sh.boundary_bytes
    empty = not parts
    # An empty middle stage hands its input on as its output: nothing of its own to free.
    y = 0 if (last or (empty and not first)) else act
    dx = 0 if (first or empty) else act
    B, I = walk(bparts, "B"), walk(bparts, "I")
    if not last and parts:
        # The layer's backward may hand the output grad's storage on as its input grad (the
        # residual add); the runtime still references the received dy, so autograd
        # accumulates into a new buffer instead: one boundary tensor more from the start.
        # Paddle's static backward writes that new input grad too, but frees the received dy
        # (a job's keyword argument) at its last use inside the job: the extra buffer adds to
        # the net change, not to the peak (held against the programs Paddle builds,
        # bench/paddlenlp_templates.py).
        via_b, via_i = parts[-1][0].grad_passes_through
        extra = [(act, 0)] if conv.framework.static_backward_frees_dy else []
        if via_b:
            B = compose([B] + extra) if extra else compose([(act, act), B])
        if via_i:
            I = compose([I] + extra) if extra else compose([(act, act), I])
    return StageJobs(
        stage=stage,
        F=walk(fparts, "F"),
        B=B,
        I=I,
        W=walk(bparts, "W"),
        layers=layers,
        notes={"embedding": first, "head": last},
        input_bytes=0 if first else act,
        output_bytes=y,
        input_grad_bytes=dx,
        output_grad_bytes=0 if last else act,
    )


def optimizer_workspace(
    impl: str, optimizer: str, local_bytes: int, largest_bytes: int, offload: float = 0.0
) -> int:
    """What the optimizer implementation materialises while it steps: nothing for fused
    kernels (Megatron, Paddle, torch fused=True); for torch's foreach Adam the denominator
    sqrt(v)/c + eps as one temporary list the size of the local parameters (in the math
    dtype), freed inside the step; for the for-loop path the same per parameter (sqrt, then
    the division: two temporaries of the largest parameter). SGD and the quantized optimizers
    (8/4-bit, one parameter's states at a time in their own kernels) keep no such temporary.
    With --optimizer-offload the offloaded share steps on the CPU."""
    if optimizer in ("sgd", "adam8bit", "adam4bit"):
        return 0
    return int({"fused": 0, "foreach": local_bytes, "for-loop": 2 * largest_bytes}[impl] * (1.0 - offload))


@lru_cache(maxsize=4096)
def _optimizer_job(workspace: int, grads_in_step: int, optimizer_in_step: int) -> JobMemory:
    """The optimizer step as a small program. Its working memory is `workspace` (Megatron's
    fp32 copies of narrow grads, templates.static, and `optimizer_workspace`). On the first
    step the optimizer creates its states before it updates (`optimizer_in_step` bytes); with
    zero_grad(set_to_none=True) the gradients the step created (`grads_in_step` bytes) are
    freed after it."""
    prog = Program("optimizer", type="optimizer")
    prog.add_tensor(Tensor("opt_state", (1,), "fp32", "optimizer_state"))
    prog.add_tensor(Tensor("grads", (), "uint8", "grad", bytes=grads_in_step))
    reads = ("opt_state", "grads")
    if optimizer_in_step:
        prog.add_tensor(Tensor("new_state", (), "uint8", "optimizer_state", bytes=optimizer_in_step))
        prog.add_op(Op("init_state", (), ("new_state",)))
        reads += ("new_state",)
    prog.add_op(Op("optimizer_step", reads, ("opt_state",), workspace_bytes=workspace))
    prog.add_op(Op("zero_grad", ("grads",), (), frees=("grads",)))
    r = analyze_program(prog, live_on_entry=("grads",), keep=() if grads_in_step else ("grads",))
    return JobMemory(r.net_bytes, r.peak_bytes)


def layer_explain(arch, plan: ParallelPlan, layer: int | None = None) -> list[dict]:
    """What one decoder layer keeps for backward: rows {tensor, shape, dtype, bytes, why},
    largest first, then a row for the forward transient peak and one for the backward peak.
    `layer` defaults to the first layer of stage 0 (recomputed if the plan recomputes it)."""
    from .templates.layers import layer_options
    from .templates.programs import layer_programs

    arch, plan, conv, sh = _resolve(arch, plan)
    idx = 0 if layer is None else layer
    if not 0 <= idx < arch.layers:
        raise UserError(f"layer {idx} out of range: {arch.name} has {arch.layers} layers")
    k = plan.pp_layout[0] if plan.recompute_layers is None else plan.recompute_layers
    pos = idx - sum(plan.pp_layout[: _stage_of_layer(plan, idx)])
    opts = layer_options(arch, plan, idx, pos < k)
    pp = layer_programs(arch, sh, conv, opts)
    rf = pp.results["F"]
    # largest first, ties by name: the same order every run (the kept storages are a set)
    rows = sorted(_kept_rows(pp).values(), key=lambda r: (-r["bytes"], r["tensor"]))
    rows.append(
        {
            "tensor": "(forward peak)",
            "shape": [],
            "dtype": "",
            "bytes": rf.peak_bytes,
            "why": f"transient peak above the layer's start at op {rf.peak_op_label}",
        }
    )
    rb = pp.results["B"]
    rows.append(
        {
            "tensor": "(backward peak)",
            "shape": [],
            "dtype": "",
            "bytes": rb.peak_bytes,
            "why": f"peak above the backward's start at op {rb.peak_op_label}",
        }
    )
    if plan.recompute_allgather:
        rows += _regather_trade(arch, plan, conv, sh, opts, pp)
    return rows


def _kept_rows(pp) -> dict[str, dict]:
    """What a layer's forward leaves alive for its backward: storage -> explain row."""
    F, B = pp.F, pp.B
    readers: dict[str, list[str]] = {}
    for op in B.ops:
        label = ("recompute of " + op.type) if op.phase == "recompute" else op.type
        for n in op.inputs:
            st = B.tensors[n].storage
            readers.setdefault(st, [])
            if label not in readers[st]:
                readers[st].append(label)
    by_storage: dict[str, Tensor] = {}
    for t in F.tensors.values():
        if t.storage == t.name:
            by_storage[t.storage] = t
    rows = {}
    rf = pp.results["F"]
    kept = (rf.live_after - {F.tensors[pp.input].storage}) if pp.input in F.tensors else rf.live_after
    for st in kept:
        t = by_storage.get(st)
        if t is None:
            continue
        if st == F.tensors[pp.output].storage:
            # by symmetry with this layer's own input: does the next layer's backward read it?
            saved = pp.input in F.tensors and F.tensors[pp.input].storage in readers
            why = (
                "layer output: the next layer's input (its norm saves it)"
                if saved
                else "layer output: the next layer's input, alive until that layer's forward is done "
                "(it keeps a copy or offloads it, not this tensor)"
            )
        else:
            why = "read in backward by " + ", ".join(readers.get(st, ["(kept)"]))
        rows[st] = {"tensor": st, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes, "why": why}
    return rows


def _regather_trade(arch, plan: ParallelPlan, conv, sh, opts, pp) -> list[dict]:
    """--recompute-allgather, per layer and microbatch: the tensors the layer no longer keeps
    for backward, what it keeps instead, and the all-gathers its backward runs in exchange
    (the same layer built without the switch, compared). None when the convention gathers
    again in backward anyway (Megatron)."""
    from dataclasses import replace

    from .templates.conventions import convention_for
    from .templates.programs import layer_programs

    base_conv = convention_for(replace(plan, recompute_allgather=False))
    if base_conv == conv:
        return []
    base = layer_programs(arch, sh, base_conv, opts)
    kept, kept_before = _kept_rows(pp), _kept_rows(base)
    dropped = [dict(r, why="no longer kept: " + r["why"]) for st, r in kept_before.items() if st not in kept]
    added = [
        dict(r, why="kept instead (this rank's sequence shard): " + r["why"])
        for st, r in kept.items()
        if st not in kept_before
    ]
    gathers_before = {o for op in base.B.ops if op.type == "all_gather" for o in op.outputs}
    comm = []
    for op in pp.B.ops:
        if op.type == "all_gather" and op.phase == "backward" and not set(op.outputs) & gathers_before:
            t = pp.B.tensors[op.outputs[0]]
            comm.append(
                {
                    "tensor": t.name,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "bytes": t.nbytes,
                    "why": f"all-gather added to the backward of {op.module or 'the layer'}: "
                    f"{', '.join(op.inputs)} from the {plan.tp} tensor-parallel ranks",
                }
            )
    net = sum(r["bytes"] for r in dropped) - sum(r["bytes"] for r in added)
    section = (
        f"--recompute-allgather trades memory for communication, per layer and microbatch: "
        f"{fmt_bytes(net)} less kept for backward, {len(comm)} all-gather(s) more in backward"
    )
    return [dict(r, section=section) for r in sorted(dropped, key=lambda r: -r["bytes"]) + added + comm]


def _stage_of_layer(plan: ParallelPlan, idx: int) -> int:
    acc = 0
    for s, n in enumerate(plan.pp_layout):
        if idx < acc + n:
            return s
        acc += n
    return len(plan.pp_layout) - 1


def clear_caches() -> None:
    """Forget every cached analysis (tests, benchmarks)."""
    from .templates.programs import clear_caches as clear_parts

    clear_parts()
    from .templates.static import clear_caches as clear_static

    clear_static()
    _stage_jobs.cache_clear()
    _stages_memo.cache_clear()
    _stage_jobs_alike.cache_clear()
    _STAGE_PLANS.clear()
    _optimizer_job.cache_clear()
    _layer_runs.cache_clear()


def format_explain(rows: list[dict]) -> str:
    """Plain-text table of `layer_explain` rows (for --explain)."""
    lines = [f"{'tensor':40s} {'shape':>24s} {'dtype':>6s} {'bytes':>12s}  why"]
    for r in rows:
        lines.append(
            f"{r['tensor'][:40]:40s} {str(r['shape']):>24s} {r['dtype']:>6s} {fmt_bytes(r['bytes']):>12s}  "
            f"{r['why']}"
        )
    return "\n".join(lines)
