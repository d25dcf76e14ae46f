"""A model given by its dimensions (`costmodel.transformer.TransformerDims`), handed to the
tracer as the architecture those dimensions describe, so it is priced like the same model
named, configured or built (issue 31: one price whatever the door).

A gated MLP is a Llama-era decoder: an HF llama config (a mixtral one with experts), rotary
positions, RMSNorm, no biases. Without one it is a GPT-era decoder: the reference GPT's
`GPTConfig` (learned positions, LayerNorm, GELU MLP, biases, the head tied to the embedding as
Megatron-LM ties it). The flags the tracer cannot change on those (biases, dropout) are the
architecture's own; `flash_attention` False moves the attention to torch's math path.
"""
from __future__ import annotations

from typing import Any

from costmodel.attention import on_path
from costmodel.transformer import TransformerDims
from costmodel.workload import Workload


def model_of_dims(d: TransformerDims) -> Any:
    """The config the tracer takes for these dimensions (an HF dict, or a `GPTConfig`)."""
    if not d.gated_mlp:
        from planner.trace.models.reference_gpt import GPTConfig

        return GPTConfig(vocab_size=d.vocab, n_layers=d.n_layers, hidden=d.hidden, heads=d.heads,
                         ffn_hidden=d.ffn, max_seq_len=d.seq_len, tie_embeddings=True)
    config = {"model_type": "llama", "hidden_size": d.hidden, "intermediate_size": d.ffn,
              "num_hidden_layers": d.n_layers, "num_attention_heads": d.heads, "num_key_value_heads": d.kv,
              "vocab_size": d.vocab, "max_position_embeddings": d.seq_len,
              "tie_word_embeddings": d.tied_embeddings, "hidden_act": "silu"}
    if d.n_experts:
        config.update(model_type="mixtral", num_local_experts=d.n_experts, num_experts_per_tok=d.top_k or 2)
    return config


def on_its_attention_path(workload: Workload, d: TransformerDims) -> Workload:
    """The traced workload on the attention path the dimensions state."""
    return workload if d.flash_attention else on_path(workload, "math")
