"""What a layer keeps in memory besides its parameters, from the traced op graph: the saved
activations by TP state, what sequence parallelism as the executor runs it keeps whole, and
the temporaries alive at the layer's worst moment.

Sequence parallelism under DTensor (the eager stack) all-gathers a column-split linear's
sequence-sharded input inside that linear's input hook, so the linear saves the gathered
tensor: one whole copy per linear (q, k and v each their own), where Megatron's SP saves the
shard and gathers again in backward. What is not computed from the hidden states at all (a
causal mask, rotary tables) is whole on every TP rank too. The logits stay split over the
vocabulary, their loss computed by torch's loss parallelism (`executor.apply.tensor_parallel`).

Temporaries are tensors autograd does not keep: in forward, those alive at once by the
forward order (the fp32 copy of the logits beside the bf16 logits); in backward, the gradient
of an op's output beside the gradients of its inputs (log-softmax's fp32 gradients). The
layer's transient is the larger of the two, with the TP state of the tensors that set it.
"""
from __future__ import annotations

from planner.trace.graph import OpGraph


def view_base(g, node: int) -> int:
    """The node whose storage `node` views."""
    while g.nodes[node]["kind"] == "view":
        preds = [p for p in g.predecessors(node) if not g.edges[p, node].get("param")]
        if len(preds) != 1:
            break
        node = preds[0]
    return node


def _inputs(g, node: int) -> list[int]:
    return [p for p in g.predecessors(node) if not g.edges[p, node].get("param") and g.nodes[p]["phase"] != "input"]


def sp_whole_bytes(og: OpGraph, layer: str, members: list[int], nbytes) -> tuple[float, float]:
    """(bytes the executor's SP keeps whole per TP rank, replicated saved bytes they replace)."""
    g = og.graph
    whole = dropped = 0.0
    replaced: set[int] = set()
    for node in members:
        data = g.nodes[node]
        if data.get("tp_style") != "colwise":
            continue
        ins = _inputs(g, node)
        whole += max((nbytes(g.nodes[p]) for p in ins), default=0.0)
        replaced |= {view_base(g, p) for p in ins}
    for base in replaced:
        data = g.nodes[base]
        if data["saved_bytes"] and data.get("saved_layer") == layer and data.get("tp", "R") == "R":
            dropped += data["saved_bytes"]
    for _, data in og.nodes(None):
        unsplit = not data.get("stream", True)  # a mask or rotary table: never sequence-split
        if data["saved_bytes"] and data.get("saved_layer") == layer and unsplit and data.get("tp", "R") == "R" \
                and not data.get("scores"):
            whole += data["saved_bytes"]
            dropped += data["saved_bytes"]
    return whole, dropped


def transient(og: OpGraph, members: list[int], nbytes) -> tuple[float, str]:
    """(the layer's largest temporaries, the TP state of the tensor that sets them: S or R)."""
    g = og.graph
    order = sorted(members)
    inside = set(order)
    last_use = {}
    for node in order:
        for p in _inputs(g, node):
            if p in inside:
                last_use[view_base(g, p)] = node
    live: dict[int, float] = {}
    best, kind = 0.0, "R"
    for node in order:
        data = g.nodes[node]
        if data["kind"] != "view" and not data["saved_bytes"]:
            live[node] = nbytes(data)
        if sum(live.values()) > best:
            best, kind = sum(live.values()), data.get("tp", "R")
        for done in [n for n in live if last_use.get(n, node) <= node and n != node]:
            del live[done]
        grads = nbytes(data) + sum(nbytes(g.nodes[p]) for p in _inputs(g, node)) if data["kind"] != "view" else 0.0
        if grads > best:
            best, kind = grads, data.get("tp", "R")
    return best, kind

