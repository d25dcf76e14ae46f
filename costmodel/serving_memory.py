"""What a served model holds per GPU: its weights (in the served dtype or quantized) and its
KV cache per token (grouped-query aware: TP splits the KV heads until each rank keeps one), on
the heaviest of a uniform pipeline's stages. `costmodel.inference` prices time and capacity
from them.
"""
from __future__ import annotations

from hardware.engines import WeightQuantization
from hardware.errors import ModelError
from layout.plan import uniform_stages

from .workload import LayerProfile, Workload


def _dims(workload: Workload) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) from the workload's metadata."""
    if not workload.heads or not workload.hidden:
        raise ModelError("model", f"{workload.name} does not record heads/hidden", "serving needs an attention model")
    kv = workload.kv_heads or workload.heads
    return workload.heads, kv, workload.hidden // workload.heads


def kv_heads_per_rank(workload: Workload, tp: int) -> float:
    _, kv, _ = _dims(workload)
    return kv / tp if tp <= kv else 1.0


KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}  # a KV cache element (vLLM's, SGLang's and TensorRT-LLM's fp8 KV)


def kv_element_bytes(workload: Workload, kv_dtype: str | None) -> float:
    """Bytes of one cached key or value element: the KV dtype's, else the workload's activations'
    (16-bit under FP8 weights: an engine keeps a 16-bit cache unless told otherwise)."""
    return float(KV_DTYPE_BYTES[kv_dtype]) if kv_dtype else float(workload.dtype_bytes)


def kv_bytes_per_token(workload: Workload, kv_dtype: str | None = None) -> float:
    """K and V of every block for one token, whole model."""
    _, kv, head_dim = _dims(workload)
    return 2.0 * workload.n_blocks * kv * head_dim * kv_element_bytes(workload, kv_dtype)


def kv_per_token_per_block_rank(workload: Workload, tp: int, kv_dtype: str | None = None) -> float:
    _, _, head_dim = _dims(workload)
    return 2.0 * kv_heads_per_rank(workload, tp) * head_dim * kv_element_bytes(workload, kv_dtype)


def stage_runs_of(workload: Workload, pp: int) -> list[list[tuple[LayerProfile, int]]]:
    """Megatron-style uniform partition, each stage as runs of (layer, count)."""
    kinds = [layer.kind for layer in workload.layers]
    out = []
    for stage in uniform_stages(kinds, pp):
        runs: list[tuple[LayerProfile, int]] = []
        position = 0
        for seg in workload.segments:
            lo, hi = max(stage.start, position), min(stage.end, position + seg.count)
            position += seg.count
            if lo < hi:
                runs.append((seg.layer, hi - lo))
        out.append(runs)
    return out


def params_on_tp_rank(layer: LayerProfile, tp: int) -> float:
    return layer.params / (tp if layer.tp_shardable else 1)


def kv_bytes_per_token_per_gpu(workload: Workload, tp: int, pp: int, kv_dtype: str | None = None) -> float:
    """KV bytes one token adds on the GPU of the stage with the most blocks."""
    blocks = max(sum(n for layer, n in runs if layer.kind == "block") for runs in stage_runs_of(workload, pp))
    return blocks * kv_per_token_per_block_rank(workload, tp, kv_dtype)


def served_weight_bytes(workload: Workload, dtype: str, quantization: WeightQuantization | None = None) -> float:
    """Bytes per served weight: FP8 serving stores and reads 1-byte weights, a weight-only method
    its packed bits and its groups' scales and zero points (the KV cache and activations stay in
    the workload's 16-bit dtype)."""
    if quantization is not None:
        return quantization.bytes_per_weight
    return 1.0 if dtype == "fp8" else workload.dtype_bytes


def weight_bytes_per_gpu(workload: Workload, tp: int, pp: int, dtype: str = "bf16",
                         quantization: WeightQuantization | None = None) -> float:
    """Weights of the heaviest stage on one of its TP ranks."""
    held = max(sum(params_on_tp_rank(l, tp) * n for l, n in runs) for runs in stage_runs_of(workload, pp))
    return held * served_weight_bytes(workload, dtype, quantization)
