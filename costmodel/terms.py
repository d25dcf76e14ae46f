"""The terms a plan's step is composed from, per pipeline rank, and the step's and the peak's
composition on one GPU type (`estimate_uniform`; the peak's terms are `costmodel.peak`'s);
`costmodel.estimate` is the entry.

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


from hardware.schema import Cluster

from . import collectives as coll
from .compute import expert_exchange_time, layer_time, recompute_flops
from .data_parallel import (expert_reduction_time, exposed_dp, host_copy_seconds, layer_params_on_rank,
                            optimizer_time, prefetch_fill, sharded_exposed, weight_gather_time)
from .layout import Layout, RankTime, layout_of, stage_runs
from .peak import peak_moments
from .offload import host_memory_per_node, states_on_host
from .runtime_memory import runtime_memory_bytes
from layout.axes import REBUILT
from layout.plan import Plan
from layout.results import Estimate, StageEstimate
from .shared_cores import shared_core_pipeline_time
from .validate import check_plan
from .workload import LayerProfile, Workload, tied_params_on_rank

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


def stage_time(plan: Plan, workload: Workload, lay: Layout, index: int, rank: RankTime) -> None:
    """Add virtual stage `index` to its rank's per-micro-batch times."""
    stage = plan.stages[index]
    runs = stage_runs(plan, workload, index)
    times = [(layer_time(layer, lay.ctx, policy), count) for layer, policy, count in runs]
    fwd = sum(t.forward * n for t, n in times)
    bwd = sum(t.backward * n for t, n in times)
    params = sum(layer_params_on_rank(layer, plan.tp, plan.ep) * n for layer, _, n in runs)
    if plan.pp > 1:  # the stage's own copy of weights tied to a layer on another stage
        params += sum(tied_params_on_rank(layer, plan.tp) * n for layer, _, n in runs)
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
