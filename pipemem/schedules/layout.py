"""The one layer-layout function: how many decoder layers each virtual stage holds.

Which rank runs a virtual stage is the schedule's placement (`actions.stage_rank_map`); how the
layers are split over the stages, in stage order, is here. Frameworks differ only in what they
fix beforehand (Megatron's --decoder-first/last-pipeline-num-layers, torchtitan counting the
embedding and the output as layers); the split of what is left is this one rule.
"""

from __future__ import annotations

from ..errors import UserError


def layer_layout(layers: int, stages: int, balanced: bool = False) -> tuple[int, ...] | None:
    """Layers per virtual stage. When `stages` divides `layers`, an even split. Otherwise None,
    or with `balanced` every stage gets floor(layers/stages) and the remainder goes one each to
    the stages from the second-last backwards to the second, then the last, then the first: the
    first stage holds the embedding and the most in-flight microbatches, the last the head and
    the loss, so they are left lighter (Llama 3 405B, 126 layers on 16 stages: 7, 8 x 14, 7)."""
    if stages < 1 or stages > layers:
        raise UserError(f"{stages} pipeline stages for {layers} layers: give 1 to {layers} stages")
    q, r = divmod(layers, stages)
    if r == 0:
        return (q,) * stages
    if not balanced:
        return None
    order = list(range(stages - 2, 0, -1)) + ([stages - 1] if stages > 1 else []) + [0]
    out = [q] * stages
    for s in order[:r]:
        out[s] += 1
    return tuple(out)
