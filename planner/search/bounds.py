"""Lower bounds on the step time of any partition of a layout.

They let the search skip layouts that cannot beat the best plan found and
report a proven optimality gap. Both bounds use the pipeline composition
m*Rmax + (sum R - Rmax)/v = (m - 1/v)*Rmax + sum R/v, which grows with the
slowest rank's per-micro-batch work Rmax and with the total sum R. Each bound
takes a lower bound on both: the least total over every split of the blocks
among the pipeline ranks, and the least slowest rank over every split (the
bottleneck, which integer blocks and the embedding and head on the end ranks
keep above sum R / pp). Both splits are found by adding blocks one at a time:
to the rank with the smallest marginal cost for the total (each rank's cost is
convex in its blocks), to the rank whose cost after it is smallest for the
bottleneck (each rank's cost grows with its blocks). The optimizer step of the
average rank is added: the most loaded rank holds at least the average.
"""
from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

from costmodel.terms import bubble_fill, pipeline_seconds
from layout.axes import REBUILT, RECOMPUTE
from planner.search.coefficients import StageModelData, fixed_per_rank
from planner.search.linear_model import cheapest_mix

# (leaner, middle) policies a rank's whole-block mix draws beside "none" (whole_block_mix)
MIXES = (("full", "selective"), ("full", "op"), ("op", "selective"))
RankCost = Callable[[int], float]  # a pipeline rank's per-micro-batch seconds with n blocks


def _pipeline(total: float, slowest: float, vpp: int, m: int, core_sharing: float = 1.0, fill: float = 0.0) -> float:
    """The closed form; where CPU ranks share cores (`costmodel.shared_cores`) a rank runs
    up to `core_sharing` times faster while peers wait, so only its own m micro-batches at
    that speed bound the step."""
    if float("inf") in (total, slowest):  # not 0 * inf for a single micro-batch
        return float("inf")
    if core_sharing > 1.0:
        return m * slowest / core_sharing
    return pipeline_seconds(slowest, total, m, vpp, fill)


def lower_bound(data: StageModelData, pp: int, vpp: int, m: int) -> float:
    """Cheap bound: the blocks priced without recomputation, except without
    pipelining, where the one rank's memory fixes the cheapest checkpointing
    mix exactly (relaxed to fractions of blocks). inf where even the average
    rank cannot hold its share."""
    params = _params(data)
    if _average_rank_overflows(data, params, pp):
        return float("inf")
    if pp == 1:
        fixed = data.prefix + data.suffix
        room = (data.capacity - _states(data) - data.extra_bytes(0)
                - data.saved_bytes(0, vpp, {}))
        work = (cheapest_mix(data, data.n_blocks, room, data.in_flight[0]) + sum(l.time["none"] for l in fixed)
                + sum(data.stage_fill(s, vpp) for s in range(vpp)))
        return _pipeline(work, work, vpp, m) + _optimizer(data, params, pp) + _exposed_reduction(data, pp, vpp)
    block = data.block.time["none"]
    costs = [lambda n, f=fixed: n * block + f for fixed in _fixed_times(data, pp, vpp)]
    total = data.n_blocks * block + sum(_fixed_times(data, pp, vpp))
    return (_pipeline(total, _least_slowest(costs, vpp, data.n_blocks), vpp, m, data.core_sharing, _fill(data, pp))
            + _optimizer(data, params, pp) + _exposed_reduction(data, pp, vpp))


