"""Parameter shapes of one rank's shard: defined in `pipemem.model` (next to ArchSpec), named
here too for template-side callers."""

from ..model import embedding_param_shapes, head_param_shapes, layer_param_shapes

__all__ = ["embedding_param_shapes", "head_param_shapes", "layer_param_shapes"]
