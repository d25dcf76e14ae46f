"""The heterogeneity-aware layouts of a mixed-GPU cluster, priced with the cost model's own
per-layer and per-stage terms, each stage on its own group's GPU profile: the pipeline
split (stages assigned to groups, every group order tried, block counts balanced per
stage) and the data split (whole replicas per group, the global batch split unevenly).
`planner.mixed.search` compares them with the single-group plans.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import permutations


from costmodel import collectives as coll
from costmodel.compute import Context, layer_time
from costmodel.data_parallel import dp_time, optimizer_time
from costmodel.estimate import DEFAULT_MEMORY_RESERVE, GIB, p2p_time, pipeline_time, rank_memory, stage_time
from costmodel.layout import Layout, RankTime
from costmodel.memory import activation_bytes, in_flight_micro_batches, model_state_bytes
from costmodel.plan import Plan, StagePlan, uniform_stages
from costmodel.workload import Workload
from hardware.mixed import MixedCluster
from hardware.schema import Cluster

from planner.mixed.plan import GroupBalance, HeteroPlan

MICRO_BATCHES = (1, 2, 4)
POLICIES = ("none", "selective", "full")
ZEROS = (0, 1)


@dataclass
class _Eval:
    step: float
    plan: HeteroPlan


def _lay(cluster: Cluster, tp: int, mb: int, dtype: str, dp: int, m: int, pp_inter_node: bool) -> Layout:
    ctx = Context(cluster=cluster, dtype=dtype, tp=tp, sp=False, micro_batch=mb, tp_group=coll.group_of(tp, 1, cluster))
    dp_group = coll.group_of(dp, tp, cluster)
    return Layout(ctx=ctx, dp_group=dp_group, pp_inter_node=pp_inter_node, m=m, shard_group=dp_group,
                  replicate_group=coll.Group(1, 1))


def capacity_bytes(cluster: Cluster, reserve: float) -> float:
    return cluster.gpu.hbm_gb * GIB * (1 - reserve)


def _exposed_dp(ranks: list[RankTime], plan: Plan, lays: list[Layout]) -> float:
    """As costmodel.estimate.exposed_dp, each rank on its own group's links."""
    exposed, slack = 0.0, 0.0
    for rank, lay in zip(ranks, lays):
        window = rank.backward + rank.recompute + slack
        exposed = max(exposed, dp_time(rank.params, plan, lay) - window)
        slack += rank.backward + rank.recompute
    return max(0.0, exposed)


def _stages_from_counts(workload: Workload, counts: list[int], policy: str) -> list[StagePlan]:
    kinds = [layer.kind for layer in workload.layers]
    first = kinds.index("block")
    bounds, pos = [0], first
    for c in counts:
        pos += c
        bounds.append(pos)
    bounds[-1] = len(kinds)
    return [StagePlan(start=a, end=b, recompute=[policy if kinds[i] == "block" else "none" for i in range(a, b)])
            for a, b in zip(bounds, bounds[1:])]


def _short(cluster: Cluster) -> str:
    return cluster.spec()


# --- pipeline split ---------------------------------------------------------------

def _balance_blocks(workload, order, pp_of, tp, dp, mb, m, zero, policy, dtype, reserve) -> list[int] | None:
    """Exact min-max block counts per stage under each stage's memory; None if nothing fits."""
    layers = workload.layers
    block = next(l for l in layers if l.kind == "block")
    prefix = [l for l in layers[: layers.index(block)]]
    suffix = [l for l in layers[max(i for i, l in enumerate(layers) if l.kind == "block") + 1:]]
    pp = sum(pp_of[id(g)] for g in order)
    stage_group = [g for g in order for _ in range(pp_of[id(g)])]
    t_block, mem_block, extra_t, extra_mem, cap = [], [], [], [], []
    per_group_t = {}
    for s, g in enumerate(stage_group):
        if id(g) not in per_group_t:
            ctx = Context(cluster=g, dtype=dtype, tp=tp, sp=False, micro_batch=mb, tp_group=coll.group_of(tp, 1, g))
            per_group_t[id(g)] = (ctx, layer_time(block, ctx, policy).total)
        ctx, tb = per_group_t[id(g)]
        inflight = in_flight_micro_batches("1f1b", s, pp, 1, m)
        ends = (prefix if s == 0 else []) + (suffix if s == pp - 1 else [])
        t_block.append(tb)
        extra_t.append(sum(layer_time(l, ctx, "none").total for l in ends))
        state = lambda p: sum(model_state_bytes(p / tp, dtype, zero, dp).values())  # noqa: E731
        mem_block.append(state(block.params) + activation_bytes(block, policy, tp=tp, sp=False, micro_batch=mb) * inflight)
        extra_mem.append(sum(state(l.params) + activation_bytes(l, "none", tp=tp, sp=False, micro_batch=mb) * inflight for l in ends))
        cap.append(capacity_bytes(g, reserve))
    n = workload.n_blocks
    mem_cap = [math.floor((cap[s] - extra_mem[s]) / mem_block[s]) for s in range(pp)]
    if min(mem_cap) < 1 or sum(mem_cap) < n:
        return None

    def caps(T: float) -> list[int]:
        return [min(mem_cap[s], max(0, math.floor((T - extra_t[s]) / t_block[s] + 1e-9))) for s in range(pp)]

    candidates = sorted({k * t_block[s] + extra_t[s] for s in range(pp) for k in range(1, min(n, mem_cap[s]) + 1)})
    lo, hi = 0, len(candidates) - 1
    if sum(caps(candidates[hi])) < n or min(caps(candidates[hi])) < 1:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        c = caps(candidates[mid])
        if sum(c) >= n and min(c) >= 1:
            hi = mid
        else:
            lo = mid + 1
    counts = caps(candidates[lo])
    while sum(counts) > n:  # trim the stages whose time is largest, keeping one block each
        s = max((s for s in range(pp) if counts[s] > 1), key=lambda s: counts[s] * t_block[s] + extra_t[s])
        counts[s] -= 1
    return counts


