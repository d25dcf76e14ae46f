"""Why nothing fits: the numbers a user needs to change the request.

When no layout fits, report the smallest per-GPU memory any layout needs
(full recomputation and ZeRO-3 included), the category that dominates it
(the knob that binds), and the smallest GPU count of the same type that
would fit.
"""
from __future__ import annotations

import hardware
from costmodel.terms import GIB, usable_memory_bytes
from costmodel.workload import Workload
from hardware.errors import ParallaxError
from hardware.schema import Cluster

from planner.search.enumerate import uniform_candidates

MAX_DOUBLINGS = 10


def _least_memory(workload, cluster, *, global_batch, fixed, dtype, memory_reserve):
    pins = {k: v for k, v in fixed.items() if k != "recompute"}
    smallest = None
    for cand in uniform_candidates(workload, cluster, global_batch=global_batch, fixed={**pins, "recompute": "full"},
                                   dtype=dtype, memory_reserve=memory_reserve):
        if cand.fits:
            return cand
        if smallest is None or cand.estimate.peak_memory_bytes < smallest.estimate.peak_memory_bytes:
            smallest = cand
    return smallest


def smallest_fitting_count(workload: Workload, cluster: Cluster, **kwargs) -> int | None:
    pins = {k: v for k, v in kwargs.pop("fixed").items() if k not in ("dp",)}
    count = cluster.n_gpus
    for _ in range(MAX_DOUBLINGS):
        count *= 2
        try:
            bigger = hardware.load(f"{count}x{cluster.gpu.name}", gpus_per_node=cluster.gpus_per_node)
        except ParallaxError:
            continue
        cand = _least_memory(workload, bigger, fixed=pins, **kwargs)
        if cand is not None and cand.fits:
            return count
    return None


def infeasibility_report(workload: Workload, cluster: Cluster, *, global_batch, fixed, dtype, memory_reserve) -> dict:
    kwargs = dict(global_batch=global_batch, dtype=dtype, memory_reserve=memory_reserve)
    least = _least_memory(workload, cluster, fixed=fixed, **kwargs)
    capacity = least.estimate.memory_capacity_bytes if least is not None else usable_memory_bytes(cluster, memory_reserve)
    if least is None:
        return {
            "message": f"no layout of {cluster.n_gpus} GPUs satisfies the pinned fields {fixed} for global batch {global_batch}",
            "hint": "unpin a field or change the batch so that it divides by dp * micro_batch",
            "min_memory_gib": None, "binding": None, "min_gpus": None,
        }
    peak = max(least.estimate.stages, key=lambda s: s.peak_bytes).memory_bytes
    binding = max(peak, key=peak.get)
    min_gpus = smallest_fitting_count(workload, cluster, fixed=fixed, **kwargs)
    need = least.estimate.peak_memory_bytes / GIB
    more = f"at least {min_gpus}x{cluster.gpu.name} would fit" if min_gpus else "no cluster up to 1024x larger fits"
    message = (f"{workload.name} does not fit on {cluster.spec()}: the leanest layout needs {need:.1f} GiB per GPU "
               f"and {capacity / GIB:.1f} GiB is usable; {binding} ({peak[binding] / GIB:.1f} GiB) dominates")
    est = least.estimate
    if least.fits and fixed.get("recompute", "full") != "full":  # the pinned policy is what does not fit
        pinned = fixed["recompute"]
        message = (f"{workload.name} does not fit on {cluster.spec()} with the pinned recompute={pinned}: every such "
                   f"layout needs more than the {capacity / GIB:.1f} GiB usable per GPU; with recompute=full the "
                   f"leanest layout needs {need:.1f} GiB and fits")
        more = "drop --recompute to let the search choose, or pin --recompute full"
        binding = "recompute"
    elif need <= capacity / GIB and est.host_memory_capacity_bytes is not None:  # it fits the GPUs, not the hosts
        binding = "host_memory"
        message = (f"{workload.name} does not fit on {cluster.spec()}: offloaded ({need:.1f} GiB per GPU), its states "
                   f"need {est.host_memory_bytes / 1e9:.0f} GB of host memory per node and "
                   f"{est.host_memory_capacity_bytes / 1e9:.0f} GB is usable (node.host_memory_gb)")
    return {
        "message": message,
        "hint": more,
        "min_memory_gib": need,
        "usable_gib": capacity / GIB,
        "binding": binding,
        "min_gpus": min_gpus,
    }
