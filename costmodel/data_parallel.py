"""The data-parallel share of a step: ZeRO's collectives, their overlap, the optimizer.

ZeRO-2/3 (FSDP2) gather every layer's weights per micro-batch (again for the
backward under ZeRO-3) and reduce-scatter its gradients over the shard group,
hidden behind the neighbouring layer's compute by one-layer prefetch except the
first gather and last scatter of each pass. ZeRO-0/1 and HSDP reduce once per
step, behind the last backward; ZeRO-1 gathers the updated weights after the
optimizer step. The solver's linear model reads the same functions.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hardware.schema import Cluster

from . import collectives as coll
from .compression import plan_reduction_time
from .compute import LayerTime, fresh_page_time, memory_bandwidth
from .fp8 import weight_cast_bytes_per_param
from .memory import gathered_weight_element_bytes, optimizer_traffic_bytes, plan_state_bytes, reduce_bytes
from .offload import host_copy_time, host_optimizer_seconds_per_param
from .workload import layer_params_on_rank
from layout.plan import Plan

if TYPE_CHECKING:
    from .layout import Layout, RankTime


def expert_reduction_time(expert_params: float, plan: Plan, lay: Layout) -> float:
    """The expert weights' gradient sum over the ranks holding the same experts (dp*cp/ep of
    them), after the backward: the executor runs it beside DDP, not overlapped; under
    ZeRO-1 each expert optimizer's weight all-gather follows the step, over the same ranks."""
    if plan.ep == 1 or not expert_params or lay.expert_group.size == 1 or plan.zero >= 2:
        return 0.0  # ZeRO-2/3: the experts' own FSDP2 units reduce-scatter them per micro-batch
    nbytes = expert_params * reduce_bytes(plan)  # zero 0/1: the weights' dtype, as their gradients'
    if plan.zero == 1:
        return 2 * coll.all_gather(nbytes, lay.expert_group, lay.ctx.cluster)
    return coll.all_reduce(nbytes, lay.expert_group, lay.ctx.cluster)


def exposed_after_overlap(comm: float, window: float, cluster: Cluster) -> float:
    """What of `comm` seconds of collectives stays on the critical path beside `window` seconds of compute.

    Collectives hide behind compute in proportion to the hardware's `comm_overlap`
    (1 when they run on their own engines, as NCCL beside GEMMs; near 0 when they
    need the cores the compute uses, as gloo on oversubscribed CPU ranks).
    """
    return comm - overlap_fraction(cluster) * min(comm, max(window, 0.0))


def overlap_fraction(cluster: Cluster) -> float:
    overlap = cluster.gpu.efficiency.comm_overlap
    return 1.0 if overlap is None else overlap


def sharded_collectives(params: float, plan: Plan, lay: Layout) -> tuple[float, float, float]:
    """(forward all-gather, backward all-gather, reduce-scatter) seconds of one layer's
    weights per micro-batch under ZeRO-2/3 (FSDP2), over the shard group. Without
    pipelining the weights are gathered for every forward, again for every backward
    under ZeRO-3 (resharded after forward), and every micro-batch's gradients are
    reduce-scattered. Pipelined, the weights stay gathered after a backward: ZeRO-3
    gathers once per backward and for the warm-up forwards before the first one
    (pp of the m, the first rank's count), ZeRO-2 once per step, and the reduce-scatter
    is once per step (`dp_time`). The bytes do not shrink as dp grows; the ring's
    latency grows with it."""
    if not plan.gathers_weights:
        return 0.0, 0.0, 0.0
    nbytes = params * gathered_weight_element_bytes(plan.dtype, plan.fp8_param_gather)
    scattered = params * reduce_bytes(plan)
    cluster = lay.ctx.cluster
    # Offloaded (costmodel/offload.py): the fp32 shard comes from the host before each gather, and the
    # reduced gradient shard goes back after each reduce-scatter.
    copy = host_copy_time(offloaded_shard_bytes(params, plan), plan, cluster)
    # FSDP2 gathers into a new flat buffer and copies out into the unsharded parameters' new storage,
    # and reduce-scatters from a new flat copy of the gradients: on a host allocator, fresh pages each time.
    gather = coll.all_gather(nbytes, lay.shard_group, cluster) + fresh_page_time(nbytes, 2, cluster) + copy
    wire = 0.0 if plan.pp > 1 else (  # pipelined, the reduce-scatter itself is dp_time's
        coll.reduce_scatter(scattered, lay.shard_group, cluster) + fresh_page_time(scattered, 1, cluster))
    scatter = wire + copy
    if copies_through_fsdp2(plan):  # its copies beside its collectives, on their streams
        gather += fsdp_gather_copy_in_seconds(params, plan, cluster)
        scatter += fsdp_reduce_stream_seconds(params, plan, cluster)
    forward, backward, handoffs = sharded_passes(plan)
    return gather * forward, gather * backward, scatter * handoffs


