"""ZeRO-1 over DTensor parameters (TP, or FSDP2's replicate).

ZeroRedundancyOptimizer shards AdamW's state over the dp group, but it takes
plain tensors only. Each DTensor parameter's local shard is therefore handed
to it as a plain parameter sharing the shard's storage: the owning dp rank
updates it in place and broadcasts it, which writes straight into the DTensor.
Before each step the local gradient shards are attached to those views.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class LocalShardZero:
    """AdamW with its state sharded over `group`, stepping the local shards of `params`."""

    def __init__(self, params: list[nn.Parameter], group, lr: float) -> None:
        self.params = params
        self.views = [nn.Parameter(_local(p).detach()) for p in params]
        self.inner = ZeroRedundancyOptimizer(self.views, optimizer_class=torch.optim.AdamW, process_group=group, lr=lr)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def defaults(self):
        return self.inner.defaults

    def step(self) -> None:
        for param, view in zip(self.params, self.views):
            if view.data.data_ptr() != _local(param).data_ptr():  # storage moved: follow it
                view.data = _local(param).detach()
            view.grad = None if param.grad is None else _local(param.grad).detach()
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, view in zip(self.params, self.views):
            param.grad = None
            view.grad = None
