"""Search over layouts: branch and bound around the per-layout CP-SAT model.

Layouts (DP/TP/PP/ZeRO/SP/micro-batch/schedule) come from planner/search/space.py.
Phase 1 prices every layout's uniform partitions with the linear stage model
(the estimator's composition, evaluated without building plans) and has the
estimator price the best few. Phase 2 runs the CP-SAT stage model
(non-uniform partition, per-layer checkpointing) on the most promising
layouts, skipping any whose lower bound cannot beat the best plan, until the
time limit. The result is never worse than the best uniform plan, and the
reported gap is against the lowest bound of any layout left unsolved.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from costmodel.data_parallel import held_zero, layer_params_on_rank
from costmodel.estimate import estimate
from costmodel.terms import usable_memory_bytes
from costmodel.memory import gathered_weight_bytes, model_state_bytes
from costmodel.offload import states_on_host
from layout.axes import RECOMPUTE
from layout.plan import Plan, StagePlan
from layout.results import SolverReport
from costmodel.workload import Workload
from hardware.schema import Cluster

from planner.request import PlanRequest
from planner.search.bounds import balanced_split, lower_bound, memory_aware_bound
from planner.search.coefficients import (LayerTimes, StageModelData, block_span, least_recompute_counts, linear_step,
                                         rank_step, single_block_profile, stage_model_data)
from planner.search.enumerate import Candidate
from planner.search.pinned import is_fully_pinned, pinned_plan
from planner.search.solver import StageModel
from layout.layout import Layout
from planner.search.space import layouts, recompute_choices, to_plan

LAYOUT_SOLVE_LIMIT_S = 0.5


@dataclass
class SearchResult:
    best: list[Candidate]  # best first, one per layout
    report: SolverReport


def stages_from_counts(workload: Workload, counts: list[dict[str, int]]) -> list[StagePlan]:
    """Blocks in order; inside a stage the leanest policy first (full, op, selective, none)."""
    first, last = block_span(workload)
    stages, position = [], first
    for s, stage in enumerate(counts):
        start = 0 if s == 0 else position
        policies = [p for p in reversed(RECOMPUTE) for _ in range(stage[p])]
        position += len(policies)
        end = workload.n_layers if s == len(counts) - 1 else position
        policies = ["none"] * (first if s == 0 else 0) + policies + ["none"] * (end - position if s == len(counts) - 1 else 0)
        stages.append(StagePlan(start=start, end=end, recompute=policies))
    return stages


def _priced(workload, cluster, layout, plan, reserve, policy) -> Candidate:
    return Candidate(layout, policy, plan, estimate(workload, plan, cluster, memory_reserve=reserve))


@dataclass
class _Entry:
    layout: Layout
    template: Plan
    data: StageModelData
    bound: float
    uniform_best: float = float("inf")
    promise: float = float("inf")  # linear time of the better of uniform and greedy mixed checkpointing
    uniform_policy: str = "full"
    proven: float | None = None
    tightened: bool = False  # the memory-aware bound has replaced the cheap one
    split: list[dict[str, int]] | None = None  # the bottleneck bound's split, rounded to whole blocks


def _entries(workload, cluster, global_batch, fixed, dtype, model, memory_reserve, dropped: list | None = None,
             deadline: float = float("inf")) -> tuple[list[_Entry], bool]:
    """Every layout with its coefficients and cheap bound, lowest bound first, and whether the
    enumeration finished before `deadline` (a perf_counter time); the layouts whose states
    alone overflow are counted in `dropped` instead."""
    entries, times, per_rank = [], LayerTimes(), {}
    capacity = usable_memory_bytes(cluster, memory_reserve)  # every layout's bound: its own is smaller
    for layout in layouts(workload, cluster, global_batch, fixed):
        if time.perf_counter() > deadline:
            entries.sort(key=lambda e: e.bound)
            return entries, False
        if _states_overflow(workload, layout, dtype, capacity, per_rank, cluster):
            if dropped is not None:
                dropped.append(layout)
            continue
        template = to_plan(layout, workload, cluster, global_batch=global_batch, dtype=dtype, recompute="none",
                                  model=model or workload.name, shared_stages=True)
        room = usable_memory_bytes(cluster, memory_reserve, template, workload)  # this layout's communicators
        data = stage_model_data(workload, template, cluster, room, times)
        entries.append(_Entry(layout, template, data, lower_bound(data, layout.pp, layout.vpp, template.num_micro_batches)))
    entries.sort(key=lambda e: e.bound)
    return entries, True


def _states_overflow(workload: Workload, layout: Layout, dtype: str, capacity: float, per_rank: dict,
                     cluster: Cluster) -> bool:
    """Whether the average pipeline rank's weights and optimizer states alone exceed
    one GPU (the fullest rank holds at least the average; experts priced at the dense
    per-parameter figure, which shards over more ranks): such a layout's bound is inf, so it
    is dropped before its coefficients are built. Offloaded states are on the host."""
    if states_on_host(layout, cluster):
        return False
    key = (layout.tp, layout.ep)
    if key not in per_rank:
        per_rank[key] = sum(layer_params_on_rank(s.layer, layout.tp, layout.ep) * s.count for s in workload.segments)
    shard = layout.shard_degree
    states = model_state_bytes(1.0, dtype, held_zero(layout), shard, layout.stack)
    # gradients left out: one FSDP2 micro-batch holds none at its peak (estimate.gradients_at_peak)
    state = (states["weights"] + states["optimizer"]
             + gathered_weight_bytes(1.0, dtype, held_zero(layout), shard, layout.stack))
    return per_rank[key] / layout.pp * state > capacity


class _Tally:
    """Best fitting plan per layout."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.best: dict[Layout, Candidate] = {}

    def add(self, cand: Candidate) -> None:
        current = self.best.get(cand.layout)
        if cand.fits and (current is None or cand.estimate.step_time_s < current.estimate.step_time_s):
            self.best[cand.layout] = cand

    def kth(self) -> float:
        times = sorted(c.estimate.step_time_s for c in self.best.values())
        return times[self.top_k - 1] if len(times) >= self.top_k else float("inf")

    def first(self) -> float:
        return min((c.estimate.step_time_s for c in self.best.values()), default=float("inf"))


