"""Pipeline parallelism: cut the model at the plan's stage boundaries.

Each pipeline rank keeps, per virtual stage it owns (where the schedule places
it, `Layout.stage_rank`: stage i on rank i % pp, or in a V for zbv), a copy of
the model stripped of what the stage does not own. Names of
the kept parameters are unchanged, so checkpoints and comparisons line up with
the unsplit model. The reference GPT tolerates missing modules (None / deleted
from the ModuleDict); HuggingFace models get parameter-free stand-ins instead,
because their forward code calls every module it registered.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from layout.plan import Plan
from executor.apply.layers import LayerMap, layer_map
from executor.runtime.models import HFStage


# Schedules of model chunks (vpp per rank, placed by `Layout.stage_rank`); zero-bubble is torch's
# ZB1P and zbv its ZB-V, both splitting each backward into input and weight gradients.
CHUNKED = {"interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble,
           "zbv": ScheduleZBVZeroBubble}


class Skipped(nn.Module):
    """A block another stage owns: hands its hidden states through."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class ZeroEmbedding(nn.Module):
    """A position embedding another stage owns: adds nothing to the incoming hidden states, in
    the dtype the embedding had (bf16 master weights keep the stream bf16)."""

    def __init__(self, dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dim = dim
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, device=ids.device, dtype=self.dtype)


class Passthrough(nn.Module):
    def forward(self, x, *args, **kwargs):
        return x


def owned_stages(plan: Plan, pp_rank: int) -> list[int]:
    """Virtual stage indices that run on pipeline rank `pp_rank`."""
    return plan.rank_stages(pp_rank)


def _drop(model: nn.Module, name: str, lmap: LayerMap, stand_in) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, nn.ModuleDict):
        del parent[attr]
    elif isinstance(parent, nn.ModuleList):
        parent[int(attr)] = Skipped()
    else:
        setattr(parent, attr, stand_in(getattr(parent, attr), name))


def _stand_in(model: nn.Module, lmap: LayerMap):
    """What replaces a module another stage owns. The reference GPT checks for None. An HF model
    calls every module it registered: a zero embedding (positions add nothing), a passthrough
    otherwise. Any other module is called as its forward was written, so its first embedding
    (the tokens', which a later stage's input replaces) becomes a passthrough too."""
    if getattr(model, "drops_to_none", False):
        return lambda old, name: None
    tokens = next((n for n in lmap.pre if isinstance(model.get_submodule(n), nn.Embedding)), None)
    hf = isinstance(model, HFStage)

    def stand_in(old: nn.Module, name: str) -> nn.Module:
        if isinstance(old, nn.Embedding) and (hf or name != tokens):
            return ZeroEmbedding(old.embedding_dim, old.weight.dtype)
        return Passthrough()

    return stand_in


def cut(model: nn.Module, lmap: LayerMap, start: int, end: int) -> nn.Module:
    """Strip `model` (in place) down to expanded layers [start, end)."""
    hf = isinstance(model, HFStage)
    stand_in = _stand_in(model, lmap)
    for layer in range(lmap.n_layers):
        if not start <= layer < end:
            for name in lmap.modules_of(layer):
                _drop(model, name, lmap, stand_in)
    if hf:
        model.first = start == 0
    return model


def apply_pipeline(module: nn.Module, mesh: DeviceMesh, plan: Plan) -> list[nn.Module]:
    """The model chunks this rank runs, one per owned virtual stage (the whole model when pp == 1)."""
    if plan.pp == 1:
        return [module]
    lmap = layer_map(module)
    stages = owned_stages(plan, mesh.get_local_rank("pp"))
    chunks = []
    for i, index in enumerate(stages):
        source = module if i == len(stages) - 1 else copy.deepcopy(module)
        spec = plan.stages[index]
        chunks.append(cut(source, lmap, spec.start, spec.end))
    return chunks


def build_schedule(chunks: list[nn.Module], mesh: DeviceMesh, plan: Plan, loss_fn, device: torch.device):
    """PipelineStage objects plus the schedule the plan names; None when pp == 1."""
    if plan.pp == 1:
        return None
    group = mesh["pp"].get_group()
    stages = [PipelineStage(chunk, index, plan.n_virtual_stages, device, group=group)
              for chunk, index in zip(chunks, owned_stages(plan, mesh.get_local_rank("pp")))]
    n = plan.num_micro_batches
    if plan.schedule in CHUNKED:
        return CHUNKED[plan.schedule](stages, n, loss_fn=loss_fn)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[plan.schedule]
    return kind(stages[0], n, loss_fn=loss_fn)
