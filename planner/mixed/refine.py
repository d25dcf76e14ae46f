"""A mixed pipeline split refined by the CP-SAT stage model, each rank on its own GPU.

`planner.search.solver.StageModel` is the model the uniform branch and bound solves;
here each pipeline rank's coefficients (`stage_model_data`) are taken on the GPU group
that holds it, at that group's memory capacity, so the model balances blocks against
each GPU's speed and memory and chooses per-layer checkpointing. It starts from the
single-policy balance (`planner.mixed.layouts.pipeline_balance`), and the estimator
prices what it returns: the refined plan is kept only where it is faster.
"""
from __future__ import annotations

from layout.plan import Plan
from layout.rules import allowed_recompute
from costmodel.workload import Workload
from hardware.mixed import MixedCluster

from planner.mixed.layouts import priced, rank_data
from planner.search.branch_and_bound import LAYOUT_SOLVE_LIMIT_S, stages_from_counts
from planner.search.coefficients import POLICIES, LayerTimes, block_span
from planner.search.solver import StageModel


def counts_of(workload: Workload, plan: Plan) -> list[dict[str, int]]:
    """Blocks per policy on each stage of `plan` (the model's variables, for its hint)."""
    first, last = block_span(workload)
    out = []
    for stage in plan.stages:
        counts = dict.fromkeys(POLICIES, 0)
        for i, policy in zip(range(stage.start, stage.end), stage.recompute):
            if first <= i < last:
                counts[policy] += 1
        out.append(counts)
    return out


def refine(workload: Workload, plan: Plan, mixed: MixedCluster, order, reserve: float, times: LayerTimes,
           time_limit_s: float = LAYOUT_SOLVE_LIMIT_S) -> Plan:
    """`plan` (a priced pipeline split) or the CP-SAT partition of its layout, whichever is faster."""
    model = StageModel(rank_data(workload, plan, mixed, order, reserve, times), plan.pp, plan.vpp, plan.num_micro_batches)
    model.allow_only(allowed_recompute(plan))
    model.hint(counts_of(workload, plan))
    solution = model.solve(time_limit_s)
    if solution is None:
        return plan
    better = priced(workload, plan.model_copy(update={"stages": stages_from_counts(workload, solution.counts),
                                                      "estimate": None}), mixed, reserve)
    if better is None or better.estimate.step_time_s >= plan.estimate.step_time_s:
        return plan
    return better
