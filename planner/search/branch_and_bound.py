"""Search over layouts: branch and bound around the per-layout CP-SAT model.

Layouts (DP/TP/PP/ZeRO/SP/micro-batch/schedule) come from planner/search/space.py.
Phase 1 takes them in order of their floor (planner/search/floor.py) and builds the
coefficients and cheap bound only of those whose floor could still beat the best
uniform plans found so far, pricing their uniform partitions with the linear stage
model (the estimator's composition, evaluated without building plans); the
estimator prices the best few. Phase 2 runs the CP-SAT stage model (non-uniform
partition, per-layer checkpointing) first on the most promising layout, then on the
rest lowest bound first, skipping any whose bound cannot beat the best plan, until the
proven gap is small enough or the time limit passes. Each solve asks only for plans
faster than the best found (`StageModel.cap`): a slower layout is then pruned, its bound
proven to be the cap, in a fraction of the time its optimum would take (the alternatives
keep their greedy or split partitions). The result
is never worse than the best uniform plan, and the reported gap is against the
lowest bound (or floor, for the layouts never built) of any layout left unsolved.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from costmodel.estimate import estimate
from costmodel.workload import Workload
from hardware.schema import Cluster
from layout.axes import RECOMPUTE
from layout.layout import Layout
from layout.plan import Plan, StagePlan
from layout.results import SolverReport

from planner.request import PlanRequest
from planner.search.bounds import balanced_split, memory_aware_bound, rank_costs
from planner.search.coefficients import block_span, single_block_profile
from planner.search.linear_model import least_recompute_counts, linear_step
from planner.search.enumerate import Candidate
from planner.search.frontier import Entry, EntryBuilder, Frontier
from planner.search.pinned import is_fully_pinned, pinned_plan
from planner.search.solver import StageModel
from planner.search.space import recompute_choices

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
    # the enumeration gets half the time limit, so that pricing and refining its layouts fit in the rest
    half = started + time_limit_s / 2
    build = EntryBuilder(workload, cluster, global_batch, dtype, model, memory_reserve)
    frontier = Frontier(workload, cluster, fixed, build, top_k, deadline=half)
    frontier.grow(frontier.kth_uniform, deadline=half)
    tally = _Tally(top_k)
    for entry in _worth_pricing(frontier.entries, top_k):
        for cand in uniform_plans(workload, cluster, entry.layout, entry.template, {"recompute": entry.uniform_policy}, memory_reserve):
            tally.add(cand)
    # the estimator's k-th may stand above the linear model's: build what could still beat it
    frontier.grow(lambda: max(frontier.kth_uniform(), tally.kth()), deadline=half)
    entries = frontier.entries
    deadline = started + time_limit_s
    refined = 0
    while True:
        _tighten_bounds(entries, tally.first())
        if single_block_profile(workload):
            refined += _refine_entries(workload, cluster, entries, frontier, tally, fixed, memory_reserve, target_gap,
                                       deadline)
        # then build what the first half of the time left unbuilt, while it could still beat the best
        if (time.perf_counter() > deadline or _gap(tally.first(), _proven_bound(entries, frontier)) <= target_gap
                or frontier.floor_left() >= tally.first()):
            break
        built, now = len(entries), time.perf_counter()
        frontier.grow(tally.first, deadline=now + (deadline - now) / 2)  # half what is left, to refine in the rest
        if len(entries) == built:
            break
        for entry in _worth_pricing(entries[built:], top_k):
            for cand in uniform_plans(workload, cluster, entry.layout, entry.template, {"recompute": entry.uniform_policy},
                                      memory_reserve):
                tally.add(cand)
    ranked = sorted(tally.best.values(), key=lambda c: c.estimate.step_time_s)
    _tighten_bounds(entries, tally.first())
    bound = _proven_bound(entries, frontier) if frontier.complete else None
    report = _report(ranked, bound, frontier.considered, refined, time.perf_counter() - started)
    if not ranked and (not frontier.complete or frontier.floor_left() < float("inf")):
        report = report.model_copy(update={"status": "timeout"})  # layouts were left unpriced, not refused
    return SearchResult(best=ranked[:top_k], report=report)


def _refine_entries(workload, cluster, entries: list[Entry], frontier: Frontier, tally: _Tally, fixed, memory_reserve,
                    target_gap: float, deadline: float) -> int:
    """Phase 2 over the entries not yet solved: CP-SAT on each that could beat the best, in
    `_refine_order`, until the proven gap is small enough or the deadline passes. Returns how
    many it solved."""
    refined = 0
    for entry in _refine_order([e for e in entries if not e.solved]):
        if time.perf_counter() > deadline or _gap(tally.first(), _proven_bound(entries, frontier)) <= target_gap:
            break
        if entry.bound >= tally.first():
            continue
        left = deadline - time.perf_counter()
        cand, entry.proven = refine(workload, cluster, entry, fixed, memory_reserve, min(LAYOUT_SOLVE_LIMIT_S, left),
                                    cap=tally.first())
        entry.solved = True
        refined += 1
        if cand is not None:
            tally.add(cand)
    return refined


def _worth_pricing(entries: list[Entry], top_k: int, within: float = 0.01) -> list[Entry]:
    """The layouts whose uniform plans the estimator should price: the best few, and any close to the best."""
    fitting = sorted((e for e in entries if e.uniform_best < float("inf")), key=lambda e: e.uniform_best)
    if not fitting:
        return []
    cutoff = fitting[0].uniform_best * (1 + within)
    return [e for i, e in enumerate(fitting) if i < 3 * top_k or e.uniform_best <= cutoff]


def _refine_order(priced: list[Entry]) -> list[Entry]:
    """The most promising layout first (by the better of its best uniform plan and its greedy or
    split mixed-checkpointing plan), to set a good cap for the rest; then the rest by bound,
    lowest first, the order that raises the proven bound soonest."""
    if not priced:
        return []
    leader = min(priced, key=lambda e: (e.promise, e.bound))
    return [leader] + sorted((e for e in priced if e is not leader), key=lambda e: e.bound)


def uniform_plans(workload, cluster, layout, template, fixed, reserve) -> list[Candidate]:
    out = []
    for policy in recompute_choices(fixed, layout):
        kinds = [layer.kind for layer in workload.layers]
        stages = [s.model_copy(update={"recompute": [policy if kinds[i] == "block" else "none" for i in range(s.start, s.end)]})
                  for s in template.stages]
        out.append(_priced(workload, cluster, layout, template.model_copy(update={"stages": stages}), reserve, policy))
    return out


def refine(workload, cluster, entry: Entry, fixed, reserve, solve_limit_s: float = LAYOUT_SOLVE_LIMIT_S,
           cap: float = float("inf")) -> tuple[Candidate | None, float | None]:
    """CP-SAT partition and per-layer checkpointing of one layout (for at most `solve_limit_s`:
    the search's time left; only partitions faster than `cap`, the search's best, where
    finite), started from the greedy least-recompute assignment and the bottleneck split (each
    also priced on its own)."""
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
    # CPU ranks sharing cores run faster than the closed form CP-SAT minimises (`bounds._pipeline`):
    # there its objective is no bound on the estimate, so neither a cap nor its proof holds
    shared = entry.data.core_sharing > 1.0
    if cap < float("inf") and not shared:
        model.cap(cap)
    solution = model.solve(solve_limit_s)
    if solution is not None and solution.counts is not None:
        plan = template.model_copy(update={"stages": stages_from_counts(workload, solution.counts)})
        cands.append(_priced(workload, cluster, layout, plan, reserve, "cp-sat"))
    proven = entry.bound if shared else (max(solution.bound_s, entry.bound) if solution is not None else None)
    if not cands:
        return None, proven
    return min(cands, key=lambda c: (not c.fits, c.estimate.step_time_s)), proven


def _allowed_split(split: list[dict[str, int]] | None, allowed: tuple[str, ...]) -> list[dict[str, int]] | None:
    """The split start where it uses only the allowed (pinned) policies."""
    if split is None or any(n and k not in allowed for stage in split for k, n in stage.items()):
        return None
    return split


def _tighten_bounds(entries: list[Entry], best: float) -> None:
    """For unsolved pipelined layouts that could still beat `best` (once each): the
    memory-aware bound in place of the cheap one, and the bottleneck split as a start whose
    linear price may raise the layout's promise."""
    for entry in entries:
        if entry.proven is None and not entry.tightened and entry.bound < best and entry.layout.pp > 1:
            entry.tightened = True
            lay, m = entry.layout, entry.template.num_micro_batches
            ranks = rank_costs(entry.data, lay.pp, lay.vpp)
            entry.bound = max(entry.bound, memory_aware_bound(entry.data, lay.pp, lay.vpp, m, ranks))
            if entry.bound < best:
                entry.split = balanced_split(entry.data, lay.pp, lay.vpp, ranks)
            if entry.split is not None:
                step, headroom = linear_step(entry.data, entry.split, lay.pp, lay.vpp, m)
                if headroom >= 0:
                    entry.promise = min(entry.promise, step)


def _proven_bound(entries: list[Entry], frontier: Frontier) -> float:
    """Lowest step time any layout could still reach: CP-SAT bounds where solved, the analytic
    bound elsewhere, the floor of those never built."""
    solved_or_bounded = (e.proven if e.proven is not None else e.bound for e in entries)
    return min(min(solved_or_bounded, default=float("inf")), frontier.floor_left())


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
