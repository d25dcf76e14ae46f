"""Training plans for mixed-GPU clusters (`hardware.mixed.MixedCluster`), as Plans with groups.

The search has the uniform branch and bound's two phases:

1. every pipeline split (each group order, its blocks at the exact single-policy
   balance) and every data split (the global batch shared by CP-SAT,
   `planner.mixed.shares`) is built as a Plan and priced by the estimator;
   The best uniform plan of the cluster seen as its slowest GPU (any layout the uniform
   search offers) is laid on the groups as a pipeline split too, so every feature of the
   uniform space reaches mixed clusters;
2. the most promising pipeline splits go to the CP-SAT stage model with per-rank
   coefficients (`planner.mixed.refine`), until the time limit; it keeps a refined
   partition only where the estimator finds it faster, so the search is never slower
   than phase 1 alone (the side search it replaced).

Each group alone is also planned by `planner.plan_uniform` (the other GPUs idle), so a
mixed cluster never plans slower than its best single group. The baseline in the
notes is the best uniform plan that ignores the difference: `plan_uniform` on the
cluster seen as n GPUs of the slowest type (`MixedCluster.as_uniform`), the pace equal
shares run at on the mixed cluster.
"""
from __future__ import annotations

import time
from typing import Any

from layout.plan import Plan
from layout.results import SolverReport
from hardware.errors import InfeasibleError
from hardware.mixed import MixedCluster, load_mixed

from planner.mixed.layouts import data_splits, pipeline_splits, placed
from planner.mixed.refine import refine
from planner.request import PlanRequest
from planner.resolve import model_name, resolve_workload
from planner.search.coefficients import LayerTimes
from planner.uniform import plan_uniform


def plan_mixed(model: Any, hw: str | MixedCluster, request: PlanRequest, *, compare_uniform: bool = True) -> Plan:
    """The fastest plan for a mixed cluster: a pipeline or data split over its groups, or the
    best single group's plan; the others priced are its `alternatives` (dtype None: bf16)."""
    request = request.model_copy(update={"dtype": request.dtype or "bf16", "top_k": 1})
    global_batch, seq_len, dtype = request.global_batch, request.seq_len, request.dtype
    time_limit_s, memory_reserve = request.time_limit_s, request.memory_reserve
    mixed = load_mixed(hw)
    workload = resolve_workload(model, seq_len=seq_len, dtype=dtype, cluster=mixed)
    start = time.perf_counter()  # the search's budget: tracing (a cold cache) does not spend it
    name = model_name(model, workload)
    kw = dict(global_batch=global_batch, dtype=dtype, name=name, reserve=memory_reserve)
    uniform = uniform_baseline(workload, mixed, request) if compare_uniform else None
    seeds = placed(workload, mixed, uniform, memory_reserve) if uniform is not None else []
    # the enumerations stop at half and three quarters of the limit: each split is a full estimate,
    # and a cluster of many replicas prices slowly (the baseline and the single groups take their own share)
    pipes = sorted(pipeline_splits(workload, mixed, **kw, deadline=start + time_limit_s / 2) + seeds,
                   key=lambda po: po[0].estimate.step_time_s)
    datas = data_splits(workload, mixed, **kw, deadline=start + 3 * time_limit_s / 4)
    refined, times, budget = [], LayerTimes(), time_limit_s / 2
    for plan, order in pipes:
        if time.perf_counter() - start > budget:
            refined.append(plan)
            continue
        refined.append(refine(workload, plan, mixed, order, memory_reserve, times))
    subsets = _subsets(workload, mixed, request)
    found = refined + datas + subsets
    if not found:
        raise InfeasibleError("hw", f"{name} fits no layout on {mixed.spec()} at global batch {global_batch}",
                              "add GPUs, lower the batch or the sequence length")
    found.sort(key=lambda p: p.estimate.step_time_s)
    best = found[0]
    notes = _comparison(best, mixed, uniform, compare_uniform)
    solved = sum(1 for a, b in zip(refined, pipes) if a is not b[0])
    report = SolverReport(status="mixed", wall_s=time.perf_counter() - start, layouts_considered=len(found),
                          layouts_solved=solved, gap=None,
                          notes=[f"{len(pipes)} pipeline splits ({len(seeds)} of them the uniform plan laid on the "
                                 f"groups) and {len(datas)} data splits priced; CP-SAT improved "
                                 f"{solved} pipeline partitions; {len(subsets)} single-group plans"])
    alternatives = [_best_of(found, kind) for kind in ("pipeline", "data", "")]
    return best.model_copy(update={"solver": report, "notes": [*notes, *best.notes],
                                   "alternatives": [a for a in alternatives if a is not None and a is not best]})


def _best_of(found: list[Plan], split: str) -> Plan | None:
    return next((p for p in found if p.split == split), None)


def _quarter(request: PlanRequest) -> PlanRequest:
    """A side search's request: a quarter of the time limit."""
    return request.model_copy(update={"time_limit_s": request.time_limit_s / 4})


def _subsets(workload, mixed, request: PlanRequest) -> list[Plan]:
    out = []
    for group in mixed.groups:
        try:
            out.append(plan_uniform(workload, group, _quarter(request)))
        except InfeasibleError:
            continue
    return out


def uniform_baseline(workload, mixed, request: PlanRequest) -> Plan | None:
    """The best uniform plan of the cluster seen as n GPUs of the slowest type."""
    try:
        return plan_uniform(workload, mixed.as_uniform(request.dtype or "bf16"), _quarter(request))
    except InfeasibleError:
        return None


def _comparison(best: Plan, mixed: MixedCluster, uniform: Plan | None, compare: bool) -> list[str]:
    step = best.estimate.step_time_s
    if best.split:
        notes = [f"{best.split} split over {mixed.spec()}"]
    else:
        notes = [f"{best.hardware} alone is fastest; the other GPUs of {mixed.spec()} stay idle"]
    if not compare:
        return notes
    if uniform is None:
        return [*notes, "the uniform plan that ignores the difference does not fit"]
    theirs = uniform.estimate.step_time_s
    return [*notes, f"the uniform plan that ignores the difference ({uniform.layout_tag}, everyone at the slowest "
                    f"GPU's pace): {theirs:.3g} s, {theirs / step:.2f}x this plan's {step:.3g} s"]
