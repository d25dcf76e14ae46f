"""Memory-bound traffic once pointwise chains fuse: what torch.compile (Inductor) and fused
kernel stacks (Transformer Engine's norms, SwiGLU, RoPE) read and write.

Eager PyTorch runs every elementwise op as its own kernel, each reading its inputs from and
writing its output to HBM: the traced `bytes` summed. A fusing stack runs each connected chain
of pointwise ops (views pass through) as one kernel: it reads the tensors entering the chain
once and writes only the tensors that leave it, those a GEMM, another layer, the backward or
the saved activations need. Only GEMMs, attention and embeddings break a chain.
"""
from __future__ import annotations

import networkx as nx

from planner.trace.graph import OpGraph

POINTWISE = ("elementwise", "view")


def fused_elementwise_bytes(og: OpGraph, members: set[int], nbytes) -> float:
    """Forward memory-bound bytes of the layer's nodes `members` with pointwise chains fused."""
    g = og.graph
    pointwise = [n for n in members if g.nodes[n]["kind"] in POINTWISE and g.nodes[n]["phase"] == "forward"]
    chains = nx.weakly_connected_components(g.subgraph(pointwise))
    gathers = sum(g.nodes[n]["bytes"] for n in members if g.nodes[n]["kind"] == "embedding")  # not pointwise
    return gathers + sum(_chain_bytes(g, chain, nbytes) for chain in chains)


def _chain_bytes(g: nx.DiGraph, chain: set[int], nbytes) -> float:
    if all(g.nodes[n]["kind"] == "view" for n in chain):
        return 0.0  # views alone move nothing
    entering = {p for n in chain for p in g.predecessors(n) if p not in chain}
    leaving = [n for n in chain if g.nodes[n]["saved_bytes"] or not any(True for _ in g.successors(n))
               or any(s not in chain for s in g.successors(n))]
    return sum(nbytes(g.nodes[p]) for p in entering) + sum(nbytes(g.nodes[n]) for n in leaving)
