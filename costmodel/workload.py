"""What the cost model prices: a model reduced to an ordered list of layers.

Tracing (planner/) and the analytic transformer builder both produce a
`Workload`; the cost model never sees torch. Quantities are per *sequence* of
`seq_len` tokens at tensor-parallel degree 1, so that micro-batch size and TP
degree are applied by the cost model alone. Repeated layers are stored once
as a `Segment` with a count, so a 126-layer model is priced from one block.
"""
from __future__ import annotations

from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

LayerKind = Literal["embedding", "block", "head", "other"]


class AttentionCall(BaseModel):
    """A layer's `scaled_dot_product_attention` calls as torch's kernel choice sees them: the
    shapes, dtype, mask, dropout and memory layout its eligibility rules read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    value_dim: int = Field(ge=1)
    q_len: int = Field(ge=1)
    kv_len: int = Field(ge=1)
    dtype: Literal["float32", "float64", "bfloat16", "float16"]
    mask: Literal["none", "causal", "bool", "float"] = Field(description="no mask, is_causal, or an explicit mask")
    dropout: bool
    gqa: bool = Field(False, description="enable_gqa: fewer key/value heads than query heads")
    layout: Literal["bshd", "packed", "other"] = Field(
        "other", description="the query/key/value strides: [b, s, h, d] transposed (what cuDNN takes), one packed "
        "QKV projection, or anything else")
    count: int = Field(1, ge=1, description="calls per layer")

    @property
    def element_bytes(self) -> int:
        """Bytes of one element of its queries, keys and values."""
        return {"float64": 8, "float32": 4}.get(self.dtype, 2)


class LayerProfile(BaseModel):
    """One layer's forward work, parameters and saved activations, per sequence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: LayerKind
    params: int = Field(ge=0)
    matmul_flops: float = Field(ge=0, description="forward GEMM FLOPs")
    matmul_min_dim: int = Field(ge=1, description="smallest GEMM weight dimension at tp=1 (with a micro-batch's "
                                "tokens, sets GEMM efficiency)")
    attention_flops: float = Field(0.0, ge=0, description="forward FLOPs of the s^2 attention core")
    elementwise_bytes: float = Field(0.0, ge=0, description="forward memory-bound traffic (norms, activations, softmax)")
    act_sp_whole: float = Field(0.0, ge=0, description="saved bytes per sequence that sequence parallelism under "
                                "DTensor keeps whole on every TP rank: each column-split linear's gathered input, "
                                "and what is not computed from the hidden states (a causal mask, rotary tables)")
    act_sp_dropped: float = Field(0.0, ge=0, description="the replicated saved bytes those whole copies replace")
    act_transient: float = Field(0.0, ge=0, description="temporaries per sequence at the layer's worst moment, "
                                 "beside its saved activations (a loss's fp32 logits and their gradients)")
    act_transient_tp: Literal["S", "R"] = Field(
        "R", description="the TP state of what sets act_transient: split, or replicated (split by SP)")
    act_allocator_slack: float = Field(0.0, ge=0, description="bytes per sequence torch's caching allocator reserves "
                                       "beyond the layer's live tensors at their peak: blocks it freed that its "
                                       "later requests are too large to reuse (the 16-bit logits beside the loss's "
                                       "fp32 ones), from a replay of its traced allocations (planner/trace/"
                                       "allocations.py); TP splits it as act_transient")
    elementwise_fused_bytes: float | None = Field(
        None, ge=0, description="the same traffic with each chain of pointwise ops fused into one kernel, as the "
                                "compile and fused stacks run it (None: elementwise_bytes, already counted fused)")
    elementwise_kernel_bytes: float | None = Field(
        None, ge=0, description="the fused chains with 16-bit inputs and outputs, as the fused stack's kernels "
                                "(Megatron-LM's, Transformer Engine's) take and return them, their fp32 math inside "
                                "(None: elementwise_fused_bytes)")
    act_replicated: float = Field(0.0, ge=0, description="saved bytes TP leaves replicated (SP splits them)")
    act_tp_sharded: float = Field(0.0, ge=0, description="saved bytes TP splits")
    act_attention_scores: float = Field(0.0, ge=0, description="saved s^2 bytes (dropped by selective recompute)")
    act_compiled_share: float | None = Field(None, ge=0, le=1, description="what the compile stack saves of the saved "
                                             "activations: torch.compile's min-cut partition recomputes pointwise ops "
                                             "in the backward (planner/trace/partition.py; None: not traced, kept whole)")
    act_input: float = Field(0.0, ge=0, description="bytes kept under full recompute (the layer input)")
    act_op_split: float | None = Field(None, ge=0, description="bytes per sequence the op policy keeps that TP "
                                       "splits: the saved outputs of column-split products and of attention "
                                       "kernels (None: not traced; the op policy is then priced as none)")
    act_op_whole: float = Field(0.0, ge=0, description="bytes per sequence the op policy keeps whole on every TP "
                                "rank: the saved outputs of row-split products (their partial sums) and unsplit ones")
    act_op_reduced: float = Field(0.0, ge=0, description="bytes per sequence of the row-split products' outputs: "
                                  "under SP the op policy keeps their reduce-scatter's shard")
    op_recompute_flops: float = Field(0.0, ge=0, description="forward FLOPs per sequence of the products the op "
                                      "policy recomputes (every second matrix multiply)")
    tp_shardable: bool = True
    tp_allreduces_fwd: int = Field(0, ge=0, description="activation all-reduces per forward under TP")
    tp_comm_bytes: float = Field(0.0, ge=0, description="bytes of one such all-reduce, per sequence")
    tp_allreduces_bwd: int | None = Field(None, ge=0, description="activation all-reduces per backward under TP, "
                                          "of tp_comm_bytes each (None: as many as the forward, Megatron's mirror)")
    boundary_bytes: float = Field(0.0, ge=0, description="output bytes sent to the next pipeline stage")
    grad_dense_bytes: float = Field(0.0, ge=0, description="bytes of dense weight gradient a backward materialises "
                                    "whatever the batch (an embedding's [vocab, hidden] table: zero-filled, "
                                    "scattered into, accumulated), per micro-batch")
    host_ops_forward: int = Field(0, ge=0, description="aten ops one micro-batch's forward of the layer dispatches "
                                  "(traced): eager PyTorch issues each from the host, and a layer runs no faster than "
                                  "the host issues its ops (0: not traced, no such floor)")
    host_ops_backward: int = Field(0, ge=0, description="the same for its backward: autograd's ops, each found by the "
                                   "module whose forward recorded it")
    host_ops_saved: int = Field(0, ge=0, description="tensors its forward saves for backward (every save, parameters "
                                "and views too): a checkpoint's recompute dispatches the forward's ops again and a "
                                "detach of each")
    largest_weight: int = Field(0, ge=0, description="elements of the layer's largest weight (a tied one included): "
                                "its gradient is one tensor that size per backward, which a host allocator maps fresh")
    expert_params: int = Field(0, ge=0, description="mixture-of-experts weights (part of params): the executor "
                               "keeps them whole under TP, every TP rank computing every routed token's experts")
    expert_flops: float = Field(0.0, ge=0, description="FLOPs of the expert GEMMs (part of matmul_flops), per sequence")
    expert_dispatch_bytes: float = Field(0.0, ge=0, description="activations an expert-parallel layer sends to its "
                                         "experts per sequence: seq * top_k * hidden * bytes (and as many back)")
    expert_tokens: float = Field(0.0, ge=0, description="tokens each expert computes per sequence: seq * top_k / experts "
                                 "(the M of its GEMMs)")
    gemm_input_elements: float = Field(0.0, ge=0, description="elements per sequence of the activations the layer's "
                                       "weight GEMMs read, each tensor once (projections sharing an input read it "
                                       "once): what FP8 training casts in the forward")
    gemm_output_elements: float = Field(0.0, ge=0, description="elements per sequence of those GEMMs' outputs: the "
                                        "gradients FP8 training casts in the backward")
    gemm_casts: int = Field(0, ge=0, description="tensors those are: distinct GEMM inputs plus GEMM outputs (each "
                            "cast is scaled by its own amax)")
    tied_params: int = Field(0, ge=0, description="parameters shared with an earlier layer (a tied LM head), "
                             "counted there; a pipeline stage holding this layer keeps its own copy of them")
    attention: AttentionCall | None = Field(None, description="its scaled_dot_product_attention calls, if any")
    attention_path: Literal["fused", "math"] | None = Field(
        None, description="how this profile runs them: one fused kernel (flash, memory-efficient, cuDNN, the CPU's "
        "flash loop: no scores kept) or torch's math path (scores materialised, softmaxed, dropped out, saved)")
    under_autocast: "LayerProfile | None" = Field(None, description="the same layer traced over fp32 weights under "
                                                  "torch.autocast: what it keeps where a plan casts its weights per "
                                                  "use (`costmodel.autocast.under_autocast`)")
    other_path: "LayerProfile | None" = Field(None, description="the same layer on the other attention path, for "
                                              "the device whose kernel choice needs it (`costmodel.attention`)")


