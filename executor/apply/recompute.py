"""Activation checkpointing per layer, as the plan's recompute policies say.

The composable `checkpoint` keeps parameter names intact (unlike a wrapper
module), so FSDP, pipeline cuts and comparisons see the same names. "selective"
saves matmul outputs (expensive to recompute, cheap to keep relative to the
attention and elementwise intermediates) and recomputes everything else.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from layout.plan import Plan
from executor.apply.layers import LayerMap, get_or_none

_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.linear.default}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def recompute_by_layer(plan: Plan) -> dict[int, str]:
    """Expanded layer index -> recompute policy."""
    return {stage.start + i: policy for stage in plan.stages for i, policy in enumerate(stage.recompute)}


def apply_recompute(module: nn.Module, mesh: DeviceMesh, plan: Plan, lmap: LayerMap) -> nn.Module:
    """Checkpoint every layer whose policy is not "none" (layers this chunk dropped are skipped)."""
    for layer, policy in recompute_by_layer(plan).items():
        if policy == "none":
            continue
        for name in lmap.modules_of(layer):
            sub = get_or_none(module, name)
            if sub is None or not any(True for _ in sub.parameters()):
                continue
            if policy == "full":
                checkpoint(sub, use_reentrant=False)
            else:
                checkpoint(sub, use_reentrant=False, context_fn=_selective_context)
    return module