def memory_aware_bound(data: StageModelData, pp: int, vpp: int, m: int, ranks: list[_RankCost] | None = None) -> float:
    """Bound for pipelined layouts: each rank checkpointing the cheapest mix its
    own memory allows for the blocks it is given; for the total a fractional
    mix (an LP value function with a right-hand side affine in the count, so
    convex in it), for the slowest rank whole blocks (exact, and growing with
    the count). inf: no split fits. `ranks`: `rank_costs`' (shared with `balanced_split`)."""
    ranks = ranks or rank_costs(data, pp, vpp)
    costs = [lambda n, rank=rank: rank.blocks_time(n) + rank.fixed_time for rank in ranks]
    total = _least_total(costs, vpp, data.n_blocks)
    if total == float("inf"):
        return total
    whole = [lambda n, rank=rank: rank.whole_blocks_time(n) + rank.fixed_time for rank in ranks]
    return (_pipeline(total, _least_slowest(whole, vpp, data.n_blocks), vpp, m, data.core_sharing, _fill(data, pp))
            + _optimizer(data, _params(data), pp) + _exposed_reduction(data, pp, vpp))


def _least_total(costs: list[RankCost], start: int, n_blocks: int) -> float:
    """Least sum of the ranks' costs over splits of `n_blocks`, `start` blocks each at least
    (marginal allocation, exact for convex costs)."""
    counts = [start] * len(costs)
    work = [cost(start) for cost in costs]
    if any(w == float("inf") for w in work):
        return float("inf")
    heap = [(costs[r](start + 1) - work[r], r) for r in range(len(costs))]
    heapq.heapify(heap)
    for _ in range(n_blocks - sum(counts)):
        marginal, r = heapq.heappop(heap)
        if marginal == float("inf"):
            return float("inf")
        counts[r] += 1
        work[r] += marginal
        heapq.heappush(heap, (costs[r](counts[r] + 1) - work[r], r))
    return sum(work)


def _least_slowest(costs: list[RankCost], start: int, n_blocks: int) -> float:
    return least_slowest_split(costs, start, n_blocks)[0]


def least_slowest_split(costs: list[RankCost], start: int, n_blocks: int) -> tuple[float, list[int]]:
    """Least cost of the slowest rank over splits of `n_blocks`, and that split: the values
    taken from the heap never decrease, so the last one is the n-th smallest that any split
    must reach."""
    counts = [start] * len(costs)
    level = max(cost(start) for cost in costs)
    heap = [(costs[r](start + 1), r) for r in range(len(costs))]
    heapq.heapify(heap)
    for _ in range(n_blocks - sum(counts)):
        value, r = heapq.heappop(heap)
        counts[r] += 1
        level = max(level, value)
        heapq.heappush(heap, (costs[r](counts[r] + 1), r))
    return level, counts


def balanced_split(data: StageModelData, pp: int, vpp: int,
                   ranks: list[_RankCost] | None = None) -> list[dict[str, int]] | None:
    """A feasible partition from the bottleneck bound's split: each rank's blocks with the
    fastest whole-block checkpointing mix its memory allows, spread over its virtual stages.
    A primal start beside the greedy one (None when a rank's rounded mix does not fit)."""
    S = pp * vpp
    ranks = ranks or rank_costs(data, pp, vpp)
    level, counts = least_slowest_split([lambda n, rank=rank: rank.whole_blocks_time(n) + rank.fixed_time
                                         for rank in ranks], vpp, data.n_blocks)
    if level == float("inf"):
        return None
    stages: list[dict[str, int]] = [{} for _ in range(S)]
    for r, (rank, n) in enumerate(zip(ranks, counts)):
        mix = rank.whole_block_mix(n)
        if mix is None:
            return None
        order = [k for k in reversed(RECOMPUTE) for _ in range(mix[k])]
        for i, s in enumerate(data.stages_of(r, pp, S)):
            lo, hi = round(i * n / vpp), round((i + 1) * n / vpp)
            stages[s] = {k: order[lo:hi].count(k) for k in RECOMPUTE}
    return stages


def _params(data: StageModelData) -> float:
    return data.n_blocks * data.block.params + sum(l.params for l in data.prefix + data.suffix)


def _fill(data: StageModelData, pp: int) -> float:
    """A zero-bubble schedule's ramp fill (`costmodel.terms.bubble_fill`): every weight gradient's
    time, whatever the partition, so exact in a bound."""
    grads = data.n_blocks * data.block.weight_grad + sum(l.weight_grad for l in data.prefix + data.suffix)
    return bubble_fill(data.schedule, grads, pp)