def layer_params_on_rank(layer: LayerProfile, tp: int, ep: int = 1) -> float:
    """A rank's share of the layer's weights: the TP-split ones / tp, the experts / ep
    (whole under TP, as DTensor leaves them)."""
    split = tp if layer.tp_shardable else 1
    return (layer.params - layer.expert_params) / split + layer.expert_params / ep


def tied_params_on_rank(layer: LayerProfile, tp: int) -> float:
    """A rank's share of the weight `layer` shares with another (a head tied to its embedding),
    split by TP as the layer's own are."""
    return layer.tied_params / (tp if layer.tp_shardable else 1)


class Segment(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    layer: LayerProfile
    count: int = Field(1, ge=1)


class Workload(BaseModel):
    """A model as a sequence of (layer, repeat count) segments at one sequence length."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    seq_len: int = Field(gt=0)
    dtype_bytes: int = Field(2, gt=0)
    segments: list[Segment]
    heads: int | None = None
    kv_heads: int | None = None
    hidden: int | None = None
    vocab: int | None = None
    flash_attention: bool = True
    n_experts: int = Field(0, ge=0, description="experts per mixture-of-experts layer (0: dense)")
    max_seq_len: int | None = Field(None, description="longest sequence the model takes (learned positions), if any")
    attention_backend: str | None = Field(None, description="the attention kernel its layers are priced with, once "
                                          "chosen for a device (`costmodel.attention.for_device`); None: as traced")

    @cached_property
    def layers(self) -> list[LayerProfile]:
        """The expanded layer list; stage boundaries index into it."""
        return [seg.layer for seg in self.segments for _ in range(seg.count)]

    @property
    def n_layers(self) -> int:
        return sum(seg.count for seg in self.segments)

    @property
    def n_blocks(self) -> int:
        return sum(seg.count for seg in self.segments if seg.layer.kind == "block")

    @property
    def params(self) -> int:
        return sum(seg.layer.params * seg.count for seg in self.segments)

    def forward_flops(self) -> float:
        """Model forward FLOPs per sequence (GEMMs plus the attention core)."""
        return sum((s.layer.matmul_flops + s.layer.attention_flops) * s.count for s in self.segments)

    def max_tp(self) -> int | None:
        """Largest TP degree any layer could take, or None when only divisibility limits it."""
        if any(not seg.layer.tp_shardable and seg.layer.kind == "block" for seg in self.segments):
            return 1
        return None

    def tp_divides(self, tp: int) -> bool:
        """Whether every TP-split dimension divides evenly by `tp`."""
        if tp == 1:
            return True
        if self.max_tp() == 1:
            return False
        for dim in (self.heads, self.kv_heads):
            if dim is not None and dim % tp != 0 and tp % dim != 0:
                return False
        return self.heads is None or self.heads % tp == 0