def sharded_passes(plan: Plan) -> tuple[float, float, float]:
    """Per micro-batch, how often each FSDP2 unit gathers for forward, gathers for backward and
    hands its reduced gradients over (reduce-scatter, or the offloaded copy back). Pipelined,
    ZeRO-3 gathers for the warm-up forwards (pp of the m) and every backward, ZeRO-2 once per
    step, and the gradients leave once per step; so do they when the units hold them unsharded
    (`hold_unsharded`: the reduce-scatters all run in the last micro-batch's backward, priced
    here as a 1/m share of each)."""
    zero3 = 1.0 if plan.zero >= 3 else 0.0
    m = plan.num_micro_batches
    if plan.pp > 1:
        return (min(m, plan.pp) if plan.zero >= 3 else 1) / m, zero3, 1 / m
    return 1.0, zero3, (1 / m if plan.holds_unsharded_gradients else 1.0)


def offloaded_shard_bytes(params: float, plan: Plan) -> float:
    """A rank's shard of `params` weights as the host holds them (the master precision)."""
    return params * plan_state_bytes(plan)[0] / plan.shard_degree


def host_copy_seconds(params: float, plan: Plan, cluster: Cluster) -> float:
    """Seconds per step a rank holding `params` parameters spends copying shards to and from the
    host, before any overlap with compute (the plan's host-traffic share)."""
    if not plan.offload:
        return 0.0
    copies = plan.num_micro_batches * sum(sharded_passes(plan))
    return copies * host_copy_time(offloaded_shard_bytes(params, plan), plan, cluster)


def sharded_exposed(params: float, t: LayerTime, plan: Plan, lay: Layout,
                    collectives: tuple[float, float, float] | None = None) -> float:
    """What of a layer's ZeRO-2/3 collectives the compute does not hide. With one-layer
    prefetch a layer's gathers run beside its neighbour's whole forward (with its TP
    collectives) and whole backward (with recomputation), the reduce-scatter beside the
    next backward; gathers and scatters share the one link, so they add up
    (`collectives`: the layer's `sharded_collectives`, where already known). FSDP2's copies out
    of each gather and of the gradients into each reduce-scatter's buffer run on the stream that
    computes: never hidden."""
    fwd_gather, bwd_gather, scatter = collectives or sharded_collectives(params, plan, lay)
    if not (fwd_gather or scatter):
        return 0.0
    forward = t.forward + t.tp_comm / 2
    backward = t.backward + t.recompute + t.tp_comm / 2
    cluster = lay.ctx.cluster
    return (exposed_after_overlap(fwd_gather, forward, cluster)
            + exposed_after_overlap(bwd_gather + scatter, backward, cluster) + sum(fsdp_serial_copies(params, plan, cluster)))


def copies_through_fsdp2(plan: Plan) -> bool:
    """Whether the sharded weights and gradients pass through FSDP2's flat buffers: ZeRO-2/3
    gathers on the eager and compile stacks (the executor's); Megatron's buffers (the fused
    stack) are the collectives' own."""
    return plan.gathers_weights and plan.stack != "fused"


