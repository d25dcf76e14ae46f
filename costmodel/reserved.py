"""What torch's caching allocator reserves at a rank's peak beyond the tensors the peak holds:
the figure `torch.cuda.max_memory_reserved()` reads, and the one a run dies on.

Why: the estimate's moments (`peak.peak_moments`) count live tensors, which is what
`max_memory_allocated()` reads. The allocator keeps every block it frees, and a block serves
only requests no larger than itself, on its own stream. The dry run's replay of llama-3-8b's
allocations (executor.measure.dry_run through costmodel.allocator, expandable segments) shows
what lies reserved and free at the peak, the loss; three mechanisms account for it:
- **A layer's own slack** (`LayerProfile.act_allocator_slack`, replayed from its traced ops):
  the loss frees its 16-bit logits once it has upcast them, and the fp32 tensors that follow
  are too large for that block.
- **The root unit's gathered weights** under ZeRO-3: gathered at the forward's start, below
  every activation, and freed when the root's forward ends, just before the loss. The loss's
  tensors, larger, cannot take that block.
- **FSDP2's all-gather stream**: each unit's all-gather output is allocated on a stream of its
  own and freed after its copy-out, and what that stream frees serves no other stream. Its pool
  holds the largest two outputs alive at once: the root's and the first block's prefetched
  beside it (or two blocks').
Reserved memory never shrinks without memory pressure, so the peak reservation is the largest,
over the moments, of each moment's tensors and the blocks then cached. CPU ranks have no caching
allocator: there it is the tensors' peak.

The search holds this reservation, not the tensors' peak, to the GPU's memory less the runtime's
(`terms.usable_memory_bytes`): the headroom is the fragmentation predicted, not a flat share.
"""
from __future__ import annotations

from hardware import Cluster
from layout.plan import Plan

from .memory import WEIGHT_BYTES, transient_split
from .workload import LayerProfile


def allocator_slack_bytes(layer: LayerProfile, *, tp: int, sp: bool, micro_batch: float, **_) -> float:
    """The layer's own slack on one TP rank, split as its temporaries are (`memory.transient_bytes`)."""
    return layer.act_allocator_slack / transient_split(layer, tp, sp) * micro_batch


def all_gather_pool_bytes(plan: Plan, root_params: float, block_params: float) -> float:
    """FSDP2's all-gather stream's reservation: the root unit's output beside the first block's
    (or two blocks'), in the compute dtype; nothing where FSDP2 gathers nothing."""
    if not plan.gathers_weights:
        return 0.0
    return WEIGHT_BYTES[plan.dtype] * (max(root_params, block_params) + block_params)


def root_hole_bytes(plan: Plan, root_params: float, loss_temporaries: float, sharded: bool) -> float:
    """The root unit's gathered weights, freed before the loss under ZeRO-3: a hole the loss's
    temporaries are too large to fill (none where they are smaller: they would reuse it)."""
    hole = WEIGHT_BYTES[plan.dtype] * root_params if sharded else 0.0
    return hole if loss_temporaries >= hole else 0.0


def caches_blocks(cluster: Cluster) -> bool:
    """Whether the ranks allocate through torch's CUDA caching allocator (not a CPU's malloc)."""
    return cluster.gpu.device_type == "cuda"


def moment_slacks(end_slack: float, block_slack: float, hole: float) -> list[float]:
    """What lies cached beside each of `memory.activation_moments`' moments, in its order (the loss,
    the root unit's backward, a block's backward): the last layers' own slack and the root's hole
    at the loss (both reused by the backward after it), a block's own slack at its backward."""
    return [end_slack + hole, 0.0, block_slack]


def peak_reserved_bytes(totals: list[float], slacks: list[float], stepping: float, pool: float) -> float:
    """The largest, over the moments (`totals`, each with the `slacks` cached beside it, and the
    optimizer step's `stepping`), of what the default stream's pool holds, with the all-gather
    stream's `pool` beside every one."""
    return max(max(t + s for t, s in zip(totals, slacks)), stepping) + pool
