"""Map a module tree onto the plan's expanded layer list [embedding, blocks..., head].

One generic rule serves the reference GPT and HuggingFace families alike: the
blocks are the largest ModuleList/ModuleDict of same-typed children; modules
holding parameters registered before it form layer 0 (embeddings), those after
it form the head. No table per model name.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from planner.executable import block_container


@dataclass(frozen=True)
class LayerMap:
    container: str
    block_names: tuple[str, ...]
    pre: tuple[str, ...]
    post: tuple[str, ...]
    heads: int | None
    kv_heads: int | None

    @property
    def n_layers(self) -> int:
        return len(self.block_names) + 2

    def modules_of(self, layer: int) -> tuple[str, ...]:
        """Module names making up expanded layer `layer`."""
        if layer == 0:
            return self.pre
        if layer == self.n_layers - 1:
            return self.post
        return (self.block_names[layer - 1],)


def _block_container(model: nn.Module) -> str:
    best = block_container(model)
    if best is None:
        raise ValueError("no ModuleList/ModuleDict of repeated blocks found")
    return best


def _find_attr(model: nn.Module, names: tuple[str, ...]) -> int | None:
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None),
                   getattr(getattr(model, "model", None), "config", None),
                   getattr(getattr(model, "model", None), "cfg", None)):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int):
                return value
    return None


def layer_map(model: nn.Module) -> LayerMap:
    """Find blocks, embedding modules and head modules by position in the module tree."""
    container = _block_container(model)
    prefix = container + "."
    blocks = tuple(prefix + key for key, _ in model.get_submodule(container).named_children())
    pre, post, seen_blocks = [], [], False
    for name, module in model.named_modules():
        if name == container:
            seen_blocks = True
            continue
        if name.startswith(prefix) or not any(True for _ in module.parameters(recurse=False)):
            continue
        (post if seen_blocks else pre).append(name)
    heads = _find_attr(model, ("heads", "num_attention_heads", "n_head"))
    kv = _find_attr(model, ("num_key_value_heads",)) or heads
    return LayerMap(container, blocks, tuple(pre), tuple(post), heads, kv)


def get_or_none(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule `name`, or None when a pipeline stage dropped it."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
