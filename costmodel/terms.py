"""The terms a plan's step and peak are composed from, per pipeline rank, and their
composition on one GPU type (`estimate_uniform`); `costmodel.estimate` is the entry.

The solver's coefficients (`planner/search/coefficients.py`) and the simulator call these
same terms instead of retyping them.

The step is composed per pipeline rank r from per-micro-batch stage times
T_r (compute, recomputation, TP collectives, exposed ZeRO-3 gathers and
pipeline sends): a pipeline of m micro-batches and v chunks per rank takes
m * max_r T_r + (sum_r T_r - max_r T_r) / v, which is the textbook
(m + (p-1)/v) * T for uniform stages and lets the slowest stage set the pace
otherwise. Where a node's ranks time-share its cores (CPU ranks,
`Node.oversubscription`), the schedule is played instead, each rank computing
faster while its peers wait (`shared_core_pipeline_time`). The data-parallel gradient reduction overlaps the last backward
(and the pipeline drain on later ranks); what is left is exposed. The
optimizer step is memory-bound. The solver uses the same per-layer terms.
"""
from __future__ import annotations

from itertools import groupby

from hardware.schema import Cluster

from . import collectives as coll
from .compute import expert_exchange_time, layer_time, recompute_flops
from .autocast import autocast_copy_bytes, cast_back_bytes, cast_gradient_pile_bytes, cast_params_on_rank
from .accumulation import held_zero
from .data_parallel import (expert_reduction_time, exposed_dp, host_copy_seconds, layer_params_on_rank,
                            optimizer_time, prefetch_fill, sharded_exposed, weight_gather_time)
from .in_flight import end_layer_saved_bytes, held_output_bytes, in_flight_micro_batches, stage_in_flight
from .memory import (WEIGHT_BYTES, activation_bytes, activation_keywords, bucket_copy_bytes, gathered_weight_bytes,
                     held_gradient_bytes, model_state_bytes, moment_bytes, new_gradient_bytes,
                     optimizer_step_bytes, plan_state_bytes, reduce_bytes, transient_bytes)
from .layout import Layout, RankTime, kv_bytes_per_sequence, layout_of
from .offload import device_state_bytes, host_memory_per_node, states_on_host
from .reserved import (all_gather_pool_bytes, allocator_slack_bytes, caches_blocks, moment_slacks,
                       peak_reserved_bytes, root_hole_bytes)
from .runtime_memory import runtime_memory_bytes
from layout.axes import REBUILT
from layout.plan import Plan
from layout.results import Estimate, StageEstimate
from .shared_cores import shared_core_pipeline_time
from .validate import check_plan
from .workload import LayerProfile, Workload

# A share of each GPU kept free beyond what the plan is priced to reserve (its tensors and the
# caching allocator's blocks, costmodel.reserved) and the runtime's memory: the prediction's own
# error, not the allocator's fragmentation (priced). On the 10 H200 runs of
# benchmarks/data/h200_gpu_runs.csv (benchmarks/gpu_runs.py) the prediction fell short of
# max_memory_allocated by at most 4.7% and of max_memory_reserved by at most 4.6% (MAPE 2.4% and
# 2.9%); 5% of the GPU covers that band. A prediction short of the GPU's own reservation costs
# the allocator a release and retry (a device synchronisation), not the run, while the live
# tensors fit (costmodel.allocator, the dry run's replay on the device). `--memory-reserve` sets it.
DEFAULT_MEMORY_RESERVE = 0.05
GIB = 2**30


def usable_memory_bytes(cluster: Cluster, memory_reserve: float, layout=None, workload: Workload | None = None) -> float:
    """What a plan's reservation (`Estimate.peak_reserved_bytes`) may take of a GPU: its memory
    less the user's reserve and the runtime's fixed memory (the CUDA context, cuBLAS workspaces,
    and `layout`'s communicators' buffers; without a layout, the part every layout holds: a bound)."""
    runtime = runtime_memory_bytes(layout, cluster, tied_across_stages(workload))
    return cluster.gpu.hbm_gb * GIB * (1 - memory_reserve) - sum(runtime.values())


def tied_across_stages(workload: Workload | None) -> bool:
    """Whether a pipeline of this model opens a group for weights tied across its stages."""
    return workload is not None and any(s.layer.tied_params for s in workload.segments)