def search(workload: Workload, cluster: Cluster, request: PlanRequest, *, model: str | None = None) -> SearchResult:
    """Phase 1 prices the uniform and greedy plans of every layout with the
    linear model and has the estimator price the best, then tightens the
    bounds of the layouts that could beat it; phase 2 runs the CP-SAT stage
    model on the most promising layouts until the proven gap is at most
    `request.target_gap` or its time limit passes (dtype None searches bf16)."""
    dtype = request.dtype or "bf16"
    fixed, global_batch, top_k = request.pins(dtype), request.global_batch, request.top_k
    time_limit_s, memory_reserve, target_gap = request.time_limit_s, request.memory_reserve, request.target_gap
    started = time.perf_counter()
    cluster = cluster.for_stack(fixed.get("stack", "eager"))  # every layout of one search prices one stack
    dropped: list = []
    # the enumeration gets half the time limit, so that pricing and refining its layouts fit in the rest
    entries, complete = _entries(workload, cluster, global_batch, fixed, dtype, model, memory_reserve, dropped,
                                 deadline=started + time_limit_s / 2)
    tally = _Tally(top_k)
    priced = _rank_uniform(workload, entries, fixed)
    for entry in _worth_pricing(priced, top_k):
        for cand in uniform_plans(workload, cluster, entry.layout, entry.template, {"recompute": entry.uniform_policy}, memory_reserve):
            tally.add(cand)
    _tighten_bounds(entries, tally.first())
    refined = 0
    if single_block_profile(workload):
        for entry in _refine_order(priced):
            if time.perf_counter() - started > time_limit_s or _gap(tally.first(), _proven_bound(entries)) <= target_gap:
                break
            if entry.bound >= tally.first():
                continue
            cand, entry.proven = refine(workload, cluster, entry, fixed, memory_reserve)
            refined += 1
            if cand is not None:
                tally.add(cand)
    ranked = sorted(tally.best.values(), key=lambda c: c.estimate.step_time_s)
    _tighten_bounds(entries, tally.first())
    bound = _proven_bound(entries) if complete else None
    report = _report(ranked, bound, len(entries) + len(dropped), refined, time.perf_counter() - started)
    return SearchResult(best=ranked[:top_k], report=report)


