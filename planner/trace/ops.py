"""What the tracer knows at the level of aten ops: FLOP formulas that torch's counter
lacks, which ops alias or keep a parameter, the dispatch mode that records every op,
and fake-tensor stand-ins for ops whose fake kernels are narrower than their real ones.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
ALIASING = {aten._unsafe_view, aten.detach, aten.alias, aten.lift_fresh}
PARAM_PRESERVING = {aten._to_copy, aten.clone, aten.contiguous}


def _sdpa_cpu_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """FlopCounterMode has no formula for the CPU flash kernel: reuse the sdpa one.

    Convention (as torch's): 4·b·h·s_q·s_k·d, the full s² square, causal or not.
    """
    return flop_counter.sdpa_flop_count(query.shape, *_per_query_head(query, key, value))


def _sdpa_cpu_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, *_per_query_head(query, key, value))


def _per_query_head(query, key, value) -> tuple:
    """Key and value shapes with the query's head count: grouped-query attention computes one score
    matrix per query head, and torch before 2.12 asserts equal heads in its formula."""
    heads = query.shape[1]
    return (*key.shape[:1], heads, *key.shape[2:]), (*value.shape[:1], heads, *value.shape[2:])


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """A mixture of experts' grouped GEMM (HF's and torchtitan's experts): 2·M·N·K over the
    groups. Two 2-D operands are a weight gradient whose groups split the contracted dim, so its
    [groups, N1, N2] output sums over M once in all; otherwise every output element is one
    K-long dot product."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


CUSTOM_FLOPS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
    aten._grouped_mm: _grouped_mm_flops,
}
FUSED_ATTENTION = {packet for packet in (*flop_counter.flop_registry, *CUSTOM_FLOPS) if "attention" in str(packet)}


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class Recorder(TorchDispatchMode):
    """Records each aten op into the tracer's graph (sits above FakeTensorMode)."""

    def __init__(self, tracer) -> None:  # a planner.trace.module.Tracer
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "prim":
            self.tracer.current_op = str(func)
        out = run_on_fake(func, args, kwargs)
        if func.namespace != "prim":
            self.tracer.record(func, args, kwargs, out)
        return out


def run_on_fake(func, args, kwargs):
    """The op's fake result. `aten._grouped_mm` (HF's MoE experts) has a fake kernel for
    bf16 only, though CPUs run it in fp32 too: other dtypes take their shape from a bf16 run
    and keep their own dtype (the graph records the op with its real inputs)."""
    if func._overloadpacket is not torch.ops.aten._grouped_mm:
        return func(*args, **kwargs)
    floats = {t.dtype for t in tensors((args, kwargs)) if t.is_floating_point()}
    if floats <= {torch.bfloat16}:
        return func(*args, **kwargs)
    cast = lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    out = func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
    return out.to(next(iter(floats - {torch.bfloat16})))