def p2p_time(layer: LayerProfile, plan: Plan, lay: Layout) -> float:
    """Send of the stage output forward plus its gradient backward, one micro-batch."""
    nbytes = layer.boundary_bytes * plan.micro_batch_per_rank / plan.tp  # scatter-gather over TP ranks
    return 2 * coll.point_to_point(nbytes, lay.ctx.cluster, inter_node=lay.pp_inter_node)


def stage_runs(plan: Plan, workload: Workload, index: int) -> list[tuple[LayerProfile, str, int]]:
    """Virtual stage `index` as runs of (identical layer, policy, count): repeated layers are priced once."""
    stage = plan.stages[index]
    runs = []
    position = 0
    for segment in workload.segments:
        lo, hi = max(stage.start, position), min(stage.end, position + segment.count)
        position += segment.count
        if lo >= hi:
            continue
        for policy, group in groupby(stage.recompute[lo - stage.start : hi - stage.start]):
            runs.append((segment.layer, policy, sum(1 for _ in group)))
    return runs


def stage_time(plan: Plan, workload: Workload, lay: Layout, index: int, rank: RankTime) -> None:
    """Add virtual stage `index` to its rank's per-micro-batch times."""
    stage = plan.stages[index]
    runs = stage_runs(plan, workload, index)
    times = [(layer_time(layer, lay.ctx, policy), count) for layer, policy, count in runs]
    fwd = sum(t.forward * n for t, n in times)
    bwd = sum(t.backward * n for t, n in times)
    params = sum(layer_params_on_rank(layer, plan.tp, plan.ep) * n for layer, _, n in runs)
    if plan.pp > 1:  # the stage's own copy of weights tied to a layer on another stage
        params += sum(layer.tied_params / (plan.tp if layer.tp_shardable else 1) * n for layer, _, n in runs)
    rank.forward += fwd
    rank.backward += bwd
    rank.weight_grad += sum(t.weight_grad * n for t, n in times)
    rank.recompute += sum(t.recompute * n for t, n in times)
    rank.tp_comm += sum(t.tp_comm * n for t, n in times)
    rank.pp_comm += p2p_time(runs[-1][0], plan, lay) if plan.pp > 1 and not plan.hands_over_in_place(index) else 0.0
    # One-layer prefetch: each layer's gathers hide behind its own compute.
    rank.zero_comm += sum(
        sharded_exposed(layer_params_on_rank(layer, plan.tp, plan.ep), t, plan, lay) * n
        for (layer, _, n), (t, _) in zip(runs, times)
    )
    rank.zero_comm += prefetch_fill(runs, times, plan, lay)
    rank.params += params
    rank.expert_params += sum(layer.expert_params / plan.ep * n for layer, _, n in runs)
    rank.ep_comm += sum(expert_exchange_time(layer, lay.ctx) * (3 if policy in REBUILT else 2) * n
                        for layer, policy, n in runs)
    rank.stage_estimates.append(
        StageEstimate(index=index, start=stage.start, end=stage.end, forward_s=fwd, backward_s=bwd, memory_bytes={})
    )


def pipeline_seconds(slowest: float, total: float, m: int, vpp: int, fill: float = 0.0) -> float:
    """A pipeline of m micro-batches whose ranks take `total` per micro-batch together, the
    slowest `slowest`, with vpp chunks per rank: m * slowest + (total - slowest - fill) / vpp
    (the textbook (m + (p-1)/v) * T for even stages), `fill` being the ramps' idle time a
    zero-bubble schedule fills with weight gradients (`bubble_fill`). The solver's objective
    and bounds call it too."""
    return m * slowest + (total - slowest - fill) / vpp


# Weight gradients per rank a zero-bubble schedule moves into each of its p-1 ramp slots.
FILLED_WEIGHT_GRADS = {"zero-bubble": 2.0, "zbv": 3.0}


def bubble_fill(schedule: str, weight_grads: float, pp: int) -> float:
    """What a zero-bubble schedule takes off the ramps, per micro-batch of ranks: with the
    backward split into input gradients (B) and weight gradients (W), ZB-H1's bubble is
    (p-1)(F + B - W) where 1F1B's is (p-1)(F + B + W), and ZB-V's, in its chunks' times,
    (p-1)(F + B - 2W) (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", the mechanism; torch's
    ZB1P keeps 1F1B's memory): 2 W (3 W for ZB-V's two chunks) per rank off the p-1 ramp slots,
    W being the ranks' mean weight-gradient time (`weight_grads` their sum). B, the input
    gradients, holds at least W's GEMMs and F at least as many again, so the bubble stays >= 0."""
    return FILLED_WEIGHT_GRADS.get(schedule, 0.0) * weight_grads * (pp - 1) / pp