def _rank_uniform(workload: Workload, entries: list[_Entry], fixed: dict) -> list[_Entry]:
    """Price every layout's uniform plans, and its greedy least-recompute mix,
    with the linear stage model (exactly the estimator's composition, without
    building plans)."""
    first, last = block_span(workload)
    for entry in entries:
        allowed = recompute_choices(fixed, entry.layout)
        blocks = [min(st.end, last) - max(st.start, first) for st in entry.template.stages]
        lay, m = entry.layout, entry.template.num_micro_batches
        per_rank = [sum(blocks[r::lay.pp]) for r in range(lay.pp)]
        for policy in allowed:
            step, headroom = rank_step(entry.data, [{policy: b} for b in per_rank], lay.pp, lay.vpp, m)
            if headroom >= 0 and step < entry.uniform_best:
                entry.uniform_best, entry.uniform_policy = step, policy
        greedy = least_recompute_counts(entry.data, blocks, lay.pp, allowed)
        if greedy is not None:
            entry.promise = min(entry.uniform_best, linear_step(entry.data, greedy, lay.pp, lay.vpp, m)[0])
    return entries


def _worth_pricing(entries: list[_Entry], top_k: int, within: float = 0.01) -> list[_Entry]:
    """The layouts whose uniform plans the estimator should price: the best few, and any close to the best."""
    fitting = sorted((e for e in entries if e.uniform_best < float("inf")), key=lambda e: e.uniform_best)
    if not fitting:
        return []
    cutoff = fitting[0].uniform_best * (1 + within)
    return [e for i, e in enumerate(fitting) if i < 3 * top_k or e.uniform_best <= cutoff]


def _refine_order(priced: list[_Entry]) -> list[_Entry]:
    """Most promising layouts first: by the better of their best uniform plan and
    their greedy mixed-checkpointing plan; layouts with neither go last, by bound."""
    return sorted(priced, key=lambda e: (e.promise, e.bound))


def uniform_plans(workload, cluster, layout, template, fixed, reserve) -> list[Candidate]:
    out = []
    for policy in recompute_choices(fixed, layout):
        kinds = [layer.kind for layer in workload.layers]
        stages = [s.model_copy(update={"recompute": [policy if kinds[i] == "block" else "none" for i in range(s.start, s.end)]})
                  for s in template.stages]
        out.append(_priced(workload, cluster, layout, template.model_copy(update={"stages": stages}), reserve, policy))
    return out


def refine(workload, cluster, entry: _Entry, fixed, reserve) -> tuple[Candidate | None, float | None]:
    """CP-SAT partition and per-layer checkpointing of one layout, started from
    the greedy least-recompute assignment (also priced on its own)."""
    layout, template = entry.layout, entry.template
    model = StageModel(entry.data, layout.pp, layout.vpp, template.num_micro_batches)
    allowed = recompute_choices(fixed, layout)
    model.allow_only(allowed)
    first, last = block_span(workload)
    blocks = [min(st.end, last) - max(st.start, first) for st in template.stages]
    greedy = least_recompute_counts(entry.data, blocks, layout.pp, allowed)
    starts = [(name, c) for name, c in (("greedy", greedy), ("split", _allowed_split(entry.split, allowed))) if c is not None]
    cands = []
    for name, counts in starts:
        plan = template.model_copy(update={"stages": stages_from_counts(workload, counts)})
        cands.append(_priced(workload, cluster, layout, plan, reserve, name))
    if starts:
        m = template.num_micro_batches
        model.hint(min(starts, key=lambda s: linear_step(entry.data, s[1], layout.pp, layout.vpp, m)[0])[1])
    solution = model.solve(LAYOUT_SOLVE_LIMIT_S)
    if solution is not None:
        plan = template.model_copy(update={"stages": stages_from_counts(workload, solution.counts)})
        cands.append(_priced(workload, cluster, layout, plan, reserve, "cp-sat"))
    if not cands:
        return None, None
    best = min(cands, key=lambda c: (not c.fits, c.estimate.step_time_s))
    return best, max(solution.bound_s, entry.bound) if solution is not None else None


