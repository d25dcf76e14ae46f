"""What the executor needs to know of a model: where its blocks are, which modules TP
splits, and the facts the rulebook (`layout.rules`) judges a layout against.

The executor composes what torch provides, applied in this order:
pipeline (torch.distributed.pipelining: GPipe, 1F1B, interleaved 1F1B over any
number of chunks that the blocks fill) -> tensor parallel (DTensor colwise /
rowwise on nn.Linear and nn.Embedding, sequence parallel on the norms, across
pipeline stages too) -> expert parallel (MoE experts split over ep data-parallel
ranks, all-to-all; whole on every TP rank, so no SP) -> context parallel (sequence
chunks, keys and values all-gathered; pp=1) -> activation checkpointing (per
layer) -> data parallel
(DDP, or a per-weight all-reduce where parameters are DTensors or the rank is a
pipeline stage; ZeRO-1 shards the optimizer state over dp by rows of every weight; FSDP2 for ZeRO-2/3,
on the 2-D (dp_replicate, dp_shard) mesh for hybrid sharding).
Gradient compression runs as DDP communication hooks, so it needs the DDP path.
"""
from __future__ import annotations

from layout.rules import TP_SPLIT_MODULES, ModelFacts


def block_container(model) -> str | None:
    """Where the executor finds a model's repeated blocks: the largest ModuleList/ModuleDict
    of same-typed children (its name), or None when there is none to map layers from."""
    from torch import nn

    best, size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > size:
            if len({type(child) for child in module.children()}) == 1:
                best, size = name, len(module)
    return best


def tp_split_classes() -> tuple[type, ...]:
    """The classes of `layout.rules.TP_SPLIT_MODULES` (torch imported only when asked)."""
    from torch import nn

    return tuple(getattr(nn, name) for name in TP_SPLIT_MODULES)


def facts_of_workload(workload) -> ModelFacts:
    """The planner's view: a traced or analytic `costmodel.workload.Workload`."""
    return ModelFacts(n_blocks=workload.n_blocks, heads=workload.heads, kv_heads=workload.kv_heads,
                      tp_splittable=workload.max_tp() != 1, max_seq_len=workload.max_seq_len, vocab=workload.vocab,
                      name=workload.name, n_experts=workload.n_experts)
