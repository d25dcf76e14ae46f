"""What a mixture-of-experts layer reads when it serves a batch of tokens.

A step routes each of its tokens to top_k of the layer's E experts, and only the experts some
token chose are read from HBM. With routing spread evenly over the experts (what the
load-balancing loss these models train with aims at), one expert is left untouched by b tokens
with probability (1 - k/E)^b, so a step reads the expected share 1 - (1 - k/E)^b of the expert
weights: k/E for a single token, nearly all of them once b is a few times E/k. Routing that is
skewed towards a few experts reads less; this is the even-routing figure.

The FLOPs need no such share: the tracer counts the routed tokens' expert GEMMs only
(`LayerProfile.expert_flops`).

How a replica's ranks hold the experts decides what its slowest rank does (`ExpertLoad`):
- split (the engines' default under TP): every rank holds a 1/tp slice of every expert, so
  each reads its slice of the touched experts and computes 1/tp of every routed token;
- expert-parallel (vLLM's --enable-expert-parallel, SGLang's and TensorRT-LLM's --ep-size
  equal to tp): each rank holds E/tp experts whole, and the step waits for the busiest one,
  the rank whose experts the tokens touched most. Its expected share is sampled (seeded):
  the maximum of dependent counts has no closed form. Few tokens each draw k distinct
  experts; many (past EXACT_DRAWS choices a sample) take each expert as chosen by each token
  independently with probability k/E, which keeps the expected counts and, at that size, their
  spread.
  With attention still TP-split, every rank sees every token, and the experts' outputs are
  summed by the same all-reduce as under TP: the two differ in reads and work, not traffic.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .workload import LayerProfile

SAMPLES = 256  # routing draws per (experts, top_k, tokens, ranks): the busiest rank's mean to about 1%
EXACT_DRAWS = 4096  # tokens * experts per sample up to which each token's k distinct experts are drawn


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


def weights_read(layer: LayerProfile, params_on_rank: float, tp_split: int, load: "ExpertLoad") -> float:
    """Parameters a rank holding `params_on_rank` of `layer` (its experts' split `tp_split` ways)
    reads for a step: its dense weights whole, and `load`'s share of the experts."""
    return params_on_rank - layer.expert_params / tp_split + layer.expert_params * load.weights


@dataclass(frozen=True)
class ExpertLoad:
    """What the busiest rank of a replica does of one MoE layer's expert work for a step's tokens."""

    weights: float  # share of the layer's expert weights it reads
    work: float  # share of the routed tokens' expert GEMMs it runs
    slices: int  # ways each expert's weights are split (its GEMMs' smallest dimension shrinks with them)


def expert_load(layer: LayerProfile, n_experts: int, seq_len: int, tokens: float, tp: int,
                expert_parallel: bool) -> ExpertLoad:
    """The busiest of `tp` ranks' share of `layer`'s experts for `tokens` routed tokens: split
    evenly when each expert is sliced over TP, the expected busiest when the ranks hold whole
    experts (`expert_parallel`, E divisible by tp)."""
    touched = expert_share_read(layer, n_experts, seq_len, tokens)
    if not expert_parallel or tp == 1 or not layer.expert_params:
        return ExpertLoad(weights=touched / tp, work=1.0 / tp, slices=tp)
    if n_experts % tp:
        raise ValueError(f"{n_experts} experts do not split evenly over {tp} ranks")
    top_k = routed_top_k(layer, n_experts, seq_len)
    weights, work = _busiest_rank(n_experts, round(top_k, 6), max(1, round(tokens)), tp)
    return ExpertLoad(weights=weights, work=work, slices=1)


@lru_cache(maxsize=4096)
def _busiest_rank(n_experts: int, top_k: float, tokens: int, ranks: int) -> tuple[float, float]:
    """(share of the experts, share of the routed work) of the busiest of `ranks` ranks holding
    n_experts / ranks experts each, expected over seeded routing draws."""
    rng = np.random.default_rng(0)
    k = int(round(top_k))
    if tokens * n_experts <= EXACT_DRAWS and k == top_k:
        chosen = rng.random((SAMPLES, tokens, n_experts)).argpartition(k - 1, axis=2)[:, :, :k]
        counts = np.zeros((SAMPLES, n_experts))
        np.add.at(counts, (np.arange(SAMPLES)[:, None, None], chosen), 1)
        counts = counts.reshape(SAMPLES, ranks, n_experts // ranks)
    else:
        counts = rng.binomial(tokens, top_k / n_experts, size=(SAMPLES, ranks, n_experts // ranks))
    touched = (counts > 0).sum(axis=2).max(axis=1).mean() / n_experts
    work = counts.sum(axis=2).max(axis=1).mean() / (tokens * top_k)
    return float(touched), float(min(1.0, work))
