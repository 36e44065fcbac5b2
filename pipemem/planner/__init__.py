"""`pipemem plan`: every parallel plan that fits a model on N GPUs, ranked by a written-down cost
model, and the smallest memory a zero-bubble schedule needs.

    space.py        the plans proposed (degrees, layouts, sharding, schedules, micro-batch sizes)
    search.py       validity, exact pruning, the recomputation ladder, one estimate per plan
    cost.py         pipeline makespan and bubble from FLOPs-proportional durations, communication
    hardware.py     nominal GPU speeds for the cost model, the default memory reserve
    zero_bubble.py  the memory-limited zero-bubble scheduler on a plan's real stage jobs

Every memory number comes from `pipemem.estimate`, so each listed plan re-estimates to the same
bytes with `pipemem estimate` and its flags.
"""

from .search import PlanResult, PlanSearch, SearchStats, Target, flags_string, search_plans
from .space import SpaceOptions

__all__ = [
    "search_plans",
    "PlanSearch",
    "PlanResult",
    "SearchStats",
    "SpaceOptions",
    "Target",
    "flags_string",
]
