"""Lower bounds on the step time of any partition of a layout.

They let the search skip layouts that cannot beat the best plan found and
report a proven optimality gap. Both bounds use the pipeline composition
m*Rmax + (sum R - Rmax)/v, which grows with the total per-micro-batch work
sum R and with Rmax >= sum R / pp, so a lower bound on the total work gives
one on the step.
"""
from __future__ import annotations

import heapq

from .coefficients import StageModelData, cheapest_mix


def _pipeline(total: float, pp: int, vpp: int, m: int) -> float:
    return (m - 1 / vpp) * total / pp + total / vpp


def lower_bound(data: StageModelData, pp: int, vpp: int, m: int) -> float:
    """Cheap bound: the work priced without recomputation, except without
    pipelining, where the one rank's memory fixes the cheapest checkpointing
    mix exactly (relaxed to fractions of blocks)."""
    fixed = data.prefix + data.suffix
    fixed_time = sum(l.time["none"] for l in fixed)
    blocks = data.n_blocks * data.block.time["none"]
    if pp == 1:
        params = data.n_blocks * data.block.params + sum(l.params for l in fixed)
        room = (data.capacity - params * data.state_bytes_per_param - data.zero3_buffer_bytes
                - sum(l.activation["none"] for l in fixed) * data.in_flight[0])
        blocks = cheapest_mix(data, data.n_blocks, room, data.in_flight[0])
    return _pipeline(blocks + fixed_time + data.p2p * (pp * vpp - 1), pp, vpp, m)


def memory_aware_bound(data: StageModelData, pp: int, vpp: int, m: int) -> float:
    """Bound for pipelined layouts: the least total work over every split of
    the blocks among the ranks, each rank checkpointing the cheapest
    (fractional) mix its own memory allows. Each rank's least work is convex
    in its block count (an LP value function with a right-hand side affine in
    the count), so adding blocks one at a time to the rank with the smallest
    marginal cost finds the optimum split. inf: no split fits."""
    S = pp * vpp
    ranks = [_RankCost(data, r, pp, S) for r in range(pp)]
    counts = [vpp] * pp  # every virtual stage holds at least one block
    work = [rank.blocks_time(n) for rank, n in zip(ranks, counts)]
    if any(w == float("inf") for w in work):
        return float("inf")
    heap = [(ranks[r].blocks_time(counts[r] + 1) - work[r], r) for r in range(pp)]
    heapq.heapify(heap)
    for _ in range(data.n_blocks - sum(counts)):
        marginal, r = heapq.heappop(heap)
        if marginal == float("inf"):
            return float("inf")
        counts[r] += 1
        work[r] += marginal
        heapq.heappush(heap, (ranks[r].blocks_time(counts[r] + 1) - work[r], r))
    total = sum(work) + sum(rank.fixed_time for rank in ranks)
    return _pipeline(total, pp, vpp, m)


class _RankCost:
    """One pipeline rank's fixed layers and memory, for `memory_aware_bound`."""

    def __init__(self, data: StageModelData, r: int, pp: int, S: int) -> None:
        stages = range(r, S, pp)
        fixed = [l for s in stages for l in (data.prefix if s == 0 else []) + (data.suffix if s == S - 1 else [])]
        self.data = data
        self.in_flight = data.in_flight[r]
        self.fixed_time = sum(l.time["none"] for l in fixed) + data.p2p * sum(1 for s in stages if s < S - 1)
        self.fixed_bytes = (sum(l.params for l in fixed) * data.state_bytes_per_param + data.zero3_buffer_bytes
                            + sum(l.activation["none"] for l in fixed) * self.in_flight)

    def blocks_time(self, n: int) -> float:
        d = self.data
        room = d.capacity - self.fixed_bytes - n * d.block.params * d.state_bytes_per_param
        return cheapest_mix(d, n, room, self.in_flight)
