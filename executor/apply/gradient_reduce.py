"""Data-parallel gradient reduction for replicated weights outside DDP.

DDP takes one plain-tensor module run once per micro-batch, and only ZeRO-0 goes through
it. Tensor-parallel weights (DTensors), pipeline stages (whose backwards torch's
schedules run) and ZeRO-1 come here. FSDP2's `replicate` used to take the first two, but
it runs each weight as an FSDP2 parameter of one shard: its "unsharded" weight is a copy
of the full one, held from the forward to the end of the backward, so the rank held its
weights twice (Llama 3 8B at pp2: 13.8 GiB the cost model never priced).

`DataParallelGradients` keeps the weights as they are and reduces each gradient in
place: an all-reduce under ZeRO-0; under ZeRO-1 a reduce-scatter of the rows each rank
steps (`zero_one.row_span`), the reduction the cost model prices for a sharded optimizer,
half an all-reduce's traffic. It then averages over dp. In a plain step each
gradient's reduction starts as soon as the last micro-batch's backward has accumulated
it, overlapping the rest of that backward. Under a pipeline schedule they all run when
the step syncs, as FSDP2 under torch's schedules reduces once the schedule ends: the
schedule divides the gradients by the micro-batches after its last backward, which must
not meet a reduction in flight. Either way every rank issues the same collectives in the
same order (the backward's, or the module's parameter order).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from executor.apply.zero_one import local_grad, row_span

REDUCER = "parallax_gradient_reducer"


class DataParallelGradients:
    """Averages `module`'s dense gradients over `group` of `size` ranks, whole (`rows` False)
    or only the rows this rank steps under ZeRO-1 (`rows` True: the others stay unreduced).
    Experts reduce on their own replicas (executor/apply/expert_parallel.py: ExpertGradients).
    A plain step arms it for its last micro-batch (`data_parallel.sync_context`); nothing arms
    it under a pipeline schedule."""

    def __init__(self, module: nn.Module, group, size: int, rows: bool) -> None:
        seen, self.params = set(), []
        for p in module.parameters():
            if p.requires_grad and not hasattr(p, "expert_parallel") and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.group, self.size, self.rows = group, size, rows
        self.rank = dist.get_rank(group)
        self.armed = False
        self.works: list = []
        self.launched: set[int] = set()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def arm(self, last_micro_batch: bool) -> None:
        """Whether the coming backward is the step's last for this replica."""
        self.armed = last_micro_batch

    def _accumulated(self, param: torch.Tensor) -> None:
        if self.armed and id(param) not in self.launched:
            self.launched.add(id(param))
            self.works += self._reduce(local_grad(param), async_op=True)

    def _reduce(self, grad: torch.Tensor, async_op: bool) -> list:
        if not self.rows or grad.dim() == 0:
            return [dist.all_reduce(grad, group=self.group, async_op=async_op)]
        spans = [row_span(grad.shape[0], self.size, r) for r in range(self.size)]
        if grad.shape[0] % self.size == 0 and grad.is_contiguous():  # in place: our rows are our chunk
            lo, hi = spans[self.rank]
            return [dist.reduce_scatter_tensor(grad.narrow(0, lo, hi - lo), grad, group=self.group, async_op=async_op)]
        return [dist.reduce(grad.narrow(0, lo, hi - lo), dst=dist.get_global_rank(self.group, r), group=self.group,
                            async_op=async_op) for r, (lo, hi) in enumerate(spans) if hi > lo]

    def _mine(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.rows or grad.dim() == 0:
            return grad
        lo, hi = row_span(grad.shape[0], self.size, self.rank)
        return grad.narrow(0, lo, hi - lo)

    @torch.no_grad()
    def sync(self) -> None:
        """Wait for the reductions launched in the backward, reduce what they missed, average."""
        for work in self.works:
            if work is not None:
                work.wait()
        for p in self.params:
            if p.grad is not None and id(p) not in self.launched:
                self._reduce(local_grad(p), async_op=False)
        for p in self.params:
            if p.grad is not None:
                self._mine(local_grad(p)).div_(self.size)
        self.works, self.launched = [], set()
        self.armed = False


def attach(module: nn.Module, group, size: int, rows: bool) -> nn.Module:
    setattr(module, REDUCER, DataParallelGradients(module, group, size, rows))
    return module


def reducer_of(module: nn.Module) -> DataParallelGradients | None:
    return getattr(module, REDUCER, None)
