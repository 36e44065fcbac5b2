"""Reserved memory per rank: each rank's allocation stream (pipemem.alloc_stream) replayed
through the CUDA caching allocator model (pipemem.allocator) under the plan's allocator
settings (`--alloc-conf`, PYTORCH_CUDA_ALLOC_CONF syntax).

`attach_reserved(est, conf)` gives every `RankEstimate` of a templates or traced estimate a
`reserved_source`: the stream is built and replayed when `peak_reserved_bytes` is first read
(a plan search that never reads it pays nothing), and the result is cached per (stage plan,
schedule, runtime, rank, settings): the same plan asked again reads it back. Templates'
streams are rebuilt from their programs, traced ones read from the recorded programs (the
stage plan's `allocs`). Where the stream is not modelled (Paddle programs, the paddle
convention, a stage adjustment the stream cannot express) the rank's `peak_reserved_bytes` is
None and the estimate says why in a warning, once.

The allocator runs without a capacity: the reserved peak is what the allocator would ask the
device for if it had room (no release-and-retry near the capacity; the verdict compares it
with the GPU).
"""

from __future__ import annotations

import hashlib
import weakref

import numpy as np

from .errors import UserError

_CACHE: dict = {}
_BY_CONTENT: dict = {}  # (digest of a rank's events, their count, period, settings) -> peak reserved
_CACHE_MAX = 4096
NOT_MODELLED_MODES = dict(paddle="Paddle programs (Paddle's allocator is its own)")


def alloc_config(text):
    """PYTORCH_CUDA_ALLOC_CONF text (None or "" = PyTorch's defaults) -> the allocator's config;
    a bad key or value raises UserError naming --alloc-conf."""
    from .allocator import AllocatorConfig

    if text is not None and not isinstance(text, str):
        raise UserError(
            f"--alloc-conf {text!r}: give the PYTORCH_CUDA_ALLOC_CONF text, e.g. "
            "expandable_segments:True,max_split_size_mb:256"
        )
    try:
        return AllocatorConfig.parse(text or "")
    except UserError as e:
        msg = str(e)
        raise UserError(msg if "--alloc-conf" in msg else f"--alloc-conf: {msg}") from None


def attach_reserved(est, conf) -> None:
    """Give each rank of `est` its reserved source (see the module docstring)."""
    text = _conf_text(conf)
    est.alloc_conf = text
    if est.reserved_inputs is None or getattr(est.reserved_inputs[0], "allocs", None) is None:
        what = NOT_MODELLED_MODES.get(est.mode, f"--mode {est.mode}")
        est.warnings.append(
            f"reserved memory (the caching allocator's segments) is not modelled for {what}: "
            "peak_reserved_bytes is null; the allocated numbers stand"
        )
        return
    # each rank's source is the shared one's `run`, called with the rank (holding the rank in it
    # would make each rank a reference cycle)
    run = _Sources(est, conf, text).run
    for r in est.ranks:
        r.reserved_source = run


class _Sources:
    """What the ranks of one estimate share to find their reserved bytes: the lowered schedule
    and first-backward microbatches, made when a rank's reserved is first read. It holds the
    estimate weakly (only to add a warning to it): the estimate holds its ranks and they hold
    this, so a strong reference would make every estimate a reference cycle, freed only by the
    cyclic collector (a plan search makes thousands)."""

    __slots__ = ("est", "reserved_inputs", "runtime", "conf", "text", "inputs", "said")

    def __init__(self, est, conf, text):
        self.est = weakref.ref(est)
        self.reserved_inputs, self.runtime = est.reserved_inputs, est.runtime
        self.conf, self.text = conf, text
        self.inputs = None
        self.said = False

    def run(self, r):
        stage_plan, schedule = self.reserved_inputs
        if self.inputs is None:
            from .runtime import lower

            self.inputs = (
                lower(schedule, self.runtime),
                {s: m for s, m in stage_plan.first_backward_overrides(schedule)},
            )
        lowered, first_mb = self.inputs
        key = (id(stage_plan), id(lowered), r.pp_rank, self.text, r.static, r.source[2])
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is stage_plan and hit[1] is lowered:
            value, why = hit[2], hit[3]
        else:
            value, why = _peak_reserved(stage_plan, lowered, r, self.conf, first_mb)
            if len(_CACHE) >= _CACHE_MAX:
                del _CACHE[next(iter(_CACHE))]
            _CACHE[key] = (stage_plan, lowered, value, why)
        est = self.est()
        if why and not self.said and est is not None:  # (no estimate left to warn: nobody to tell)
            self.said = True
            est.warnings.append(
                f"reserved memory is not modelled for this plan ({why}): peak_reserved_bytes "
                "is null; the allocated numbers stand"
            )
        return value


def _peak_reserved(stage_plan, lowered, r, conf, first_mb) -> tuple[int | None, str]:
    from .alloc_stream import StreamNotModelled, rank_stream_period
    from .allocator.pools import peak_reserved_bytes

    try:
        _, events, period = rank_stream_period(
            stage_plan, lowered, r.pp_rank, r.static, r.source[2], stage_plan.stages, first_mb
        )
    except StreamNotModelled as e:
        return None, str(e)
    # Plans that differ in ways a rank's stream does not show (Megatron's micro-batch 2 at cp 4
    # and micro-batch 1 at cp 2 and dp 2 allocate the same sizes in the same order) replay one
    # stream: read back by its content (a 256-bit digest of the events, the period, the settings)
    digest = hashlib.blake2b(digest_size=32)
    for a in (events.signed, events.stream, events.handle):
        digest.update(np.ascontiguousarray(a, np.int64).data)
    key = (digest.digest(), len(events), period, _conf_text(conf))
    hit = _BY_CONTENT.get(key)
    if hit is None:
        # each (pool, stream) part replayed alone (allocator.pools: the same peak), and the steady
        # phase's repetitions not replayed once a part settles: the same result
        # (allocator.CachingAllocator.run_periodic)
        hit = int(peak_reserved_bytes(events.signed, events.stream, events.handle, conf, period))
        if len(_BY_CONTENT) >= _CACHE_MAX:
            del _BY_CONTENT[next(iter(_BY_CONTENT))]
        _BY_CONTENT[key] = hit
    return hit, ""


def _conf_text(conf) -> str:
    text = getattr(conf, "text", None)
    if isinstance(text, str):
        return text
    return str(conf)


def clear_cache() -> None:
    _CACHE.clear()
    _BY_CONTENT.clear()
