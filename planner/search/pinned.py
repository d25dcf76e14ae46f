"""A layout the user pinned whole, estimated as given.

When the degrees are pinned (tp and pp, dp following from the GPU count), the
user asks what that layout does, not which layout to pick. The estimate then
answers even where the search would not offer the layout: a layout the
executor's declaration refuses, or one the memory model rejects. The plan says
so in its notes: the executor's objection, or the modelled peak against the
usable memory. A pin that no layout can honour is a PlanError naming the field.
"""
from __future__ import annotations

from pydantic import ValidationError

from costmodel.estimate import estimate

from costmodel.terms import GIB
from layout.plan import Plan
from costmodel.workload import Workload
from hardware.errors import PlanError
from hardware.schema import Cluster

from layout.rules import layout_problem
from planner.executable import facts_of_workload
from layout.layout import Layout
from planner.search.space import RECIPE, recompute_choices, to_plan


def is_fully_pinned(fixed: dict | None) -> bool:
    return bool(fixed) and "tp" in fixed and "pp" in fixed


def pinned_layout(fixed: dict, cluster: Cluster) -> Layout:
    """The one layout `fixed` names; unpinned fields take the plain defaults."""
    tp, pp, cp, n = fixed["tp"], fixed["pp"], fixed.get("cp", 1), cluster.n_gpus
    if n % (cp * tp * pp):
        raise PlanError("pp", f"cp*tp*pp = {cp}*{tp}*{pp} does not divide the {n} GPUs",
                        f"pick cp, tp and pp whose product divides {n}")
    dp = fixed.get("dp", n // (cp * tp * pp))
    if dp * cp * tp * pp != n:
        raise PlanError("dp", f"dp*cp*tp*pp = {dp}*{cp}*{tp}*{pp} is not the cluster's {n} GPUs",
                        f"use dp={n // (cp * tp * pp)}")
    vpp = fixed.get("vpp", 1)
    schedule = fixed.get("schedule", "interleaved" if vpp > 1 else "1f1b")
    compression = fixed.get("compression", "none")
    return Layout(dp=dp, tp=tp, pp=pp, sp=fixed.get("sp", False), zero=fixed.get("zero", 0),
                  micro_batch=fixed.get("micro_batch", 1), schedule=schedule, vpp=vpp,
                  compression=compression if isinstance(compression, str) else "none",
                  dp_shard=fixed.get("dp_shard"), cp=cp, ep=fixed.get("ep", 1),
                  **{name: fixed[name] for name in (*RECIPE, "offload", "accumulation") if name in fixed})


def _as_plan(layout: Layout, workload: Workload, cluster: Cluster, policy: str, **kw) -> Plan:
    try:
        return to_plan(layout, workload, cluster, recompute=policy, **kw)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "layout"
        raise PlanError(field, first["msg"].removeprefix("Value error, "), "change the pinned layout") from None
    except ValueError as error:
        raise PlanError("pp", str(error), "pin fewer pipeline stages") from None


def memory_note(est) -> str:
    """Why a given layout does not fit as priced: its reservation past the usable memory while its
    tensors fit (it runs, the allocator giving its cache back each step), or its tensors past it."""
    usable = f"{est.memory_capacity_bytes / GIB:.0f} GiB usable"
    if est.fits_with_retries:
        return (f"memory model: {est.held_bytes / GIB:.0f} GiB reserved with no memory pressure > {usable}; its "
                f"{est.peak_memory_bytes / GIB:.0f} GiB of tensors fit, so it runs with torch's caching allocator "
                "giving its cache back and retrying each step (a device synchronisation)")
    return f"memory model: {est.peak_memory_bytes / GIB:.0f} GiB of tensors > {usable}"


def pinned_plan(workload: Workload, cluster: Cluster, *, global_batch: int, fixed: dict, dtype: str = "bf16",
                model: str | None = None, memory_reserve: float) -> Plan:
    """The pinned layout with its estimate: the fastest checkpointing policy that fits (or,
    when none does, the one with the smallest peak), flagged where it falls outside."""
    layout = pinned_layout(fixed, cluster)
    priced = []
    for policy in recompute_choices(fixed, layout):
        plan = _as_plan(layout, workload, cluster, policy, global_batch=global_batch, dtype=dtype,
                        model=model or workload.name)
        priced.append((plan, estimate(workload, plan, cluster, memory_reserve=memory_reserve)))
    fitting = [pe for pe in priced if pe[1].fits]
    plan, est = (min(fitting, key=lambda pe: pe[1].step_time_s) if fitting
                 else min(priced, key=lambda pe: pe[1].peak_memory_bytes))
    notes = []
    problem = layout_problem(layout, facts_of_workload(workload), workload.seq_len, plan.num_micro_batches)
    if problem is not None:
        notes.append(f"outside the executor's space: {problem}")
    if not est.fits:
        notes.append(memory_note(est))
    return plan.model_copy(update={"estimate": est, "notes": [*plan.notes, *notes]})
