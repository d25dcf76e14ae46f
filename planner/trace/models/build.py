"""A catalog model as a torch module with random weights.

The planner traces it (on the meta device or under FakeTensor) and the
executor trains it, from the same catalog entry: one model, one workload.
The reference GPT family (`model_type: reference-gpt`) is built from this
project's own module; every other family through `transformers`.
"""
from __future__ import annotations

from torch import nn

from hardware.errors import ModelError
from planner.trace.models.catalog import hf_config, model_config
from planner.trace.models.reference_gpt import GPTConfig, ReferenceGPT

REFERENCE = "reference-gpt"


def is_reference(name: str) -> bool:
    return model_config(name).get("model_type") == REFERENCE


def reference_config(name: str, n_layers: int | None = None) -> GPTConfig:
    """The entry's GPTConfig; `n_layers` overrides the depth (tracing builds two blocks)."""
    cfg = model_config(name)
    return GPTConfig(vocab_size=cfg["vocab_size"], n_layers=n_layers or cfg["num_hidden_layers"],
                     hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"], ffn_hidden=cfg.get("intermediate_size"),
                     max_seq_len=cfg["max_position_embeddings"], tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def build_module(name: str, depth: int | None = None) -> nn.Module:
    """The catalog model `name`: a ReferenceGPT, or an HF causal LM from its config (`depth`:
    that many blocks, as the tracer builds it)."""
    if is_reference(name):
        return ReferenceGPT(reference_config(name, depth))
    config = hf_config(name)
    if depth is not None:
        from planner.trace.hf import reduced_config

        config = reduced_config(config, depth)[0]
    config._attn_implementation = "sdpa"
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as error:  # encoder or encoder-decoder families
        raise ModelError("model", f"{name} is not a causal language model the executor can train ({error})",
                         "use a decoder-only model such as gpt2 or llama-3-8b") from None
