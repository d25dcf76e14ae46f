"""Data parallelism and ZeRO on the "dp" mesh dimension.

zero 3: FSDP2 sharding parameters, gradients and optimizer state, parameters
re-gathered for backward (offloaded: those shards in host memory, `offload_policy`); zero 2: FSDP2 keeping the gathered parameters from
forward to backward; zero 1: replicated parameters with the optimizer state
sharded by rows of every weight (executor/apply/zero_one.py); zero 0: replicated parameters. Blocks are
sharded one by one so that only one block's parameters are gathered at a time.
Hybrid sharding (`plan.dp_shard`) hands FSDP2 the 2-D (dp_replicate, dp_shard)
view of the dp dimension: states sharded inside a shard group, gradients all-reduced across the
groups once per step. ZeRO-2/3 reduce-scatter every micro-batch's gradients, or under
`accumulation` hold_unsharded hold them unsharded (a full copy, in the reduce dtype) and
reduce-scatter once, in the step's last micro-batch.

Replicated parameters go through DDP where it can hold them (one plain-tensor
module per rank under ZeRO-0, `layout.layout.Layout.reduces_through_ddp`) and
through a per-weight in-place reduction otherwise (executor/apply/gradient_reduce.py):
DTensor parameters under TP and pipeline stages, whose per-micro-batch backward
passes DDP's reducer cannot follow, and ZeRO-1, whose rows it reduce-scatters.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from layout.plan import Plan
from executor.apply.gradient_reduce import attach, reducer_of
from executor.apply.layers import LayerMap, get_or_none
from executor.apply.expert_parallel import ep_meshes, expert_parameter_names
from executor.runtime.mesh import hsdp_mesh


def apply_data_parallel(module: nn.Module, mesh: DeviceMesh, plan: Plan, lmap: LayerMap, seed: int = 0) -> nn.Module:
    """Wrap or shard `module` over the dp dimension; a no-op when dp == 1. `seed` (the run's) seeds
    the compression hooks' randomness (stochastic rounding, PowerSGD)."""
    if plan.data_parallel == 1 and not plan.offload:
        return module
    if plan.compression != "none":
        from executor.apply.compression import check_compression

        check_compression(plan)
    dp_mesh = mesh["dp"]
    if plan.zero >= 2:
        reshard = plan.zero == 3
        if plan.dp_replicate > 1:
            dp_mesh = hsdp_mesh(mesh, plan)
        if plan.ep > 1:
            expert_units(module, mesh, plan, reshard)
        kw = dict(reshard_after_forward=reshard, mp_policy=mixed_precision(plan), offload_policy=offload_policy(plan))
        for name in lmap.block_names:
            block = get_or_none(module, name)
            if block is not None and any(True for _ in block.parameters()):
                fully_shard(block, mesh=dp_mesh, **kw)
        fully_shard(module, mesh=dp_mesh, **kw)
        return module
    if not plan.reduces_through_ddp:  # DTensor weights, pipeline stages, ZeRO-1 (executor/apply/gradient_reduce.py)
        return attach(module, dp_mesh.get_group(), plan.data_parallel, rows=plan.zero == 1)
    experts = expert_parameter_names(module)
    if experts:  # reduced over their own replicas (executor/apply/expert_parallel.py), not over all of dp
        DDP._set_params_and_buffers_to_ignore_for_model(module, experts)
    # By default gradients live in DDP's buckets instead of beside them: one copy (the cost model prices either).
    ddp = DDP(module, process_group=dp_mesh.get_group(), gradient_as_bucket_view=plan.ddp_bucket_view)
    if plan.compression != "none":  # gradient compression: DDP comm hooks (executor/apply/compression.py)
        from executor.apply.compression import register_compression

        register_compression(ddp, plan, dp_mesh.get_group(), seed=seed)
    return ddp


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision(plan: Plan) -> MixedPrecisionPolicy:
    """FSDP2 gathers half-precision plans' weights in the compute dtype and reduce-scatters their
    gradients in the plan's reduce dtype, by default fp32 as torchtitan does (the collectives
    and unsharded buffers the cost model prices, `costmodel.memory.reduce_bytes`); the sharded
    weights, their gradients and AdamW's state stay in the master dtype. fp8 plans compute in
    bf16 here."""
    if plan.dtype == "fp32":
        return MixedPrecisionPolicy()
    half = torch.float16 if plan.dtype == "fp16" else torch.bfloat16
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=REDUCE_DTYPES.get(plan.reduce_dtype, torch.float32))


def cast_master_weights(module: nn.Module, plan: Plan) -> nn.Module:
    """bf16 master weights (`master_dtype`): the parameters themselves become bf16, so their
    gradients and torch AdamW's moments (made like the parameter) are bf16 too; buffers (rotary
    frequencies) keep their dtype."""
    if plan.master_dtype == "fp32" or plan.dtype == "fp32":
        return module
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point():
                param.data = param.data.to(torch.bfloat16)
    return module


def offload_policy(plan: Plan) -> OffloadPolicy:
    """FSDP2's CPUOffloadPolicy for offloaded plans: sharded states on the host, the optimizer
    stepping there. Pinned staging buffers need CUDA; on CPU ranks the same path runs unpinned."""
    if not plan.offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def expert_units(module: nn.Module, mesh: DeviceMesh, plan: Plan, reshard: bool) -> None:
    """Expert parallelism under ZeRO-2/3: each expert module its own FSDP2 unit over the ranks
    holding the same experts (edp), resharded after forward or not, so that the outer unit
    over all of dp leaves them alone. Its reduction averages over edp; the mean loss wants
    the sum over edp divided by all dp*cp ranks, so ExpertGradients scales by edp/(dp*cp) = 1/ep
    (a custom FSDP2 divide factor would be one collective less, but gloo has no PREMUL_SUM).
    Under ZeRO 0/1 ExpertGradients reduces them itself."""
    _, edp = ep_meshes(mesh, plan)
    for sub in list(module.modules()):
        names = [n for n, p in sub.named_parameters(recurse=False) if hasattr(p, "expert_parallel")]
        if not names:
            continue
        tags = {n: getattr(sub, n).expert_parallel for n in names}
        fully_shard(sub, mesh=edp, reshard_after_forward=reshard)
        for n, tag in tags.items():  # fully_shard made new (DTensor) parameters: keep the mark
            getattr(sub, n).expert_parallel = tag


def sync_context(module: nn.Module, last_micro_batch: bool, plan: Plan):
    """Skip gradient synchronisation on all but the last micro-batch of a step: DDP's and
    the per-weight reduction's whole; FSDP2's HSDP all-reduce, its reduce-scatter too where the plan holds
    the unsharded gradients (`accumulation` hold_unsharded)."""
    import contextlib

    if isinstance(module, DDP) and not last_micro_batch:
        return module.no_sync()
    if reducer_of(module) is not None:
        reducer_of(module).arm(last_micro_batch)
        return contextlib.nullcontext()
    if plan.holds_unsharded_gradients and hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(last_micro_batch)
    elif hasattr(module, "set_requires_all_reduce"):  # FSDP2 sharded: reduce-scatter always, HSDP's all-reduce once
        module.set_requires_all_reduce(last_micro_batch)
    elif hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(last_micro_batch)
    return contextlib.nullcontext()
