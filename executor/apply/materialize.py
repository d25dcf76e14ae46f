"""Turn (plan, model) into what one rank trains: chunks, schedule, optimizer.

The appliers run in one fixed order (`APPLY_ORDER`), each `apply_x(module, mesh, plan, ...)`:

1. pipeline  - cut first, so later appliers only touch what this rank keeps;
2. tensor    - DTensor sharding needs the plain nn.Linear/nn.Embedding modules;
3. expert    - the experts split over the ep ranks, tokens routed by all-to-all;
4. context   - attention routed through the cp ranks' gathered keys and values;
5. recompute - wraps whole layers, whose inner linears are already split;
6. compile   - each block's (checkpointed) forward compiled, on the compile stack;
7. data      - FSDP2/DDP go outermost: they must see the final (DTensor)
               parameters and the checkpointed, compiled forward.

The pipeline schedule is built last, around the fully wrapped chunks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from layout.plan import Plan
from executor.apply.recompute import apply_recompute
from executor.apply.compile import apply_compile
from executor.apply.context_parallel import apply_context_parallel
from executor.apply.expert_parallel import ExpertGradients, apply_expert_parallel
from executor.apply.data_parallel import apply_data_parallel, cast_master_weights
from executor.apply.gradient_reduce import reducer_of
from executor.apply.optimizer import ChunkOptimizers, build_optimizer
from executor.apply.layers import LayerMap, layer_map
from executor.runtime.mesh import build_mesh, local_device
from executor.apply.pipeline import apply_pipeline, build_schedule
from executor.apply.tensor_parallel import apply_tensor_parallel
from executor.apply.tied import TiedGradients, aliases, tied_groups
from planner.trace.tp_styles import TPAnalysis, analyse_tp
from executor.apply.validate import validate



@dataclass(frozen=True)
class _Rank:
    """What the appliers after the pipeline read: this rank's mesh, the plan, the model's layer
    map and TP styles, and the run's seed."""

    mesh: DeviceMesh
    plan: Plan
    lmap: LayerMap
    analysis: TPAnalysis | None
    seed: int


# Each model chunk goes through these in this order, after the pipeline cut it into chunks.
APPLIERS: tuple[tuple[str, Callable[[nn.Module, _Rank], nn.Module]], ...] = (
    ("tensor_parallel", lambda c, r: apply_tensor_parallel(c, r.mesh, r.plan, r.analysis) if r.analysis else c),
    ("expert_parallel", lambda c, r: apply_expert_parallel(c, r.mesh, r.plan)),
    ("context_parallel", lambda c, r: apply_context_parallel(c, r.mesh, r.plan)),
    ("recompute", lambda c, r: apply_recompute(c, r.mesh, r.plan, r.lmap)),
    ("compile", lambda c, r: apply_compile(c, r.mesh, r.plan, r.lmap)),
    ("data_parallel", lambda c, r: apply_data_parallel(c, r.mesh, r.plan, r.lmap, r.seed)),
)
APPLY_ORDER = ("pipeline",) + tuple(name for name, _ in APPLIERS)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the micro-batch, a plain tensor. Logits a TP head left
    split over the vocabulary (a DTensor) need `loss_context`: the log-softmax and the picked
    targets then reduce across the TP ranks, no rank holding the whole vocabulary."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    # the replicated scalar's own copy: a view of the DTensor's local tensor is refused by the
    # in-place detach torch's zero-bubble schedules give a loss once its backward has run
    return loss.to_local().clone() if isinstance(loss, DTensor) else loss


def loss_context(plan: Plan):
    """What a step's forward and backward run under for `lm_loss`: torch's loss parallelism
    wherever TP splits the head (`executor.apply.tensor_parallel` leaves its logits split), as
    torchtitan runs it. Tensors that are not vocabulary-split DTensors are untouched by it."""
    return loss_parallel() if plan.tp > 1 else contextlib.nullcontext()


@dataclass
class Materialized:
    modules: list[nn.Module]
    schedule: object | None
    optimizer: ChunkOptimizers
    mesh: DeviceMesh
    device: torch.device
    tp_replicated: list[str] = field(default_factory=list)
    tied: TiedGradients | None = None
    tied_aliases: dict[str, str] = field(default_factory=dict)
    experts: ExpertGradients | None = None
    tied_names: list[tuple[str, ...]] = field(default_factory=list)  # each tied weight's names, canonical first

    def sync_gradients(self) -> None:
        """The gradient sums DDP/FSDP do not do: replicated weights outside DDP (their all-reduces
        launched in the backward), tied copies across stages, experts across replicas."""
        reducers = [reducer_of(m) for m in self.modules]
        for sync in (*reducers, self.tied, self.experts):
            if sync is not None:
                sync.sync()

    def as_tuple(self):
        return (self.modules if len(self.modules) > 1 else self.modules[0]), self.schedule, self.optimizer


def tp_analysis(model: nn.Module, plan: Plan) -> TPAnalysis | None:
    """Styles from the planner's traced OpGraph when available, else from our own data-flow walk."""
    if plan.tp == 1:
        return None
    example = torch.randint(0, 8, (2, min(8, plan.seq_len)), device=next(model.parameters()).device)
    return analyse_tp(model, example)


def materialize_rank(plan: Plan, model: nn.Module, mesh: DeviceMesh | None = None, lr: float = 1e-3,
                     seed: int = 0) -> Materialized:
    """Apply every parallelism of `plan` to `model` for the calling rank (process group must exist);
    `seed` is the run's (it seeds gradient compression's randomness)."""
    validate(plan, model)
    mesh = mesh if mesh is not None else build_mesh(plan)
    device = local_device()
    if any(p.device != device for p in model.parameters()):  # a no-op .to() fails on fake tensors
        model = model.to(device)
    model = cast_master_weights(model, plan)
    lmap: LayerMap = layer_map(model)
    analysis = tp_analysis(model, plan)
    groups = tied_groups(model)
    chunks = apply_pipeline(model, mesh, plan)
    rank = _Rank(mesh, plan, lmap, analysis, seed)
    replicated: list[str] = []
    for name, applier in APPLIERS:
        chunks = [applier(c, rank) for c in chunks]
        if name == "tensor_parallel":
            replicated = sorted({n for c in chunks for n in getattr(c, "tp_replicated", [])})
    schedule = build_schedule(chunks, mesh, plan, lm_loss, device)
    optimizer = build_optimizer(chunks, mesh, plan, lr)
    tied = TiedGradients(groups, lmap, plan, mesh, chunks) if groups and plan.pp > 1 else None
    experts = ExpertGradients(chunks, mesh, plan) if plan.ep > 1 else None
    return Materialized(chunks, schedule, optimizer, mesh, device, replicated, tied, aliases(groups), experts, groups)


def materialize(plan: Plan, model: nn.Module):
    """(stage module or list of chunks, schedule or None, optimizer) for a user's own loop. Under TP
    the model returns its logits as a vocabulary-split DTensor: run the forward and backward inside
    `loss_context(plan)`, the loss `lm_loss`'s (or any `F.cross_entropy` over those logits)."""
    return materialize_rank(plan, model).as_tuple()
