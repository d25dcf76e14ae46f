"""Playing one training step of a plan through the event engine (`costmodel.simulate.step`
is the entry, for every plan).

`estimate` composes a step from a closed formula; this module *plays* the
step: one data-parallel replica's pipeline ranks (DP ranks are symmetric),
each with a compute stream and intra-/inter-node links, running the plan's
real schedule order (GPipe, 1F1B or interleaved 1F1B) against the data
dependencies between stages. Non-uniform partitions, per-layer checkpointing,
contention between pipeline sends and gradient buckets on one NIC, bucketed
DP reduction overlapped with the last backward, ZeRO-3 gathers with one-layer
prefetch and the optimizer step all appear as they happen, so the simulator
is the reference where it and the formula differ.

Prices are the analytic model's own per-layer terms (see `ops`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hardware.schema import Cluster

from .. import collectives as coll
from ..data_parallel import expert_reduction_time, optimizer_time, weight_gather_time
from ..peak import peak_moments, rank_receiving
from ..terms import price_ranks
from ..layout import RankTime
from layout.plan import Plan
from .engine import Engine, EngineInput, Event
from .ops import Pricer, buckets, p2p_seconds, stage_activation
from .repeat import carried, played_lengths, shortened
from .schedule import rank_orders
from .stats import RankSim, breakdown, exposed_by_kind, memory_timeline
from ..workload import Workload

__all__ = ["SimResult", "RankSim", "Event", "GroupTimeline", "simulate_uniform", "play"]


@dataclass
class SimResult:
    plan: Plan
    step_time_s: float
    pipeline_s: float  # when the last forward/backward ends
    bubble_fraction: float  # pipeline idle of the busiest rank over its busy time
    breakdown_s: dict[str, float]  # critical rank, sums to the step
    exposed_comm_s: dict[str, float]  # worst rank per kind
    ranks: list[RankSim]
    peak_memory_bytes: float
    peak_memory_rank: int
    peak_memory_time_s: float
    tokens_per_s: float
    mfu: float
    events: list[Event] = field(repr=False)
    groups: list["GroupTimeline"] = field(default_factory=list)  # a mixed-cluster plan's groups
    played_micro_batches: int | None = None  # fewer than the plan's: the rest identical and counted (`repeat`)

    @property
    def critical_rank(self) -> int:
        return max(range(len(self.ranks)), key=lambda r: (self.ranks[r].end_s, -r))


@dataclass
class GroupTimeline:
    """One GPU group of a mixed-cluster plan in the simulated step: the pipeline ranks it holds
    (a pipeline split: one timeline through every group), or its own replica played on its own
    GPUs (a data split: one timeline per group, the slowest setting the step)."""

    group: str
    pipeline_ranks: list[int]
    own: "SimResult | None" = None


def simulate_uniform(workload: Workload, plan: Plan, cluster: Cluster, bucket_bytes: float) -> SimResult:
    """A step of a plan on one GPU type; long ones played shortened and extrapolated (`repeat`)."""
    cluster = cluster.for_stack(plan.stack)
    lengths = played_lengths(plan)
    if lengths is None:
        return _play_uniform(workload, plan, cluster, bucket_bytes)
    short, longer = (_play_uniform(workload, shortened(plan, m), cluster, bucket_bytes) for m in lengths)
    return carried(short, longer, *lengths, plan)


def _play_uniform(workload: Workload, plan: Plan, cluster: Cluster, bucket_bytes: float) -> SimResult:
    lay, rank_times = price_ranks(workload, plan, cluster)
    return play(workload, plan, [cluster] * plan.pp, [lay] * plan.pp, rank_times, bucket_bytes)


def play(workload: Workload, plan: Plan, clusters: list[Cluster], lays: list, rank_times: list[RankTime],
         bucket_bytes: float, send_lays: list | None = None) -> SimResult:
    """Run the engine over priced pipeline ranks, rank r on `clusters[r]` with layout `lays[r]`;
    `send_lays[s]`: the layout virtual stage s's sends cross (default: its rank's)."""
    pricers = {}
    for lay in lays:
        pricers.setdefault(id(lay), Pricer(plan, workload, lay))
    per_rank = [pricers[id(lay)] for lay in lays]
    peaks = [peak_moments(plan, workload, r, rank_times[r], clusters[r]) for r in range(plan.pp)]
    # each rank's transient at its peak moment (a rebuilt block, the loss's temporaries), while its ops run
    transients = [max(0.0, memory["activations"] - saved) for memory, saved, _ in peaks]
    sends = send_lays or [lays[plan.stage_rank(s)] for s in range(plan.n_virtual_stages)]
    spec = _engine_input(plan, per_rank, sends, bucket_bytes, transients)
    out = Engine(spec).run()
    return _assemble(plan, workload, clusters, lays, rank_times, spec, out, [memory for memory, _, _ in peaks])


def _engine_input(plan: Plan, pricers: list[Pricer], sends: list, bucket_bytes: float,
                  transients: list[float]) -> EngineInput:
    n, rank = plan.n_virtual_stages, plan.stage_rank
    phases = ("F", "B", "W") if plan.splits_backward else ("F", "B")
    templates = {(s, ph): pricers[rank(s)].template(s, ph) for s in range(n) for ph in phases}
    fwd = [p2p_seconds(plan, pricers[rank(s)].workload, sends[s], plan.stages[s].end - 1)
           if s < n - 1 and not plan.hands_over_in_place(s) else 0.0 for s in range(n)]
    bwd = [0.0] + fwd[:-1]  # the gradient of stage s's input has the size of stage s-1's output
    grads = {}
    if plan.data_parallel > 1 and (plan.zero < 2 or plan.dp_replicate > 1 or plan.pp > 1):
        last = phases[-1]  # the gradients are final in the last backward op: the weights' (W) under zero-bubble
        grads = {s: buckets(plan, pricers[rank(s)], s, templates[(s, last)], bucket_bytes) for s in range(n)}
    reducers = [_bucket_pricer(plan, pricer.lay) for pricer in pricers]
    return EngineInput(
        n_stages=n,
        orders=rank_orders(plan.schedule, plan.pp, plan.num_micro_batches, plan.vpp),
        templates=templates,
        p2p_fwd=fwd,
        p2p_bwd=bwd,
        activation=[(stage_activation(plan, pricers[rank(s)], s), transients[rank(s)]) for s in range(n)],
        buckets=grads,
        bucket_time=lambda nbytes, stage: reducers[rank(stage)](nbytes),
        pp_stream=pricers[0].pp_stream,
        dp_stream=pricers[0].dp_stream,
    )


def _bucket_pricer(plan: Plan, lay):
    """ZeRO-0 all-reduces each bucket; ZeRO-1 reduce-scatters it (the owner updates its shard);
    HSDP all-reduces each bucket's shard across the replicas."""
    cluster, group = lay.ctx.cluster, lay.dp_group
    if plan.zero == 0:
        return lambda nbytes: (coll.all_reduce(nbytes, group, cluster), "allreduce")
    if plan.zero >= 2:  # pipelined: the one reduce-scatter per step, then HSDP's all-reduce
        shard, replicas, once = plan.shard_degree, lay.replicate_group, plan.pp > 1
        return lambda nbytes: ((coll.reduce_scatter(nbytes, lay.shard_group, cluster) if once else 0.0)
                               + coll.all_reduce(nbytes / shard, replicas, cluster), "reduce")
    return lambda nbytes: (coll.reduce_scatter(nbytes, group, cluster), "reduce-scatter")


