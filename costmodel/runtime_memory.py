"""Device memory a rank holds beyond what its tensors and the allocator's caching account for:
the CUDA context, cuBLAS's cached workspaces and the collective library's buffers, one set per
communicator the executor's mesh runs collectives on.

Why: these are fixed costs of a layout, not a share of the GPU. A plan with TP, pipeline and
HSDP groups opens more communicators than a plain FSDP plan, and each holds its buffers whether
or not its collective is large; nvidia-smi counts them, torch's statistics do not.
Figures are the hardware's data (`hardware.schema.RuntimeMemory`, `CommunicatorMemory`).
"""
from __future__ import annotations

from hardware.schema import Cluster
from layout.layout import Layout


def communicators(layout: Layout, tied_across_stages: bool = False) -> dict[str, int]:
    """The process groups of more than one rank a rank of `layout` holds, with their sizes, as
    `executor/runtime/mesh.py` creates them: the world; one per mesh dimension ("pp", "dp",
    "tp"), a dimension spanning the world reusing its group; each 2-D view of "dp" that context
    parallelism ("dp_only", "cp") and expert parallelism ("edp", "ep") unflatten; HSDP's view
    ("dp_replicate", "dp_shard"); a second group of a 2-D view's inner size where FSDP2 shards
    over that view (HSDP's shard and the experts' ep dimension: torch 2.13 creates it); and, for a
    pipeline, the group of the two stages holding tied weights (`executor/apply/tied.py`).
    tests/test_dry_run.py holds this to the groups a fake world creates."""
    world = layout.n_gpus
    groups = {"world": world}
    for name, size in (("pp", layout.pp), ("dp", layout.data_parallel), ("tp", layout.tp)):
        if size != world:
            groups[name] = size
    if layout.zero >= 2 and layout.dp_replicate > 1 and layout.shard_degree > 1:
        groups.update(dp_replicate=layout.dp_replicate, dp_shard=layout.shard_degree, dp_shard_flat=layout.shard_degree)
    if layout.cp > 1:
        groups.update(dp_only=layout.dp, cp=layout.cp)
    if layout.ep > 1:
        groups.update(edp=layout.data_parallel // layout.ep, ep=layout.ep, ep_flat=layout.ep)
    if tied_across_stages and layout.pp > 1:
        groups["tied"] = 2
    return {name: size for name, size in groups.items() if size > 1}


def runtime_memory_bytes(layout: Layout | None, cluster: Cluster, tied_across_stages: bool = False) -> dict[str, float]:
    """Per rank, by kind: the CUDA context, cuBLAS workspaces, and the collective library's
    buffers for each communicator of `layout` (None: the layout-free part, a bound for every
    layout). Empty where the profile states none (CPU ranks)."""
    out = dict(cluster.gpu.runtime_memory.bytes()) if cluster.gpu.runtime_memory else {}
    library = cluster.collectives.memory if cluster.collectives else None
    if layout is not None and library is not None and cluster.gpu.device_type == "cuda":
        n = len(communicators(layout, tied_across_stages))
        if n:
            out["nccl"] = n * library.bytes_per_communicator()
    return out
