"""How many micro-batches of each pipeline stage a rank holds at its peak, and what a
pipeline's stage holds for them besides its saved activations.

A rank's chunks are not alike at its peak: an interleaved last rank holds one micro-batch of its
last chunk beside pp of its first, and a partition may give its chunks unlike numbers of blocks
(ZB-V's rank 0 of llama-3-8b, 1 block beside the embedding and 13 beside the head). So a rank's
saved bytes are the largest, over the moments its order can peak at (`rank_holdings`), of each
stage's bytes per micro-batch times that stage's micro-batches held (`saved_at_peak`). The
orders are torch's (`costmodel.simulate.schedule`); the tests hold their peaks to the papers'
warm-up counts. The search's bounds take `fewest_in_flight`, which no split of the blocks goes
under.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import numpy as np

from layout.axes import stage_rank

from .memory import WEIGHT_BYTES
from .simulate.schedule import forward_moments, rank_order
from .workload import LayerProfile


def pipeline_held_logits_bytes(layer: LayerProfile, tp: int, dtype: str) -> float:
    """Per sequence, the head's output a pipeline's last stage keeps until that micro-batch's
    backward (torch.distributed.pipelining's forward cache holds each stage's output; the
    schedule computes the loss from it): the logits in the compute dtype, the rank's vocabulary
    shard (the executor's TP head leaves them split for the loss's parallel cross-entropy).
    The dry run of llama-3.2-1b dp4 pp2 at 4K tokens read this 1 GiB on the last rank."""
    return layer.gemm_output_elements * WEIGHT_BYTES[dtype] / tp


Holding = tuple[tuple[int, int, int], ...]  # per stage of a rank: (stage, saved activations held, outputs held)


def rank_holdings(schedule: str, rank: int, pp: int, vpp: int, num_micro_batches: int) -> tuple[Holding, ...]:
    """The moments pipeline rank `rank`'s memory can peak at, whatever its stages weigh: after
    each forward of its order (`forward_moments`), each of its stages' micro-batches held, less
    the moments another holds at least as many of in every count (a sum with weights of zero or
    more never peaks there alone). Read off the order of `moment_micro_batches`, which shows
    every moment the step's does."""
    return _holdings(schedule, rank, pp, vpp, moment_micro_batches(schedule, pp, vpp, num_micro_batches))


@lru_cache(maxsize=16384)
def _holdings(schedule: str, rank: int, pp: int, vpp: int, m: int) -> tuple[Holding, ...]:
    stages = [s for s in range(pp * vpp) if stage_rank(schedule, pp, s) == rank]
    moments = sorted(set(forward_moments(rank_order(schedule, rank, pp, m, vpp), stages)))
    counts = np.array(moments, dtype=np.int64).reshape(-1, 2 * len(stages))
    at_least = (counts[:, None, :] >= counts[None, :, :]).all(axis=2)  # [i, j]: i holds as many as j of each
    covered = (at_least & ~np.eye(len(counts), dtype=bool)).any(axis=0)  # rows unique: a cover holds more of some
    return tuple(tuple((s, int(row[2 * i]), int(row[2 * i + 1])) for i, s in enumerate(stages))
                 for row in counts[~covered])


def moment_micro_batches(schedule: str, pp: int, vpp: int, num_micro_batches: int) -> int:
    """Micro-batches whose order shows every moment a step of `num_micro_batches` does: each
    order but GPipe's (which holds them all) reaches its steady state within two rounds of pp
    micro-batches and repeats it round after round until its cool-down, so a longer step adds
    no moment, given the same remainder of a last partial round (a test holds the two equal up
    to twelve rounds). Three rounds keep one to spare, and the search's orders short."""
    rounds = 3
    if schedule == "gpipe" or num_micro_batches <= rounds * pp:
        return num_micro_batches
    return rounds * pp + num_micro_batches % pp


def saved_at_peak(holdings: tuple[Holding, ...], saved_bytes: Mapping[int, float],
                  output_bytes: Mapping[int, float]) -> float:
    """A rank's saved activations and forward-cache outputs at its peak: the most, over its
    `rank_holdings`, of each stage's bytes per micro-batch (`saved_bytes`, `output_bytes`, by
    stage) times that stage's micro-batches held."""
    return max((sum(saved_bytes.get(s, 0.0) * saved + output_bytes.get(s, 0.0) * outputs for s, saved, outputs in h)
                for h in holdings), default=0.0)


