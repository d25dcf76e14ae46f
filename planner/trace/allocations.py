"""What torch's caching allocator holds beyond a layer's live tensors, from the layer's traced ops.

Why: a run dies on what the allocator has reserved, and the allocator keeps every block it
frees. A layer whose later requests are larger than the blocks it freed cannot reuse them and
grows instead: the loss upcasts the 16-bit logits to fp32 and frees them, and the fp32
log-probabilities that follow are twice too large for their block, so the 16-bit logits' bytes
stay reserved beside the loss's peak. Replaying the layer's own allocation sequence through
`costmodel.allocator` (with expandable segments, as the executor sets it) measures that: each
op's output is allocated at the op and freed after its last reader inside the layer (saved
tensors after their backward reader); what leaves the layer (its output, its parameters'
gradients) is kept. The slack is the replay's peak reservation over its peak allocation.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

from costmodel.allocator import CachingAllocator
from planner.trace.graph import OpGraph
from planner.trace.saved import view_base


def layer_nodes(og: OpGraph, layer: str) -> list[int]:
    """The layer's forward ops and the backward ops autograd ran for them (each backward op goes
    to the layer whose forward ran the module that recorded it), in execution order."""
    module_layers = og.module_layers()
    return [n for n, d in og.nodes(None) if og.layer_of(d, module_layers) == layer]


def allocator_slack(og: OpGraph, layer: str, nbytes: Callable[[dict], float]) -> float:
    """Bytes the caching allocator reserves beyond the layer's live tensors at their peak, for the
    traced batch (`og.batch` sequences)."""
    g = og.graph
    members = layer_nodes(og, layer)
    frees = _frees(og, members)
    allocator = CachingAllocator(expandable_segments=True)
    for node in members:
        data = g.nodes[node]
        if data["kind"] != "view" and data.get("shape") is not None and nbytes(data) > 0:
            allocator.malloc(node, int(nbytes(data)))
        for done in frees.get(node, ()):
            if allocator.holds(done):
                allocator.free(done)
    return float(allocator.stats.peak_reserved - allocator.stats.peak_allocated)


def _frees(og: OpGraph, members: list[int]) -> dict[int, list[int]]:
    """Each member's storages to free once it has run: those it read last, unless a reader
    outside the layer keeps them."""
    g = og.graph
    inside = set(members)
    last: dict[int, int] = {}
    for node in members:
        for p in g.predecessors(node):
            if not g.edges[p, node].get("param"):
                base = view_base(g, p)
                if base in inside:
                    last[base] = max(last.get(base, node), node)
    kept = {view_base(g, n) for n in members if any(s not in inside for s in g.successors(n))}
    frees: dict[int, list[int]] = defaultdict(list)
    for base, node in last.items():
        if base not in kept:
            frees[node].append(base)
    return frees
