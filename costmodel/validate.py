"""Checks that a plan (solved or hand-written) fits its model and cluster."""
from __future__ import annotations

from hardware.errors import PlanError
from hardware.schema import Cluster
from layout.axes import TP_DEGREES
from layout.rules import check_world

from layout.plan import Plan
from .workload import Workload


FP8_GPUS = "h100-sxm, h200, b200 or mi300x"


def check_fp8(cluster: Cluster, field: str, needs: str, otherwise: str) -> None:
    """FP8 (GEMMs, a KV cache) needs a GPU whose profile has an FP8 peak (Hopper and later, MI300X)."""
    if "fp8" not in cluster.gpu.peak_tflops:
        raise PlanError(field, f"{needs}, and {cluster.gpu.name} has no fp8 peak in its profile",
                        f"use {otherwise}, or a GPU with an FP8 peak such as {FP8_GPUS}")


def check_dtype(dtype: str, cluster: Cluster) -> None:
    if dtype == "fp8":
        check_fp8(cluster, "dtype", "fp8 needs FP8 GEMMs", "bf16")


def default_dtype(cluster: Cluster) -> tuple[str, str]:
    """bf16, unless the profile's bf16 matmuls are no faster than its fp32 ones (CPUs without
    native bf16 units run them tens of times slower): then fp32, and the reason."""
    peaks = cluster.gpu.peak_tflops
    half, full = peaks.get("bf16"), peaks.get("fp32")
    if half is None or full is None or half > full:
        return "bf16", ""
    return "fp32", (f"dtype fp32: {cluster.gpu.name}'s bf16 matmuls ({half:.3g} TFLOP/s) are no faster than its fp32 "
                    f"ones ({full:.3g} TFLOP/s); pass --dtype bf16 to plan bf16 anyway")


def check_plan(plan: Plan, workload: Workload, cluster: Cluster) -> None:
    """Raise PlanError naming the first field that does not fit."""
    check_dtype(plan.dtype, cluster)
    if workload.seq_len != plan.seq_len:  # memory would be priced at one length and tokens/s at the other
        raise PlanError("seq_len", f"the plan's {plan.seq_len} tokens differ from the {workload.seq_len} {workload.name} "
                        "was traced at", "trace the model at the plan's sequence length")
    check_world(plan, cluster.n_gpus, "GPUs on the hardware", "make the degrees multiply to the GPU count")
    if plan.stages[-1].end != workload.n_layers:
        raise PlanError(
            "stages",
            f"the last stage ends at layer {plan.stages[-1].end} but {workload.name} has {workload.n_layers} layers",
            f"end the last stage at {workload.n_layers}",
        )
    if not workload.tp_divides(plan.tp):
        valid = [t for t in TP_DEGREES if workload.tp_divides(t)]
        raise PlanError("tp", f"tp={plan.tp} does not divide the attention heads ({workload.heads})", f"use one of {valid}")
    if plan.tp > 1 and not plan.sp and plan.tp > cluster.n_gpus:
        raise PlanError("tp", f"tp={plan.tp} exceeds the {cluster.n_gpus} GPUs", "lower tp")
