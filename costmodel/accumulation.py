"""Gradients between a step's micro-batches: which ZeRO stage's gradients a rank holds
across them, and what adding each micro-batch's gradient into `.grad` costs.

Kept apart from `data_parallel` (the collectives and the optimizer step), which
`costmodel.layout` cannot import: `context_of` gives each micro-batch its share of the
accumulation from here.
"""
from __future__ import annotations

from hardware.schema import Cluster

from .compute import memory_bandwidth
from .memory import DTYPE_BYTES
from .offload import host_bandwidths
from layout.plan import Plan


def held_zero(plan: Plan) -> int:
    """The ZeRO stage whose memory the ranks hold. Under torch.distributed.pipelining
    FSDP2 keeps a stage's weights and gradients unsharded from one micro-batch's
    backward to the next and reduce-scatters once per step (the schedule sets that
    itself), so pipelined ZeRO-2/3 hold what ZeRO-1 holds."""
    return 1 if plan.pp > 1 and plan.zero >= 2 else plan.zero


def accumulation_bytes_per_param(plan: Plan) -> float:
    """Bytes a step moves per parameter adding each micro-batch's gradient after the first into
    `.grad` (torch's AccumulateGrad: the held gradient and the new one read, the sum written, in the
    master dtype): over the whole gradient where the rank holds it whole between micro-batches, over
    FSDP2's shard where each micro-batch is reduce-scattered first (offloaded, on the host, where
    that shard lives: `accumulates_shards`). Megatron's fused stack accumulates inside the
    weight-gradient GEMM (`gradient_accumulation_fusion`): nothing apart."""
    if plan.num_micro_batches < 2 or plan.stack == "fused":
        return 0.0
    share = 1.0 / plan.shard_degree if accumulates_shards(plan) else 1.0
    return (plan.num_micro_batches - 1) * 3 * DTYPE_BYTES[plan.master_dtype] * share


def accumulation_seconds_per_param(plan: Plan, cluster: Cluster) -> float:
    """A step's seconds per parameter the rank holds adding gradients into `.grad`
    (`accumulation_bytes_per_param`): at the device's bandwidth, or the host's where FSDP2 keeps
    the offloaded shards there (its foreach_reduce copies each micro-batch's shard to the host
    and adds it on the CPU, the copy made blocking by the add)."""
    nbytes = accumulation_bytes_per_param(plan)
    if not nbytes:
        return 0.0
    on_host = plan.offload and accumulates_shards(plan) and cluster.gpu.device_type != "cpu"
    return nbytes / (host_bandwidths(cluster)[1] if on_host else memory_bandwidth(cluster.gpu))


def accumulates_shards(plan: Plan) -> bool:
    """Whether FSDP2 reduce-scatters every micro-batch and adds the shards (not whole gradients)."""
    return plan.gathers_weights and held_zero(plan) >= 2 and not plan.holds_unsharded_gradients
