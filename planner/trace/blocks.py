"""Repeated-block recognition and the Megatron-style TP split of an `OpGraph`.

Blocks: a repeated block is a numbered child (`model.layers.3`, `transformer.h.0`,
`encoder.block.5`) of a container whose numbered children have the same type and
do work (a GEMM or attention). No table of model names: the numbering and the
structure decide. Members are compared by their op sequence (op, shape,
relative module path); the most common signature is the representative (the
last such member, i.e. the steady state: T5's block 0 also computes the
position bias that the others reuse). Forward ops before the first block are
the embedding, after the last block the head, in between "other".

TP split: the forward DAG is walked in execution order with a state per op,
"R" (replicated, the residual stream) or "S" (sharded). A linear whose input is
R is column-parallel (output S); one whose input is S is row-parallel (output R,
one all-reduce of its output). Everything else is S when any activation input
is S. An activation×activation matmul with an [s, s] output makes attention
scores; elementwise ops and views of scores stay scores.

The split is the executor's, so that what is priced is what runs: only GEMMs
of modules that DTensor splits (`planner.executable.TP_SPLIT_MODULES`) are
split, anything else (GPT-2's fused Conv1D) stays replicated. A column-split
linear from which no further split linear is reached (the LM head) keeps its
output split over the vocabulary, and so does the loss computed from it: the
executor runs torch's loss parallelism there, as torchtitan does.
"""
from __future__ import annotations

import re
from collections import Counter

from planner.trace.graph import OpGraph, module_within

_NUMBERED = re.compile(r"^(.*)\.(\d+)$")


def analyse(og: OpGraph) -> None:
    """Find the blocks, assign every forward op a layer, and split for TP."""
    og.meta["blocks"] = find_blocks(og)
    assign_layers(og)
    split_tp(og)
    og.meta.setdefault("flash_attention", any(d["kind"] == "attention" for _, d in og.nodes()))


def _module_nodes(og: OpGraph) -> dict[str, list[int]]:
    """Forward node ids per module path and every ancestor path."""
    out: dict[str, list[int]] = {}
    for node, data in og.nodes():
        path = data["module"]
        while path:
            out.setdefault(path, []).append(node)
            path = path.rpartition(".")[0]
    return out


def signature(og: OpGraph, nodes: list[int], member: str) -> tuple:
    """What must match between two members: ops, shapes, relative module paths."""
    return tuple((og.graph.nodes[n]["op"], og.graph.nodes[n]["shape"], og.graph.nodes[n]["module"][len(member):])
                 for n in nodes)


def find_blocks(og: OpGraph) -> list[dict]:
    """Groups of repeated blocks, outermost first, in execution order."""
    by_module = _module_nodes(og)
    containers: dict[str, list[str]] = {}
    for path in by_module:
        match = _NUMBERED.match(path)
        if match:
            containers.setdefault(match.group(1), []).append(path)
    groups = []
    for prefix, members in containers.items():
        group = _group(og, prefix, members, by_module)
        if group:
            groups.append(group)
    groups = [g for g in groups if not any(other is not g and any(module_within(g["prefix"], m) for m in other["members"])
                                           for other in groups)]
    return sorted(groups, key=lambda g: g["first"])


def _group(og: OpGraph, prefix: str, members: list[str], by_module: dict[str, list[int]]) -> dict | None:
    types = Counter(og.module_types.get(m, "") for m in members)
    common = types.most_common(1)[0][0]
    members = sorted((m for m in members if og.module_types.get(m, "") == common), key=lambda m: int(m.rpartition(".")[2]))
    working = {"linear", "matmul", "attention"}
    if len(members) < 2 or not all(any(og.graph.nodes[n]["kind"] in working for n in by_module[m]) for m in members):
        return None
    sigs = {m: signature(og, by_module[m], m) for m in members}
    counts = Counter(sigs.values())
    best = max(reversed(members), key=lambda m: counts[sigs[m]])  # ties: the later (steady-state) member
    best = sigs[best]
    rep = [m for m in members if sigs[m] == best][-1]
    if len(set(sigs.values())) > 1:
        odd = [m for m in members if sigs[m] != best]
        og.warn_once(f"blocks of {prefix} differ structurally ({', '.join(odd)} differ from {rep}); priced as {rep}")
    return {"prefix": prefix, "members": members, "rep": rep, "first": min(by_module[members[0]]),
            "last": max(max(by_module[m]) for m in members)}


