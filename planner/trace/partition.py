"""What a compiled layer keeps for its backward: the min-cut partition of AOTAutograd.

Under eager PyTorch every op saves what its own backward reads (`saved_bytes` in the traced
graph): a norm its output, the SwiGLU product its two inputs and the activation. torch.compile's
partitioner (AOTAutograd's min-cut rematerialisation, inductor's default) chooses instead the
cheapest set of forward tensors from which the backward can rebuild everything it needs,
recomputing pointwise ops (fused into the backward's kernels) but never a matrix multiply, an
attention kernel, an embedding lookup or a random op. That choice is a minimum cut:

- each forward tensor is an edge `in -> out` whose capacity is its bytes (the cost of saving it);
- a tensor the backward needs (one eager saves) drains to the sink;
- a tensor that cannot be recomputed (a product, an attention, a lookup, a random draw, the
  layer's inputs) is fed from the source: it exists once the forward ran;
- a data dependency is an uncuttable edge from the producer's `out` to the consumer's `in`.

The cut's capacity is what the compiled layer saves. Parameters are kept whatever the stack
and cost nothing here.
"""
from __future__ import annotations

from functools import lru_cache

import networkx as nx

from planner.trace.graph import OpGraph

POINTWISE = ("elementwise", "view")
GEMMS = ("linear", "matmul", "attention")
RANDOM = ("dropout", "bernoulli", "rand")  # a random op is drawn once: recomputing it would draw again
REDUCTION_RATIO = 4  # an op whose output is this many times smaller than its inputs is kept, not recomputed


@lru_cache(maxsize=1)
def recomputable_ops() -> frozenset[str]:
    """The ops torch's partitioner may recompute ('aten.mul', 'aten.view'...): its own default list."""
    from torch._functorch.partitioners import get_default_op_list

    return frozenset(str(op) for op in get_default_op_list().recomputable_ops)


def compiled_saved_bytes(og: OpGraph, layer: str, nbytes) -> float | None:
    """Bytes `layer`'s compiled forward saves for its backward (None: it saves nothing under eager)."""
    g = og.graph
    needed = [n for n, d in og.nodes(None) if d["saved_bytes"] and d.get("saved_layer") == layer]
    if not needed:
        return None
    members = {n for n, d in og.nodes() if d.get("layer") == layer} | set(needed)
    flow = nx.DiGraph()
    for node in members:
        flow.add_edge(("in", node), ("out", node), capacity=nbytes(g.nodes[node]))
        if not _recomputable(g, node, nbytes):
            flow.add_edge("source", ("in", node))
        for pred in g.predecessors(node):
            if g.edges[pred, node].get("param"):
                continue
            if pred not in members:  # a tensor from another layer: there when the backward runs only if saved
                flow.add_edge(("in", pred), ("out", pred), capacity=nbytes(g.nodes[pred]))
                flow.add_edge("source", ("in", pred))
            flow.add_edge(("out", pred), ("in", node))
    for node in needed:
        flow.add_edge(("out", node), "sink")
    cut, _ = nx.minimum_cut(flow, "source", "sink")
    return float(cut)


def _recomputable(g, node: int, nbytes) -> bool:
    """Whether the partitioner may recompute `node` in the backward (torch's rules): a forward op on
    its list, not random, not a reduction, and not one a backward GEMM reads (a product's input is
    needed whole by its weight gradient: recomputing it there is not fused, so not free)."""
    data = g.nodes[node]
    if data["kind"] not in POINTWISE or data["phase"] != "forward":
        return False
    op = data["op"]
    if ".".join(op.split(".")[:2]) not in recomputable_ops() or any(word in op.lower() for word in RANDOM):
        return False
    inputs = sum(nbytes(g.nodes[p]) for p in g.predecessors(node) if not g.edges[p, node].get("param"))
    if REDUCTION_RATIO * nbytes(data) < inputs:
        return False
    return not _feeds_a_gemm(g, node)


def _feeds_a_gemm(g, node: int) -> bool:
    """Whether `node`'s value (or a view of it) is an input of a product or an attention."""
    frontier = [node]
    while frontier:
        current = frontier.pop()
        for user in g.successors(current):
            kind = g.nodes[user]["kind"]
            if kind in GEMMS:
                return True
            if kind == "view":
                frontier.append(user)
    return False
