"""Cost model: prices a plan of a workload on a cluster (time, memory, dollars).

Holds the plan and workload schemas, collectives, compute, memory, the data-
parallel share, the estimator, the event simulator and serving prices.
May import: hardware (and numpy, pydantic); never planner, executor or the CLI.
"""
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
