"""A HuggingFace config from someone else, checked before anything is built from it.

Why: a config is data a user downloads or edits. `num_hidden_layers: 0` divides by zero,
`1e9` allocates until the process dies, heads that do not divide the hidden size fail
deep inside tracing, a NaN rope theta prices nothing. Each size key transformers reads is
held to a whole number in the range `hardware.limits` gives, and the head counts to the
shapes attention needs, in one line naming the key and the file.
"""
from __future__ import annotations

import math
from typing import Any

from hardware.errors import ModelError
from hardware.limits import MAX_EXPERTS, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB

SIZE_KEYS: dict[str, int] = {  # the generic and family names transformers reads, with their bounds
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers"), MAX_LAYERS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "d_ff", "d_kv",
                     "head_dim", "moe_intermediate_size"), MAX_HIDDEN * 8),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "num_key_value_heads"), MAX_HEADS),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok"), MAX_EXPERTS),
    "vocab_size": MAX_VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), MAX_SEQ_LEN),
}
ZERO_ALLOWED = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok")  # 0: a dense model
POSITIVE_FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "initializer_range")


def check_config(cfg: dict[str, Any], origin: str) -> dict[str, Any]:
    """`cfg` when its sizes are whole numbers in range and its heads fit its width, else one ModelError."""
    for key, high in SIZE_KEYS.items():
        value, low = cfg.get(key), 0 if key in ZERO_ALLOWED else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise ModelError(key, f"{value!r} in {origin} is not a whole number in [{low}, {high:,}]",
                             "a config.json written by transformers (save_pretrained)")
    for key in POSITIVE_FLOATS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ModelError(key, f"{value!r} in {origin} is not a positive finite number", "e.g. 10000.0 for rope_theta")
    _check_heads(cfg, origin)
    return cfg


def _first(cfg: dict[str, Any], *keys: str) -> int | None:
    return next((cfg[k] for k in keys if cfg.get(k) is not None), None)


def _check_heads(cfg: dict[str, Any], origin: str) -> None:
    """Query heads split the width (unless the config names its own head_dim); key/value heads split the query heads."""
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    kv = cfg.get("num_key_value_heads")
    explicit = cfg.get("head_dim") is not None or cfg.get("d_kv") is not None
    if hidden and heads and not explicit and hidden % heads:
        raise ModelError("num_attention_heads", f"{heads} heads do not divide hidden size {hidden} in {origin}",
                         f"use a head count dividing {hidden}, or give head_dim")
    if heads and kv and heads % kv:
        raise ModelError("num_key_value_heads", f"{kv} key/value heads do not divide {heads} query heads in {origin}",
                         "use a divisor of the query heads (grouped-query attention)")
