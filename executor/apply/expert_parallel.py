"""Expert parallelism: a mixture-of-experts layer's experts split over the ep ranks of a
data-parallel group, tokens sent to their experts and back with all-to-all.

The ep dimension is the inner factor of the data-parallel one (dp = edp x ep): the ep
ranks pool their tokens, each holds experts/ep experts, and the edp ranks that hold
the same experts reduce those experts' gradients among themselves. Each expert module
(HF's `*Experts`: 3-D `gate_up_proj` [E, 2F, H] and `down_proj` [E, H, F]) is replaced
by one holding its local slice and routing through torch's autograd all-to-all
(`all_to_all_single_autograd`, uneven splits; it runs on gloo). Dense weights go
through DDP or FSDP2 as before. Under ZeRO 0/1 the expert weights are hidden from
DDP and synchronised here: summed over edp and divided by dp, the gradient of the
mean loss; under ZeRO-2/3 each expert module is its own FSDP2 unit over edp
(executor/data_parallel.shard_experts) and only the remaining 1/ep is applied here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from layout.plan import Plan
from executor.runtime.mesh import dp_view

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def ep_meshes(mesh: DeviceMesh, plan: Plan) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep, edp) views of the data-parallel dimension, ep inner."""
    both = dp_view(mesh, (plan.data_parallel // plan.ep, plan.ep), ("edp", "ep"))
    return both["ep"], both["edp"]


def is_experts(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, w, None), nn.Parameter) and getattr(module, w).dim() == 3
               for w in EXPERT_WEIGHTS) and hasattr(module, "num_experts")


class ExpertParallelExperts(nn.Module):
    """The local experts of one MoE layer; forward(tokens [T, H], top_k_index, top_k_weights)."""

    def __init__(self, original: nn.Module, group, ep: int, rank: int) -> None:
        super().__init__()
        self.group, self.ep, self.rank = group, ep, rank
        self.num_experts, self.local = original.num_experts, original.num_experts // ep
        self.act_fn = original.act_fn
        lo = rank * self.local
        for name in EXPERT_WEIGHTS:
            full = getattr(original, name)
            param = nn.Parameter(full.detach()[lo:lo + self.local].clone(), requires_grad=full.requires_grad)
            param.expert_parallel = (group, ep)  # executor.runtime.compare gathers the full tensor by it
            setattr(self, name, param)

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(rows.contiguous(), recv, send, group=self.group)

    def _compute(self, tokens: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        # An expert without tokens still runs (on zero rows): the result must depend on `tokens`
        # and the weights on every rank, or a rank whose experts got nothing would skip the
        # backward of the dispatch all-to-all that its peers wait in.
        out = torch.zeros_like(tokens)
        for e in range(self.local):
            rows = (experts == self.rank * self.local + e).nonzero(as_tuple=True)[0]
            gate, up = F.linear(tokens[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out.index_add(0, rows, F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return out

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[1]
        expert = top_k_index.reshape(-1)
        token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
        order = torch.argsort(expert // self.local, stable=True)
        send = torch.bincount(expert // self.local, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        arrived = self._exchange(hidden[token[order]], send_l, recv_l)
        their_experts = torch.empty(sum(recv_l), dtype=expert.dtype, device=expert.device)
        dist.all_to_all_single(their_experts, expert[order].contiguous(), recv_l, send_l, group=self.group)
        back = self._exchange(self._compute(arrived, their_experts), recv_l, send_l)
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token[order], (back * weights[:, None]).to(hidden.dtype))


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """Replace every expert module by its expert-parallel slice; ep=1: no-op."""
    if plan.ep == 1:
        return module
    ep_mesh, _ = ep_meshes(mesh, plan)
    group, rank = ep_mesh.get_group(), ep_mesh.get_local_rank()
    for name, sub in list(module.named_modules()):
        for child_name, child in list(sub.named_children()):
            if is_experts(child):
                setattr(sub, child_name, ExpertParallelExperts(child, group, plan.ep, rank))
    return module


def expert_parameter_names(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if hasattr(p, "expert_parallel")]


class ExpertGradients:
    """Before each optimizer step: expert gradients summed over the ranks holding the same
    experts and divided by the data-parallel size (ZeRO 0/1: DDP or the per-weight all-reduce
    averages the dense ones). Under ZeRO-2/3 the experts' FSDP2 units have already averaged
    them over those ranks: only the 1/ep remains."""

    def __init__(self, modules: list[nn.Module], mesh: DeviceMesh, plan: Plan) -> None:
        _, edp = ep_meshes(mesh, plan)
        self.group, self.reduce = edp.get_group(), plan.zero <= 1
        self.scale = 1.0 / plan.data_parallel if self.reduce else 1.0 / plan.ep
        self.params = [p for m in modules for p in m.parameters() if hasattr(p, "expert_parallel")]

    def sync(self) -> None:
        for param in self.params:
            if param.grad is not None:
                if self.reduce:
                    dist.all_reduce(param.grad, group=self.group)
                param.grad.mul_(self.scale)