def pipeline_time(ranks: list[RankTime], m: int, vpp: int, schedule: str = "1f1b") -> float:
    totals = [r.per_micro_batch for r in ranks]
    fill = bubble_fill(schedule, sum(r.weight_grad for r in ranks), len(ranks))
    return pipeline_seconds(max(totals), sum(totals), m, vpp, fill)


def device_states(params: float, expert_params: float, plan: Plan, cluster: Cluster) -> dict[str, float]:
    """The model states of a rank's `params` parameters on its device, by category: expert
    states shard over the ranks holding the same experts; offloaded ones are on the host."""
    if states_on_host(plan, cluster):  # offloaded: the sharded states and the optimizer step live on the host
        return device_state_bytes(params, plan)
    per_param = plan_state_bytes(plan)
    states = model_state_bytes(params - expert_params, plan.dtype, held_zero(plan), plan.shard_degree, plan.stack,
                               per_param)
    if expert_params:
        experts = model_state_bytes(expert_params, plan.dtype, held_zero(plan), max(1, plan.shard_degree // plan.ep),
                                    plan.stack, per_param)
        states = {k: states[k] + experts[k] for k in states}
    return states


def owned_shares(plan: Plan) -> tuple[float, float]:
    """The fractions of its parameters and of its largest weight a rank owns (steps) under
    ZeRO: a 1/shard_degree share of each (FSDP2's shards; ZeRO-1's rows of every weight,
    executor/apply/zero_one.py)."""
    shard = plan.shard_degree if plan.zero >= 1 else 1
    return 1 / shard, 1 / shard


def peak_moments(plan: Plan, workload: Workload, rank_index: int, rank: RankTime,
                 cluster: Cluster) -> tuple[dict, float, float]:
    """The rank's memory by category at the largest of its four candidate peaks, as the dry
    run measures them:
    - the loss, computed outside every FSDP2 unit between forward and backward: every
      in-flight micro-batch's saved activations and the last layers' temporaries (the loss's
      fp32 logits and their gradients), no gathered buffers;
    - the root unit's backward (the head's, after the loss's): the saved activations less
      the head's one micro-batch (the loss's log-probabilities, its largest, are freed) and
      ZeRO-3's gathered root weights with their unsharded gradients;
    - a block's backward: the saved activations less the head's one micro-batch (freed by
      then), the block's and the next's gathered weights and one block's unsharded gradients,
      the accumulation transient, and the larger of the block's temporaries and a fully
      recomputed block being rebuilt (one layer at a time);
    - the optimizer step: every gradient and AdamW's temporaries (`optimizer_step_bytes`), or
      just before it, under ZeRO-3, the root unit's unsharded gradients and the flat copy its
      reduce-scatter reads (in the reduce dtype) beside every other gradient.
    Under ZeRO-2 FSDP2 holds the rank's gathered 16-bit weights at all three instead
    (`gathered_weight_bytes`). Model states are there at each, but for one micro-batch under
    FSDP2 without pipelining no gradient exists yet (`gradients_at_peak`); held unsharded
    (`held_gradient_bytes`), they sit beside the gather buffers instead. Returns the peak's categories, every
    in-flight micro-batch's saved activations (`activations` less them: that moment's transient), and what
    the caching allocator reserves at its largest (`reserved.peak_reserved_bytes`)."""
    states = device_states(rank.params, rank.expert_params, plan, cluster)
    stepping = {**states, "activations": optimizer_step_temporaries(plan, workload, rank, cluster)}
    if not gradients_at_peak(plan):
        states["gradients"] = 0.0
    held_gradients = held_gradient_bytes(rank.params, plan)
    if held_gradients:  # unsharded until the last micro-batch reduces them, and no sharded ones yet
        states["gradients"] = 0.0
    dense = rank.params - rank.expert_params
    states["gradients"] += bucket_copy_bytes(dense, plan, stepping=False)
    stepping["gradients"] += bucket_copy_bytes(dense, plan, stepping=True)
    kw = activation_keywords(plan, kv_bytes_per_sequence(workload), plan.dtype)
    per_mb, head_saved, rebuild, block_temporaries, end_temporaries = 0.0, 0.0, 0.0, 0.0, 0.0
    biggest, root, cast, block_slack, end_slack, cast_back = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    ends = 0.0  # the embedding's and head's bytes at the peak, each counted by its own stage's micro-batches
    for est in rank.stage_estimates:
        in_flight = stage_in_flight(plan.schedule, est.index, plan.pp, plan.vpp, plan.num_micro_batches)
        for layer, policy, count in stage_runs(plan, workload, est.index):
            kept = activation_bytes(layer, policy, **kw)
            if layer.kind == "block":
                per_mb += kept * count
            else:
                ends += end_layer_saved_bytes(layer, policy, in_flight, plan.pp > 1, **kw) * count
            cast += cast_params_on_rank(layer, plan.tp, plan.ep) * count
            cast_back = max(cast_back, cast_back_bytes(layer, plan))
            if layer.kind == "block":
                block_temporaries = max(block_temporaries, transient_bytes(layer, **kw))
                block_slack = max(block_slack, allocator_slack_bytes(layer, **kw))
                biggest = max(biggest, layer_params_on_rank(layer, plan.tp, plan.ep))
            else:
                end_temporaries = max(end_temporaries, transient_bytes(layer, **kw))
                end_slack = max(end_slack, allocator_slack_bytes(layer, **kw))
                root += layer_params_on_rank(layer, plan.tp, plan.ep) * count
                if layer.kind == "head":  # its one micro-batch, the logits with it
                    head_saved += (kept + held_output_bytes(layer, pipelined=plan.pp > 1, **kw)) * count
            if policy in REBUILT:
                rebuild = max(rebuild, activation_bytes(layer, "none", **kw))
    saved = per_mb * in_flight_micro_batches(plan.schedule, rank_index, plan.pp, plan.vpp, plan.num_micro_batches) + ends
    sharded = held_zero(plan) >= 3 and plan.gathers_weights
    gathered = {"root": root_buffer_bytes(root, plan.dtype), "block": block_buffer_bytes(biggest, plan.dtype, reduce_bytes(plan))}
    moments = activation_moments(saved, end_temporaries, head_saved, max(rebuild, block_temporaries),
                                 accumulation_transient(plan, workload, rank), gathered["root"], gathered["block"])
    held = gathered_weight_bytes(rank.params, plan.dtype, held_zero(plan), plan.shard_degree, plan.stack)
    if held:
        moments = [{**m, "buffers": held} for m in moments]
    elif not sharded:
        moments = [{"activations": m["activations"]} for m in moments]
    copies = autocast_copy_bytes(cast, plan)
    pile = cast_gradient_pile_bytes(cast, plan)
    if pile:  # a backward's end: every gradient, the cast copies and their gradients, no activations
        closing = {**stepping, "activations": cast_back, "buffers": copies + pile}
        stepping = max(stepping, closing, key=lambda m: sum(m.values()))
    if copies:  # autocast's compute-dtype weights, from the first forward to the backward's end
        moments = [{**m, "buffers": m.get("buffers", 0.0) + copies} for m in moments]
    if held_gradients:  # FSDP2's unsharded parameters' gradients, beside its gather buffers
        moments = [{**m, "buffers": m.get("buffers", 0.0) + held_gradients} for m in moments]
    peak = {**states, **max(moments, key=lambda m: sum(m.values()))}
    if sharded and root:  # the backward's end: every gradient but the root's, which FSDP2 copies for its reduce-scatter
        closing = {**stepping, "buffers": WEIGHT_BYTES[plan.dtype] * root, "activations": reduce_bytes(plan) * root}
        stepping = max(stepping, closing, key=lambda m: sum(m.values()))
    caching = caches_blocks(cluster)
    slacks = moment_slacks(end_slack, block_slack, root_hole_bytes(plan, root, end_temporaries, sharded))
    reserved = peak_reserved_bytes([sum(states.values()) + sum(m.values()) for m in moments],
                                   slacks if caching else [0.0] * len(moments), sum(stepping.values()),
                                   all_gather_pool_bytes(plan, root, biggest) if caching else 0.0)
    if sum(stepping.values()) > sum(peak.values()):
        return stepping, stepping["activations"], reserved  # nothing saved then: no transient beside the ops
    return peak, saved, reserved


def activation_moments(saved: float, end_temporaries: float, head_saved: float, block_work: float,
                       accumulation: float, root_buffer: float, block_buffer: float) -> list[dict[str, float]]:
    """The three moments of a rank's activation peak (`peak_moments`), by category: the loss
    (every in-flight micro-batch's `saved` activations and the last layers' temporaries), the
    root unit's backward (the head's one micro-batch of saved activations freed, ZeRO-3's
    gathered root weights), and a block's backward (the larger of its temporaries and a
    rebuilt block, the accumulation transient, the block's gather buffers). The solver calls
    it with `saved` 0 and adds its own linear saved term (`_rank_extra_bytes`)."""
    return [
        {"activations": saved + end_temporaries, "buffers": 0.0},
        {"activations": saved - head_saved, "buffers": root_buffer},
        {"activations": saved - head_saved + block_work + accumulation, "buffers": block_buffer},
    ]


def optimizer_step_temporaries(plan: Plan, workload: Workload, rank: RankTime, cluster: Cluster) -> float:
    """AdamW's temporaries in the rank's step (`memory.optimizer_step_bytes`), over the
    parameters it owns: a 1/shard_degree share of each under ZeRO (`owned_shares`)."""
    if states_on_host(plan, cluster):
        return 0.0
    largest = 0.0
    for est in rank.stage_estimates:
        for layer, _, _ in stage_runs(plan, workload, est.index):
            largest = max(largest, layer.largest_weight / (plan.tp if layer.tp_shardable else 1))
    params_share, largest_share = owned_shares(plan)
    return optimizer_step_bytes(rank.params * params_share, largest * largest_share, cluster.gpu.device_type, plan.stack,
                                moment_bytes(plan))


def gradients_at_peak(plan: Plan) -> bool:
    """Whether gradients exist at the activation peak (`gradients_held`)."""
    return gradients_held(plan, plan.num_micro_batches)


def gradients_held(layout, num_micro_batches: int) -> bool:
    """Whether gradients exist at the activation peak of `layout` (a Layout or Plan). With one
    micro-batch and no pipeline, not where nothing keeps them between steps: zero_grad sets
    them to None and the backward makes them as it frees activations (FSDP2, and on the
    eager and compile stacks every rank outside DDP, executor/apply/gradient_reduce.py).
    DDP's buckets (its gradients are views into them), Megatron's gradient buffer under
    ZeRO-0/1 (the fused stack), accumulated micro-batches and pipelined FSDP2's unsharded
    gradients are there."""
    if layout.pp > 1 or num_micro_batches > 1:
        return True
    if layout.stack == "fused":
        return layout.zero <= 1
    return layout.reduces_through_ddp


def root_buffer_bytes(root_params: float, dtype: str) -> float:
    """FSDP2's root unit under ZeRO-3 (the stage's embedding, head and norms) during its
    backward: its gathered 16-bit weights and their unsharded gradients."""
    return 2 * WEIGHT_BYTES[dtype] * root_params


def block_buffer_bytes(block_params: float, dtype: str, reduced: float = 2.0) -> float:
    """FSDP2 under ZeRO-3 during a block's backward: the block gathered while the next is
    prefetched, one block's unsharded gradients, and the flat copy of them its reduce-scatter
    reads, in the reduce dtype (`reduced` bytes each: FSDP2 copies the gradients in before it
    frees them)."""
    return (3 * WEIGHT_BYTES[dtype] + reduced) * block_params


def accumulation_transient(plan: Plan, workload: Workload, rank: RankTime) -> float:
    """Accumulating gradients over micro-batches, autograd computes a weight's gradient into a
    new tensor before adding it to `.grad`: one weight at a time, the largest the rank holds,
    an embedding table (or its tied copy) being the one these profiles know of."""
    if plan.num_micro_batches < 2:
        return 0.0
    return max((new_gradient_bytes(layer, plan) for est in rank.stage_estimates
                for layer, _, _ in stage_runs(plan, workload, est.index)), default=0.0)


def price_ranks(workload: Workload, plan: Plan, cluster: Cluster) -> tuple[Layout, list[RankTime]]:
    """Check the plan, then price each pipeline rank's per-micro-batch work (shared with the simulator)."""
    cluster = cluster.for_stack(plan.stack)
    check_plan(plan, workload, cluster)
    lay = layout_of(plan, cluster, workload)
    ranks = [RankTime() for _ in range(plan.pp)]
    for index in range(plan.n_virtual_stages):
        stage_time(plan, workload, lay, index, ranks[plan.stage_rank(index)])
    return lay, ranks


def estimate_uniform(workload: Workload, plan: Plan, cluster: Cluster, memory_reserve: float) -> Estimate:
    """The plan's step on one GPU type."""
    cluster = cluster.for_stack(plan.stack)
    lay, ranks = price_ranks(workload, plan, cluster)
    return _assemble(workload, plan, cluster, lay, ranks, memory_reserve)


def step_breakdown(crit: RankTime, m: int, pipe: float, dp: float, opt: float) -> dict[str, float]:
    """The step by category: the critical rank's m micro-batches, the pipeline's bubble, the
    exposed data-parallel reduction and the optimizer."""
    return {
        "compute": m * (crit.forward + crit.backward),
        "recompute": m * crit.recompute,
        "tp_comm": m * (crit.tp_comm - crit.ep_comm),
        "ep_comm": m * crit.ep_comm,  # expert parallelism's all-to-alls
        "pp_comm": m * crit.pp_comm,
        "zero_comm": m * crit.zero_comm,
        "bubble": pipe - m * crit.per_micro_batch,  # below 0 where idle ranks' cores sped the slowest up
        "dp_comm": dp,
        "optimizer": opt,
    }


def _assemble(workload, plan, cluster, lay, ranks, memory_reserve) -> Estimate:
    m = lay.m
    shared = shared_core_pipeline_time(ranks, plan, cluster)
    pipe = pipeline_time(ranks, m, plan.vpp, plan.schedule) if shared is None else shared
    dp = exposed_dp(ranks, plan, lay) + max(weight_gather_time(r.params - r.expert_params, plan, lay)
                                            + expert_reduction_time(r.expert_params, plan, lay) for r in ranks)
    opt = optimizer_time(ranks, plan, cluster)
    step = pipe + dp + opt
    crit = max(ranks, key=lambda r: r.per_micro_batch)
    breakdown = step_breakdown(crit, m, pipe, dp, opt)
    stages = []
    for r, rank in enumerate(ranks):
        memory, _, reserved = peak_moments(plan, workload, r, rank, cluster)
        for est in rank.stage_estimates:
            stages.append(est.model_copy(update={"memory_bytes": memory, "reserved_bytes": reserved}))
    stages.sort(key=lambda s: s.index)
    est = throughput(workload, plan, cluster, step, breakdown, stages, memory_reserve)
    if not plan.offload:
        return est
    host = host_memory_per_node([r.params for r in ranks], plan, cluster) if states_on_host(plan, cluster) else 0.0
    return est.model_copy(update={
        "host_memory_bytes": host, "host_copy_s": host_copy_seconds(crit.params, plan, cluster),
        "host_memory_capacity_bytes": cluster.node.host_memory_gb * 1e9 * (1 - memory_reserve)})


def throughput(workload, plan, cluster, step, breakdown, stages, memory_reserve) -> Estimate:
    seqs = plan.global_batch
    model_flops = 3 * workload.forward_flops() * seqs
    extra = sum(
        recompute_flops(layer, policy) * count * seqs
        for index in range(len(plan.stages))
        for layer, policy, count in stage_runs(plan, workload, index)
    )
    n = plan.n_gpus
    per_gpu_model = model_flops / step / n
    price = cluster.price_per_gpu_hour
    tokens = seqs * plan.seq_len
    return Estimate(
        step_time_s=step,
        breakdown_s=breakdown,
        tokens_per_s=tokens / step,
        tflops_per_gpu_model=per_gpu_model / 1e12,
        tflops_per_gpu_hw=(model_flops + extra) / step / n / 1e12,
        mfu=per_gpu_model / cluster.gpu.peak_flops(plan.dtype),
        peak_memory_bytes=max(s.peak_bytes for s in stages),
        peak_reserved_bytes=max(s.reserved_bytes or s.peak_bytes for s in stages),
        memory_capacity_bytes=usable_memory_bytes(cluster, memory_reserve, plan, workload),
        runtime_memory_bytes=runtime_memory_bytes(plan, cluster, tied_across_stages(workload)),
        stages=stages,
        usd_per_hour=price * n if price is not None else None,
        usd_per_million_tokens=price * n * step / 3600 / tokens * 1e6 if price is not None else None,
    )
