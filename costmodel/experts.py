"""What a mixture-of-experts layer reads when it serves a batch of tokens.

A step routes each of its tokens to top_k of the layer's E experts, and only the experts some
token chose are read from HBM. With routing spread evenly over the experts (what the
load-balancing loss these models train with aims at), one expert is left untouched by b tokens
with probability (1 - k/E)^b, so a step reads the expected share 1 - (1 - k/E)^b of the expert
weights: k/E for a single token, nearly all of them once b is a few times E/k. Routing that is
skewed towards a few experts reads less; this is the even-routing figure.

The FLOPs need no such share: the tracer counts the routed tokens' expert GEMMs only
(`LayerProfile.expert_flops`).
"""
from __future__ import annotations

from .workload import LayerProfile


def routed_top_k(layer: LayerProfile, n_experts: int, seq_len: int) -> float:
    """Experts each token is routed to (`expert_tokens` is seq * top_k / experts)."""
    return layer.expert_tokens * n_experts / seq_len if seq_len else 0.0


def expert_share_read(layer: LayerProfile, n_experts: int, seq_len: int, tokens: float) -> float:
    """Expected share of the layer's expert weights that `tokens` routed tokens touch (1 for a
    layer without experts, or a workload that does not say how many there are)."""
    if not layer.expert_params or n_experts <= 0:
        return 1.0
    top_k = min(float(n_experts), routed_top_k(layer, n_experts, seq_len))
    if top_k <= 0:
        return 1.0
    return 1.0 - (1.0 - top_k / n_experts) ** max(1.0, tokens)


def weights_read(layer: LayerProfile, params_on_rank: float, tp_split: int, n_experts: int, seq_len: int,
                 tokens: float) -> float:
    """Parameters one TP rank reads for `tokens` tokens through `layer`: its dense weights whole,
    the expert weights (sliced by TP as the engines' fused MoE kernels split each expert) at the
    share the tokens touch."""
    experts = layer.expert_params / tp_split
    return params_on_rank - experts * (1.0 - expert_share_read(layer, n_experts, seq_len, tokens))
