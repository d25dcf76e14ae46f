"""`scaled_dot_product_attention` traced both ways a device may run it.

On CPU fake tensors torch picks the CPU's kernel (its flash loop, or the math path when
there is dropout), which is not what a GPU runs. So the tracer replaces the call for
the length of a trace (`sdpa_as`) and records what torch's kernel choice reads of it:
shapes, dtype, mask, dropout, grouped-query heads and the memory layout
(`costmodel.workload.AttentionCall`). A module is traced once with every call as one
fused kernel (torch's CPU flash op: output and log-sum-exp saved, no score matrix) and,
when it makes any call, once more on torch's math path; `costmodel.attention` chooses
between the two per device.

Why a patch of `torch.nn.functional.scaled_dot_product_attention` and not a
torch-function mode: `nn.MultiheadAttention` calls it from inside
`F.multi_head_attention_forward`, which a mode sees as one opaque call.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Literal

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _mask_kind(attn_mask, is_causal: bool) -> str:
    if attn_mask is None:
        return "causal" if is_causal else "none"
    return "bool" if attn_mask.dtype == torch.bool else "float"


def _layout(q: torch.Tensor) -> str:
    """"bshd" for [b, h, s, d] views of [b, s, h, d] tensors, "packed" for views of one
    [b, s, 3, h, d] projection, else "other" (the layouts cuDNN's kernel accepts)."""
    if q.dim() != 4:
        return "other"
    _, h, s, d = q.shape
    strides = q.stride()
    if strides[1:] == (d, h * d, 1) and strides[0] == s * h * d:
        return "bshd"
    if strides[1:] == (d, 3 * h * d, 1) and strides[0] == s * 3 * h * d:
        return "packed"
    return "other"


def describe(q, k, v, attn_mask, dropout_p: float, is_causal: bool, enable_gqa: bool) -> dict:
    """What torch's SDPA kernel choice reads of one call (`costmodel.workload.AttentionCall`)."""
    return {"heads": int(q.shape[-3]) if q.dim() >= 3 else 1, "kv_heads": int(k.shape[-3]) if k.dim() >= 3 else 1,
            "head_dim": int(q.shape[-1]), "value_dim": int(v.shape[-1]), "q_len": int(q.shape[-2]),
            "kv_len": int(k.shape[-2]), "dtype": str(q.dtype).replace("torch.", ""),
            "mask": _mask_kind(attn_mask, is_causal), "dropout": dropout_p > 0, "gqa": bool(enable_gqa),
            "layout": _layout(q)}


def _fused(q, k, v, attn_mask, dropout_p, is_causal, scale):
    """One kernel: the CPU flash op has the fused kernels' shape (output and log-sum-exp saved,
    no scores) and a fake implementation for any mask, dropout and head count. A mask that
    needs a gradient (T5's learned position bias) goes in detached: the memory-efficient
    kernel's gradient of it (one score-sized tensor in the backward) is not priced."""
    if q.dim() != 4:
        return None
    if attn_mask is not None and attn_mask.requires_grad:
        attn_mask = attn_mask.detach()
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA does before a fused kernel:
        # an additive mask in the query's dtype, which the kernel then keeps for its backward
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=attn_mask,
                                                            scale=scale)[0]


def _math(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                   enable_gqa=enable_gqa)[0]


@contextmanager
def sdpa_as(path: Literal["fused", "math"], record: Callable[[dict], None]):
    """For the duration, every `F.scaled_dot_product_attention` call is recorded (`record`)
    and run as `path`."""
    original = F.scaled_dot_product_attention

    def traced(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cpu"):  # autocast casts SDPA's inputs; the aten kernels below are not on its list
            half = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(half) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(half)
        record(describe(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa))
        out = _fused(query, key, value, attn_mask, dropout_p, is_causal, scale) if path == "fused" else None
        if out is None:
            out = _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return out

    F.scaled_dot_product_attention = traced
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
