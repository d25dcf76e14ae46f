"""Gather a rank's trained parameters under their original names (for equivalence checks)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def canonical_name(name: str) -> str:
    """Drop wrapper prefixes (DDP's "module.") so names match the unwrapped model."""
    return name[len("module."):] if name.startswith("module.") else name


def full_parameters(modules: list[nn.Module], aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter this rank's chunks hold, unsharded (a collective over dp/tp groups);
    a tied weight's pipeline copy is named as in the uncut model (`aliases`)."""
    out, aliases = {}, aliases or {}
    for module in modules:
        for name, param in module.named_parameters():
            value = param.full_tensor() if isinstance(param, DTensor) else param
            if hasattr(param, "expert_parallel"):  # an expert-parallel slice: the experts of every ep rank
                value = _gather_experts(param, value)
            name = canonical_name(name)
            out[aliases.get(name, name)] = value.detach().cpu().clone()
    return out


def _gather_experts(param, local: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    group, ep = param.expert_parallel
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=0)

