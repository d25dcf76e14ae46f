"""Data-parallel gradient averaging for replicated weights that DDP cannot hold.

DDP takes one plain-tensor module run once per micro-batch. Tensor-parallel weights
(DTensors) and pipeline stages (whose backwards torch's schedules run) need another way.
FSDP2's `replicate` was that way, but it runs each weight as an FSDP2 parameter of one
shard: its "unsharded" weight is a copy of the full one, held from the forward to the end
of the backward, so the rank holds its weights twice. Llama 3 8B at pp2 carried 13.8 GiB
the cost model never priced.

`GradientAllReduce` keeps the weights as they are and all-reduces each gradient in place,
as DDP does, then averages over dp. In a plain step each gradient's all-reduce starts as
soon as the last micro-batch's backward has accumulated it, overlapping the rest of that
backward. Under a pipeline schedule they all run when the step syncs, as FSDP2 under
torch's schedules reduces once the schedule ends: the schedule divides the gradients by
the micro-batches after its last backward, which must not meet a reduction in flight.
Either way every rank issues the same collectives in the same order (the backward's, or
the module's parameter order).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from executor.apply.zero_one import local_tensor

REDUCER = "parallax_gradient_reducer"


class GradientAllReduce:
    """Averages `module`'s dense gradients over `group` (experts reduce on their own replicas,
    executor/apply/expert_parallel.py: ExpertGradients). A plain step arms it for its last
    micro-batch (`data_parallel.sync_context`); nothing arms it under a pipeline schedule."""

    def __init__(self, module: nn.Module, group, size: int) -> None:
        seen, self.params = set(), []
        for p in module.parameters():
            if p.requires_grad and not hasattr(p, "expert_parallel") and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.group, self.size = group, size
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
            self.works.append(dist.all_reduce(local_tensor(param.grad), group=self.group, async_op=True))

    @torch.no_grad()
    def sync(self) -> None:
        """Wait for the reductions launched in the backward, reduce what they missed, average."""
        for work in self.works:
            work.wait()
        for p in self.params:
            if p.grad is not None and id(p) not in self.launched:
                dist.all_reduce(local_tensor(p.grad), group=self.group)
        for p in self.params:
            if p.grad is not None:
                local_tensor(p.grad).div_(self.size)
        self.works, self.launched = [], set()
        self.armed = False


def attach(module: nn.Module, group, size: int) -> nn.Module:
    setattr(module, REDUCER, GradientAllReduce(module, group, size))
    return module


def reducer_of(module: nn.Module) -> GradientAllReduce | None:
    return getattr(module, REDUCER, None)
