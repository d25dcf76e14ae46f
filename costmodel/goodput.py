"""Goodput under failures: checkpoint cost, restart cost and the optimal interval.

A job on n GPUs, each failing independently with mean time between failures
`mtbf_hours` (hardware data), fails with rate n / MTBF, i.e. its mean time
between failures is M = MTBF / n. It checkpoints every tau seconds of
computation, each checkpoint taking delta seconds to write, and a failure
costs R seconds to restart (detect, reschedule, reload) plus the work since
the last checkpoint.

- Young (1974): the interval that minimises the lost time is
  tau_opt = sqrt(2 * delta * M).
- Daly (2006), "A higher order estimate of the optimum checkpoint interval
  for restart dumps", FGCS 22: with exponentially distributed failures the
  expected wall time of T_s seconds of work is
  T_w = M * exp(R / M) * (exp((tau + delta) / M) - 1) * T_s / tau,
  so goodput = T_s / T_w = tau / (M e^{R/M} (e^{(tau+delta)/M} - 1)); his
  higher-order optimum is sqrt(2 delta M) (1 + sqrt(delta/(2M))/3 + delta/(18 M)) - delta.
  To first order goodput ~ 1 - delta/tau - (R + (tau + delta)/2) / M.

The checkpoint's write time is its bytes over the job's storage bandwidth: the
profile's sourced `storage_gbps_per_node` times the nodes (each node writes its
ranks' DCP shards in parallel).

Checkpoint size is the model state that resumes training: 16-bit weights
plus fp32 master weights and the two Adam moments (2 + 12 bytes per
parameter in mixed precision, 4 + 8 in fp32); gradients are not saved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


from hardware.errors import ParallaxError
from hardware.schema import Cluster

from layout.results import CheckpointAdvice

from .memory import FP8_WEIGHT_COPY_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES, plan_state_bytes

# Aggregate checkpoint write bandwidth. Llama 3 paper (Dubey et al. 2024, sec. 3.3.1):
# Meta's Tectonic storage for the 16K-H100 training "offers 240 PB of storage out of
# 7,500 servers equipped with SSD, and supports a sustainable throughput of 2 TB/s and
# a peak throughput of 7 TB/s". The sustained figure is the default; pass your own.
DEFAULT_STORAGE_GBPS = 2000.0  # GB/s, aggregate over the job
DEFAULT_STORAGE_SOURCE = "Llama 3 paper (Dubey et al. 2024, sec. 3.3.1): Tectonic storage sustains 2 TB/s"
# Restart time: an assumption, not a measurement - detecting the failure, rescheduling
# (and swapping the bad node), restarting the processes and reloading the checkpoint.
DEFAULT_RESTART_S = 600.0
DEFAULT_RESTART_SOURCE = "assumption: 10 min to detect, reschedule, relaunch and reload; pass restart_s"


def checkpoint_bytes(params: float, dtype: str = "bf16", per_param: float | None = None) -> float:
    """Weights and optimizer state of `params` parameters (what a resume needs); `per_param`:
    a plan's own bytes (`plan_checkpoint_bytes`), else a 16-bit copy beside fp32 master and moments."""
    return params * (per_param if per_param is not None else WEIGHT_BYTES[dtype] + OPTIMIZER_BYTES[dtype])


def plan_checkpoint_bytes(plan) -> float:
    """Bytes per parameter a plan's checkpoint holds: its weights (not FP8's cast) and optimizer
    state under its precision policy (12 with fp32 weights and moments on the eager stack, 6 in bf16)."""
    weights, _, optimizer = plan_state_bytes(plan)
    cast_copy = plan.stack == "fused" and plan.dtype == "fp8" and not plan.fp8_param_gather
    return weights - (FP8_WEIGHT_COPY_BYTES if cast_copy else 0) + optimizer