def _states(data: StageModelData) -> float:
    """Every layer's states at the activation peak, over all pipeline ranks."""
    return data.n_blocks * data.block.states + sum(l.states for l in data.prefix + data.suffix)


def _optimizer(data: StageModelData, params: float, pp: int) -> float:
    return params / pp * data.optimizer_seconds_per_param  # the all-gathers and experts' reduction left out: still below


def _exposed_reduction(data: StageModelData, pp: int, vpp: int) -> float:
    """The least data-parallel reduction the first pipeline rank leaves exposed
    (`linear_model.linear_step`): no earlier rank's backward hides it, only its own blocks'
    backward, at most the widest policy's each. Its cost is linear in its block count, so the
    least over splits is at the fewest blocks it may hold (one per virtual stage) or the
    most (every other rank holding one per virtual stage)."""
    if not data.dp_seconds_per_param:
        return 0.0
    block, first = data.block, fixed_per_rank(data, pp, vpp)[0]
    widest = max(block.backward.values())

    def exposed(n: int) -> float:
        reduced = first.params + n * (block.params - block.expert_params)
        return reduced * data.dp_seconds_per_param + data.dp_latency - n * widest

    fewest, most = (vpp, data.n_blocks - (pp - 1) * vpp) if pp > 1 else (data.n_blocks, data.n_blocks)
    return max(0.0, min(exposed(fewest), exposed(most)))


def _fixed_times(data: StageModelData, pp: int, vpp: int) -> list[float]:
    """Each pipeline rank's seconds per micro-batch besides its blocks (`RankFixed.time`)."""
    return [fixed.time for fixed in fixed_per_rank(data, pp, vpp)]


def _average_rank_overflows(data: StageModelData, params: float, pp: int) -> bool:
    """Whether the ranks' average memory (their states, the leanest checkpointing of the
    blocks at the fewest micro-batches in flight) already exceeds one rank's capacity; the
    fullest rank holds at least the average."""
    leanest = min(data.block.activation.values()) * data.n_blocks * min(data.in_flight)
    extra = sum(data.extra_bytes(r) + data.least_block_bytes(r) for r in range(pp))
    average = (_states(data) + leanest + extra) / pp
    return average > data.capacity


def rank_costs(data: StageModelData, pp: int, vpp: int) -> list[_RankCost]:
    """Each pipeline rank's `_RankCost`, for `memory_aware_bound` and `balanced_split`; their
    whole-block mixes tabulated together (`_MixTable`)."""
    fixed = fixed_per_rank(data, pp, vpp)
    ranks = [_RankCost(data, r, fixed[r]) for r in range(pp)]
    table = _MixTable(data, ranks)
    for rank in ranks:
        rank.table = table
    return ranks


class _RankCost:
    """One pipeline rank's fixed layers and memory, for `memory_aware_bound`; its whole-block
    mixes are its row of the layout's `_MixTable`."""

    def __init__(self, data: StageModelData, r: int, fixed) -> None:
        self.data, self.r, self.rebuild = data, r, data.rebuild_bytes(r)
        self.in_flight = data.in_flight[r]
        self.fixed_time = fixed.time
        self.fixed_bytes = fixed.states + data.extra_bytes(r) + fixed.saved + data.least_block_bytes(r)
        self.table: _MixTable | None = None

    def blocks_time(self, n: int) -> float:
        d = self.data
        room = d.capacity - self.fixed_bytes - n * d.block.states
        return cheapest_mix(d, n, room, self.in_flight)

    def whole_block_mix(self, n: int) -> dict[str, int] | None:
        """The fastest counts of blocks per policy among `n` that fit (the linear model's memory,
        the transient of a rebuilt block included), over every mix of unrecomputed blocks with a
        leaner policy and a middle one: for each count of the leaner, the fewest middle blocks
        that make room (or all the rest, should the middle be the faster)."""
        return self.table.mix(self.r, n)

    def whole_blocks_time(self, n: int) -> float:
        return self.table.time(self.r, n)


