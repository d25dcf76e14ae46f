"""Training plans for mixed-GPU clusters (`hardware.mixed.MixedCluster`).

Three kinds of layout are priced with the cost model's own per-layer and
per-stage terms (`costmodel.compute.layer_time`, `costmodel.estimate.stage_time`,
`pipeline_time`, `rank_memory`), each stage on its own group's GPU profile:

* pipeline split: one pipeline runs through the groups; group g hosts
  n_g / (dp * tp) consecutive stages, and the block counts per stage are the
  exact min-max balance of the per-stage time (k * block time on that GPU +
  embedding / head) within each stage's memory (binary search over the
  bottleneck time; every group order is tried).
* data split: every group holds whole replicas of the same (tp, pp, stage)
  layout so gradients line up; the global batch is split unevenly, group g's
  replicas running m_g micro-batches each, m chosen exactly to minimise the
  slowest group's pipeline time. The gradient all-reduce crosses groups on the
  inter-group network.
* subset: the best plan of one group alone (`planner.plan`), so a mixed
  cluster never plans slower than its best uniform subset.

The comparison baseline is the best uniform plan that ignores the
difference: `planner.plan` on the cluster seen as n GPUs of the slowest type
(`MixedCluster.as_uniform`), which is how fast that plan runs on the mixed
cluster, since equal shares finish at the slowest group's pace.
"""
from __future__ import annotations

from typing import Any

from costmodel.estimate import DEFAULT_MEMORY_RESERVE, GIB
from costmodel.plan import Plan
from costmodel.workload import Workload
from hardware.errors import InfeasibleError, PlanError
from hardware.mixed import MixedCluster, load_mixed

from planner.resolve import model_name, resolve_workload
from planner.uniform import plan_uniform
from planner.mixed.layouts import capacity_bytes, hetero_candidates
from planner.mixed.plan import GroupBalance, HeteroPlan


def _layout_str(plan: Plan) -> str:
    return f"dp={plan.dp} tp={plan.tp} pp={plan.pp} zero={plan.zero} mb={plan.micro_batch}"


def plan_hetero(model: Any, hw: str | MixedCluster, *, global_batch: int, seq_len: int, dtype: str = "bf16",
                time_limit_s: float = 4.0, memory_reserve: float = DEFAULT_MEMORY_RESERVE,
                compare_uniform: bool = True) -> HeteroPlan:
    """The fastest heterogeneity-aware plan, with the uniform baseline and single-group subsets for comparison."""
    if not isinstance(global_batch, int) or global_batch <= 0:
        raise PlanError("global_batch", f"must be a positive integer, got {global_batch!r}", "e.g. 256")
    mixed = load_mixed(hw)
    workload = resolve_workload(model, seq_len=seq_len, dtype=dtype)
    name = model_name(model, workload)
    cands = hetero_candidates(workload, mixed, global_batch=global_batch, dtype=dtype, name=name, reserve=memory_reserve)
    subsets = {}
    for g in mixed.groups:
        try:
            p = plan_uniform(workload, g, global_batch=global_batch, seq_len=seq_len, dtype=dtype, top_k=1,
                             time_limit_s=time_limit_s, memory_reserve=memory_reserve)
        except InfeasibleError:
            continue
        subsets[g.spec()] = p
    uniform = None
    if compare_uniform:
        try:
            uniform = plan_uniform(workload, mixed.as_uniform(dtype), global_batch=global_batch, seq_len=seq_len,
                                   dtype=dtype, top_k=1, time_limit_s=time_limit_s, memory_reserve=memory_reserve)
        except InfeasibleError:
            uniform = None
    best = min(cands, key=lambda e: e.step).plan if cands else None
    best_subset = min(subsets.items(), key=lambda kv: kv[1].estimate.step_time_s) if subsets else None
    if best_subset and (best is None or best_subset[1].estimate.step_time_s < best.step_time_s):
        best = _subset_plan(best_subset[0], best_subset[1], mixed, workload, name, memory_reserve)
    if best is None:
        raise InfeasibleError("hw", f"{name} fits no layout on {mixed.spec()} at global batch {global_batch}",
                              "add GPUs, lower the batch or the sequence length")
    notes = [f"{len(cands)} heterogeneity-aware layouts priced; subsets and the uniform baseline planned by planner.plan"]
    return best.model_copy(update={
        "uniform_step_time_s": uniform.estimate.step_time_s if uniform else None,
        "uniform_layout": _layout_str(uniform) if uniform else "does not fit",
        "subset_step_time_s": {k: v.estimate.step_time_s for k, v in subsets.items()},
        "layouts_priced": len(cands), "notes": notes})


def _subset_plan(spec: str, plan: Plan, mixed: MixedCluster, workload: Workload, name: str, reserve: float) -> HeteroPlan:
    est = plan.estimate
    balance = []
    for g in mixed.groups:
        used = g.spec() == spec
        balance.append(GroupBalance(group=g.spec(), gpus=g.n_gpus, stages=f"0-{plan.pp - 1}" if used else "-",
                                    blocks_per_stage=[sum(1 for l in workload.layers[s.start:s.end] if l.kind == "block") for s in plan.stages] if used else [],
                                    replicas=plan.dp if used else 0, micro_batches=plan.num_micro_batches if used else 0,
                                    per_micro_batch_s=0.0, busy_s=est.step_time_s if used else 0.0,
                                    idle_fraction=0.0 if used else 1.0,
                                    peak_memory_gib=est.peak_memory_bytes / GIB if used else 0.0,
                                    capacity_gib=capacity_bytes(g, reserve) / GIB))
    return HeteroPlan(model=name, hardware=mixed.spec(), global_batch=plan.global_batch, seq_len=plan.seq_len,
                      dtype=plan.dtype, mode="subset", tp=plan.tp, pp=plan.pp, dp=plan.dp, micro_batch=plan.micro_batch,
                      zero=plan.zero, recompute="/".join(sorted({p for s in plan.stages for p in s.recompute})),
                      step_time_s=est.step_time_s, tokens_per_s=est.tokens_per_s, balance=balance)