def fsdp_serial_copies(params: float, plan: Plan, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of FSDP2's copies on the stream that computes,
    over a unit of `params` parameters: out of each gather's flat buffer, and (backward) into
    each reduce-scatter's (`copies_through_fsdp2`)."""
    if not copies_through_fsdp2(plan):
        return 0.0, 0.0
    forward_gathers, backward_gathers, handoffs = sharded_passes(plan)
    out = fsdp_copy_out_seconds(params, plan, cluster)
    return forward_gathers * out, backward_gathers * out + handoffs * fsdp_copy_in_seconds(params, plan, cluster)


def prefetch_fill(runs, times, plan: Plan, lay: Layout) -> float:
    """The sharded collectives one-layer prefetch cannot hide: a stage's first gather of
    each pass has no earlier layer to run beside (forward: its first layer; backward:
    its last), and its last reduce-scatter (the first layer's) drains after the compute.
    `sharded_exposed` hid them behind their own layer, so the hidden part comes back."""
    if not plan.gathers_weights:
        return 0.0
    overlap = overlap_fraction(lay.ctx.cluster)
    (first, _, _), (last, _, _) = runs[0], runs[-1]
    t_first, t_last = times[0][0], times[-1][0]
    fwd_gather, _, scatter = sharded_collectives(layer_params_on_rank(first, plan.tp, plan.ep), plan, lay)
    _, bwd_gather, _ = sharded_collectives(layer_params_on_rank(last, plan.tp, plan.ep), plan, lay)
    forward = t_first.forward + t_first.tp_comm / 2
    backward_last = t_last.backward + t_last.recompute + t_last.tp_comm / 2
    backward_first = t_first.backward + t_first.recompute + t_first.tp_comm / 2
    return overlap * (min(fwd_gather, forward) + min(bwd_gather, backward_last) + min(scatter, backward_first))


def dp_time(params: float, plan: Plan, lay: Layout) -> float:
    """Once-per-step gradient reduction, before overlap: DDP's all-reduce (ZeRO-0), the
    reduce-scatter of a sharded optimizer (ZeRO-1, its weight all-gather follows the step), HSDP's
    all-reduce of each shard across the replicas (ZeRO-2/3 reduce-scatter per micro-batch),
    and pipelined ZeRO-2/3's one reduce-scatter per step before it."""
    if plan.data_parallel == 1:
        return 0.0
    if plan.zero >= 2:
        shard = params / plan.shard_degree * reduce_bytes(plan)
        once = coll.reduce_scatter(params * reduce_bytes(plan), lay.shard_group, lay.ctx.cluster) if plan.pp > 1 else 0.0
        return once + coll.all_reduce(shard, lay.replicate_group, lay.ctx.cluster)
    if plan.compression != "none" and plan.zero == 0:  # DDP comm hooks: costmodel/compression.py
        return plan_reduction_time(params, plan, lay.dp_group, lay.ctx.cluster)
    nbytes = params * reduce_bytes(plan)  # reduced in place: DDP's buckets, or each gradient itself
    if plan.zero == 0:
        return coll.all_reduce(nbytes, lay.dp_group, lay.ctx.cluster)
    return coll.reduce_scatter(nbytes, lay.dp_group, lay.ctx.cluster)


def weight_gather_time(params: float, plan: Plan, lay: Layout) -> float:
    """ZeRO-1's all-gather of the updated weights: after the optimizer step, so never hidden;
    Megatron gathers its 16-bit copy, the executor broadcasts the weights themselves."""
    if plan.zero != 1 or plan.data_parallel == 1:
        return 0.0
    per_param = gathered_weight_element_bytes(plan.dtype, plan.fp8_param_gather) if plan.stack == "fused" \
        else plan_state_bytes(plan)[0]
    return coll.all_gather(params * per_param, lay.dp_group, lay.ctx.cluster)


def exposed_dp(ranks: list[RankTime], plan: Plan, lay: Layout | list[Layout]) -> float:
    """Gradient reduction left over after the last backward; rank r > 0 has r later backwards of slack.
    `lay`: the plan's layout, or each rank's own (a mixed cluster's pipeline split)."""
    lays = lay if isinstance(lay, list) else [lay] * len(ranks)
    exposed = 0.0
    slack = 0.0
    for rank, lay in zip(ranks, lays):
        window = rank.backward + rank.recompute + slack
        dense = rank.params - rank.expert_params  # the experts reduce after it (expert_reduction_time)
        exposed = max(exposed, exposed_after_overlap(dp_time(dense, plan, lay), window, lay.ctx.cluster))
        slack += rank.backward + rank.recompute
    return max(0.0, exposed)


def reduction_copy_passes(plan: Plan) -> float:
    """Memory passes over a rank's gradients that ZeRO 0/1's once-a-step reduction makes beside
    the wire, on the cores or SMs that compute: they divide them in place (DDP's buckets, or each
    gradient, executor/apply/gradient_reduce.py: a read and a write), or, DDP without views into
    its buckets (`Layout.copies_into_buckets`), copy each in, divide it there and copy it back
    (three reads and three writes). FSDP2's come with each reduce-scatter (`fsdp_copy_in_seconds`).
    Negligible on HBM, a visible share of a CPU step."""
    if plan.data_parallel == 1 or plan.zero >= 2:
        return 0.0
    return 6.0 if plan.copies_into_buckets else 2.0


def fsdp_gather_copy_in_seconds(params: float, plan: Plan, cluster: Cluster) -> float:
    """FSDP2's all-gather of a unit of `params` parameters, before the collective, on its own
    copy-in stream: the rank's shard read in the master dtype and written into the flat input in
    the compute copy's (the cast), hidden as the all-gather is."""
    shard = params / plan.shard_degree
    write = gathered_weight_element_bytes(plan.dtype, plan.fp8_param_gather)
    return shard * (plan_state_bytes(plan)[0] + write) / memory_bandwidth(cluster.gpu)


def fsdp_copy_out_seconds(params: float, plan: Plan, cluster: Cluster) -> float:
    """FSDP2's all-gather of a unit of `params` parameters, after the collective
    (`foreach_all_gather_copy_out`, on the stream that computes): the flat output read and
    split into each parameter's unsharded storage, in the compute copy's dtype."""
    return params * 2 * gathered_weight_element_bytes(plan.dtype, plan.fp8_param_gather) / memory_bandwidth(cluster.gpu)


def fsdp_copy_in_seconds(params: float, plan: Plan, cluster: Cluster) -> float:
    """FSDP2's foreach_reduce each time a unit hands its gradients over
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), over the unit's `params`
    (unsharded) parameters: their gradients copied into a new flat buffer in the reduce dtype, on
    the stream that computes (nothing hides it). They are read in the compute copy's dtype, or in
    the reduce dtype where the units held them between micro-batches (upcast as they accumulate)."""
    read = reduce_bytes(plan) if plan.holds_unsharded_gradients else gathered_weight_element_bytes(plan.dtype)
    return params * (read + reduce_bytes(plan)) / memory_bandwidth(cluster.gpu)


def fsdp_reduce_stream_seconds(params: float, plan: Plan, cluster: Cluster) -> float:
    """FSDP2's copies beside the reduce-scatter on its own stream, each hand-off: on one rank
    (an offloaded unit) the flat input copied to the output in place of the collective, and in
    fp16 the division before the reduce-scatter (fp32 and bf16 divide inside the collective,
    `_get_gradient_divide_factors`); a read and a write each, in the reduce dtype."""
    passes = (2.0 if plan.shard_degree == 1 else 0.0) + (2.0 if plan.reduce_dtype == "fp16" else 0.0)
    return passes * params * reduce_bytes(plan) / memory_bandwidth(cluster.gpu)


def optimizer_seconds_per_param(plan: Plan, cluster: Cluster) -> float:
    """The step's seconds per parameter a rank holds: the optimizer over its owned share,
    plus the reduction's gradient copies and a recipe's once-a-step FP8 weight cast (the solver's
    linear model uses the same number);
    offloaded, AdamW on the host (costmodel/offload.py) and the copies still on the device."""
    gpu = cluster.gpu
    bandwidth = memory_bandwidth(gpu)
    copies = reduction_copy_passes(plan) * reduce_bytes(plan) / bandwidth
    copies += weight_cast_bytes_per_param(plan.dtype, plan.stack) / bandwidth  # FP8 weights recast once a step
    if plan.offload:
        return host_optimizer_seconds_per_param(plan, cluster) + copies
    speed = gpu.efficiency.optimizer or 1.0  # measured unfused optimizers run slower than the fused traffic bound
    return optimizer_traffic_bytes(plan) / plan.shard_degree / speed / bandwidth + copies


def optimizer_time(ranks: list[RankTime], plan: Plan, cluster: Cluster) -> float:
    return max(r.params for r in ranks) * optimizer_seconds_per_param(plan, cluster)
