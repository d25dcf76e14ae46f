"""Turning what a user hands over into what the planner prices: hardware as a spec string
or a `Cluster`, a model in any form tracing understands (built-in name, config path,
cached HF id, HuggingFace config, ONNX path, nn.Module, or a ready `Workload`), and the
checks on the request's numbers.
"""
from __future__ import annotations

from typing import Any

import hardware
from costmodel.workload import Workload
from hardware.schema import Cluster



def resolve_hardware(hw, **overrides):
    """A `Cluster`, or a `hardware.mixed.MixedCluster` for a mixed spec ("16xa100-80g+8xh100-sxm")."""
    from hardware.mixed import MixedCluster, load_mixed

    if isinstance(hw, (Cluster, MixedCluster)) and not any(v is not None for v in overrides.values()):
        return hw
    if isinstance(hw, str) and "+" in hw:
        return load_mixed(hw)
    return hardware.load(hw, **overrides)


def resolve_workload(model: Any, *, seq_len: int, dtype: str, example_inputs: Any = None, cluster=None) -> Workload:
    """The model's Workload; with `cluster`, its attention on the path that hardware runs
    (`costmodel.attention.for_device`)."""
    workload = _traced(model, seq_len=seq_len, dtype=dtype, example_inputs=example_inputs)
    return for_hardware(workload, cluster) if cluster is not None else workload


def for_hardware(workload: Workload, cluster) -> Workload:
    """`workload` priced as `cluster`'s GPUs run its attention (each group's, on a mixed cluster)."""
    from costmodel.attention import for_device
    from hardware.mixed import MixedCluster

    gpus = [g.gpu for g in cluster.groups] if isinstance(cluster, MixedCluster) else [cluster.gpu]
    return for_device(workload, gpus)


def _traced(model: Any, *, seq_len: int, dtype: str, example_inputs: Any = None) -> Workload:
    if isinstance(model, Workload):
        return model

    def trace() -> Workload:  # imported here: a cached workload needs no tracer (networkx, torch)
        from planner.trace.workload_for import workload_for

        return workload_for(model, seq_len=seq_len, dtype=dtype, example_inputs=example_inputs)[0]

    if isinstance(model, str) and not model.endswith(".onnx"):
        from planner.trace.cache import cached_workload

        return cached_workload(model, seq_len, "bf16" if dtype == "fp8" else dtype, trace)
    return trace()


def model_name(model: Any, workload: Workload) -> str:
    return model if isinstance(model, str) else workload.name
