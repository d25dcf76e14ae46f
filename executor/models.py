"""Models the executor can build by name in every worker process.

torchrun starts fresh interpreters, so a model travels as a name (or an
importable "package.module:function") rather than an object. Every model is
returned as a tokens -> logits module; HuggingFace models are wrapped so that a
pipeline stage can also take hidden states in.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from hardware.errors import ModelError
from planner.models.reference_gpt import GPTConfig, ReferenceGPT


class HFStage(nn.Module):
    """tokens (first stage) or hidden states (later stages) -> logits or hidden states."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.first = True  # the pipeline applier clears it on later stages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            return self.model(input_ids=x, use_cache=False).logits
        return self.model(inputs_embeds=x, use_cache=False).logits


def _reference(**overrides) -> Callable[[], nn.Module]:
    return lambda: ReferenceGPT(GPTConfig(**overrides))


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return HFStage(LlamaForCausalLM(cfg))


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, attn_implementation="sdpa")
    return HFStage(GPT2LMHeadModel(cfg))


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "reference-tiny": _reference(vocab_size=256, n_layers=4, hidden=64, heads=4, max_seq_len=64),
    "reference-gpt": _reference(),
    # ~85M parameters: the benchmark's model.
    "gpt-85m": _reference(vocab_size=8192, n_layers=12, hidden=768, heads=12, max_seq_len=256),
    "hf-llama-tiny": _hf_llama,
    "hf-gpt2-tiny": _hf_gpt2,
}


def _catalog_builder(name: str) -> Callable[[], nn.Module] | None:
    """A built-in decoder-only model (`parallax models`), built from its config with random weights."""
    from planner.models.catalog import hf_config, list_models

    if name not in list_models():
        return None

    def build() -> nn.Module:
        from transformers import AutoModelForCausalLM

        config = hf_config(name)
        config._attn_implementation = "sdpa"
        try:
            return HFStage(AutoModelForCausalLM.from_config(config))
        except ValueError as error:  # encoder or encoder-decoder families
            raise ModelError("model", f"{name} is not a causal language model the executor can train ({error})",
                             "use a decoder-only model such as gpt2 or llama-3-8b") from None

    return build


def build_model(name: str, seed: int = 0) -> nn.Module:
    """Build `name` with a fixed seed so that every rank holds identical initial weights."""
    catalog = _catalog_builder(name) if name not in BUILDERS else None
    if name in BUILDERS:
        builder = BUILDERS[name]
    elif catalog is not None:
        builder = catalog
    elif ":" in name:
        module, _, attr = name.partition(":")
        builder = getattr(importlib.import_module(module), attr)
    else:
        raise ModelError("model", f"unknown model {name!r}",
                         f"a built-in name (parallax models), one of {sorted(BUILDERS)}, or 'package.module:function'")
    torch.manual_seed(seed)
    model = builder()
    if not isinstance(model, HFStage) and hasattr(model, "config") and hasattr(model.config, "model_type"):
        model = HFStage(model)
    for sub in model.modules():  # dropout would make ranks and the reference diverge
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
    return model


def vocab_size(model: nn.Module) -> int:
    """Vocabulary size, read from the first embedding."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise ModelError("model", "no nn.Embedding found", "the executor trains token models")
