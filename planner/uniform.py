"""The search on a cluster of one GPU type: the fastest (or cheapest per token) plan that fits."""
from __future__ import annotations

from typing import Any

import hardware
from costmodel.estimate import estimate as price_plan
from layout.plan import Plan
from layout.results import Estimate
from costmodel.validate import check_dtype, default_dtype
from costmodel.workload import Workload
from hardware.errors import InfeasibleError, PlanError
from hardware.schema import Cluster

from costmodel.attention import backend_note
from planner.request import PlanRequest
from planner.resolve import model_name, resolve_hardware, resolve_workload
from planner.search.branch_and_bound import search
from planner.search.infeasible import infeasibility_report
from planner.search.pinned import is_fully_pinned, pinned_plan
from planner.search.space import check_pins


def plan_uniform(model: Any, hw: str | Cluster, request: PlanRequest, *, example_inputs: Any = None) -> Plan:
    """The fastest (or cheapest per token) layout that fits, with `request.top_k - 1` alternatives.

    The search stops once its pick is proven within `request.target_gap` of the best any layout
    could reach, or after `request.time_limit_s`; the plan's solver report holds the gap and the time.
    `dtype` None: bf16, or fp32 on a profile whose bf16 is no faster (the plan says why).
    `mtbf_hours` (per GPU; default the profile's sourced figure) sets the plan's
    checkpoint interval and expected goodput (costmodel/goodput.py)."""
    cluster = resolve_hardware(hw, price_per_gpu_hour=request.price_per_gpu_hour)
    dtype, why = (request.dtype, "") if request.dtype is not None else default_dtype(cluster)
    check_dtype(dtype, cluster)
    request = request.model_copy(update={"dtype": dtype})
    workload = resolve_workload(model, seq_len=request.seq_len, dtype=dtype, example_inputs=example_inputs, cluster=cluster)
    why = "; ".join(filter(None, [why, backend_note(workload, cluster.gpu.name)]))
    fixed = request.pins(dtype)
    check_pins(fixed, workload, cluster)
    name = model_name(model, workload)
    clusters = _cost_clusters(cluster) if request.objective == "cost" else [cluster]
    share = request.model_copy(update={"time_limit_s": request.time_limit_s / len(clusters)})
    best_result, best_key, best_cluster, timed_out = None, None, cluster, False
    for candidate in clusters:
        result = search(workload, candidate, share, model=name)
        timed_out = timed_out or result.report.status == "timeout"
        if result.best:
            key = _objective_value(result.best[0].estimate, request.objective)
            if best_key is None or key < best_key:
                best_result, best_key, best_cluster = result, key, candidate
    kw = dict(global_batch=request.global_batch, fixed=fixed, dtype=dtype, memory_reserve=request.memory_reserve)
    if best_result is None and is_fully_pinned(fixed):  # the user's own layout, estimated and flagged
        pinned = with_profile(pinned_plan(workload, cluster, model=name, **kw), cluster)
        return _noted(with_checkpointing(pinned, workload, cluster, request.mtbf_hours), why)
    if best_result is None and timed_out:
        raise PlanError("time_limit_s", f"the search's {request.time_limit_s:g} s passed before it priced a layout "
                        "that fits", "raise --time-limit")
    if best_result is None:
        report = infeasibility_report(workload, cluster, **kw)
        raise InfeasibleError("hw", report["message"], report["hint"], report=report)
    best = _to_plan(best_result, request.objective, best_cluster)
    if best.compression != "none" and request.lets_solver_compress:
        best = best.model_copy(update={"notes": [*best.notes, _compression_note(workload, best, cluster, request.memory_reserve)]})
    return _noted(with_checkpointing(best, workload, best_cluster, request.mtbf_hours), why)


def _noted(plan_: Plan, note: str) -> Plan:
    return plan_.model_copy(update={"notes": [note, *plan_.notes]}) if note else plan_


def with_checkpointing(plan_: Plan, workload: Workload, cluster: Cluster, mtbf_hours: float | None) -> Plan:
    """The plan with its Young/Daly checkpoint interval in steps and the goodput it keeps."""
    if plan_.estimate is None:
        return plan_
    from costmodel.goodput import checkpoint_advice, plan_checkpoint_bytes

    cluster = cluster.resized(plan_.n_gpus)
    advice = checkpoint_advice(workload.params, cluster, plan_.estimate.step_time_s,
                               dtype="fp32" if plan_.dtype == "fp32" else "bf16", mtbf_hours=mtbf_hours,
                               per_param=plan_checkpoint_bytes(plan_))
    return plan_.model_copy(update={"checkpointing": advice})


def _compression_note(workload: Workload, best: Plan, cluster: Cluster, memory_reserve: float) -> str:
    """Why the solver compressed: the same plan uncompressed, priced by the estimator."""
    if best.hardware != cluster.spec():
        cluster = best.cluster()
    plain = price_plan(workload, best.model_copy(update={"compression": "none", "estimate": None}), cluster,
                       memory_reserve=memory_reserve)
    what = f"topk (k={best.topk_fraction:g}, error feedback)" if best.compression == "topk" else \
        f"{best.compression}" + (" (error feedback)" if best.compression == "int8" else "")
    return (f"lossy gradient compression {what} chosen (--allow-compression): exposed DP reduction "
            f"{plain.breakdown_s['dp_comm'] * 1e3:.1f} -> {best.estimate.breakdown_s['dp_comm'] * 1e3:.1f} ms, "
            f"step {plain.step_time_s:.3f} -> {best.estimate.step_time_s:.3f} s")


def _cost_clusters(cluster: Cluster) -> list[Cluster]:
    """For the cost objective, also try whole-node subsets (halvings) of the cluster."""
    if cluster.price_per_gpu_hour is None:
        raise PlanError("price_per_gpu_hour", f"no price is known for {cluster.gpu.name}", "pass --price-per-gpu-hour")
    out, nodes = [], cluster.n_nodes
    while nodes >= 1:
        out.append(cluster.model_copy(update={"n_nodes": nodes}))
        if nodes % 2:
            break
        nodes //= 2
    return out


def _objective_value(est: Estimate, objective: str) -> float:
    return est.usd_per_million_tokens if objective == "cost" else est.step_time_s


def with_profile(plan_: Plan, cluster: Cluster) -> Plan:
    """Embed `cluster` when its spec alone would not load it back (a profile file)."""
    return plan_ if hardware.loads_back(cluster) else plan_.model_copy(update={"hardware_profile": cluster})


def _to_plan(result, objective: str, cluster: Cluster) -> Plan:
    plans = [with_profile(c.plan.model_copy(update={"estimate": c.estimate, "objective": objective}), cluster)
             for c in result.best]
    best = plans[0]
    notes = []
    origin = {"cp-sat": "CP-SAT", "greedy": "the greedy least-recompute start of the CP-SAT search (CP-SAT found nothing better)"}
    if result.best[0].recompute in origin:
        notes.append(f"stage partition and per-layer checkpointing chosen by {origin[result.best[0].recompute]}")
    return best.model_copy(update={"alternatives": plans[1:], "solver": result.report, "notes": notes})
