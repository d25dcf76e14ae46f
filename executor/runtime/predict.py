"""The run report's prediction: the planner's estimate of the plan that ran.

The model is priced through the same door as `parallax plan` and `parallax
estimate` (`planner.api.estimate`), with the workload traced from the same
catalog entry or module that the workers build, on the plan's own hardware
(its embedded profile, or its catalog spec) unless the caller names another.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from layout.plan import Plan
from hardware.errors import ParallaxError
from hardware.mixed import MixedCluster
from planner.trace.models.catalog import list_models


def _traceable(model_name: str, trust_module: bool = False):
    """A catalog name as it is; any other model as the module the workers build."""
    if model_name in list_models():
        return model_name
    from executor.runtime.models import HFStage, build_model

    module = build_model(model_name, trust_module=trust_module)
    return module.model if isinstance(module, HFStage) else module


def _model_and_inputs(plan: Plan, model_name: str, trust_module: bool = False):
    """What the planner traces for `model_name`, and the example inputs a module needs."""
    model = _traceable(model_name, trust_module)
    return model, None if isinstance(model, str) else (torch.zeros(1, plan.seq_len, dtype=torch.long),)


def workload_of(plan: Plan, model_name: str, cluster=None, trust_module: bool = False):
    """The traced workload of the model the workers build, as the planner prices it on `cluster`."""
    from planner.resolve import resolve_workload

    model, inputs = _model_and_inputs(plan, model_name, trust_module)
    return resolve_workload(model, seq_len=plan.seq_len, dtype=plan.dtype, example_inputs=inputs, cluster=cluster)


def estimate_of(plan: Plan, model_name: str, cluster=None, trust_module: bool = False):
    """The planner's Estimate of `plan` for the model the workers build (raises ParallaxError)."""
    from planner.api import estimate

    cluster = cluster if cluster is not None else plan.cluster()
    if plan.groups and not isinstance(cluster, MixedCluster):
        # a mixed plan run on one kind of hardware (`--hardware cpu.json`): its layout, every rank that kind
        plan = plan.model_copy(update={"groups": None, "hardware": cluster.spec()})
    model, inputs = _model_and_inputs(plan, model_name, trust_module)
    return estimate(model, plan, cluster, example_inputs=inputs)


class Prediction(NamedTuple):
    step_time_s: float | None
    peak_bytes: float | None  # the tensors' peak: max_memory_allocated
    reserved_bytes: float | None  # what the caching allocator holds at most: max_memory_reserved
    note: str


def predict(plan: Plan, model_name: str, cluster=None, trust_module: bool = False) -> Prediction:
    """The plan's step time and peak memory (allocated and reserved); Nones with the reason when no
    prediction is possible."""
    try:
        result = estimate_of(plan, model_name, cluster, trust_module)
    except ParallaxError as error:
        return Prediction(None, None, None, f"no prediction: {error}")
    return Prediction(result.step_time_s, result.peak_memory_bytes, result.peak_reserved_bytes, "")