class _MixTable:
    """`_RankCost.whole_block_mix` of every rank of one layout for every count up to a top,
    tabulated at once (axes: ranks, counts, leaner blocks among them): the bottleneck split asks
    for each rank's counts one by one, from a few up to about twice its share, most of them
    twice."""

    def __init__(self, data: StageModelData, ranks: list[_RankCost]) -> None:
        self.data = data
        self.fixed_bytes = np.array([rank.fixed_bytes for rank in ranks], dtype=float)[:, None, None]
        self.in_flight = np.array([rank.in_flight for rank in ranks], dtype=float)[:, None, None]
        self.rebuild = np.array([rank.rebuild for rank in ranks], dtype=float)[:, None, None]
        self.times = np.empty((len(ranks), 0))
        self.best = np.empty((len(ranks), 0, 3), dtype=int)  # per rank and count: (mix, leaner, middle), -1: none

    def time(self, r: int, n: int) -> float:
        if n >= self.times.shape[1]:
            self._tabulate(2 * n + 8)
        return float(self.times[r, n])

    def mix(self, r: int, n: int) -> dict[str, int] | None:
        if n >= self.times.shape[1]:
            self._tabulate(2 * n + 8)
        which, leaner, mid = (int(x) for x in self.best[r, n])
        return None if which < 0 else _mix_of(n, *MIXES[which], leaner, mid)

    def _tabulate(self, top: int) -> None:
        block = self.data.block
        act, t = block.activation, block.time
        n = np.arange(top + 1, dtype=float)[None, :, None]
        leaner = np.arange(top + 1, dtype=float)[None, None, :]
        rest = n - leaner  # negative where there are more leaner blocks than blocks: no mix
        room = self.data.capacity - self.fixed_bytes - n * block.states
        shape = (self.fixed_bytes.shape[0], top + 1)
        best_time, best = np.full(shape, np.inf), np.full(shape + (3,), -1)
        for which, (lean, middle) in enumerate(MIXES):
            rebuilt = (leaner > 0) & (lean in REBUILT)
            over = self.in_flight * (n * act["none"] - leaner * (act["none"] - act[lean])) - room
            over = over + np.where(rebuilt, self.rebuild, 0.0)
            if act["none"] > act[middle]:
                extra = np.where(~rebuilt & (middle in REBUILT), self.rebuild, 0.0)
                saved_by_middle = self.in_flight * (act["none"] - act[middle])
                fewest = np.where(over <= 0, 0.0, np.ceil((over + extra) / saved_by_middle - 1e-9))
                fits = rest >= 0
            else:
                fewest = np.zeros_like(over)
                fits = (over <= 0) & (rest >= 0)
            for mid in np.broadcast_arrays(fewest, rest):
                valid = fits & (fewest >= 0) & (fewest <= mid) & (mid <= rest)
                seconds = np.where(valid, (rest - mid) * t["none"] + mid * t[middle] + leaner * t[lean], np.inf)
                col = seconds.argmin(axis=2)[..., None]
                value = np.take_along_axis(seconds, col, axis=2)[..., 0]
                better = value < best_time
                found = np.concatenate([np.full(shape + (1,), which), col, np.take_along_axis(mid, col, axis=2)],
                                       axis=2)
                best_time = np.where(better, value, best_time)
                best = np.where(better[..., None], found.astype(int), best)
        self.times, self.best = best_time, best


def _mix_of(n: int, lean: str, middle: str, leaner: int, mid: int) -> dict[str, int]:
    return {"none": n - leaner - mid, middle: mid, lean: leaner} | {
        k: 0 for k in RECOMPUTE if k not in ("none", middle, lean)}