def _pipeline_split(workload, mixed, *, order, tp, dp, mb, zero, policy, global_batch, dtype, name, reserve) -> _Eval | None:
    pp_of = {id(g): g.n_gpus // (dp * tp) for g in order}
    pp = sum(pp_of.values())
    m = global_batch // (dp * mb)
    counts = _balance_blocks(workload, order, pp_of, tp, dp, mb, m, zero, policy, dtype, reserve)
    if counts is None:
        return None
    stages = _stages_from_counts(workload, counts, policy)
    plan = Plan(model=name, hardware=mixed.spec(), global_batch=global_batch, seq_len=workload.seq_len, dtype=dtype,
                dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb, stages=stages)
    stage_group = [g for g in order for _ in range(pp_of[id(g)])]
    ranks, lays = [RankTime() for _ in range(pp)], []
    for i, g in enumerate(stage_group):
        crosses = i + 1 < pp and stage_group[i + 1] is not g
        lay = _lay(g, tp, mb, dtype, dp, m, pp_inter_node=dp * tp >= g.gpus_per_node)
        stage_time(plan, workload, lay, i, ranks[i])
        if crosses:  # this stage's sends go over the inter-group network
            last = workload.layers[stages[i].end - 1]
            ranks[i].pp_comm = p2p_time(last, plan, _lay(mixed.with_network(g), tp, mb, dtype, dp, m, True))
        lays.append(lay)
    step = pipeline_time(ranks, m, 1) + _exposed_dp(ranks, plan, lays)
    step += max(optimizer_time([r], plan, g) for r, g in zip(ranks, stage_group))
    balance, stage_rows = [], []
    for g in order:
        idx = [i for i, x in enumerate(stage_group) if x is g]
        mems = [sum(rank_memory(plan, workload, i, ranks[i], g).values()) for i in idx]
        if max(mems) > capacity_bytes(g, reserve):
            return None
        busy = max(m * ranks[i].per_micro_batch for i in idx)
        balance.append(GroupBalance(group=_short(g), gpus=g.n_gpus, stages=f"{idx[0]}-{idx[-1]}",
                                    blocks_per_stage=[counts[i] for i in idx], replicas=dp, micro_batches=m,
                                    per_micro_batch_s=max(ranks[i].per_micro_batch for i in idx), busy_s=busy,
                                    idle_fraction=max(0.0, 1 - busy / step), peak_memory_gib=max(mems) / GIB,
                                    capacity_gib=capacity_bytes(g, reserve) / GIB))
    for i, st in enumerate(stages):
        stage_rows.append({"stage": i, "start": st.start, "end": st.end, "blocks": counts[i], "group": _short(stage_group[i]),
                           "per_micro_batch_s": ranks[i].per_micro_batch})
    hp = HeteroPlan(model=name, hardware=mixed.spec(), global_batch=global_batch, seq_len=workload.seq_len, dtype=dtype,
                    mode="pipeline-split", tp=tp, pp=pp, dp=dp, micro_batch=mb, zero=zero, recompute=policy,
                    step_time_s=step, tokens_per_s=global_batch * workload.seq_len / step, balance=balance, stages=stage_rows)
    return _Eval(step, hp)


# --- data split -------------------------------------------------------------------

def _split_micro_batches(units: int, dp_of: list[int], times) -> list[int] | None:
    """m_g >= 1 with sum dp_g * m_g = units minimising max_g times[g](m_g); exact, pruned enumeration."""
    best, best_m = math.inf, None

    def rec(i: int, left: int, chosen: list[int], worst: float) -> None:
        nonlocal best, best_m
        if i == len(dp_of) - 1:
            if left >= dp_of[i] and left % dp_of[i] == 0:
                t = max(worst, times[i](left // dp_of[i]))
                if t < best:
                    best, best_m = t, chosen + [left // dp_of[i]]
            return
        rest = sum(dp_of[i + 1:])
        for mg in range(1, (left - rest) // dp_of[i] + 1):
            t = times[i](mg)
            if max(t, worst) >= best:
                break
            rec(i + 1, left - mg * dp_of[i], chosen + [mg], max(t, worst))

    rec(0, units, [], 0.0)
    return best_m


def _data_split(workload, mixed, *, tp, pp, mb, zero, policy, global_batch, dtype, name, reserve) -> _Eval | None:
    groups = mixed.groups
    dp_of = [g.n_gpus // (tp * pp) for g in groups]
    dp = sum(dp_of)
    units = global_batch // mb
    if global_batch % mb or units < dp:
        return None
    kinds = [layer.kind for layer in workload.layers]
    stages = uniform_stages(kinds, pp, policy)
    base = Plan(model=name, hardware=mixed.spec(), global_batch=dp * mb, seq_len=workload.seq_len, dtype=dtype, dp=dp,
                tp=tp, pp=pp, zero=zero, micro_batch=mb, stages=stages)
    per_group = []
    for g in groups:
        net = mixed.with_network(g)  # DP traffic crosses groups
        lay = _lay(net, tp, mb, dtype, dp, 1, pp_inter_node=tp >= g.gpus_per_node)
        ranks = [RankTime() for _ in range(pp)]
        for i in range(pp):
            stage_time(base, workload, lay, i, ranks[i])
        per_group.append((g, lay, ranks))
    times = [lambda mg, r=ranks: pipeline_time(r, mg, 1) for _, _, ranks in per_group]
    ms = _split_micro_batches(units, dp_of, times)
    if ms is None:
        return None
    pipes = [times[i](ms[i]) for i in range(len(groups))]
    crit = pipes.index(max(pipes))
    _, lay_c, ranks_c = per_group[crit]
    step = max(pipes) + _exposed_dp(ranks_c, base, [lay_c] * pp)
    step += max(optimizer_time(ranks, base, g) for g, _, ranks in per_group)
    balance = []
    for (g, _, ranks), mg, dpg in zip(per_group, ms, dp_of):
        plan_g = base.model_copy(update={"global_batch": dp * mb * mg})
        mems = [sum(rank_memory(plan_g, workload, r, ranks[r], g).values()) for r in range(pp)]
        if max(mems) > capacity_bytes(g, reserve):
            return None
        busy = mg * max(r.per_micro_batch for r in ranks)
        balance.append(GroupBalance(group=_short(g), gpus=g.n_gpus, stages=f"0-{pp - 1}",
                                    blocks_per_stage=[sum(1 for k in kinds[s.start:s.end] if k == "block") for s in stages], replicas=dpg, micro_batches=mg,
                                    per_micro_batch_s=max(r.per_micro_batch for r in ranks), busy_s=busy,
                                    idle_fraction=max(0.0, 1 - busy / step), peak_memory_gib=max(mems) / GIB,
                                    capacity_gib=capacity_bytes(g, reserve) / GIB))
    hp = HeteroPlan(model=name, hardware=mixed.spec(), global_batch=global_batch, seq_len=workload.seq_len, dtype=dtype,
                    mode="data-split", tp=tp, pp=pp, dp=dp, micro_batch=mb, zero=zero, recompute=policy, step_time_s=step,
                    tokens_per_s=global_batch * workload.seq_len / step, balance=balance)
    return _Eval(step, hp)


# --- search -----------------------------------------------------------------------

def _tp_choices(workload: Workload, mixed: MixedCluster) -> list[int]:
    node = min(g.gpus_per_node for g in mixed.groups)
    return [t for t in (1, 2, 4, 8, 16) if t <= node and node % t == 0 and workload.tp_divides(t)]


def _common_divisors(values: list[int]) -> list[int]:
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return [d for d in range(1, g + 1) if g % d == 0]


def hetero_candidates(workload, mixed, *, global_batch, dtype="bf16", name=None, reserve=DEFAULT_MEMORY_RESERVE):
    """Every priced pipeline-split and data-split layout (fitting ones only)."""
    name = name or workload.name
    out = []
    for tp in _tp_choices(workload, mixed):
        per_tp = [g.n_gpus // tp for g in mixed.groups]
        for mb in MICRO_BATCHES:
            for zero in ZEROS:
                for policy in POLICIES:
                    kw = dict(mb=mb, zero=zero, policy=policy, global_batch=global_batch, dtype=dtype, name=name, reserve=reserve)
                    for pp in _common_divisors(per_tp):
                        if pp <= workload.n_blocks:
                            e = _data_split(workload, mixed, tp=tp, pp=pp, **kw)
                            if e:
                                out.append(e)
                    if len(mixed.groups) < 2:
                        continue
                    for dp in _common_divisors(per_tp):
                        if global_batch % (dp * mb) or sum(n // dp for n in per_tp) > workload.n_blocks:
                            continue
                        for order in permutations(mixed.groups):
                            e = _pipeline_split(workload, mixed, order=list(order), tp=tp, dp=dp, **kw)
                            if e:
                                out.append(e)
    return out
