"""The step of a mixed-GPU plan (`Plan.groups`), each group's ranks priced on its own GPU.

Both shapes reuse the uniform estimator's terms, so a mixed plan and a uniform one
disagree only where the hardware does:

* data split: each group's replicas run their own micro-batches through every stage,
  priced as the uniform plan with that group's micro-batch count on that group's
  GPUs. The gradient all-reduce spans the groups, so its ranks sit on nodes no larger
  than the smallest group and talk over the inter-group network
  (`MixedCluster.with_network`). The step is the slowest group's: the all-reduce
  cannot end before its last backward.
* pipeline split: pipeline rank r is priced on the GPUs of the group holding it, a
  send between groups over the inter-group network, and the pipeline composed as
  `costmodel.estimate.pipeline_time` does; each rank's gradient reduction overlaps
  its own backward on its own group's links, and the optimizer waits for the slowest
  rank's step.
"""
from __future__ import annotations

import math
from dataclasses import replace

from hardware.errors import PlanError
from hardware.mixed import MixedCluster
from hardware.schema import Cluster

from .data_parallel import exposed_dp, host_copy_seconds, optimizer_time, weight_gather_time
from .peak import peak_moments
from .terms import (estimate_uniform, p2p_time, pipeline_time, stage_time, step_breakdown, throughput,
                    usable_memory_bytes)
from .layout import RankTime, layout_of
from .offload import host_memory_per_node, states_on_host
from layout.plan import Plan
from layout.results import Estimate
from layout.groups import GroupEstimate, GroupShare, rank_ranges, ranks_of
from .validate import check_dtype
from .workload import Workload


def mixed_cluster_of(plan: Plan, cluster) -> MixedCluster:
    """The mixed cluster a plan with groups is priced on; a typed error for a mismatch."""
    if not plan.groups:
        raise PlanError("groups", f"{cluster.spec()} is a mixed cluster and the plan has no groups",
                        f"plan it with `parallax plan MODEL --hw {cluster.spec()}`")
    if not isinstance(cluster, MixedCluster):
        raise PlanError("hardware", f"{plan.hardware} is a mixed-cluster plan and {cluster.spec()} is one GPU type",
                        f"price it on its own cluster, {plan.hardware}")
    return cluster


def group_clusters(plan: Plan, mixed: MixedCluster) -> list[Cluster]:
    """Each of `plan.groups` matched to its group of `mixed` by spec, their GPU counts checked."""
    by_spec = {c.spec(): c for c in mixed.groups}
    if sorted(g.hardware for g in plan.groups) != sorted(by_spec):
        raise PlanError("groups", f"the plan's groups {[g.hardware for g in plan.groups]} are not the cluster's "
                        f"{sorted(by_spec)}", "give the plan the cluster it was made for")
    clusters = [by_spec[g.hardware] for g in plan.groups]
    for share, cluster in zip(plan.groups, clusters):
        need = len(share.stages) * len(share.replicas) * plan.tp
        if need != cluster.n_gpus:
            raise PlanError("groups", f"group {share.hardware} holds {len(share.stages)} stages x "
                            f"{len(share.replicas)} replicas x tp {plan.tp} = {need} GPUs, not {cluster.n_gpus}",
                            "make each group's stages x replicas x tp its GPU count")
        check_dtype(plan.dtype, cluster)
    return [c.for_stack(plan.stack) for c in clusters]


def estimate_mixed(workload: Workload, plan: Plan, mixed: MixedCluster, memory_reserve: float) -> Estimate:
    clusters = group_clusters(plan, mixed)
    if plan.stages[-1].end != workload.n_layers:
        raise PlanError("stages", f"the last stage ends at layer {plan.stages[-1].end} but {workload.name} has "
                        f"{workload.n_layers} layers", f"end the last stage at {workload.n_layers}")
    if plan.split == "data":
        return _data_split(workload, plan, mixed, clusters, memory_reserve)
    return _pipeline_split(workload, plan, mixed, clusters, memory_reserve)


def _blocks(workload: Workload, plan: Plan, stages: list[int]) -> list[int]:
    kinds = [layer.kind for layer in workload.layers]
    return [sum(1 for k in kinds[plan.stages[s].start:plan.stages[s].end] if k == "block") for s in stages]


