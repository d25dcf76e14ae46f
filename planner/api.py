"""`plan` and `estimate`: the public entry points of Parallax.

Both accept a model in any form tracing understands (built-in name,
HuggingFace config, ONNX path, nn.Module with example inputs, or a ready
`Workload`) and hardware as a spec string or a `Cluster`. One door for every
cluster: a mixed spec (`16xa100-80g+8xh100-sxm`) is planned by the
mixed-cluster search (`planner.mixed`), any other by the uniform one.
"""
from __future__ import annotations

from typing import Any

from costmodel.terms import DEFAULT_MEMORY_RESERVE
from costmodel.estimate import estimate as price_plan
from layout.plan import Plan
from layout.results import Estimate
from hardware.errors import PlanError
from hardware.mixed import MixedCluster
from hardware.schema import Cluster

from planner.resolve import resolve_hardware, resolve_workload
from planner.request import PlanRequest
from planner.uniform import plan_uniform


def is_mixed(hw: Any) -> bool:
    """A cluster of several GPU types: a MixedCluster, or a spec joining parts with '+'."""
    return isinstance(hw, MixedCluster) or (isinstance(hw, str) and "+" in hw)


def plan(model: Any, hw: str | Cluster | MixedCluster, request: PlanRequest | None = None, *,
         example_inputs: Any = None, **options: Any) -> Plan:
    """The fastest (or cheapest per token) layout that fits (see `planner.uniform.plan_uniform`);
    on a mixed cluster the fastest of the heterogeneity-aware layouts and every single-group
    subset's plan (`planner.mixed.search.plan_mixed`), a Plan whose groups place it.

    What is asked is a `PlanRequest`, given whole or as its fields' keywords
    (`global_batch=1024, seq_len=8192, fixed={"tp": 8}`; keywords beside a request replace
    its fields); `example_inputs` go with an nn.Module."""
    request = PlanRequest.of(**{**(request.model_dump() if request else {}), **options})
    if not is_mixed(hw):
        return plan_uniform(model, hw, request, example_inputs=example_inputs)
    unsupported = {"fixed": request.fixed, "objective": request.objective != "time" and request.objective,
                   "price_per_gpu_hour": request.price_per_gpu_hour, "allow_compression": request.allow_compression,
                   "example_inputs": example_inputs is not None}
    for field, value in unsupported.items():
        if value:
            what = f"pinning {', '.join(sorted(request.fixed))}" if field == "fixed" else field
            raise PlanError(field, f"{what} is not offered on mixed clusters yet",
                            "plan the mixed cluster without it, or one GPU type")
    from planner.mixed.search import plan_mixed

    return plan_mixed(model, hw, request)


def estimate(model: Any, plan_: Plan, hw: str | Cluster | None = None, *, example_inputs: Any = None,
             memory_reserve: float = DEFAULT_MEMORY_RESERVE) -> Estimate:
    """Price a given plan (hand-written or solved) without searching."""
    cluster = resolve_hardware(hw) if hw is not None else plan_.cluster()
    workload = resolve_workload(model, seq_len=plan_.seq_len, dtype=plan_.dtype, example_inputs=example_inputs,
                                cluster=cluster)
    return price_plan(workload, plan_, cluster, memory_reserve=memory_reserve)
