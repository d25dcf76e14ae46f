"""Analytic workload of a decoder-only (GPT/Llama-style) transformer from its dimensions.

Used where only dimensions are known (the published-runs benchmark, quick
what-ifs) and as the cross-check for traced workloads. Activation bytes follow
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4: per layer and sequence, s*h*(34 + 5*a*s/h) bytes
in 16-bit with dropout, of which 10*s*h stay replicated under tensor
parallelism, 24*s*h are split, and 5*a*s^2 are attention scores. Here the
same accounting is generalised to grouped-query attention, gated MLPs and
models without dropout.
"""
from __future__ import annotations

from dataclasses import dataclass

from .workload import LayerProfile, Segment, Workload


@dataclass(frozen=True)
class TransformerDims:
    n_layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    dropout: bool = False
    biases: bool = True
    tied_embeddings: bool = False
    learned_positions: bool = True
    flash_attention: bool = True
    dtype_bytes: int = 2
    name: str = "transformer"
    n_experts: int = 0  # mixture of experts: every MLP is n_experts experts, top_k of them per token
    top_k: int = 0

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


def _block(d: TransformerDims) -> LayerProfile:
    s, h, f, b = d.seq_len, d.hidden, d.ffn, d.dtype_bytes
    kv_dim = h * d.kv // d.heads
    mlp_params = (3 if d.gated_mlp else 2) * h * f
    moe = d.n_experts > 0 and d.top_k > 0
    active = d.top_k if moe else 1  # MLPs each token runs
    expert_params = d.n_experts * mlp_params if moe else 0
    linear_params = h * (h + 2 * kv_dim) + h * h + mlp_params
    bias_params = (h + 2 * kv_dim + h + f + h) if d.biases else 0
    norm_params = (4 if d.biases else 2) * h
    mask = 1 if d.dropout else 0  # dropout masks are 1 byte per element
    # Replicated under TP: both norm inputs, both norm outputs (inputs of the
    # column-parallel GEMMs), and the two post-GEMM dropout masks.
    replicated = s * h * (4 * b + 2 * mask)
    # Split under TP: Q, K, V, the attention output (o_proj input), and the MLP
    # intermediates (gelu: its input and output; gated: gate, up, act, product).
    mlp_saved = (4 if d.gated_mlp else 2) * s * f * b * active
    sharded = s * (h + 2 * kv_dim + h) * b + mlp_saved
    # softmax output, and with dropout its mask and output (5*a*s^2 bytes in 16-bit)
    scores = 0.0 if d.flash_attention else d.heads * s * s * (b + mask + (b if d.dropout else 0))
    softmax_traffic = 0 if d.flash_attention else 2 * d.heads * s * s * b
    act_traffic = (5 if d.gated_mlp else 2) * s * f * b * active
    router = h * d.n_experts if moe else 0
    # the op policy (torchtitan's) keeps the odd-numbered multiplies of q, k, v, o, (gate,) up, down:
    # q, v and gate (or up) TP-split, the down projection's partial sums whole (a gelu MLP's is the
    # sixth: recomputed); the attention kernel's output (its scores on the math path); and recomputes
    # k, o and the sixth
    op_split = s * (h + kv_dim + h) * b + s * f * b * active + (0 if d.flash_attention else d.heads * s * s * b)
    op_whole = s * h * b if d.gated_mlp else 0
    op_recomputed = 2.0 * s * (h * kv_dim + h * h + h * f * active)
    return LayerProfile(
        name="block",
        kind="block",
        params=linear_params - (mlp_params if moe else 0) + expert_params + router + bias_params + norm_params,
        matmul_flops=2.0 * s * (linear_params + (active - 1) * mlp_params + router),
        expert_params=expert_params,
        expert_flops=2.0 * s * active * mlp_params if moe else 0.0,
        expert_tokens=s * d.top_k / d.n_experts if moe else 0.0,
        expert_dispatch_bytes=float(s * d.top_k * h * b) if moe else 0.0,
        matmul_min_dim=min(h, f),
        largest_weight=max(h * f, h * h),
        attention_flops=4.0 * s * s * h,
        # two norms and two residual adds (read+write), the MLP activation.
        elementwise_bytes=float(s * h * b * 10 + act_traffic + softmax_traffic),
        act_replicated=float(replicated),
        act_tp_sharded=float(sharded),
        act_attention_scores=float(scores),
        act_input=float(s * h * b),
        act_op_split=float(op_split),
        act_op_whole=float(op_whole),
        act_op_reduced=float(2 * s * h * b),
        op_recompute_flops=op_recomputed,
        tp_allreduces_fwd=2,
        tp_comm_bytes=float(s * h * b),
        boundary_bytes=float(s * h * b),
        # q, k and v read the first norm's output, o the attention's, the MLP the second norm's (a mixture
        # of experts: the router that, its experts the tokens routed to them), the down projection the
        # activation's; the outputs are each projection's own
        gemm_input_elements=float(s * (2 * h + h + (h * active if moe else 0) + f * active)),
        gemm_output_elements=float(s * (2 * h + 2 * kv_dim + active * ((2 if d.gated_mlp else 1) * f + h)
                                        + (d.n_experts if moe else 0))),
        gemm_casts=(4 + (1 if moe else 0)) + (4 + (3 if d.gated_mlp else 2) + (1 if moe else 0)),
    )


def _embedding(d: TransformerDims) -> LayerProfile:
    s, h, b = d.seq_len, d.hidden, d.dtype_bytes
    params = d.vocab * h + (d.seq_len * h if d.learned_positions else 0)
    return LayerProfile(
        name="embedding",
        kind="embedding",
        params=params,
        largest_weight=d.vocab * h,
        matmul_flops=0.0,
        matmul_min_dim=h,
        elementwise_bytes=float(3 * s * h * b),
        act_replicated=float(s * h * (1 if d.dropout else 0)),
        act_input=0.0,
        # vocab-parallel embedding: one all-reduce of the looked-up rows.
        tp_allreduces_fwd=1,
        tp_comm_bytes=float(s * h * b),
        boundary_bytes=float(s * h * b),
    )


def _head(d: TransformerDims) -> LayerProfile:
    s, h, v, b = d.seq_len, d.hidden, d.vocab, d.dtype_bytes
    return LayerProfile(
        name="head",
        kind="head",
        params=(0 if d.tied_embeddings else v * h) + 2 * h,
        largest_weight=v * h,
        matmul_flops=2.0 * s * h * v,
        matmul_min_dim=h,
        # fp32 upcast and softmax of the logits for the loss.
        elementwise_bytes=float(s * v * (b + 8)),
        act_replicated=float(2 * s * h * b),
        act_tp_sharded=float(s * v * 4),
        act_input=float(s * h * b),
        boundary_bytes=0.0,
        gemm_input_elements=float(s * h),
        gemm_output_elements=float(s * v),
        gemm_casts=2,
    )


def transformer_workload(d: TransformerDims) -> Workload:
    return Workload(
        name=d.name,
        seq_len=d.seq_len,
        dtype_bytes=d.dtype_bytes,
        segments=[Segment(layer=_embedding(d)), Segment(layer=_block(d), count=d.n_layers), Segment(layer=_head(d))],
        heads=d.heads,
        kv_heads=d.kv,
        hidden=d.hidden,
        vocab=d.vocab,
        flash_attention=d.flash_attention,
        n_experts=d.n_experts if d.top_k else 0,
    )