def _tail(plan: Plan, cluster: Cluster, lay, r: int, rank_time: RankTime, out) -> tuple[float, float]:
    """Optimizer after the rank's compute and gradient reductions, then (ZeRO-1) the weight all-gather.

    Returns (end of the rank's step, optimizer seconds).
    """
    start = max(out.compute_end[r], out.dp_end[r])
    experts = expert_reduction_time(rank_time.expert_params, plan, lay)
    if experts:  # the experts' own gradient sum (and ZeRO-1 gather), after the backward
        out.events.append(Event(r, "inter" if lay.expert_group.nodes > 1 else "intra", "expert gradients", start,
                                experts, "dp"))
        start += experts
    opt = optimizer_time([rank_time], plan, cluster)
    out.events.append(Event(r, "compute", "optimizer", start, opt, "optimizer"))
    end = start + opt
    if plan.zero == 1 and plan.data_parallel > 1:
        gather = weight_gather_time(rank_time.params - rank_time.expert_params, plan, lay)
        stream = "intra" if lay.dp_group.nodes == 1 else "inter"
        out.events.append(Event(r, stream, "allgather weights", end, gather, "dp"))
        end += gather
    return end, opt


def _rank_sim(plan, memory: dict, receiving: float, r, rank_time, spec, out, events, end) -> RankSim:
    """`memory`: the rank's categories at its peak (`costmodel.estimate.peak_moments`), its
    activations with the `receiving` bytes of receive buffers the rank holds through the step."""
    ops = out.ops[r]
    tpls = [spec.templates[(op.stage, op.phase)] for op, _, _ in ops]
    busy = sum(t.duration for t in tpls)
    static = {k: v for k, v in memory.items() if k != "activations"}
    static["receive buffers"] = receiving
    timeline, peak, when = memory_timeline(out.memory_deltas[r], sum(static.values()))
    return RankSim(
        rank=r,
        stages=plan.rank_stages(r),
        busy_s=busy,
        idle_s=max(0.0, out.compute_end[r] - busy),
        compute_s=sum(t.compute for t in tpls),
        recompute_s=sum(t.recompute for t in tpls),
        tp_comm_s=sum(t.tp_comm for t in tpls),
        zero_wait_s=sum(t.zero_wait for t in tpls),
        compute_end_s=out.compute_end[r],
        end_s=end,
        exposed_comm_s={"tp": sum(t.tp_comm for t in tpls), "zero": sum(t.zero_wait for t in tpls),
                        **exposed_by_kind(events, r, ("pp", "dp"))},
        static_memory=static,
        memory_timeline=timeline,
        peak_memory_bytes=peak,
        peak_memory_time_s=when,
    )


