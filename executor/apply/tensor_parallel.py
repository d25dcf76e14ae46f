"""Tensor (and sequence) parallelism from derived styles, with DTensor.

Without SP the residual stream stays a plain replicated tensor: embeddings are
vocabulary-split (RowwiseParallel, all-reduced), linears follow the derived
colwise/rowwise styles, and the LM head is column-split with its logits
left split over the vocabulary for the loss's parallel cross-entropy (torch's
`loss_parallel`, as torchtitan runs it): no rank holds the whole vocabulary's
logits, their fp32 copy or their gradient. With SP the residual stream is a sequence-sharded DTensor (so code
that reads `x.shape[1]`, e.g. rotary embeddings and causal masks, still sees
the full sequence), norms run as SequenceParallel, column-split linears
all-gather their input and row-split linears reduce-scatter their output.
Under pipelining with SP, a stage hands its neighbour the local sequence
shard (a plain tensor, which is what `torch.distributed.pipelining` sends)
and the neighbour wraps it back into the sequence-sharded DTensor.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from layout.plan import Plan
from executor.apply.layers import get_or_none
from executor.apply.tied import tied_groups
from planner.trace.tp_styles import TPAnalysis
from planner.executable import tp_split_classes

log = logging.getLogger(__name__)


def split_styles(model: nn.Module, analysis: TPAnalysis, tp: int) -> tuple[dict[str, str], list[str]]:
    """Drop groups whose dimensions `tp` does not divide; return (styles, replicated modules)."""
    styles = dict(analysis.styles)
    for group in analysis.groups:
        if not all(_divides(model, name, styles[name], tp) for name in group if get_or_none(model, name) is not None):
            for name in group:
                styles[name] = "replicate"
    for name, style in list(styles.items()):
        module = get_or_none(model, name)
        if module is not None and isinstance(module, nn.Embedding) and not _divides(model, name, style, tp):
            styles[name] = "replicate"
    # a pipeline chunk holds some of the model's modules (the others absent or parameterless
    # stand-ins): only weights it holds can block SP
    replicated = sorted(n for n, s in styles.items() if s == "replicate" and _holds_weights(get_or_none(model, n)))
    return styles, replicated


def _holds_weights(module: nn.Module | None) -> bool:
    return module is not None and not _is_norm(module) and any(True for _ in module.parameters(recurse=False))


def _is_norm(module: nn.Module | None) -> bool:
    return module is not None and "norm" in type(module).__name__.lower()


def _divides(model: nn.Module, name: str, style: str, tp: int) -> bool:
    module = model.get_submodule(name)
    if isinstance(module, nn.Embedding):
        return module.num_embeddings % tp == 0
    if isinstance(module, nn.Linear):
        return (module.out_features if style == "colwise" else module.in_features) % tp == 0
    return True


def _style(name: str, style: str, analysis: TPAnalysis, sp: bool):
    """The DTensor ParallelStyle for one module."""
    if name in analysis.embeddings:
        first = name == analysis.token_embedding
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp and first else Replicate(),
                               use_local_output=not sp)
    if style == "colwise":
        # a split whose output leaves the model (the head's logits) stays split over the
        # vocabulary, a DTensor, for the loss's parallel cross-entropy (materialize.loss_context)
        leaves = name in analysis.model_outputs
        return ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                               use_local_output=not leaves)
    return RowwiseParallel(output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp)


def apply_tensor_parallel(module: nn.Module, mesh: DeviceMesh, plan: Plan, analysis: TPAnalysis) -> nn.Module:
    """Shard `module` over the "tp" mesh dimension; modules TP cannot split stay replicated (logged)."""
    if plan.tp == 1:
        return module
    styles, replicated = split_styles(module, analysis, plan.tp)
    # A sequence-sharded residual stream would meet the replicated modules'
    # plain weights, so SP needs every non-norm module split.
    sp = plan.sp and not replicated
    if plan.sp and not sp:
        log.warning("sequence parallelism skipped: %d modules cannot be tensor-split", len(replicated))
        module.sp_skipped = True
    layout = {}
    for name, style in styles.items():
        sub = get_or_none(module, name)
        if sub is None:
            continue
        if style in ("colwise", "rowwise") and isinstance(sub, tp_split_classes()):  # not a stage's stand-in
            layout[name] = _style(name, style, analysis, sp)
        elif sp and _is_norm(get_or_none(module, name)):
            layout[name] = SequenceParallel()
    ties = tied_groups(module)
    parallelize_module(module, mesh["tp"], layout)
    retie(module, ties)
    if sp and plan.pp > 1:
        _sequence_shard_boundaries(module, mesh["tp"])
    if replicated:
        log.info("tensor parallelism left replicated: %s", ", ".join(replicated))
    module.tp_replicated = replicated
    return module


def retie(module: nn.Module, ties: list[tuple[str, ...]]) -> None:
    """Share each tied weight again after `parallelize_module`, which gives every module it
    splits a new parameter of its own: a vocabulary-split embedding and a column-split head
    both shard the vocabulary (Shard(0)), so the head takes the embedding's DTensor."""
    for names in ties:
        first = module.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            other = getattr(owner, attr)
            placed = [getattr(p, "placements", None) for p in (first, other)]
            if placed[0] != placed[1] or first.shape != other.shape:
                raise RuntimeError(f"tied weights {names[0]} and {name} were split differently by tensor "
                                   f"parallelism ({placed[0]} and {placed[1]})")
            setattr(owner, attr, first)


def _sequence_shard_boundaries(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A pipeline stage takes and returns the local sequence shard of the residual
    stream: hidden states in (floating point, unlike the first stage's token ids)
    become the Shard(1) DTensor the stage's SP layers expect; a sequence-sharded
    DTensor out leaves as its local shard (the last stage's vocabulary-split logits
    stay a DTensor, for the loss). Registered before FSDP's hooks, so FSDP sees
    plain tensors."""

    def enter(_module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() \
                and not isinstance(args[0], DTensor):
            return (DTensor.from_local(args[0], tp_mesh, [Shard(1)], run_check=False), *args[1:])
        return None

    def leave(_module, _args, output):
        return output.to_local() if isinstance(output, DTensor) and output.placements == (Shard(1),) else None

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
