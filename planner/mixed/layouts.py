"""The heterogeneity-aware layouts of a mixed-GPU cluster, as Plans with groups.

Every layout is a `Plan` whose `groups` place it on the cluster, priced by the one
estimator (`costmodel.estimate`, which prices each group's ranks on its own GPU) and
kept only where `planner.executable` says the executor runs it:

* pipeline split: one pipeline runs through the groups in some order; group g holds
  n_g / (dp * tp) consecutive stages. The blocks per stage start from the exact min-max
  balance of one checkpointing policy (`pipeline_balance`, binary search over the
  bottleneck time within each stage's memory); the most promising layouts are then
  handed to the CP-SAT stage model (`planner.search.solver.StageModel`) with each
  pipeline rank's coefficients taken on its own group's GPU, which also chooses
  per-layer checkpointing, starting from that balance.
* data split: every group holds whole replicas of the same (tp, pp) layout and the
  global batch is split unevenly (`planner.mixed.shares`, CP-SAT): group g's replicas
  run m_g micro-batches each, so faster GPUs take more.
"""
from __future__ import annotations

import math
import time
from itertools import permutations

from costmodel.autocast import under_autocast
from costmodel.estimate import estimate
from costmodel.terms import price_ranks, usable_memory_bytes
from costmodel.mixed import crossing_seconds, spanning
from layout.plan import Plan, plan_problem, uniform_stages
from layout.groups import GroupShare
from costmodel.workload import Workload
from hardware import loads_back
from hardware.errors import PlanError
from hardware.mixed import MixedCluster
from hardware.schema import Cluster

from layout.axes import REBUILT, TP_DEGREES, ZERO_STAGES
from planner.executable import facts_of_workload
from planner.mixed.shares import split_micro_batches
from planner.search.branch_and_bound import stages_from_counts
from planner.search.coefficients import POLICIES, StageModelData, stage_model_data, with_crossing
from planner.search.space import divisors

MICRO_BATCHES = (1, 2, 4)


def share(group: Cluster, stages: list[int], replicas: list[int]) -> GroupShare:
    """The group's part of the plan, its profile embedded unless its spec loads it back."""
    return GroupShare(hardware=group.spec(), hardware_profile=None if loads_back(group) else group, stages=stages,
                      replicas=replicas)


def priced(workload: Workload, plan: Plan, mixed: MixedCluster, reserve: float) -> Plan | None:
    """The plan with its estimate, or None if it does not fit or the executor would refuse it."""
    if plan_problem(plan, facts_of_workload(workload)) is not None:
        return None
    try:
        est = estimate(workload, plan, mixed, memory_reserve=reserve)
    except PlanError:
        return None
    return plan.model_copy(update={"estimate": est}) if est.fits else None


# --- pipeline split: the single-policy balance CP-SAT starts from -------------------

def pipeline_balance(workload, stage_data: list[StageModelData], policy) -> list[int] | None:
    """Exact min-max block counts per stage (one policy, one chunk per rank) under each stage's
    memory, from each stage's own group's coefficients (`stage_data`: the solver's, which are
    the estimator's terms); None if nothing fits."""
    pp = len(stage_data)
    t_block, extra_t, mem_cap = [], [], []
    for s, data in enumerate(stage_data):
        fixed, inflight, block = data.fixed[s], data.in_flight[s], data.block
        t_block.append(block.time[policy])
        extra_t.append(fixed.time)
        used = (fixed.states + fixed.saved + data.extra_bytes(s)
                + (data.rebuild_bytes(s) if policy in REBUILT else 0.0))
        at_peak = (data.capacity - used) / (block.states + block.activation[policy] * inflight)
        at_step = (data.capacity - data.step_bytes(s, fixed.step_states)) / max(block.step_states, 1e-30)
        at_end = (data.capacity - fixed.closing) / max(block.states + block.pile, 1e-30)  # a backward's end
        mem_cap.append(math.floor(min(at_peak, at_step, at_end)))  # the blocks its peaks and its optimizer step hold
    n = workload.n_blocks
    if min(mem_cap) < 1 or sum(mem_cap) < n:
        return None

    def caps(T: float) -> list[int]:
        return [min(mem_cap[s], max(0, math.floor((T - extra_t[s]) / t_block[s] + 1e-9))) for s in range(pp)]

    candidates = sorted({k * t_block[s] + extra_t[s] for s in range(pp) for k in range(1, min(n, mem_cap[s]) + 1)})
    feasible = lambda c: sum(c) >= n and min(c) >= 1  # noqa: E731
    if not feasible(caps(candidates[-1])):
        return None
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(caps(candidates[mid])) else (mid + 1, hi)
    counts = caps(candidates[lo])
    while sum(counts) > n:  # trim the stages whose time is largest, keeping one block each
        s = max((s for s in range(pp) if counts[s] > 1), key=lambda s: counts[s] * t_block[s] + extra_t[s])
        counts[s] -= 1
    return counts