def assign_layers(og: OpGraph) -> None:
    """Set each forward node's `layer`: a block member, embedding, other or head."""
    groups = og.meta["blocks"]
    first = min((g["first"] for g in groups), default=None)
    last = max((g["last"] for g in groups), default=None)
    for node, data in og.nodes(None):
        if data["phase"] == "backward":
            continue
        data["layer"] = _layer_of(groups, data["module"], node, first, last)
        if data["saved_bytes"]:
            data["saved_layer"] = _layer_of(groups, data["saved_module"], data["saved_at"], first, last)


def _layer_of(groups: list[dict], module: str, node: int, first: int | None, last: int | None) -> str:
    """The block member that holds `module`, else a position-based segment name."""
    member = next((m for g in groups for m in g["members"] if module_within(module, m)), None)
    if member is not None:
        return member
    if first is None or node < first:
        return "embedding"
    return "head" if node > last else "other"


def _wildcard(og: OpGraph, module: str) -> str:
    """A block module's name with the block index as `*` (a TP plan key)."""
    for group in og.meta["blocks"]:
        for member in group["members"]:
            if module_within(module, member):
                return group["prefix"] + ".*" + module[len(member):]
    return module


def _split_linears(og: OpGraph) -> set[int]:
    """The forward linear nodes the executor splits: as `tp_styles.analyse_tp` derived them where
    the tracer ran it, else from the graph alone."""
    if og.tp_module_styles is not None:
        styles = og.tp_module_styles
        return {n for n, d in og.nodes() if d["kind"] == "linear" and styles.get(d.get("module")) in ("colwise", "rowwise")}
    return {n for n, d in og.nodes() if d["kind"] == "linear" and d.get("module") in og.tp_split_modules}


def split_tp(og: OpGraph) -> None:
    """Propagate R/S through the forward DAG; classify linears; mark scores."""
    g, s = og.graph, og.seq_len
    split = _split_linears(og)
    for node, data in og.nodes(None):
        if data["phase"] == "backward":
            continue
        preds = [p for p in g.predecessors(node) if not g.edges[p, node].get("param")]
        states = [g.nodes[p].get("tp", "R") for p in preds]
        sharded = "S" in states
        data["tp"], data["allreduce"], data["scores"] = ("S" if sharded else "R"), False, False
        data["tp_style"] = None
        # computed from the hidden states: what SP can split by sequence (a causal mask is not)
        data["stream"] = data["kind"] == "embedding" or any(g.nodes[p].get("stream") for p in preds)
        if data["kind"] == "linear" and node not in split:
            _set_style(og, data["module"], "replicate")
        elif data["kind"] == "linear":
            style = (og.tp_module_styles or {}).get(data["module"]) or ("rowwise" if sharded else "colwise")
            data["tp"], data["allreduce"] = ("R", True) if style == "rowwise" else ("S", False)
            data["tp_style"] = style
            _set_style(og, data["module"], style)
        elif data["kind"] == "embedding":
            # as the executor splits every nn.Embedding (planner/trace/tp_styles.py): rowwise, its
            # output all-reduced, the tokens' table and a learned position table alike
            data["tp"], data["allreduce"] = "R", True
            _set_style(og, data["module"], "rowwise")
        elif data["kind"] == "matmul":
            shape = data["shape"]
            data["scores"] = len(shape) >= 2 and shape[-1] == s and shape[-2] == s
        elif data["kind"] in ("elementwise", "view"):
            data["scores"] = any(g.nodes[p].get("scores") and _numel(g.nodes[p]["shape"]) == _numel(data["shape"])
                                 for p in preds)


def _from_input(g, node: int) -> bool:
    """Whether `node` is a model input, possibly seen through views."""
    while g.nodes[node]["kind"] == "view":
        preds = list(g.predecessors(node))
        if len(preds) != 1:
            return False
        node = preds[0]
    return g.nodes[node]["kind"] == "input"


def _set_style(og: OpGraph, module: str, style: str) -> None:
    key = _wildcard(og, module)
    if og.tp_styles.get(key, style) != style:
        og.warn_once(f"module {key} is used both {og.tp_styles[key]} and {style}; kept replicated")
        style = "replicate"
    og.tp_styles[key] = style


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count
