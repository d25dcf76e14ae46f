"""Playing a mixed-GPU plan's step, with a timeline per GPU group.

* pipeline split: one pipeline through every group, each pipeline rank's ops priced on
  its own group's GPUs (`costmodel.mixed.pipeline_ranks`) and a send between groups
  over the inter-group network; each group's timeline is its pipeline ranks.
* data split: each group's replica played on its own GPUs with its own micro-batch
  count (the uniform simulation of `costmodel.mixed.group_alone`); the slowest group's
  timeline is the step's, the others finish early and wait at the all-reduce.
"""
from __future__ import annotations

from dataclasses import replace

from ..mixed import crossing_layout, group_alone, group_clusters, mixed_cluster_of, pipeline_ranks, spanning
from layout.plan import Plan
from ..workload import Workload
from .playback import GroupTimeline, SimResult, play, simulate_uniform


def simulate_mixed(workload: Workload, plan: Plan, cluster, bucket_bytes: float) -> SimResult:
    mixed = mixed_cluster_of(plan, cluster)
    clusters = group_clusters(plan, mixed)
    if plan.split == "data":
        return _data_split(workload, plan, mixed, clusters, bucket_bytes)
    owner, lays, ranks = pipeline_ranks(workload, plan, mixed, clusters)
    sends = []
    for s in range(plan.n_virtual_stages):
        here, there = owner[plan.stage_rank(s)], owner[plan.stage_rank((s + 1) % plan.n_virtual_stages)]
        sends.append(lays[plan.stage_rank(s)] if here == there else crossing_layout(plan, mixed, clusters[here], workload))
    result = play(workload, plan, [clusters[owner[r]] for r in range(plan.pp)], lays, ranks, bucket_bytes, sends)
    groups = [GroupTimeline(share.hardware, list(share.stages)) for share in plan.groups]
    return _whole(workload, plan, mixed, replace(result, groups=groups))


def _data_split(workload, plan, mixed, clusters, bucket_bytes) -> SimResult:
    own = []
    for share, cluster in zip(plan.groups, clusters):
        alone, _ = group_alone(plan, share)
        own.append(GroupTimeline(share.hardware, list(range(plan.pp)),
                                 simulate_uniform(workload, alone, spanning(mixed, cluster, plan.n_gpus), bucket_bytes)))
    slowest = max(own, key=lambda g: g.own.step_time_s).own
    return _whole(workload, plan, mixed, replace(slowest, plan=plan, groups=own))


def _whole(workload, plan, mixed, result: SimResult) -> SimResult:
    """The step's throughput over the whole global batch and every GPU's peak."""
    flops = 3 * workload.forward_flops() * plan.global_batch
    return replace(result, tokens_per_s=plan.global_batch * plan.seq_len / result.step_time_s,
                   mfu=flops / result.step_time_s / mixed.peak_flops(plan.dtype))
