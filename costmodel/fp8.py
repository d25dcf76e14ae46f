"""FP8 training priced by its mechanism: which GEMMs run in FP8, and what feeding them costs.

Which GEMMs: the blocks' projections (experts included). The LM head stays a bf16 GEMM, as
Transformer Engine recipes under Megatron-LM/NeMo keep the output layer a plain linear and
torchao's float8 conversion in torchtitan leaves `output` out by its module filter; the
attention core (scores, softmax, values) stays bf16 in both (FP8 attention is a separate kernel
neither recipe turns on).

What feeding them costs: each FP8 GEMM operand is cast from 16 bits with a scale from its
absolute maximum (amax): the activations a GEMM reads, in the forward; the gradient of its
output, in the backward; its weight. Hopper's FP8 GEMM takes its second operand transposed, so
the weight-gradient GEMM needs transposed FP8 copies of the input and of the gradient, written
beside the cast. Bytes moved per element cast, by stack (`CastRecipe`):

- fused: Transformer Engine with delayed scaling (the scale from earlier steps' amax history, no
  pass to find it). The kernel that produces a GEMM's input writes its FP8 copy and the
  transpose itself (LayerNormLinear's norm, LayerNormMLP's activation): 2 bytes written. A
  gradient goes through `cast_transpose`: 2 read, 2 written. The weights are cast once a step
  (Megatron-LM passes `is_first_microbatch`, and later micro-batches reuse the copy): 4 bytes.
  The amax history is all-reduced once per step: a few kilobytes, not priced.
- compile: torchao's Float8Linear, tensorwise dynamic scaling, fused by inductor: an amax pass
  (2 read) and a scale-and-cast pass (2 read, the FP8 copy and its transpose written): 6 bytes,
  the weights too, at every micro-batch's forward.
- eager: the same casts, each op its own kernel: abs (2 read, 2 written) and max (2 read) for
  the amax; the upcast to fp32 (2, 4), the multiply by the scale (4, 4), the saturating clamp
  (4, 4) and the cast to FP8 (4, 1); a transposed copy (1, 1): 35 bytes.

Dynamic scaling of a TP-split tensor needs its amax over the TP group: one small all-reduce per
cast on the compile and eager stacks (`amax_all_reduces`), latency-bound.
"""
from __future__ import annotations

from dataclasses import dataclass

from .workload import LayerProfile

FP8_LAYER_KINDS = ("block",)  # the head and the embedding stay 16-bit


@dataclass(frozen=True)
class CastRecipe:
    """Bytes moved per element cast to FP8, by operand, on one kernel stack."""

    activation: float  # a GEMM's input, each forward
    gradient: float  # the gradient of a GEMM's output, each backward
    weight: float  # a weight element, once per step (`weight_each_micro_batch` False) or per micro-batch
    weight_each_micro_batch: bool
    dynamic_amax: bool  # the scale from this tensor's own amax (all-reduced over TP for a split tensor)


CAST_RECIPES = {
    "fused": CastRecipe(activation=2.0, gradient=4.0, weight=4.0, weight_each_micro_batch=False, dynamic_amax=False),
    "compile": CastRecipe(activation=6.0, gradient=6.0, weight=6.0, weight_each_micro_batch=True, dynamic_amax=True),
    "eager": CastRecipe(activation=35.0, gradient=35.0, weight=35.0, weight_each_micro_batch=True, dynamic_amax=True),
}


def low_precision_gemms(layer: LayerProfile) -> bool:
    """Whether this layer's GEMMs are the ones a low-precision recipe runs low (FP8 training, a
    served W8A8 method): the blocks', never the head's or the embedding's."""
    return layer.kind in FP8_LAYER_KINDS and layer.matmul_flops > 0


def runs_fp8(layer: LayerProfile, dtype: str) -> bool:
    """Whether this layer's GEMMs run in FP8 under the plan's compute dtype."""
    return dtype == "fp8" and low_precision_gemms(layer)


def gemm_dtype(layer: LayerProfile, dtype: str, block_gemms: str | None = None) -> str:
    """The dtype this layer's GEMMs run in: FP8 in the blocks, bf16 elsewhere under FP8; a served
    quantization's `block_gemms` (W8A8: int8) in the same layers."""
    if block_gemms is not None and low_precision_gemms(layer):
        return block_gemms
    if dtype != "fp8":
        return dtype
    return "fp8" if runs_fp8(layer, dtype) else "bf16"


def cast_bytes(layer: LayerProfile, dtype: str, stack: str, micro_batch: float, split: int) -> tuple[float, float]:
    """(forward, backward) bytes one micro-batch's FP8 casts move on one rank (`split`: its TP
    share of the layer); the weights' own cast where the stack repeats it per micro-batch."""
    if not runs_fp8(layer, dtype):
        return 0.0, 0.0
    recipe = CAST_RECIPES[stack]
    forward = recipe.activation * layer.gemm_input_elements * micro_batch / split
    if recipe.weight_each_micro_batch:
        forward += recipe.weight * layer.params / split
    backward = recipe.gradient * layer.gemm_output_elements * micro_batch / split
    return forward, backward


def weight_cast_bytes_per_param(dtype: str, stack: str) -> float:
    """Bytes per weight a step's once-a-step cast moves (the fused stack's cached FP8 weights)."""
    if dtype != "fp8" or CAST_RECIPES[stack].weight_each_micro_batch:
        return 0.0
    return CAST_RECIPES[stack].weight


def amax_all_reduces(layer: LayerProfile, dtype: str, stack: str, split: int) -> int:
    """Amax all-reduces over the TP group a micro-batch's forward and backward issue: one per
    dynamically scaled cast of a TP-split layer."""
    if not runs_fp8(layer, dtype) or split == 1 or not CAST_RECIPES[stack].dynamic_amax:
        return 0
    return layer.gemm_casts