def _allowed_split(split: list[dict[str, int]] | None, allowed: tuple[str, ...]) -> list[dict[str, int]] | None:
    """The split start where it uses only the allowed (pinned) policies."""
    if split is None or any(n and k not in allowed for stage in split for k, n in stage.items()):
        return None
    return split


def _tighten_bounds(entries: list[_Entry], best: float) -> None:
    """For unsolved pipelined layouts that could still beat `best` (once each): the
    memory-aware bound in place of the cheap one, and the bottleneck split as a start whose
    linear price may raise the layout's promise."""
    for entry in entries:
        if entry.proven is None and not entry.tightened and entry.bound < best and entry.layout.pp > 1:
            entry.tightened = True
            lay, m = entry.layout, entry.template.num_micro_batches
            entry.bound = max(entry.bound, memory_aware_bound(entry.data, lay.pp, lay.vpp, m))
            if entry.bound < best:
                entry.split = balanced_split(entry.data, lay.pp, lay.vpp)
            if entry.split is not None:
                step, headroom = linear_step(entry.data, entry.split, lay.pp, lay.vpp, m)
                if headroom >= 0:
                    entry.promise = min(entry.promise, step)


def _proven_bound(entries: list[_Entry]) -> float:
    """Lowest step time any layout could still reach: CP-SAT bounds where solved, the analytic bound elsewhere."""
    return min((e.proven if e.proven is not None else e.bound for e in entries), default=float("inf"))


def _gap(best: float, bound: float) -> float:
    if best == float("inf"):
        return float("inf")
    return max(0.0, (best - min(best, bound)) / best)


def _report(ranked, bound, considered, refined, wall) -> SolverReport:
    if not ranked:
        return SolverReport(status="infeasible", wall_s=wall, layouts_considered=considered, layouts_solved=refined, gap=float("inf"))
    if bound is None:  # the time limit cut the enumeration: the layouts not seen bound nothing
        return SolverReport(status="feasible", wall_s=wall, layouts_considered=considered, layouts_solved=refined,
                            gap=None, notes=[f"the time limit passed before every layout was enumerated ({considered} "
                                             "seen); raise --time-limit to search them all"])
    gap = _gap(ranked[0].estimate.step_time_s, bound)
    status = "optimal" if gap < 1e-3 else "feasible"
    return SolverReport(status=status, wall_s=wall, layouts_considered=considered, layouts_solved=refined, gap=gap)


def best_plan(workload, cluster, request: PlanRequest, *, model: str | None = None) -> Plan | None:
    """The fastest fitting plan with its estimate; a fully pinned layout the search does not
    offer (or that does not fit) estimated as given, with notes saying why; else None."""
    result = search(workload, cluster, request.model_copy(update={"top_k": 1}), model=model)
    if not result.best:
        dtype = request.dtype or "bf16"
        if is_fully_pinned(request.fixed):
            return pinned_plan(workload, cluster, global_batch=request.global_batch, fixed=request.pins(dtype), dtype=dtype,
                               model=model, memory_reserve=request.memory_reserve)
        return None
    cand = result.best[0]
    return cand.plan.model_copy(update={"estimate": cand.estimate, "solver": result.report})
