"""Models the executor builds by name in every worker process.

torchrun starts fresh interpreters, so a model travels as a name: a catalog
entry (`parallax models`, the same entry the planner traced) or an importable
"package.module:function". Every model is returned as a tokens -> logits
module; HuggingFace models are wrapped so that a pipeline stage can also take
hidden states in.
"""
from __future__ import annotations


import torch
from torch import nn

from hardware.errors import ModelError
from planner.trace.models.build import build_module
from planner.trace.models.catalog import list_models


class HFStage(nn.Module):
    """tokens (first stage) or hidden states (later stages) -> logits or hidden states."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.first = True  # the pipeline applier clears it on later stages
        self.position_ids: torch.Tensor | None = None  # the tokens' positions when not 0..s-1 (context parallelism)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            extra = {} if self.position_ids is None else {
                "position_ids": self.position_ids.to(x.device)[None].expand(x.shape[0], -1)}
            out = self.model(input_ids=x, use_cache=False, **extra).logits
        else:
            out = self.model(inputs_embeds=x, use_cache=False).logits
        # A stage whose head another stage owns returns HF's slice of its hidden states, a view:
        # the zero-bubble schedule detaches stage outputs in place, and FSDP2 warns that an
        # in-place op on a view drops its hooks. The copy replaces the base, which nothing keeps.
        return out.clone() if out._is_view() else out


def _builder(name: str, trust_module: bool):
    if name in list_models():
        return lambda: build_module(name)
    if ":" in name:  # a user's factory, imported as `parallax plan --module` did
        from planner.factory import load_factory, refuse_untrusted

        if not trust_module:
            raise refuse_untrusted(name)
        return load_factory(name, field="model")
    import difflib

    close = difflib.get_close_matches(name, list_models(), n=3, cutoff=0.4)
    raise ModelError("model", f"unknown model {name!r}",
                     f"did you mean {', '.join(close)}?" if close else "a name from `parallax models` or 'package.module:function'")


def build_model(name: str, seed: int = 0, trust_module: bool = False) -> nn.Module:
    """Build `name` with a fixed seed so that every rank holds identical initial weights; a
    module factory ("pkg.mod:build") only when the user has said it may run (`trust_module`)."""
    builder = _builder(name, trust_module)
    torch.manual_seed(seed)
    model = builder()
    if not isinstance(model, HFStage) and hasattr(model, "config") and hasattr(model.config, "model_type"):
        model = HFStage(model)
    for sub in model.modules():  # dropout would make ranks and the reference diverge
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
        elif isinstance(sub, nn.MultiheadAttention):  # its attention dropout is a float, not a module
            sub.dropout = 0.0
    return model


def parameter_shapes(model: nn.Module) -> dict[str, list[int]]:
    """The unsplit model's parameter names and shapes, as a checkpoint's manifest records them."""
    return {name: list(param.shape) for name, param in model.named_parameters()}


def vocab_size(model: nn.Module) -> int:
    """Vocabulary size, read from the first embedding."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise ModelError("model", "no nn.Embedding found", "the executor trains token models")