def _assemble(plan, workload, clusters, lays, rank_times, spec, out, memories) -> SimResult:
    tails = [_tail(plan, clusters[r], lays[r], r, rank_times[r], out) for r in range(plan.pp)]
    by_rank: list[list[Event]] = [[] for _ in range(plan.pp)]
    for e in out.events:
        by_rank[e.rank].append(e)
    receiving = [rank_receiving(plan, workload, plan.rank_stages(r)) for r in range(plan.pp)]
    ranks = [_rank_sim(plan, memories[r], receiving[r], r, rank_times[r], spec, out, by_rank[r], tails[r][0])
             for r in range(plan.pp)]
    step = max(end for end, _ in tails)
    pipeline = max(out.compute_end)
    busiest = max(r.busy_s for r in ranks)
    crit = max(ranks, key=lambda k: (k.end_s, -k.rank))
    peak = max(ranks, key=lambda k: k.peak_memory_bytes)
    kinds = {kind for k in ranks for kind in k.exposed_comm_s}
    model_flops = 3 * workload.forward_flops() * plan.global_batch
    return SimResult(
        plan=plan,
        step_time_s=step,
        pipeline_s=pipeline,
        bubble_fraction=(pipeline - busiest) / busiest if busiest else 0.0,
        breakdown_s=breakdown(crit, step, tails[crit.rank][1]),
        exposed_comm_s={kind: max(k.exposed_comm_s.get(kind, 0.0) for k in ranks) for kind in sorted(kinds)},
        ranks=ranks,
        peak_memory_bytes=peak.peak_memory_bytes,
        peak_memory_rank=peak.rank,
        peak_memory_time_s=peak.peak_memory_time_s,
        tokens_per_s=plan.global_batch * plan.seq_len / step,
        mfu=model_flops / step / plan.n_gpus / clusters[0].gpu.peak_flops(plan.dtype),
        events=out.events,
    )
