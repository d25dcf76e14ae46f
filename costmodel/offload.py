"""Offloaded states (FSDP2's CPUOffloadPolicy): what they cost in time and where they live.

Under offload a rank's sharded fp32 weights, their gradients and AdamW's state sit in
host memory. Every all-gather first copies the rank's shard of the unit to the device,
every reduce-scatter copies the reduced shard back, and the optimizer steps on the host
over the shard, reading and writing the states at the host's memory bandwidth (a node's
bandwidth shared by its ranks, which step at the same moment). The copies run on the
collectives' stream and hide as they do; the host step follows the backward and is not
hidden. On a CPU profile the device is the host: the states stay in the one memory the
ranks measure, and a copy runs at the memory's own bandwidth.
"""
from __future__ import annotations

from hardware.errors import PlanError
from hardware.schema import Cluster

from .memory import DTYPE_BYTES, WEIGHT_BYTES, model_state_bytes, plan_state_bytes, reduce_bytes
from layout.plan import Plan


def host_priced(cluster: Cluster) -> bool:
    """Whether the profile has the host figures offload is priced by (its link, memory, bandwidth)."""
    node = cluster.node
    return None not in (node.host_link_gbps, node.host_memory_gb, node.host_memory_gbps)


def host_bandwidths(cluster: Cluster) -> tuple[float, float]:
    """(host<->device bytes/s per GPU, host memory bytes/s per rank)."""
    node = cluster.node
    if not host_priced(cluster):
        raise PlanError("offload", f"{cluster.spec()} has no host figures (node.host_link_gbps, host_memory_gb, "
                        "host_memory_gbps) to price offload by", "add them to the profile, or plan without offload")
    return node.host_link_gbps * 1e9, node.host_memory_gbps * 1e9 / node.gpus_per_node


def host_copy_time(nbytes: float, plan: Plan, cluster: Cluster) -> float:
    """One copy between host and device of an offloaded shard (nothing without offload)."""
    if not plan.offload or nbytes <= 0:
        return 0.0
    return nbytes / host_bandwidths(cluster)[0]


# torch's AdamW on CPU tensors is its per-tensor loop (no foreach or fused CPU path by default), eight
# passes per parameter, fp32 bytes read + written: weight decay 4+4, lerp of the first moment 8+4,
# mul and addcmul of the second 4+4 and 8+4, sqrt, divide and add of the denominator 4+4 each, and
# addcdiv into the weight 12+4: 80 bytes, against the fused kernel's 28 (OPTIMIZER_TRAFFIC_BYTES).
# Calibrated CPUs measure their AdamW at 0.31-0.48 of the 28-byte bound, i.e. 58-90 bytes.
HOST_ADAMW_TRAFFIC_BYTES = 80


# That loop also allocates two fp32 temporaries per parameter (the second moment's square root and its
# quotient by the bias correction) and frees them: a tensor above glibc's mmap threshold (32 MiB at most,
# most of a model's weights) goes back to the OS on free, so each step maps and zeroes them again.
HOST_ADAMW_FRESH_BYTES = 8  # both figures count fp32 elements


def host_optimizer_seconds_per_param(plan: Plan, cluster: Cluster) -> float:
    """AdamW on the host, per parameter a rank holds (it steps its 1/shard_degree share): its
    traffic at the host's bandwidth, and its temporaries' fresh pages where the profile measured
    how fast the host maps them (every parameter counted as in a tensor above the threshold). The
    loop's tensors are the master weights' dtype, which the moments share (bf16 states: half the bytes)."""
    element_share = plan_state_bytes(plan)[0] / DTYPE_BYTES["fp32"]
    fresh = cluster.node.host_fresh_page_gbps
    fresh_s = HOST_ADAMW_FRESH_BYTES / (fresh * 1e9) if fresh else 0.0
    return element_share * (HOST_ADAMW_TRAFFIC_BYTES / host_bandwidths(cluster)[1] + fresh_s) / plan.shard_degree


def device_state_bytes(params: float, plan: Plan) -> dict[str, float]:
    """What of an offloaded rank's states stays on the device: pipelined, FSDP2 keeps a stage's
    weights gathered (in the compute dtype) and its gradients unsharded from the first
    micro-batch to the step's one reduce-scatter, upcast to the reduce dtype as they accumulate
    (`FSDPParam.to_accumulated_grad_if_needed`; the dry run of llama-3.2-1b pp2 reads fp32);
    otherwise nothing beyond the units' gather buffers, which the peak moments count."""
    if plan.pp == 1:
        return {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0}
    return {"weights": WEIGHT_BYTES[plan.dtype] * params, "gradients": reduce_bytes(plan) * params, "optimizer": 0.0}


def states_on_host(plan: Plan, cluster: Cluster) -> bool:
    """Whether offloaded states leave the device's memory: not on a CPU profile, whose device is the host.
    (`plan` may be any layout with an `offload` field, as the search's layouts.)"""
    return plan.offload and cluster.gpu.device_type != "cpu"


def host_state_bytes(params: float, plan: Plan) -> float:
    """A rank's offloaded weights, gradients and AdamW state in host memory."""
    if not plan.offload:
        return 0.0
    return sum(model_state_bytes(params, plan.dtype, 3, plan.shard_degree, plan.stack, plan_state_bytes(plan)).values())


def host_memory_per_node(rank_params: list[float], plan: Plan, cluster: Cluster) -> float:
    """Host bytes a node's ranks hold: each pipeline rank's states, times the ranks per node doing
    its share (every node holds whole pipelines' worth, or its part of one)."""
    if not plan.offload:
        return 0.0
    per_stage = [host_state_bytes(p, plan) for p in rank_params]
    ranks_per_node = cluster.gpus_per_node
    per_pp_rank = plan.n_gpus // plan.pp  # ranks that hold each pipeline rank's states
    if per_pp_rank >= ranks_per_node:
        return max(per_stage) * ranks_per_node
    stages_per_node = max(1, ranks_per_node // per_pp_rank)
    return max(sum(per_stage[i:i + stages_per_node]) for i in range(0, plan.pp, stages_per_node)) * per_pp_rank