def fewest_in_flight(schedule: str, rank: int, pp: int, vpp: int, num_micro_batches: int) -> tuple[int, int]:
    """What no split of rank `rank`'s blocks among its stages (one block each at least) holds
    less of at its peak, as (c, e): every block's bytes per micro-batch c times, and e more of
    the leanest block's. At the moment holding the most of its least-held stage (c of it), each
    stage's first block is held as many times as that stage's micro-batches, the rest at least
    c. A bound's terms (the solver may load the stages it holds fewest of); with one stage a
    rank, (its count at the peak, 0). The search asks it of every layout it weighs: from two
    rounds of micro-batches on, in closed form (`_long_step_least`; a test holds the two equal)."""
    if num_micro_batches >= 2 * pp:
        return _long_step_least(schedule, rank, pp, vpp, num_micro_batches)
    holding = least_held_moment(rank_holdings(schedule, rank, pp, vpp, num_micro_batches))
    least = min(n for _, n, _ in holding)
    return least, sum(n for _, n, _ in holding) - least * len(holding)


def least_held_moment(holdings: tuple[Holding, ...]) -> Holding:
    """The moment `fewest_in_flight` reads: the most held of the rank's least-held stage, then the
    most held in all."""
    return max(holdings, key=lambda h: (min(n for _, n, _ in h), sum(n for _, n, _ in h)))


def _long_step_least(schedule: str, rank: int, pp: int, vpp: int, m: int) -> tuple[int, int]:
    """`fewest_in_flight` of a step of at least 2*pp micro-batches. 1F1B's rank holds pp - rank,
    zero-bubble's pp of each chunk at once; ZB-V's rank + 1 of its way back up beside
    2*pp - 1 - rank of its way down; an interleaved rank in the first half holds pp of every chunk
    with 2*(pp/2 - rank) - 1 more of its first, one in the second half 2*(pp - rank) - 1 of every
    chunk with 2*rank + 1 - pp more of each but its last."""
    if schedule == "gpipe":
        return m, 0
    if schedule == "1f1b":
        return pp - rank, 0
    if schedule == "zero-bubble":
        return pp, 0
    if schedule == "zbv":
        return rank + 1, 2 * (pp - 1 - rank)
    if 2 * rank < pp:
        return pp, pp - 1 - 2 * rank
    return 2 * (pp - rank) - 1, (vpp - 1) * (2 * rank - pp + 1)


def receive_buffer_bytes(layer: LayerProfile, *, tp: int, sp: bool, micro_batch: float, stack: str = "eager",
                         **_activation_keywords) -> float:
    """Per micro-batch, one receive buffer at the pipeline boundary after `layer`: its output, or
    that output's gradient, as the rank holds it (sequence-split over TP under SP, where the
    executor hands a stage's output on as a Shard(1) DTensor; `micro_batch` is already per CP
    rank). None on the fused stack: Megatron-LM allocates each receive when it posts it and
    drops it once used, so a held input is a saved activation like any other. Takes
    `costmodel.memory.activation_keywords`."""
    if stack == "fused":
        return 0.0
    return layer.boundary_bytes * micro_batch / (tp if sp and layer.tp_shardable else 1)


def receive_buffers(stages: list[int], n_stages: int, input_bytes: Mapping[int, float],
                    grad_bytes: Mapping[int, float], num_micro_batches: int) -> float:
    """What a pipeline rank's stages hold in receive buffers through the whole step: torch 2.13's
    `PipelineStage` allocates one input buffer per micro-batch on every stage but the first and
    one output-gradient buffer per micro-batch on every stage but the last, when it first runs,
    and keeps them (pytorch/pytorch#136380; just-in-time allocation is pytorch#196463, not in
    2.13). A held micro-batch's input buffer is also the first block's saved input: the callers
    count a stage's input once, here (`saved_at_peak` takes the stages' saved bytes less it).
    tests/test_dry_run.py pins the buffers to torch; with them priced, and allocated by the dry
    run as torch does, llama-3.2-1b tp2+sp pp4 1F1B at 4K tokens reads -0.6% and -0.4% on its
    middle ranks (-5.7% and -7.3% without)."""
    return num_micro_batches * sum((input_bytes.get(s, 0.0) if s > 0 else 0.0)
                                   + (grad_bytes.get(s, 0.0) if s < n_stages - 1 else 0.0) for s in stages)


def held_output_bytes(layer: LayerProfile, *, pipelined: bool, tp: int, micro_batch: float, dtype: str,
                      **_activation_keywords) -> float:
    """Per micro-batch, what a layer's stage keeps in the pipeline's forward cache besides the
    layer's saved activations: the head's logits on a pipeline's last stage, nothing elsewhere.
    Takes `costmodel.memory.activation_keywords`."""
    if not pipelined or layer.kind != "head":
        return 0.0
    return pipeline_held_logits_bytes(layer, tp if layer.tp_shardable else 1, dtype) * micro_batch
