"""Cost model: prices a plan of a workload on a cluster (time, memory, dollars).

Holds the workload schema, collectives, compute, memory, the data-parallel
share, the estimator, the event simulator and serving prices; the Plan it prices
is data on the floor below (`layout`).
May import: hardware, layout (and numpy, pydantic); never planner, executor or the CLI.
"""
from .estimate import estimate
from .terms import DEFAULT_MEMORY_RESERVE
from .transformer import TransformerDims, transformer_workload
from .workload import LayerProfile, Segment, Workload

__all__ = [
    "DEFAULT_MEMORY_RESERVE",
    "LayerProfile",
    "Segment",
    "TransformerDims",
    "Workload",
    "estimate",
    "transformer_workload",
]
