"""The model's tensor-parallel split, derived once from the data flow of one forward.

The rule (Megatron's): a linear fed by the replicated residual stream is split
column-wise; a linear fed by a column-split output is split row-wise and
returns the stream to replicated. A column-split tensor that reaches a norm,
a residual add or anything else that mixes all features before a row-wise
linear makes its whole group replicated.

One derivation, two callers: the tracer runs it on its fake forward and prices
that split (`planner.trace.module`, `blocks.split_tp`); the executor runs it on
the live module and applies it (`executor.apply.materialize`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from planner.executable import tp_split_classes
from planner.trace.ops import run_on_fake

_MIXING_OPS = {"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "mean", "var_mean", "softmax", "_softmax", "_log_softmax"}


@dataclass
class TPAnalysis:
    styles: dict[str, str]
    groups: list[set[str]] = field(default_factory=list)
    model_outputs: set[str] = field(default_factory=set)  # column-split linears whose output the model returns (the head)
    token_embedding: str | None = None
    embeddings: list[str] = field(default_factory=list)


class _Flow(TorchDispatchMode):
    """Propagates 'derived from these column-split linears' tags through every aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, frozenset[str]] = {}
        self.keep: list[torch.Tensor] = []
        self.conflicts: set[str] = set()

    def tag(self, value) -> frozenset[str]:
        out = frozenset()
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                out |= self.tags.get(id(leaf), frozenset())
        return out

    def set(self, tensor: torch.Tensor, tag: frozenset[str]) -> None:
        self.tags[id(tensor)] = tag
        self.keep.append(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = run_on_fake(func, args, kwargs or {})
        tag = self.tag((args, kwargs))
        if tag:
            name = func.overloadpacket.__name__
            if name in _MIXING_OPS or (name.startswith("add") and self._residual(args, out)):
                self.conflicts |= tag
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.set(leaf, tag)
        return out

    def _residual(self, args, out) -> bool:
        """An add of a split tensor with an unsplit tensor of the same shape: a residual connection."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return any(not self.tags.get(id(t)) and t.shape == out.shape for t in tensors)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def analyse_tp(model: nn.Module, example: torch.Tensor | None = None, forward=None) -> TPAnalysis:
    """Run `example` through `model` once (or call `forward()`, a call of `model` the caller
    arranges, such as the tracer's on fake weights) and classify every parameter-holding module."""
    flow, styles, parent = _Flow(), {}, {}
    embeddings: list[str] = []

    def find(name: str) -> str:
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    def hook(name):
        def post(module, args, output):
            if isinstance(module, nn.Embedding):
                embeddings.append(name)
                styles.setdefault(name, "rowwise")
                flow.set(output, frozenset())
                return
            feeding = flow.tag(args)
            if feeding:
                styles[name] = "rowwise"
                for other in feeding:
                    parent[find(other)] = find(name)
                flow.set(output, frozenset())
            else:
                styles[name] = "colwise"
                parent.setdefault(name, name)
                flow.set(output, frozenset({name}))
        return post

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, tp_split_classes()):
            handles.append(module.register_forward_hook(hook(name)))
        elif any(True for _ in module.parameters(recurse=False)):
            styles[name] = "replicate"
    try:
        with torch.no_grad(), flow:
            output = forward() if forward is not None else model(example)
    finally:
        for handle in handles:
            handle.remove()
    outputs = {n for n in flow.tag(output) if styles.get(n) == "colwise"}
    return _resolve(styles, parent, find, flow.conflicts - outputs, outputs, embeddings)


def _resolve(styles, parent, find, conflicts, outputs, embeddings) -> TPAnalysis:
    groups: dict[str, set[str]] = {}
    for name in parent:
        groups.setdefault(find(name), set()).add(name)
    bad_roots = {find(n) for n in conflicts}
    for root in bad_roots:
        for name in groups[root]:
            styles[name] = "replicate"
    kept = [g for r, g in groups.items() if r not in bad_roots]
    return TPAnalysis(styles, kept, outputs, embeddings[0] if embeddings else None, list(embeddings))


def derive_tp_styles(model: nn.Module, example: torch.Tensor) -> dict[str, str]:
    """module name -> "colwise" | "rowwise" | "replicate" (the `OpGraph.tp_styles` shape)."""
    return analyse_tp(model, example).styles