def spanning(mixed: MixedCluster, group: Cluster, n_gpus: int) -> Cluster:
    """`group`'s GPUs, `n_gpus` of them on nodes no larger than the smallest group, joined by the
    inter-group network: where a collective over every group's ranks runs."""
    per_node = math.gcd(group.gpus_per_node, *(g.n_gpus for g in mixed.groups))
    net = mixed.with_network(group)
    return net.model_copy(update={"n_nodes": n_gpus // per_node,
                                  "node": net.node.model_copy(update={"gpus_per_node": per_node})})


def group_alone(plan: Plan, share: GroupShare) -> tuple[Plan, int]:
    """A data split's group as a uniform plan: every replica at this group's (busiest) micro-batch
    count, so the data-parallel collectives span the whole cluster; and that count."""
    m = max(plan.micro_batches_of(r) for r in share.replicas)
    return plan.model_copy(update={"groups": None, "dp_micro_batches": None,
                                   "global_batch": plan.dp * plan.micro_batch * m}), m


def crossing_layout(plan: Plan, mixed: MixedCluster, cluster: Cluster, workload: Workload):
    """Where a pipeline send from `cluster`'s group to another group goes: the inter-group network."""
    return replace(layout_of(plan, spanning(mixed, cluster, plan.n_gpus), workload), pp_inter_node=True)


def _data_split(workload, plan, mixed, clusters, reserve) -> Estimate:
    per_group = []
    for share, cluster in zip(plan.groups, clusters):
        alone, m = group_alone(plan, share)
        per_group.append((share, m, estimate_uniform(workload, alone, spanning(mixed, cluster, plan.n_gpus),
                                                     memory_reserve=reserve)))
    step = max(est.step_time_s for _, _, est in per_group)
    rows = []
    for share, m, est in per_group:
        busy = sum(v for k, v in est.breakdown_s.items() if k not in ("bubble", "dp_comm", "optimizer"))
        rows.append(_row(plan, share, len(share.replicas), m, _blocks(workload, plan, share.stages), busy / m,
                         busy, step, (est.peak_memory_bytes, est.peak_reserved_bytes), est.memory_capacity_bytes))
    crit = max(range(len(per_group)), key=lambda i: per_group[i][2].step_time_s)
    slowest = per_group[crit][2]
    est = throughput(workload, plan, clusters[crit], step, slowest.breakdown_s, slowest.stages, reserve)
    return _mixed_throughput(workload, plan, mixed, est, rows)


def _row(plan, share: GroupShare, replicas, m, blocks, per_mb, busy, step, peaks, capacity) -> GroupEstimate:
    """`peaks`: the group's (tensors' peak, reservation) on its worst rank."""
    ranks = ranks_of(share, plan.dp, plan.tp)
    return GroupEstimate(group=share.hardware, gpus=len(ranks), ranks=rank_ranges(sorted(ranks)), stages=share.stages,
                         replicas=replicas, micro_batches=m, blocks_per_stage=blocks, per_micro_batch_s=per_mb,
                         busy_s=busy, idle_fraction=max(0.0, 1 - busy / step), peak_memory_bytes=peaks[0],
                         peak_reserved_bytes=peaks[1], memory_capacity_bytes=capacity)


def pipeline_ranks(workload, plan, mixed, clusters):
    """Each pipeline rank priced on its group's GPUs; a send between groups on their network."""
    owner = {s: i for i, share in enumerate(plan.groups) for s in share.stages}
    lays = [layout_of(plan, clusters[owner[r]], workload) for r in range(plan.pp)]
    ranks = [RankTime() for _ in range(plan.pp)]
    for index in range(plan.n_virtual_stages):
        stage_time(plan, workload, lays[plan.stage_rank(index)], index, ranks[plan.stage_rank(index)])
    for rank, extra in zip(ranks, crossing_seconds(workload, plan, mixed, [clusters[owner[r]] for r in range(plan.pp)])):
        rank.pp_comm += extra
    return owner, lays, ranks


def crossing_seconds(workload: Workload, plan: Plan, mixed: MixedCluster, rank_clusters: list[Cluster]) -> list[float]:
    """Per pipeline rank, what its sends to a rank of another GPU group cost per micro-batch
    beyond a send inside its own group: they cross the inter-group network (a stage's last
    layer is a block, whatever the partition; the solver adds these to its ranks' fixed time)."""
    block = next(layer for layer in workload.layers if layer.kind == "block")
    extra = [0.0] * plan.pp
    for index in range(plan.n_virtual_stages - 1):
        r, nxt = plan.stage_rank(index), plan.stage_rank(index + 1)
        if rank_clusters[r] is not rank_clusters[nxt]:
            own = layout_of(plan, rank_clusters[r], workload)
            across = crossing_layout(plan, mixed, rank_clusters[r], workload)
            extra[r] += p2p_time(block, plan, across) - p2p_time(block, plan, own)
    return extra


