"""Cost model: prices a plan of a workload on a cluster (time, memory, dollars)."""
from .estimate import DEFAULT_MEMORY_RESERVE, estimate
from .plan import Estimate, Plan, StagePlan
from .transformer import TransformerDims, transformer_workload
from .workload import LayerProfile, Segment, Workload

__all__ = [
    "DEFAULT_MEMORY_RESERVE",
    "Estimate",
    "LayerProfile",
    "Plan",
    "Segment",
    "StagePlan",
    "TransformerDims",
    "Workload",
    "estimate",
    "transformer_workload",
]
