"""One validated DeviceMesh per plan, the same code path on GPU and CPU.

The mesh's dimensions are ("pp", "dp", "tp"): TP innermost, so the ranks that
exchange activations every layer are neighbours (same node, fastest links),
and PP outermost, so only point-to-point stage traffic crosses the widest gap.
Hybrid sharding unflattens "dp" into (dp_replicate, dp_shard), shard innermost
(`hsdp_mesh`), the order the cost model places its groups in.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from layout.plan import Plan
from layout.rules import check_world

MESH_DIMS = ("pp", "dp", "tp")


def device_and_backend() -> tuple[str, str]:
    """Pick the accelerator if there is one; gloo on CPU otherwise. On a GPU, gloo beside NCCL
    carries the few CPU tensors a run reduces (timings agreed across ranks), which NCCL refuses."""
    if torch.cuda.is_available():
        return "cuda", "cpu:gloo,cuda:nccl"
    return "cpu", "gloo"


# torch's caching allocator as a rank runs it: one growing segment per pool and stream, so freed
# blocks of different sizes merge (the dry run's allocator replay prices this setting)
ALLOCATOR_SETTINGS = "expandable_segments:True"


def local_device() -> torch.device:
    """The device this rank computes on (its own GPU under torchrun's LOCAL_RANK), its caching
    allocator set as the plan's memory is judged (`ALLOCATOR_SETTINGS`)."""
    kind, _ = device_and_backend()
    if kind == "cuda":
        torch.cuda.memory._set_allocator_settings(ALLOCATOR_SETTINGS)
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(timeout_s: float = 120.0, init_method: str | None = None,
                     rank: int | None = None, world_size: int | None = None) -> None:
    """Start the default process group unless one exists; a timeout makes a hung peer visible."""
    if dist.is_initialized():
        return
    _, backend = device_and_backend()
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group(backend, **kwargs)


def build_mesh(plan: Plan) -> DeviceMesh:
    """The (pp, dp, tp) mesh of `plan`, "dp" holding all dp x cp data-parallel ranks (context
    parallelism unflattens it, executor/apply/context_parallel.py); the degrees multiply to the world size."""
    world = dist.get_world_size()
    check_world(plan, world, "processes run", f"launch {plan.n_gpus} processes or change the degrees")
    kind, _ = device_and_backend()
    return init_device_mesh(kind, (plan.pp, plan.data_parallel, plan.tp), mesh_dim_names=MESH_DIMS)


def dp_view(mesh: DeviceMesh, sizes: tuple[int, int], names: tuple[str, str]) -> DeviceMesh:
    """A 2-D view of the dp dimension, built once per mesh: every `_unflatten` creates new
    process groups (a collective), and HSDP, CP and EP each ask for theirs more than once."""
    views = mesh.__dict__.setdefault("_parallax_dp_views", {})
    if (sizes, names) not in views:
        views[(sizes, names)] = mesh["dp"]._unflatten(0, sizes, names)
    return views[(sizes, names)]


def hsdp_mesh(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The 2-D (dp_replicate, dp_shard) view of the dp dimension that FSDP2 takes for HSDP."""
    return dp_view(mesh, (plan.dp_replicate, plan.shard_degree), ("dp_replicate", "dp_shard"))


def coords(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's coordinate along each mesh dimension."""
    return {name: mesh.get_local_rank(name) for name in MESH_DIMS}
