"""torch.autocast's copies of the weights, held through a step's forward and backward.

A half-precision plan whose GEMMs read fp32 master weights as they are (DDP, TP or
pipeline stages without ZeRO-2/3, a single rank) computes under
`torch.autocast`: every linear casts its weight to the compute dtype at its first use and
autocast caches that copy until its region exits, while each GEMM also saves it for its
backward. So the rank holds a compute-dtype copy of every weight a GEMM reads beside the
fp32 states from the first forward to the end of the backward, recomputed layers included
(the cache outlives the checkpoint). FSDP2's mixed-precision gather (ZeRO-2/3 over several
ranks, or offloaded) casts at the gather instead, and bf16 master weights need no cast.

Seen on one H200 (benchmarks/data/h200_gpu_runs.csv): llama-3.2-1b at 2 x 2048 tokens on one
rank held 1.8 GiB of bf16 block weights and the tied table's 0.49 GiB copy at its peak,
measured and dry-run alike.
"""
from __future__ import annotations

from .data_parallel import layer_params_on_rank
from .memory import WEIGHT_BYTES
from .workload import LayerProfile


def casts_weights_per_use(plan) -> bool:
    """Whether autocast casts the plan's weights at each use (see the module docstring)."""
    gathered_in_compute_dtype = plan.zero >= 2 and (plan.data_parallel > 1 or plan.offload)
    return (plan.dtype != "fp32" and plan.master_dtype == "fp32" and plan.stack != "fused"
            and not gathered_in_compute_dtype)


def cast_params_on_rank(layer: LayerProfile, tp: int, ep: int = 1) -> float:
    """The elements of `layer`'s weights that its GEMMs read on one rank: none of an embedding
    (a lookup, not cast), a head's own and the table it shares with a tied embedding."""
    if layer.kind == "embedding":
        return 0.0
    tied = layer.tied_params / (tp if layer.tp_shardable else 1)
    return layer_params_on_rank(layer, tp, ep) + tied


def autocast_copy_bytes(cast_params: float, plan) -> float:
    """Bytes of the compute-dtype copies of `cast_params` weight elements that the rank holds."""
    return WEIGHT_BYTES[plan.dtype] * cast_params if casts_weights_per_use(plan) else 0.0