def young_interval(write_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints: sqrt(2 * delta * M)."""
    return math.sqrt(2 * write_s * mtbf_s)


def daly_interval(write_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (valid for delta < 2M; M beyond that)."""
    if write_s >= 2 * mtbf_s:
        return mtbf_s
    r = write_s / (2 * mtbf_s)
    return math.sqrt(2 * write_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - write_s


def expected_goodput(interval_s: float, write_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly's exponential model: useful compute / expected wall time."""
    if interval_s <= 0:
        raise ParallaxError("checkpoint interval", f"must be positive, got {interval_s}")
    if math.isinf(mtbf_s):
        return interval_s / (interval_s + write_s)
    x = (interval_s + write_s) / mtbf_s
    return interval_s / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(x))


def first_order_goodput(interval_s: float, write_s: float, restart_s: float, mtbf_s: float) -> float:
    """1 - delta/tau - (R + (tau + delta)/2) / M: checkpoint overhead plus expected loss per failure."""
    return 1 - write_s / interval_s - (restart_s + (interval_s + write_s) / 2) / mtbf_s


@dataclass(frozen=True)
class Goodput:
    n_gpus: int
    gpu_mtbf_hours: float
    job_mtbf_s: float
    checkpoint_bytes: float
    write_s: float
    restart_s: float
    interval_s: float  # the interval the goodput is given for
    optimal_interval_s: float  # Young
    daly_interval_s: float
    goodput: float
    failures_per_day: float
    sources: dict

    def steps_between(self, step_time_s: float) -> int:
        """The optimal interval rounded to whole training steps (at least 1)."""
        return max(1, round(self.optimal_interval_s / step_time_s))


def goodput(params: float, cluster: Cluster, *, dtype: str = "bf16", storage_gbps: float | None = None,
            restart_s: float | None = None, interval_s: float | None = None,
            mtbf_hours: float | None = None, per_param: float | None = None) -> Goodput:
    """Expected goodput of training `params` parameters on `cluster`, at `interval_s` (default: Young's optimum)."""
    per_gpu = mtbf_hours if mtbf_hours is not None else cluster.gpu.mtbf_hours
    if per_gpu is None:
        raise ParallaxError("mtbf_hours", f"no MTBF is known for {cluster.gpu.name}", "pass mtbf_hours or add it to the profile")
    sources = {
        "mtbf_hours": cluster.gpu.sources.get("mtbf_hours", "user") if mtbf_hours is None else "user",
        "storage_gbps": DEFAULT_STORAGE_SOURCE if storage_gbps is None else "user",
        "restart_s": DEFAULT_RESTART_SOURCE if restart_s is None else "user",
    }
    if storage_gbps is None and cluster.storage_gbps_per_node is not None:
        storage_gbps = cluster.storage_gbps_per_node * cluster.n_nodes
        sources["storage_gbps"] = f"{cluster.n_nodes} nodes x {cluster.storage_gbps_per_node:g} GB/s: " + \
            cluster.sources.get("storage_gbps_per_node", "profile")
    storage = DEFAULT_STORAGE_GBPS if storage_gbps is None else storage_gbps
    restart = DEFAULT_RESTART_S if restart_s is None else restart_s
    if storage <= 0 or restart < 0:
        raise ParallaxError("storage_gbps/restart_s", "storage bandwidth must be positive and restart time non-negative")
    n = cluster.n_gpus
    mtbf_s = per_gpu * 3600 / n
    size = checkpoint_bytes(params, dtype, per_param)
    write = size / (storage * 1e9)
    young = young_interval(write, mtbf_s)
    tau = young if interval_s is None else interval_s
    return Goodput(n_gpus=n, gpu_mtbf_hours=per_gpu, job_mtbf_s=mtbf_s, checkpoint_bytes=size, write_s=write,
                   restart_s=restart, interval_s=tau, optimal_interval_s=young, daly_interval_s=daly_interval(write, mtbf_s),
                   goodput=expected_goodput(tau, write, restart, mtbf_s), failures_per_day=86400 / mtbf_s, sources=sources)


def checkpoint_advice(params: float, cluster: Cluster, step_time_s: float, *, dtype: str = "bf16",
                      mtbf_hours: float | None = None, per_param: float | None = None) -> CheckpointAdvice | None:
    """Young's interval in whole steps of `step_time_s`, and Daly's goodput there; None
    when the profile states no MTBF and none is given."""
    if mtbf_hours is None and cluster.gpu.mtbf_hours is None:
        return None
    g = goodput(params, cluster, dtype=dtype, mtbf_hours=mtbf_hours, per_param=per_param)
    steps = g.steps_between(step_time_s)
    at = expected_goodput(steps * step_time_s, g.write_s, g.restart_s, g.job_mtbf_s)
    return CheckpointAdvice(every_steps=steps, interval_s=steps * step_time_s, goodput=at, write_s=g.write_s,
                            job_mtbf_s=g.job_mtbf_s, gpu_mtbf_hours=g.gpu_mtbf_hours, sources=g.sources)


