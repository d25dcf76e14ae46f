"""The compile stack as torchtitan runs it: each block's forward compiled by `torch.compile`.

Per block, not the whole model, so that the pipeline's cuts, FSDP2's per-block hooks and the
pipeline schedule stay outside the compiled regions, and a block's graph is built once and
reused by the blocks like it. The forward is compiled after recomputation wrapped it (a
checkpointed forward, "op" or "selective", is traced with its checkpoint), and before the data
parallelism: FSDP2's gathers and reductions run around the compiled call, in eager.

Inductor generates C++ on a CPU and Triton on a GPU: the pointwise chains between the matrix
multiplies run fused, which is what the cost model prices for the stack
(`costmodel.compute`'s fused elementwise traffic).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from layout.plan import Plan
from executor.apply.layers import LayerMap, get_or_none


def apply_compile(module: nn.Module, mesh: DeviceMesh, plan: Plan, lmap: LayerMap) -> nn.Module:
    """Compile the forward of each block this chunk holds, when the plan's stack is compile."""
    if plan.stack != "compile":
        return module
    for name in lmap.block_names:
        block = get_or_none(module, name)
        if block is not None:
            compile_forward(block)
    return module


def compile_forward(block: nn.Module) -> None:
    """`block.forward` compiled in place: the parameters keep their names (a wrapping
    OptimizedModule would prefix them), and the module's hooks run outside the graph."""
    block.forward = torch.compile(block.forward)
