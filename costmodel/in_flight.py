"""How many micro-batches of each pipeline stage a rank holds at its peak, and what a
pipeline's stage holds for them besides its saved activations.

A rank's chunks are not alike at its peak (an interleaved last rank holds one micro-batch of
its last chunk beside pp of its first). The embedding and the head, one chunk each, take their
own stage's count (`stage_in_flight`, read off the schedule's order). The blocks still take the
chunks' average (`in_flight_micro_batches`, closed form, which the search asks of every
layout): exact where a rank's chunks hold as many blocks, an approximation where the partition
splits them unevenly (ZB-V's rank 0 of llama-3-8b with 1 and 13 blocks reads +17% against
the dry run).
"""
from __future__ import annotations

from functools import lru_cache

from layout.axes import stage_rank

from .memory import WEIGHT_BYTES, activation_bytes
from .simulate.schedule import holdings_at_peak, rank_order
from .workload import LayerProfile


def in_flight_micro_batches(schedule: str, rank: int, pp: int, vpp: int, num_micro_batches: int) -> float:
    """How many micro-batches of a stage's activations pipeline rank `rank` holds at its peak.

    GPipe runs all forwards first; 1F1B holds at most pp - rank; interleaved
    1F1B warms up with 2*(pp-rank-1) + (vpp-1)*pp chunk forwards (Narayanan et
    al. 2021), each holding 1/vpp of the rank's layers. torch's zero-bubble ZB1P
    warms up with (vpp-1)*pp + (pp-rank-1) chunk forwards, then runs a forward and
    an input-gradient backward (I) each step, each chunk's weight gradients (W)
    trailing its I by `rank` steps (`costmodel.simulate.schedule.zero_bubble`,
    torch's own order). Its I keeps the chunk's autograd graph for W
    (`stage_backward_input` runs with retain_graph), so a chunk's activations are
    held from its forward to its W: the warm-up plus rank + 1 steps' forwards,
    pp*vpp chunks once there are pp micro-batches (not the paper's 1x memory).
    torch's ZB-V runs its weight gradients right after their input gradients but in the
    cool-down, so each rank holds min(2*pp, m + rank + 1, 2*m) chunks at its peak: with 2*pp
    micro-batches or more, pp micro-batches of its layers on every rank (1F1B's first rank's).
    That is its order's own peak (`costmodel.simulate.schedule.zbv`, `held_at_peak`; a test
    holds the two equal).
    """
    m = num_micro_batches
    if schedule == "gpipe":
        return float(m)
    if schedule == "zero-bubble":
        total = m * vpp
        warmup = min(total, (vpp - 1) * pp + (pp - rank - 1))
        return (warmup + min(total - warmup, rank + 1)) / vpp
    if schedule == "zbv":  # its order's peak (held_at_peak of zbv's), in closed form: the search asks per rank
        return min(2 * pp, m + rank + 1, 2 * m) / vpp
    if schedule == "interleaved":
        chunks = min(m * vpp, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1)
        return chunks / vpp
    return float(min(m, pp - rank))


def pipeline_held_logits_bytes(layer: LayerProfile, tp: int, dtype: str) -> float:
    """Per sequence, the head's output a pipeline's last stage keeps until that micro-batch's
    backward (torch.distributed.pipelining's forward cache holds each stage's output; the
    schedule computes the loss from it): the logits in the compute dtype, whole on every TP
    rank where the executor gathers them (`tp_gather_bytes`), else the rank's vocabulary shard.
    The dry run of llama-3.2-1b dp4 pp2 at 4K tokens read this 1 GiB on the last rank."""
    if layer.tp_gather_bytes:
        return layer.tp_gather_bytes
    return layer.gemm_output_elements * WEIGHT_BYTES[dtype] / tp


@lru_cache(maxsize=65536)
def stage_in_flight(schedule: str, stage: int, pp: int, vpp: int, num_micro_batches: int) -> tuple[int, int]:
    """At the peak of the rank running virtual stage `stage`, how many of that stage's micro-batches
    it holds: (their saved activations, their outputs in the forward cache). They differ where the
    backward is split: the outputs go with the input gradients, the activations with the weights'."""
    rank = stage_rank(schedule, pp, stage)
    _, saved, outputs = holdings_at_peak(rank_order(schedule, rank, pp, num_micro_batches, vpp))
    return saved.get(stage, 0), outputs.get(stage, 0)


def held_output_bytes(layer: LayerProfile, *, pipelined: bool, tp: int, micro_batch: float, dtype: str,
                      **_activation_keywords) -> float:
    """Per micro-batch, what a layer's stage keeps in the pipeline's forward cache besides the
    layer's saved activations: the head's logits on a pipeline's last stage, nothing elsewhere.
    Takes `costmodel.memory.activation_keywords`."""
    if not pipelined or layer.kind != "head":
        return 0.0
    return pipeline_held_logits_bytes(layer, tp if layer.tp_shardable else 1, dtype) * micro_batch


def end_layer_saved_bytes(layer: LayerProfile, policy: str, in_flight: tuple[int, int], pipelined: bool,
                          **activation_keywords) -> float:
    """An embedding's or head's bytes at its rank's peak: what it keeps for each of its stage's
    micro-batches held (`stage_in_flight`) and, pipelined, the head's logits for each whose
    backward is still to run."""
    saved, outputs = in_flight
    return (activation_bytes(layer, policy, **activation_keywords) * saved
            + held_output_bytes(layer, pipelined=pipelined, **activation_keywords) * outputs)
