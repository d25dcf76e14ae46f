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

from layout.axes import stage_rank

from .memory import WEIGHT_BYTES
from .simulate.schedule import forward_moments, rank_order
from .workload import LayerProfile


def pipeline_held_logits_bytes(layer: LayerProfile, tp: int, dtype: str) -> float:
    """Per sequence, the head's output a pipeline's last stage keeps until that micro-batch's
    backward (torch.distributed.pipelining's forward cache holds each stage's output; the
    schedule computes the loss from it): the logits in the compute dtype, whole on every TP
    rank where the executor gathers them (`tp_gather_bytes`), else the rank's vocabulary shard.
    The dry run of llama-3.2-1b dp4 pp2 at 4K tokens read this 1 GiB on the last rank."""
    if layer.tp_gather_bytes:
        return layer.tp_gather_bytes
    return layer.gemm_output_elements * WEIGHT_BYTES[dtype] / tp


Holding = tuple[tuple[int, int, int], ...]  # per stage of a rank: (stage, saved activations held, outputs held)


@lru_cache(maxsize=16384)
def rank_holdings(schedule: str, rank: int, pp: int, vpp: int, num_micro_batches: int) -> tuple[Holding, ...]:
    """The moments pipeline rank `rank`'s memory can peak at, whatever its stages weigh: after
    each forward of its order (`forward_moments`), each of its stages' micro-batches held, less
    the moments another holds at least as many of in every count (a sum with weights of zero or
    more never peaks there alone)."""
    stages = [s for s in range(pp * vpp) if stage_rank(schedule, pp, s) == rank]
    order = rank_order(schedule, rank, pp, num_micro_batches, vpp)
    moments = {tuple((s, saved.get(s, 0), outputs.get(s, 0)) for s in stages)
               for saved, outputs in forward_moments(order)}

    def covers(a: Holding, b: Holding) -> bool:
        return a != b and all(x[1] >= y[1] and x[2] >= y[2] for x, y in zip(a, b))

    return tuple(sorted(h for h in moments if not any(covers(other, h) for other in moments)))


def saved_at_peak(holdings: tuple[Holding, ...], saved_bytes: Mapping[int, float],
                  output_bytes: Mapping[int, float]) -> float:
    """A rank's saved activations and forward-cache outputs at its peak: the most, over its
    `rank_holdings`, of each stage's bytes per micro-batch (`saved_bytes`, `output_bytes`, by
    stage) times that stage's micro-batches held."""
    return max((sum(saved_bytes.get(s, 0.0) * saved + output_bytes.get(s, 0.0) * outputs for s, saved, outputs in h)
                for h in holdings), default=0.0)


def fewest_in_flight(schedule: str, rank: int, pp: int, vpp: int, num_micro_batches: int) -> int:
    """The fewest micro-batches a block of rank `rank` is held for at its peak, however the
    partition splits its blocks among its stages: at some moment the rank holds at least this
    many of every stage's. A bound's factor (the solver may load the stages it holds fewest of);
    with one stage a rank, that stage's count at the peak."""
    return max(min(saved for _, saved, _ in holding)
               for holding in rank_holdings(schedule, rank, pp, vpp, num_micro_batches))


def held_output_bytes(layer: LayerProfile, *, pipelined: bool, tp: int, micro_batch: float, dtype: str,
                      **_activation_keywords) -> float:
    """Per micro-batch, what a layer's stage keeps in the pipeline's forward cache besides the
    layer's saved activations: the head's logits on a pipeline's last stage, nothing elsewhere.
    Takes `costmodel.memory.activation_keywords`."""
    if not pipelined or layer.kind != "head":
        return 0.0
    return pipeline_held_logits_bytes(layer, tp if layer.tp_shardable else 1, dtype) * micro_batch