def pipeline_template(workload, mixed, order, *, tp, dp, mb, zero, global_batch, dtype, name) -> Plan:
    """The pipeline split's layout with even stages (the partition is chosen afterwards)."""
    per = [g.n_gpus // (dp * tp) for g in order]
    pp, groups, first = sum(per), [], 0
    for g, n in zip(order, per):
        groups.append(share(g, list(range(first, first + n)), list(range(dp))))
        first += n
    kinds = [layer.kind for layer in workload.layers]
    return Plan(model=name, hardware=mixed.spec(), global_batch=global_batch, seq_len=workload.seq_len, dtype=dtype,
                dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb, stages=uniform_stages(kinds, pp), groups=groups)


def rank_data(workload, plan: Plan, mixed, order, reserve: float, times=None) -> list[StageModelData]:
    """The solver's coefficients of each pipeline rank of a pipeline split: taken on the GPU group
    holding it, at that group's capacity, its sends to another group over their network."""
    clusters = {g.spec(): g.for_stack(plan.stack) for g in order}
    per_group = {spec: stage_model_data(workload, plan, cluster, usable_memory_bytes(cluster, reserve, plan, workload), times)
                 for spec, cluster in clusters.items()}
    owner = {s: share.hardware for share in plan.groups for s in share.stages}
    crossing = crossing_seconds(workload, plan, mixed, [clusters[owner[r]] for r in range(plan.pp)])
    return [with_crossing(per_group[owner[r]], crossing, plan.vpp) for r in range(plan.pp)]


def balanced_pipeline(workload, mixed, template: Plan, order, policy, reserve) -> Plan | None:
    counts = pipeline_balance(workload, rank_data(workload, template, mixed, order, reserve), policy)
    if counts is None:
        return None
    per_policy = [{k: (c if k == policy else 0) for k in POLICIES} for c in counts]
    return priced(workload, template.model_copy(update={"stages": stages_from_counts(workload, per_policy)}), mixed, reserve)


def pipeline_splits(workload, mixed, *, global_batch, dtype, name, reserve,
                    deadline: float = math.inf) -> list[tuple[Plan, list]]:
    """Every fitting pipeline split at its best single-policy balance, with the group order; those
    priced before `deadline` (a perf_counter time) when it comes first."""
    out = []
    for tp in tp_choices(workload, mixed):
        per_tp = [g.n_gpus // tp for g in mixed.groups]
        for dp in common_divisors(per_tp):
            if sum(n // dp for n in per_tp) > workload.n_blocks or sum(n // dp for n in per_tp) < 2:
                continue
            for mb in MICRO_BATCHES:
                if global_batch % (dp * mb):
                    continue
                for zero in ZERO_STAGES:
                    for order in permutations(mixed.groups):
                        if time.perf_counter() > deadline:
                            return out
                        template = pipeline_template(workload, mixed, order, tp=tp, dp=dp, mb=mb, zero=zero,
                                                     global_batch=global_batch, dtype=dtype, name=name)
                        plans = [p for p in (balanced_pipeline(workload, mixed, template, order, k, reserve)
                                             for k in POLICIES) if p is not None]
                        if plans:
                            out.append((min(plans, key=lambda p: p.estimate.step_time_s), list(order)))
    return out


def placed(workload, mixed, uniform: Plan, reserve) -> list[tuple[Plan, list]]:
    """A uniform plan (any layout the uniform search offers: sp, offload, interleaving...) laid on
    the groups as a pipeline split, in every group order where each group holds whole pipeline
    ranks; priced on the mixed cluster with its even partition, for CP-SAT to rebalance."""
    per_rank = uniform.n_gpus // uniform.pp
    if any(g.n_gpus % per_rank for g in mixed.groups) or len(mixed.groups) < 2:
        return []
    out = []
    for order in permutations(mixed.groups):
        groups, first = [], 0
        for g in order:
            n = g.n_gpus // per_rank
            groups.append(share(g, list(range(first, first + n)), list(range(uniform.dp))))
            first += n
        plan = uniform.model_copy(update={"hardware": mixed.spec(), "hardware_profile": None, "groups": groups,
                                          "estimate": None, "alternatives": [], "solver": None, "notes": [],
                                          "checkpointing": None})
        plan = priced(workload, Plan.model_validate(plan.model_dump()), mixed, reserve)
        if plan is not None:
            out.append((plan, list(order)))
    return out


# --- data split ----------------------------------------------------------------------

def data_split(workload, mixed, *, tp, pp, mb, zero, policy, global_batch, dtype, name, reserve) -> Plan | None:
    dp_of = [g.n_gpus // (tp * pp) for g in mixed.groups]
    dp, units = sum(dp_of), global_batch // mb
    if global_batch % mb or units < dp:
        return None
    kinds = [layer.kind for layer in workload.layers]
    alone = Plan(model=name, hardware=mixed.spec(), global_batch=dp * mb, seq_len=workload.seq_len, dtype=dtype, dp=dp,
                 tp=tp, pp=pp, zero=zero, micro_batch=mb, stages=uniform_stages(kinds, pp, policy))
    paces = []
    for g in mixed.groups:
        try:
            _, ranks = price_ranks(under_autocast(workload, alone), alone, spanning(mixed, g, alone.n_gpus))
        except PlanError:
            return None
        totals = [r.per_micro_batch for r in ranks]
        # costmodel.terms.pipeline_seconds with one chunk per rank: m * slowest + the rest, linear in m
        paces.append((max(totals), sum(totals) - max(totals)))
    ms = split_micro_batches(units, dp_of, paces)
    if ms is None:
        return None
    groups, first = [], 0
    for g, n in zip(mixed.groups, dp_of):
        groups.append(share(g, list(range(pp)), list(range(first, first + n))))
        first += n
    shares = [m for m, n in zip(ms, dp_of) for _ in range(n)]
    plan = alone.model_copy(update={"global_batch": global_batch, "groups": groups,
                                    "dp_micro_batches": shares if len(set(shares)) > 1 else None})
    return priced(workload, Plan.model_validate(plan.model_dump()), mixed, reserve)


def data_splits(workload, mixed, *, global_batch, dtype, name, reserve, deadline: float = math.inf) -> list[Plan]:
    """Every fitting data split; those priced before `deadline` when it comes first."""
    out = []
    for tp in tp_choices(workload, mixed):
        per_tp = [g.n_gpus // tp for g in mixed.groups]
        for pp in common_divisors(per_tp):
            if pp > workload.n_blocks:
                continue
            for mb in MICRO_BATCHES:
                for zero in ZERO_STAGES:
                    for policy in POLICIES:
                        if time.perf_counter() > deadline:
                            return out
                        plan = data_split(workload, mixed, tp=tp, pp=pp, mb=mb, zero=zero, policy=policy,
                                          global_batch=global_batch, dtype=dtype, name=name, reserve=reserve)
                        if plan is not None:
                            out.append(plan)
    return out


def tp_choices(workload: Workload, mixed: MixedCluster) -> list[int]:
    node = min(g.gpus_per_node for g in mixed.groups)
    return [t for t in TP_DEGREES if t <= node and node % t == 0 and workload.tp_divides(t)]


def common_divisors(values: list[int]) -> list[int]:
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return list(divisors(g))
