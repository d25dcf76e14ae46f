"""The estimate of one plan: its step time, throughput, memory and cost.

One entry for every plan: a plan on one GPU type is composed from the per-rank terms
(`costmodel.terms.estimate_uniform`), a mixed-cluster plan from the same terms per GPU
group (`costmodel.mixed`).
"""
from __future__ import annotations

from hardware.schema import Cluster
from layout.plan import Plan
from layout.results import Estimate

from .autocast import under_autocast
from .mixed import estimate_mixed, mixed_cluster_of
from .terms import DEFAULT_MEMORY_RESERVE, estimate_uniform
from .workload import Workload


def estimate(workload: Workload, plan: Plan, cluster, *, memory_reserve: float = DEFAULT_MEMORY_RESERVE) -> Estimate:
    """The plan's step on `cluster`: a `Cluster`, or the `MixedCluster` a plan with groups was made for."""
    workload = under_autocast(workload, plan)
    if plan.groups or not isinstance(cluster, Cluster):
        return estimate_mixed(workload, plan, mixed_cluster_of(plan, cluster), memory_reserve)
    return estimate_uniform(workload, plan, cluster, memory_reserve)
