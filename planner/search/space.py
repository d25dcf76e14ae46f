"""The discrete layout space: which DP x TP x PP x micro-batch x schedule x
ZeRO x SP combinations are legal for a workload on a cluster.

Both the CP-SAT planner (which adds the per-stage partition and per-layer
checkpointing on top) and the exhaustive uniform baseline draw from here, so
the two search the same layouts. Pinned fields (`fixed`) filter the space, and
so does the executor's declaration (`planner.executable`): a layout the
executor cannot run is never offered.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterator

from costmodel.offload import host_bandwidths, host_priced
from layout.plan import Plan, uniform_stages
from costmodel.workload import Workload
from hardware.errors import PlanError
from hardware.loader import loads_back
from hardware.schema import Cluster
from layout.axes import ACCUMULATION, AXIS, RECOMPUTE, SPLIT_BACKWARD_SCHEDULES, axis_problem
from layout.layout import Layout
from layout.rules import EXECUTED_STACKS, allowed_recompute, layout_problem, moe_sp_problem, structural_problem
from planner.executable import facts_of_workload

MAX_MICRO_BATCH = 16
CP_CHOICES = (2, 4, 8, 16)
CP_MIN_SEQ = 16384  # pruning: below it the K/V all-gathers cost more than the activations they save


def to_plan(layout: Layout, workload: Workload, cluster: Cluster, *, global_batch: int, dtype: str, recompute: str,
            model: str, shared_stages: bool = False) -> Plan:
    """The layout with a uniform partition; `shared_stages`: StagePlans validated once and
    shared with every plan of the same partition (the search's templates, never edited)."""
    kinds = [layer.kind for layer in workload.layers]
    n_stages = layout.n_virtual_stages
    stages = list(_uniform(tuple(kinds), n_stages, recompute)) if shared_stages else uniform_stages(kinds, n_stages, recompute)
    return Plan(model=model, hardware=cluster.spec(), hardware_profile=_embedded(cluster), global_batch=global_batch,
                seq_len=workload.seq_len, dtype=dtype, stages=stages, **layout.axes())


_LAST_EMBEDDED: list = [None, None]  # (cluster, what its plans embed): the search makes thousands of plans of one


def _embedded(cluster: Cluster) -> Cluster | None:
    """The profile a plan of `cluster` carries: none for a catalog cluster its spec rebuilds, the
    cluster itself for a calibrated or edited one. Clusters are frozen, so the last answer holds
    for the same object."""
    if _LAST_EMBEDDED[0] is not cluster:
        _LAST_EMBEDDED[:] = [cluster, None if loads_back(cluster) else cluster]
    return _LAST_EMBEDDED[1]


@lru_cache(maxsize=256)
def _uniform(kinds: tuple[str, ...], n_stages: int, recompute: str) -> tuple:
    """`uniform_stages`, validated once per partition: thousands of layouts share a few (their
    templates share the StagePlans, which the search replaces and never edits)."""
    return tuple(uniform_stages(list(kinds), n_stages, recompute))


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of `n`, ascending, found up to its square root (a million GPUs is a
    thousand trials, not a million)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def check_pins(fixed: dict, workload: Workload | None = None, cluster: Cluster | None = None) -> None:
    """Refuse pins that no layout could honour, naming the field and what would be valid: each
    value against its axis (`layout.axes`), then against the model and the cluster."""
    for key, value in fixed.items():
        if key == "compression" and isinstance(value, (tuple, list, set, frozenset)):  # --allow-compression's set
            bad = [m for m in value if AXIS["compression"].check(m)]
            if bad or not value:
                raise PlanError("compression", f"{bad or value!r} is not valid",
                                f"use any of {', '.join(AXIS['compression'].choices)}")
        elif (why := axis_problem(key, value)) is not None:
            raise PlanError("fixed" if key not in AXIS else key, why)
    if "recompute" in fixed:
        _check_recompute_pin(fixed)
    _check_recipe_pins(fixed)
    _check_schedule_pins(fixed)
    if workload is not None and cluster is not None:
        _check_pins_fit(fixed, workload, cluster)


def _check_recompute_pin(fixed: dict) -> None:
    schedule, stack = fixed.get("schedule", "1f1b"), fixed.get("stack", "eager")
    allowed = allowed_recompute(Layout(schedule=schedule, stack=stack))
    if fixed["recompute"] in allowed:
        return
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        raise PlanError("recompute", f"{fixed['recompute']!r} with the {schedule} schedule: the executor runs it "
                        "without recomputation", "pin recompute none, or another schedule")
    raise PlanError("recompute", f"{fixed['recompute']!r} on the {stack} stack: Megatron-LM has no op-level "
                    "checkpointing", f"use one of {', '.join(allowed)}, or stack eager")


def _check_schedule_pins(fixed: dict) -> None:
    """A pinned schedule against a pinned vpp, through the rulebook (zbv runs two chunks per
    rank; a single-chunk schedule runs one), on a pipeline of the pinned pp or the least one."""
    if "schedule" not in fixed or "vpp" not in fixed:
        return
    probe = Layout(pp=max(2, fixed.get("pp", 2)), schedule=fixed["schedule"], vpp=fixed["vpp"])
    if (problem := structural_problem(probe)) is not None:
        raise problem


def _check_recipe_pins(fixed: dict) -> None:
    """The precision, accumulation and TP-overlap pins against each other and the pinned stack,
    ZeRO stage, TP, SP and pipeline (an unpinned stage is one of FSDP2's, an unpinned TP split
    with SP, where every pin can hold)."""
    keys = (*RECIPE, "accumulation", "zero", "pp", "tp", "sp")
    probe = Layout(**{"zero": 3, **({"tp": 2, "sp": True} if fixed.get("tp_overlap") else {}),
                      **{k: fixed[k] for k in keys if k in fixed}, "ddp_bucket_view": True})
    if (problem := structural_problem(probe)) is not None:
        raise problem
    if fixed.get("ddp_bucket_view") is False:  # DDP's own layouts: zero 0, tp 1, pp 1 over more than one rank
        ddp = Layout(dp=fixed.get("dp", 2), ddp_bucket_view=False,
                     **{k: fixed.get(k, 0 if k == "zero" else 1) for k in ("zero", "tp", "pp")})
        if (problem := structural_problem(ddp)) is not None:
            raise problem


def _check_pins_fit(fixed: dict, workload: Workload, cluster: Cluster) -> None:
    """The pins against the model's facts (through the rulebook) and the cluster's size."""
    facts = facts_of_workload(workload)
    ep = fixed.get("ep", 1)
    probes = [Layout(dp=ep, ep=ep)]  # the sequence against the model's positions, ep against its experts
    if fixed.get("sp") and facts.n_experts:
        raise moe_sp_problem(facts)
    if fixed.get("offload"):
        probes.append(Layout(zero=fixed.get("zero", 3), ep=fixed.get("ep", 1), offload=True, dp=fixed.get("ep", 1)))
    if fixed.get("cp", 1) != 1:
        probes.append(Layout(pp=fixed.get("pp", 1), cp=fixed["cp"]))
    for probe in probes:
        if (problem := layout_problem(probe, facts, workload.seq_len)) is not None:
            raise problem
    if fixed.get("offload"):
        host_bandwidths(cluster)  # the typed error naming the host figures a profile lacks
    if "tp" in fixed and fixed["tp"] not in tp_choices(workload, cluster):
        if (problem := layout_problem(Layout(tp=fixed["tp"]), facts, workload.seq_len)) is not None:
            raise problem
        raise PlanError("tp", f"tp={fixed['tp']} must divide the {cluster.n_gpus} GPUs and fit in two nodes",
                        f"use one of {tp_choices(workload, cluster)}")
    if "pp" in fixed and (fixed["pp"] > workload.n_blocks or cluster.n_gpus % fixed["pp"]):
        raise PlanError("pp", f"pp={fixed['pp']} must divide {cluster.n_gpus} GPUs and not exceed {workload.n_blocks} layers",
                        f"use a divisor of {cluster.n_gpus} up to {workload.n_blocks}")


def tp_choices(workload: Workload, cluster: Cluster) -> list[int]:
    """Powers of two up to two nodes' worth that the executor can split the model by
    (TP may cross a node if it pays)."""
    limit = min(cluster.n_gpus, 2 * cluster.gpus_per_node)
    facts = facts_of_workload(workload)
    return [t for t in AXIS["tp"].searched if t <= limit and cluster.n_gpus % t == 0
            and layout_problem(Layout(tp=t), facts, workload.seq_len) is None]


def _schedules(pp: int, m: int, n_blocks: int, pinned: str | None,
               pinned_vpp: int | None = None) -> Iterator[tuple[str, int]]:
    """GPipe takes the time of 1F1B with more micro-batches in flight, so it is
    dominated and only offered when pinned."""
    if pp == 1:
        yield "1f1b", 1
        return
    yield "1f1b", 1
    if pinned == "gpipe":
        yield "gpipe", 1
    if m % pp == 0:
        depths = (pinned_vpp,) if pinned_vpp is not None and pinned_vpp > 1 else AXIS["vpp"].searched
        for v in depths:
            if n_blocks >= pp * v:
                yield "interleaved", v
        for v in (1, *depths):  # zero-bubble (ZB1P) over one chunk per rank too
            if n_blocks >= pp * v:
                yield "zero-bubble", v
        if n_blocks >= 2 * pp and pinned_vpp in (None, 2):  # ZB-V: two chunks per rank, always
            yield "zbv", 2


def layouts(workload: Workload, cluster: Cluster, global_batch: int, fixed: dict | None = None) -> Iterator[Layout]:
    """Every legal layout that honours the pinned fields."""
    fixed = fixed or {}
    n = cluster.n_gpus
    facts = facts_of_workload(workload)
    for tp in tp_choices(workload, cluster):
        # SP's rules read only tp, the sequence and the model: half the layouts, judged once per tp
        sp_choices = (False, True) if tp > 1 and layout_problem(Layout(tp=tp, sp=True), facts, workload.seq_len) is None \
            else (False,)
        for pp, cp in _pp_cp(n // tp, workload, fixed):
            dp = n // (tp * pp * cp)
            if global_batch % dp:
                continue
            for mb in divisors(global_batch // dp):
                if mb > MAX_MICRO_BATCH:
                    break
                m = global_batch // (dp * mb)
                for schedule, vpp in _schedules(pp, m, workload.n_blocks, fixed.get("schedule"), fixed.get("vpp")):
                    for zero, shard in zero_choices(dp, tp, cluster, fixed, cp):
                        for sp in sp_choices:
                            for ep in ep_choices(workload, dp * cp, fixed):
                                recipe = _recipe(fixed)
                                recipe["tp_overlap"] = recipe["tp_overlap"] and sp  # pinned on: the SP layouts
                                layout = Layout(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero, micro_batch=mb, schedule=schedule,
                                                vpp=vpp, dp_shard=shard, cp=cp, ep=ep, **recipe)
                                if _honours(layout, fixed) and recompute_choices(fixed, layout):
                                    for method, offload, held in _method_offload(layout, cluster, fixed, m):
                                        offered = _with(layout, compression=method, offload=offload,
                                                        accumulation=held)
                                        if layout_problem(_runnable(offered), facts, workload.seq_len, m) is None:
                                            yield offered


def _runnable(offered: Layout) -> Layout:
    """The layout the executor's rules judge for `offered`: a pinned stack it does not run is
    judged as eager, the precision pairs only Megatron's optimizer keeps as the master dtype,
    TP overlap and FP8 weights as off (each priced, not run). Most layouts are their own."""
    return _with(offered, stack=offered.stack if offered.stack in EXECUTED_STACKS else "eager",
                 optimizer_dtype=offered.master_dtype, tp_overlap=False, fp8_param_gather=False)


def _with(layout: Layout, **update) -> Layout:
    """`layout` with `update`, the same object where nothing changes (thousands of layouts a
    search, most of them unchanged)."""
    if all(getattr(layout, key) == value for key, value in update.items()):
        return layout
    return layout.model_copy(update=update)


def _pp_cp(ranks: int, workload: Workload, fixed: dict) -> Iterator[tuple[int, int]]:
    """(pp, cp) over `ranks` = n / tp: pipelines, and for long sequences context
    parallelism (the executor runs it without pipeline stages)."""
    for pp in divisors(ranks):
        if pp <= workload.n_blocks:
            yield pp, 1
    long = workload.seq_len >= CP_MIN_SEQ or fixed.get("cp", 1) > 1
    for cp in ((fixed["cp"],) if fixed.get("cp", 1) > 1 else CP_CHOICES) if long else ():
        if ranks % cp == 0:
            yield 1, cp


def ep_choices(workload: Workload, dp: int, fixed: dict) -> tuple[int, ...]:
    """1, and for a mixture-of-experts model every degree that divides both dp*cp and the experts
    (the declaration then keeps those the executor composes with)."""
    if "ep" in fixed:
        return (fixed["ep"],)
    return (1, *(e for e in divisors(dp) if e > 1 and workload.n_experts and workload.n_experts % e == 0))


def zero_choices(dp: int, tp: int, cluster: Cluster, fixed: dict, cp: int = 1) -> Iterator[tuple[int, int | None]]:
    """ZeRO stages with their shard group: all of dp, and for ZeRO-2/3 hybrid sharding
    (HSDP) with the shard group filling the node, where the gathers stay on NVLink and
    only the once-per-step all-reduce crosses nodes (or a pinned dp_shard)."""
    if dp == 1 and cp == 1:
        yield 0, None
        if host_priced(cluster):  # one rank's states on the host: FSDP2 over one rank (offload_choices)
            yield 3, None
        return
    for zero in AXIS["zero"].choices:
        yield zero, None
        if zero < 2:
            continue
        pinned = fixed.get("dp_shard")
        inside = cluster.gpus_per_node // tp if cluster.gpus_per_node % tp == 0 else 0
        for shard in ((pinned,) if pinned is not None else (inside,)):
            if shard and 1 < shard < dp * cp and dp * cp % shard == 0:
                yield zero, shard


def compression_choices(layout: Layout, fixed: dict) -> tuple[str, ...]:
    """A pinned method as given; a set of allowed methods (the user allows lossy compression)
    only where the executor can hook the reduction: DDP, i.e. dp > 1, zero 0, tp 1."""
    pinned = fixed.get("compression", "none")
    if isinstance(pinned, str):
        return (pinned,)
    hookable = layout.reduces_through_ddp and layout.zero == 0
    return tuple(m for m in pinned if m == "none" or hookable) or ("none",)


def offload_choices(layout: Layout, cluster: Cluster, fixed: dict) -> tuple[bool, ...]:
    """Offload beside every ZeRO-2/3 layout where the profile prices the host, and as the only
    choice of a single rank's ZeRO-3 (without it that layout is plain dp=1); the estimate
    keeps it only where it wins (nothing else fits, or the memory it frees buys a faster layout)."""
    if layout.zero < 2 or not host_priced(cluster) or (layout.stack != "eager" and "offload" not in fixed):
        choices: tuple[bool, ...] = (False,)  # other stacks' offload (Megatron's, DeepSpeed's) is priced only when pinned
    else:
        choices = (True,) if layout.data_parallel == 1 else (False, True)
    return tuple(c for c in choices if c == fixed.get("offload", c))


def accumulation_choices(layout: Layout, m: int, fixed: dict) -> tuple[str, ...]:
    """A pinned policy as given; both where FSDP2 units accumulate several micro-batches
    without a pipeline (holding the gradients trades memory for collectives), else reduce_each."""
    if "accumulation" in fixed:
        return (fixed["accumulation"],)
    if layout.zero >= 2 and layout.pp == 1 and m > 1:
        return ACCUMULATION
    return ("reduce_each",)


RECIPE = ("stack", "master_dtype", "optimizer_dtype", "reduce_dtype", "tp_overlap", "fp8_param_gather",
          "ddp_bucket_view")  # pinned or the default, never searched


def _recipe(fixed: dict) -> dict:
    return {name: fixed.get(name, AXIS[name].default) for name in RECIPE}


def _method_offload(layout: Layout, cluster: Cluster, fixed: dict, m: int):
    for method in compression_choices(layout, fixed):
        for offload in offload_choices(layout, cluster, fixed):
            for held in accumulation_choices(layout, m, fixed):
                yield method, offload, held


def _honours(layout: Layout, fixed: dict) -> bool:
    def value_of(key):  # a dp_shard of all dp is plain sharding
        return (layout.dp_shard or layout.dp * layout.cp) if key == "dp_shard" else getattr(layout, key)

    return all(value_of(key) == value for key, value in fixed.items()
               if key not in ("recompute", "compression", "offload", "accumulation"))


def recompute_choices(fixed: dict | None, layout: Layout | None = None) -> tuple[str, ...]:
    """The policies searched: a pinned one, else every one the executor runs with `layout`."""
    fixed = fixed or {}
    allowed = allowed_recompute(layout) if layout is not None else RECOMPUTE
    return tuple(p for p in ((fixed["recompute"],) if "recompute" in fixed else RECOMPUTE) if p in allowed)
