"""The order in which each pipeline rank runs its forward and backward passes.

A schedule is, per pipeline rank, an ordered list of `Op(phase, micro_batch,
stage)`; the simulator runs each rank's list in order and lets data
dependencies (a forward needs the previous stage's forward, a backward the
next stage's backward) decide *when*. Keeping the order separate from the
timing is what lets GPipe, 1F1B and interleaved 1F1B share one engine, and
lets a non-uniform partition show its real effect instead of a formula's.
"""
from __future__ import annotations

from typing import NamedTuple

from hardware.errors import PlanError


class Op(NamedTuple):
    phase: str  # "F", "B" (the whole backward; a zero-bubble schedule's input gradients) or "W" (its weight gradients)
    micro_batch: int
    stage: int  # virtual stage index; it runs on the rank `layout.axes.stage_rank` places it on


def gpipe(rank: int, pp: int, m: int) -> list[Op]:
    """All forwards, then all backwards (Huang et al. 2019): every micro-batch stays in flight."""
    return [Op("F", j, rank) for j in range(m)] + [Op("B", j, rank) for j in range(m)]


def one_f_one_b(rank: int, pp: int, m: int) -> list[Op]:
    """PipeDream-flush / Megatron 1F1B: pp-rank-1 warm-up forwards, then alternate."""
    warmup = min(pp - rank - 1, m)
    ops = [Op("F", j, rank) for j in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", warmup + i, rank), Op("B", i, rank)]
    ops += [Op("B", j, rank) for j in range(m - warmup, m)]
    return ops


def _chunk_sequence(m: int, pp: int, vpp: int, reverse: bool) -> list[tuple[int, int]]:
    """(micro_batch, chunk) in Megatron's order: groups of pp micro-batches sweep the chunks."""
    chunks = range(vpp - 1, -1, -1) if reverse else range(vpp)
    seq = []
    for first in range(0, m, pp):
        group = range(first, min(first + pp, m))
        seq += [(j, c) for c in chunks for j in group]
    return seq


def interleaved(rank: int, pp: int, m: int, vpp: int) -> list[Op]:
    """Interleaved 1F1B (Narayanan et al. 2021): vpp chunks per rank, chunk c is stage c*pp + rank."""
    fwd = _chunk_sequence(m, pp, vpp, reverse=False)
    bwd = _chunk_sequence(m, pp, vpp, reverse=True)
    total = m * vpp
    warmup = min(total, 2 * (pp - rank - 1) + (vpp - 1) * pp)
    ops = [Op("F", j, c * pp + rank) for j, c in fwd[:warmup]]
    for i in range(total - warmup):
        j, c = fwd[warmup + i]
        ops.append(Op("F", j, c * pp + rank))
        j, c = bwd[i]
        ops.append(Op("B", j, c * pp + rank))
    ops += [Op("B", j, c * pp + rank) for j, c in bwd[total - warmup :]]
    return ops


def zero_bubble(rank: int, pp: int, m: int, vpp: int) -> list[Op]:
    """torch's interleaved zero-bubble order (ZB1P, Qi et al. 2023): (vpp-1)*pp + (pp-rank-1)
    warm-up chunk forwards (one hop per rank, not interleaved 1F1B's two), then a forward and
    an input-gradient backward each step, the weight gradients trailing their backwards by
    `rank` steps, and a cool-down of input gradients each followed by the oldest weight
    gradient still owed, the rest of those at the end."""
    fwd = _chunk_sequence(m, pp, vpp, reverse=False)
    bwd = _chunk_sequence(m, pp, vpp, reverse=True)
    total = m * vpp
    warmup = min(total, (vpp - 1) * pp + (pp - rank - 1))
    ops = [Op("F", j, c * pp + rank) for j, c in fwd[:warmup]]
    owed: list[Op] = []
    for i in range(total - warmup):
        j, c = fwd[warmup + i]
        ops.append(Op("F", j, c * pp + rank))
        j, c = bwd[i]
        ops.append(Op("B", j, c * pp + rank))
        owed.append(Op("W", j, c * pp + rank))
        if i >= rank:
            ops.append(owed.pop(0))
    for j, c in bwd[total - warmup:]:
        ops.append(Op("B", j, c * pp + rank))
        owed.append(Op("W", j, c * pp + rank))
        ops.append(owed.pop(0))
    return ops + owed


def zbv(rank: int, pp: int, m: int) -> list[Op]:
    """torch's ZB-V order (Qi et al. 2023, sec. 6): two chunks per rank in a V, the way down
    (stage `rank`) and the way back up (stage 2*pp-1-rank). It warms up with 2*(pp-rank)-1
    forwards of the first chunk, `rank` forwards of each chunk in turn, then pp-rank rounds of
    the second chunk's forward, input gradients (B) and weight gradients (W); the steady state
    runs a forward, B and W on each chunk in turn; the cool-down runs `rank` pairs of Bs, then
    pp-rank first-chunk Bs each with the oldest first-chunk W owed, then the Ws left, the
    second chunk's first. Laid out for at least 2*pp-1 micro-batches, the ones past m dropped."""
    n = max(m, 2 * pp - 1)
    down, up = rank, 2 * pp - 1 - rank
    done = {("F", down): 0, ("F", up): 0, ("B", down): 0, ("B", up): 0, ("W", down): 0, ("W", up): 0}
    ops: list[Op] = []

    def run(phase: str, stage: int) -> None:
        ops.append(Op(phase, done[(phase, stage)], stage))
        done[(phase, stage)] += 1

    for _ in range(2 * (pp - rank) - 1):
        run("F", down)
    for _ in range(rank):
        run("F", up)
        run("F", down)
    for _ in range(pp - rank):
        for phase in "FBW":
            run(phase, up)
    while done[("F", up)] < done[("F", down)] or done[("F", down)] < n:
        if done[("F", down)] < n:
            run("F", down)
        for stage, phases in ((down, "BW"), (up, "FBW")):
            for phase in phases:
                run(phase, stage)
    for _ in range(rank):
        run("B", down)
        run("B", up)
    for _ in range(pp - rank):
        run("B", down)
        run("W", down)
    for stage in (up, down):
        while done[("W", stage)] < done[("B", stage)]:
            run("W", stage)
    return [op for op in ops if op.micro_batch < m]


def held_at_peak(order: list[Op]) -> int:
    """The most chunk activations a rank holds at once running `order`: each forward's are kept
    to its backward, or to its weight gradients where the backward is split (torch's
    stage_backward_input retains the graph for them)."""
    stages = sorted({op.stage for op in order})
    return max((sum(moment[::2]) for moment in forward_moments(order, stages)), default=0)


def forward_moments(order: list[Op], stages: list[int]) -> list[tuple[int, ...]]:
    """After each forward of `order`, how many micro-batches of each of `stages` the rank holds,
    flat: (saved, outputs) of stages[0], then of stages[1], and so on. Saved activations are kept
    to the backward, or to the weight gradients where it is split (torch's stage_backward_input
    retains the graph for them); outputs stay in torch.distributed.pipelining's forward cache
    until the backward pops them. Only a forward adds, so the rank's activation peak is at one of
    these moments, whatever its stages weigh; which one depends on the weights (an interleaved
    last rank holds one micro-batch of its last chunk beside pp of its first at one moment,
    none of its last and pp + 1 of its first at another)."""
    place = {stage: 2 * i for i, stage in enumerate(stages)}
    frees = "W" if any(op.phase == "W" for op in order) else "B"
    counts = [0] * (2 * len(stages))
    moments = []
    for op in order:
        i = place[op.stage]
        if op.phase == "F":
            counts[i] += 1
            counts[i + 1] += 1
            moments.append(tuple(counts))
            continue
        if op.phase == "B":
            counts[i + 1] -= 1
        if op.phase == frees:
            counts[i] -= 1
    return moments


def rank_order(schedule: str, rank: int, pp: int, m: int, vpp: int = 1) -> list[Op]:
    """One pipeline rank's op list (`rank_orders` checks the layout first)."""
    if schedule == "gpipe":
        return gpipe(rank, pp, m)
    if schedule == "interleaved":
        return interleaved(rank, pp, m, vpp)
    if schedule == "zero-bubble":
        return zero_bubble(rank, pp, m, vpp)
    if schedule == "zbv":
        return zbv(rank, pp, m)
    return one_f_one_b(rank, pp, m)


def rank_orders(schedule: str, pp: int, m: int, vpp: int = 1) -> list[list[Op]]:
    """One op list per pipeline rank."""
    if schedule not in ("gpipe", "1f1b", "interleaved", "zero-bubble", "zbv"):
        raise PlanError("schedule", f"unknown schedule {schedule!r}", "use gpipe, 1f1b, interleaved, zero-bubble or zbv")
    if schedule == "interleaved" and m % pp:
        # Megatron's constraint: with a partial group of micro-batches the
        # warm-up counts no longer match and the ranks can deadlock.
        raise PlanError("micro_batch", f"interleaved needs the {m} micro-batches to be a multiple of pp={pp}",
                        "change micro_batch or global_batch, or use schedule 1f1b")
    return [rank_order(schedule, r, pp, m, vpp) for r in range(pp)]
