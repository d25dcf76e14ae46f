"""Mixture-of-experts weights in a checkpoint: one entry per expert.

An experts module holds 3-D weights [experts, ...]. Under expert parallelism each
ep rank holds a slice of them under the same parameter name, and FSDP2 may shard
that slice again by rows over the ranks holding the same experts; without EP the
whole stack may be FSDP2-sharded by rows over dp. Whatever the layout, every row
this rank holds is one whole expert, so a checkpoint stores each expert under its
own name ("<weight>#expert3", likewise each AdamW moment). A rank's entries are
views of its tensors: DCP saves them, and loads into them in place, on any ep, dp,
zero or pipeline layout.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from executor.apply.expert_parallel import EXPERT_WEIGHTS, ExpertParallelExperts, is_experts


def expert_rows(chunk: nn.Module) -> dict[str, int]:
    """The state-dict name of each expert weight this chunk holds -> the global index of the
    first expert its module holds (the EP rank's first)."""
    out = {}
    for name, module in chunk.named_modules():
        if not is_experts(module):
            continue
        base = module.rank * module.local if isinstance(module, ExpertParallelExperts) else 0
        for weight in EXPERT_WEIGHTS:
            for fqn in _get_fqns(chunk, f"{name}.{weight}" if name else weight):
                out[fqn] = base
    return out


def _first_row(value: torch.Tensor) -> int:
    """Where a tensor's local rows start within its module's experts: a DTensor's own offset
    (FSDP2's shard of a weight, or ZeRO-1's rows of a moment), else 0."""
    if not isinstance(value, DTensor):
        return 0
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return offset[0]


def _owner(key: str, rows: dict[str, int]) -> str | None:
    """The expert weight `key` belongs to: the weight itself, or one of its optimizer states."""
    for fqn in rows:
        if key == fqn or (key.startswith(f"state.{fqn}.") and "." not in key[len(f"state.{fqn}."):]):
            return fqn
    return None


def split_experts(state: dict, rows: dict[str, int]) -> dict:
    """`state` with each expert weight (and its moments) replaced by one view per local expert."""
    out = {}
    for key, value in state.items():
        fqn = _owner(key, rows) if isinstance(value, torch.Tensor) and value.dim() >= 3 else None
        if fqn is None:
            out[key] = value
            continue
        local, first = (value._local_tensor if isinstance(value, DTensor) else value), rows[fqn] + _first_row(value)
        for i in range(local.shape[0]):
            out[f"{key}#expert{first + i}"] = local[i]
    return out
