"""Where a plan's groups sit on the cluster (`Layout`) and what one pipeline rank spends per
micro-batch (`RankTime`): the shared vocabulary of the estimator, the data-parallel
share, the shared-core pipeline model and the simulator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

from hardware.schema import Cluster

from . import collectives as coll
from .autocast import cast_bytes_per_element
from .compute import Context, memory_bandwidth
from .accumulation import accumulation_seconds_per_param
from layout.plan import Plan
from layout.results import StageEstimate
from .workload import LayerProfile, Workload


@dataclass
class RankTime:
    """Per-micro-batch times of one pipeline rank (all its virtual stages)."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    pp_comm: float = 0.0
    zero_comm: float = 0.0
    params: float = 0.0
    expert_params: float = 0.0  # of `params`: expert weights, sharded and reduced over their own replicas
    ep_comm: float = 0.0  # of `tp_comm`: expert parallelism's all-to-alls
    weight_grad: float = 0.0  # of `backward`: the weight gradients (`LayerTime.weight_grad`)
    stage_estimates: list[StageEstimate] = field(default_factory=list)

    @property
    def per_micro_batch(self) -> float:
        return self.forward + self.backward + self.recompute + self.tp_comm + self.pp_comm + self.zero_comm


@dataclass(frozen=True)
class Layout:
    """Derived facts about where a plan's groups sit on the cluster."""

    ctx: Context
    dp_group: coll.Group
    pp_inter_node: bool
    m: int
    shard_group: coll.Group  # ZeRO's shard group: all of dp, or HSDP's dp_shard
    replicate_group: coll.Group  # HSDP's copies of the shards (size 1 otherwise)
    expert_group: coll.Group = coll.Group(1, 1)  # the ranks holding the same experts (dp*cp/ep of them)


def kv_bytes_per_sequence(workload: Workload) -> float:
    """One attention layer's keys and values for a whole sequence."""
    heads = workload.heads or 1
    head_dim = (workload.hidden or 0) / heads
    return 2.0 * (workload.kv_heads or heads) * head_dim * workload.seq_len * workload.dtype_bytes


def context_of(layout, dtype: str, cluster: Cluster, workload: Workload | None = None) -> Context:
    """What a layer's cost depends on under `layout` (a `layout.layout.Layout` or a Plan): the
    TP, CP and EP groups (TP innermost, inside a node first), the tokens per rank, the stack, and
    each micro-batch's share of the once-a-step casts and accumulation. A bare Layout (the search's
    floor) has no batch to share them over: left out, a floor below every batch's price."""
    cast = cast_bytes_per_element(layout, dtype) / memory_bandwidth(cluster.gpu)
    planned = isinstance(layout, Plan)
    m = layout.num_micro_batches if planned else 1
    return Context(cluster=cluster, dtype=dtype, tp=layout.tp, sp=layout.sp, micro_batch=layout.micro_batch_per_rank,
                   tp_group=coll.group_of(layout.tp, 1, cluster), cp=layout.cp,
                   cp_group=coll.group_of(layout.cp, layout.tp, cluster),
                   cp_kv_bytes=kv_bytes_per_sequence(workload) if workload is not None else 0.0,
                   ep=layout.ep, ep_group=coll.group_of(layout.ep, layout.tp, cluster), stack=layout.stack,
                   tp_overlap=layout.tp_overlap, seq_len=workload.seq_len if workload is not None else None,
                   cast_back_seconds=cast, first_cast_seconds=cast / m if planned else 0.0,
                   accumulation_seconds=accumulation_seconds_per_param(layout, cluster) / m if planned else 0.0)


def layout_of(plan: Plan, cluster: Cluster, workload: Workload | None = None) -> Layout:
    """Mesh order is (pp, dp, cp, tp), dp x cp being the data-parallel ranks (HSDP
    splits them into replicate x shard, shard inner): TP innermost, inside a node first."""
    if plan.cp > 1 and workload is None:
        raise ValueError("a context-parallel plan is priced with its workload (the keys and values it gathers)")
    return Layout(
        ctx=context_of(plan, plan.dtype, cluster, workload),
        dp_group=coll.group_of(plan.data_parallel, plan.tp, cluster),
        pp_inter_node=plan.data_parallel * plan.tp >= cluster.gpus_per_node,
        m=plan.num_micro_batches,
        shard_group=coll.group_of(plan.shard_degree, plan.tp, cluster),
        replicate_group=coll.group_of(plan.dp_replicate if plan.zero >= 2 else 1, plan.tp * plan.shard_degree, cluster),
        expert_group=coll.group_of(plan.data_parallel // plan.ep, plan.tp * plan.ep, cluster),
    )


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
