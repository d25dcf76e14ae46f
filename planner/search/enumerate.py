"""Exhaustive enumeration of uniform layouts: the baseline the solver must beat.

Every legal DP/TP/PP/ZeRO/SP/micro-batch/schedule combination with uniform
stages and one checkpointing policy for all layers, priced by the same cost
model. The CP-SAT planner searches a superset (non-uniform stages, per-layer
policies), so its plan can never be worse than the best one found here.
"""
from __future__ import annotations

from dataclasses import dataclass

from costmodel.estimate import estimate

from costmodel.terms import DEFAULT_MEMORY_RESERVE
from layout.plan import Plan
from layout.results import Estimate
from costmodel.workload import Workload
from hardware.schema import Cluster

from layout.layout import Layout
from planner.search.space import layouts, recompute_choices, to_plan


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    recompute: str  # the uniform policy, or "greedy" / "cp-sat" for non-uniform checkpointing
    plan: Plan
    estimate: Estimate

    @property
    def fits(self) -> bool:
        return self.estimate.fits


def uniform_candidates(
    workload: Workload,
    cluster: Cluster,
    *,
    global_batch: int,
    fixed: dict | None = None,
    dtype: str = "bf16",
    model: str | None = None,
    memory_reserve: float = DEFAULT_MEMORY_RESERVE,
):
    """Yield every uniform candidate, priced (fitting or not)."""
    for layout in layouts(workload, cluster, global_batch, fixed):
        for policy in recompute_choices(fixed, layout):
            plan = to_plan(layout, workload, cluster, global_batch=global_batch, dtype=dtype, recompute=policy, model=model or workload.name)
            yield Candidate(layout, policy, plan, estimate(workload, plan, cluster, memory_reserve=memory_reserve))


def best_uniform(workload: Workload, cluster: Cluster, **kwargs) -> Candidate | None:
    best = None
    for cand in uniform_candidates(workload, cluster, **kwargs):
        if cand.fits and (best is None or cand.estimate.step_time_s < best.estimate.step_time_s):
            best = cand
    return best
