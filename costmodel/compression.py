"""Cost of a compressed data-parallel gradient reduction: wire bytes and kernels.

Each method is priced as its collective on the compressed payload plus the
memory-bound passes that compress and decompress the gradient (at the GPU's
HBM bandwidth times its memory-bound efficiency):

- fp16 / bf16: all-reduce of 2-byte gradients; a cast before and after when
  the gradients are wider (no gain at all when they are already 16-bit).
- int8: all-reduce of 1-byte values (1/4 of fp32, 1/2 of bf16 gradients), run
  as a quantised reduce-scatter then all-gather (each rank dequantises and
  sums its chunk, requantises the result); the per-chunk fp32 scales are
  negligible. Error feedback reads and writes a residual per parameter.
- topk: every rank sends its k*N largest entries (value + int32 index), so
  the reduction is an all-gather of dp * k * N * (value + 4) bytes, which grows
  with the data-parallel degree, unlike an all-reduce.
- powersgd: all-reduce of the rank-r factors P and Q; priced as a fraction
  of the gradient as if on 4096 x 4096 matrices (rank r: 2 * r * 4096 /
  4096**2 = r/2048, 1/512 at the default rank 4) plus its matmul and
  error-feedback passes.

k and r are the plan's `topk_fraction` and `powersgd_rank` (`plan_reduction_time`
takes them from the plan); the keyword defaults are the plan's defaults.

The executor's hooks (executor/apply/compression.py) implement exactly these
collectives; `wire_bytes_per_rank` is what they count.
"""
from __future__ import annotations

from hardware.schema import Cluster

from . import collectives as coll
from .compute import memory_bandwidth
from .memory import WEIGHT_BYTES, reduce_bytes
from layout.axes import COMPRESSION
from layout.plan import DEFAULT_POWERSGD_RANK, DEFAULT_TOPK_FRACTION, Plan

TOPK_INDEX_BYTES = 4  # int32 indices
POWERSGD_RANK = DEFAULT_POWERSGD_RANK
POWERSGD_MATRIX_SIDE = 4096  # PowerSGD is priced as if every gradient were a square matrix of this side
LOSSY = ("int8", "topk", "powersgd")
METHODS = COMPRESSION  # the compression axis's values (layout.axes)

# Bytes read + written per gradient element by the compress and decompress kernels,
# as a function of the gradient's element size g (and, for Top-K, its payload).
# int8: compress reads g + residual, writes residual + q (3g + 1); the chunk owner
# reads the dp int8 chunks (1 per element overall) and writes the sum (g), requantises
# (g + 1); the receiver dequantises (1 + g): 6g + 4.
TOPK_SELECT_PASSES = 4  # radix select reads the gradient a few times


def compute_bytes_per_element(method: str, grad_bytes: int, dp: int = 1, topk_fraction: float = DEFAULT_TOPK_FRACTION) -> float:
    """Memory traffic of compressing and decompressing one gradient element."""
    g = grad_bytes
    if method in ("none",):
        return 0.0
    if method in ("fp16", "bf16"):
        return 0.0 if g <= 2 else 2 * (g + 2)  # cast down, cast back
    if method == "int8":
        return 6 * g + 4
    if method == "topk":
        payload = topk_fraction * (g + TOPK_INDEX_BYTES)
        # residual read/write + select, payload write; zero-fill + scatter of dp payloads + read back
        return 3 * g + TOPK_SELECT_PASSES * g + payload + 2 * g + dp * payload
    if method == "powersgd":
        return 5 * g  # M.Q and M^T.P read the gradient twice, error feedback, write back
    raise ValueError(f"unknown compression {method!r}")


def powersgd_wire_fraction(rank: int = DEFAULT_POWERSGD_RANK) -> float:
    """(m + n) * r / (m * n) for m = n = POWERSGD_MATRIX_SIDE: the factors' share of the gradient."""
    return 2 * rank / POWERSGD_MATRIX_SIDE


def wire_element_bytes(method: str, grad_bytes: int, powersgd_rank: int = DEFAULT_POWERSGD_RANK) -> float:
    """Bytes per gradient element of what the all-reduce carries (not Top-K)."""
    return {"none": grad_bytes, "fp16": 2, "bf16": 2, "int8": 1,
            "powersgd": grad_bytes * powersgd_wire_fraction(powersgd_rank)}[method]


def reduction_element_bytes(plan: Plan) -> float:
    """Bytes per gradient element of an all-reduce that moves the same traffic
    as the plan's gradient reduction. Top-K all-gathers dp*k*(value + index)
    per element, and a ring all-gather of T bytes moves what a ring all-reduce
    of T/2 does. Without DDP hooks (ZeRO >= 1) gradients travel uncompressed."""
    grad_bytes = reduce_bytes(plan)
    if plan.zero >= 1 or plan.compression == "none":
        return grad_bytes
    if plan.compression == "topk":
        return topk_gathered_bytes(1.0, plan.data_parallel, grad_bytes, plan.topk_fraction) / 2
    return wire_element_bytes(plan.compression, grad_bytes, plan.powersgd_rank)


def topk_gathered_bytes(params: float, dp: int, grad_bytes: int, topk_fraction: float = DEFAULT_TOPK_FRACTION) -> float:
    """Size of the all-gathered Top-K payload: dp ranks x k*N x (value + index)."""
    return dp * topk_fraction * params * (grad_bytes + TOPK_INDEX_BYTES)


def wire_bytes_per_rank(method: str, params: float, dp: int, grad_bytes: int,
                        topk_fraction: float = DEFAULT_TOPK_FRACTION,
                        powersgd_rank: int = DEFAULT_POWERSGD_RANK) -> float:
    """Bytes one rank sends in a ring implementation (what the executor's hooks count)."""
    if dp <= 1:
        return 0.0
    if method == "topk":
        return (dp - 1) / dp * topk_gathered_bytes(params, dp, grad_bytes, topk_fraction)
    return 2 * (dp - 1) / dp * params * wire_element_bytes(method, grad_bytes, powersgd_rank)


def compression_compute_time(method: str, params: float, dtype: str, dp: int, cluster: Cluster,
                             topk_fraction: float = DEFAULT_TOPK_FRACTION) -> float:
    gpu = cluster.gpu
    traffic = params * compute_bytes_per_element(method, WEIGHT_BYTES[dtype], dp, topk_fraction)
    return traffic / memory_bandwidth(gpu)


def compressed_reduction_time(params: float, method: str, dtype: str, group: coll.Group, cluster: Cluster,
                              topk_fraction: float = DEFAULT_TOPK_FRACTION,
                              powersgd_rank: int = DEFAULT_POWERSGD_RANK) -> float:
    """Once-per-step DDP (ZeRO-0) gradient reduction of `params` parameters with `method`."""
    if group.size <= 1:
        return 0.0
    g = WEIGHT_BYTES[dtype]
    if method == "topk":
        comm = coll.all_gather(topk_gathered_bytes(params, group.size, g, topk_fraction), group, cluster)
    else:
        comm = coll.all_reduce(params * wire_element_bytes(method, g, powersgd_rank), group, cluster)
    return comm + compression_compute_time(method, params, dtype, group.size, cluster, topk_fraction)


def plan_reduction_time(params: float, plan: Plan, group: coll.Group, cluster: Cluster) -> float:
    """`compressed_reduction_time` of `plan.compression` with the plan's own k and PowerSGD rank."""
    return compressed_reduction_time(params, plan.compression, plan.dtype, group, cluster,
                                     topk_fraction=plan.topk_fraction, powersgd_rank=plan.powersgd_rank)