def _pipeline_split(workload, plan, mixed, clusters, reserve) -> Estimate:
    owner, lays, ranks = pipeline_ranks(workload, plan, mixed, clusters)
    m = plan.num_micro_batches
    pipe = pipeline_time(ranks, m, plan.vpp, plan.schedule)
    dp = exposed_dp(ranks, plan, lays) + max(weight_gather_time(rank.params, plan, lay)
                                             for rank, lay in zip(ranks, lays))
    opt = max(optimizer_time([rank], plan, clusters[owner[r]]) for r, rank in enumerate(ranks))
    step = pipe + dp + opt
    breakdown = step_breakdown(max(ranks, key=lambda r: r.per_micro_batch), m, pipe, dp, opt)
    stages, memory, held = [], [], []
    for r, rank in enumerate(ranks):
        peak, _, reserved = peak_moments(plan, workload, r, rank, clusters[owner[r]])
        memory.append(peak)
        held.append(reserved)
        stages += [est.model_copy(update={"memory_bytes": peak, "reserved_bytes": reserved}) for est in rank.stage_estimates]
    stages.sort(key=lambda s: s.index)
    rows = []
    for i, share in enumerate(plan.groups):
        mine = [r for r in range(plan.pp) if owner[r] == i]
        per_mb = max(ranks[r].per_micro_batch for r in mine)
        rows.append(_row(plan, share, plan.dp, m, _blocks(workload, plan, share.stages), per_mb, m * per_mb, step,
                         (max(sum(memory[r].values()) for r in mine), max(held[r] for r in mine)),
                         usable_memory_bytes(clusters[i], reserve, plan, workload)))
    est = throughput(workload, plan, clusters[owner[plan.stage_rank(plan.n_virtual_stages - 1)]], step, breakdown, stages, reserve)
    if plan.offload:
        est = est.model_copy(update=_host(plan, owner, ranks, clusters, reserve))
    return _mixed_throughput(workload, plan, mixed, est, rows)


def _host(plan, owner, ranks, clusters, reserve) -> dict:
    """Offload on a pipeline split: each group's nodes hold their own stages' states; the fullest
    node beside the smallest host memory, and the slowest rank's copies."""
    used, copies, rooms = 0.0, 0.0, []
    for i, cluster in enumerate(clusters):
        mine = [ranks[r].params for r in range(plan.pp) if owner[r] == i]
        if states_on_host(plan, cluster):
            used = max(used, host_memory_per_node(mine, plan, cluster))
        copies = max(copies, host_copy_seconds(max(mine), plan, cluster))
        if cluster.node.host_memory_gb:
            rooms.append(cluster.node.host_memory_gb * 1e9 * (1 - reserve))
    return {"host_memory_bytes": used, "host_copy_s": copies, "host_memory_capacity_bytes": min(rooms, default=None)}


def _mixed_throughput(workload, plan, mixed, est: Estimate, rows: list[GroupEstimate]) -> Estimate:
    """The whole cluster's figures: model FLOP/s over every GPU's peak, the summed price, and
    the memory of the group closest to its capacity."""
    step = est.step_time_s
    model_flops = 3 * workload.forward_flops() * plan.global_batch
    peak = mixed.peak_flops(plan.dtype)
    prices = [g.price_per_gpu_hour for g in mixed.groups]
    usd = sum(p * g.n_gpus for p, g in zip(prices, mixed.groups)) if None not in prices else None
    tightest = max(rows, key=lambda g: g.held_bytes / g.memory_capacity_bytes)
    tokens = plan.global_batch * plan.seq_len
    return est.model_copy(update={
        "mfu": model_flops / step / peak, "peak_memory_bytes": tightest.peak_memory_bytes,
        "peak_reserved_bytes": tightest.peak_reserved_bytes, "memory_capacity_bytes": tightest.memory_capacity_bytes, "groups": rows,
        "usd_per_hour": usd, "usd_per_million_tokens": usd * step / 3600 / tokens * 1e6 if usd is not None else None})
